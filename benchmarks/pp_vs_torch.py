"""minipar pipeline parallelism beside torch.distributed.pipelining, pp=2 on CPU, schedule by schedule.

    torchrun --nproc_per_node=2 benchmarks/pp_vs_torch.py [--schedules gpipe,1f1b,interleaved_1f1b,zb_h1,zb_v,
        dualpipe_v --microbatches 4 --virtual-stages 2 --json PATH]  # --help: every flag

Per schedule, the same GPT (untied head) trains on both sides with AdamW: minipar's ``ShardedModule(
schedule=S, ...).train_step`` and PyTorch's counterpart (TORCH_SCHEDULES) over one ``PipelineStage`` per
piece, each a ``minipar.pipeline.Stage`` (the same blocks as minipar's chunk, checked); schedules the
model is too shallow for (or, dualpipe_v, with fewer micro-batches than pieces) are skipped. Timed by `harness.interleave`. Printed: medians, minipar / torch
(goal <= 1.00), the first losses of every variant: exit 1 if minipar's differ by more than --tolerance.
minipar's step also does the batch check, DDP's hooks and the loss all-reduce, in its time.

Exposed communication (minipar's side, which records each step's timeline for it): per step, the time
a rank spent blocked on a message, its blocking receives (RECV_ACT, RECV_GRAD) and the waits of its
posted ones (WAIT_ACT, WAIT_GRAD: dualpipe_v's overlapped pairs); sends never block. Printed as the
median over the steps of the mean over the ranks, beside the bubble measured on the last step's
timeline (`measured_bubble`: the idle share of the step, waits included) and the simulator's (unit
costs F = B = W, communication free). With dualpipe_v, its synchronous version runs beside it: the
same lists with every posted receive blocking (`dualpipe.without_overlap`), minipar only.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                          ScheduleZBVZeroBubble)

import harness
from minipar.models import GPT, gpt_loss
from minipar.pipeline import RankTimeline, Schedule, Stage, chunks_per_rank, measured_bubble, simulate, virtual_stage
from minipar.pipeline.dualpipe import without_overlap
from minipar.pipeline.schedule import placement_of
from minipar.pipeline.timeline import parse_action
from references import MiniparRunner, PipelineRunner

# minipar's schedule -> its PyTorch counterpart; gpipe and 1f1b take one PipelineStage, the others a list.
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
                   "zb_h1": ScheduleInterleavedZeroBubble, "zb_v": ScheduleZBVZeroBubble,
                   "dualpipe_v": ScheduleDualPipeV}
PP = 2
BLOCKING = "dualpipe_v, receives blocking"  # the synchronous version, beside the overlapped one
WAITS = ("RECV_ACT", "RECV_GRAD", "WAIT_ACT", "WAIT_GRAD")  # a rank blocked on a message


def exposed_seconds(timeline: list) -> float:
    """The time one rank's step spent blocked on messages: its blocking receives and its posted
    receives' waits (a hop between two chunks of one rank, in memory, costs ~0 there)."""
    return sum(end - start for name, start, end in timeline if (parse_action(name) or ("",))[0] in WAITS)


def chosen_schedules(args, pp: int) -> tuple[list[str], dict[str, str]]:
    """(the schedules to run, {schedule of the default set left out: why}): too few layers for its
    pieces, or (dualpipe_v: PyTorch's ScheduleDualPipeV) fewer micro-batches than pieces. Raises
    ValueError, on every rank before any collective, for an unknown schedule or one named that cannot run."""
    def pieces(s: str) -> int:
        return pp * chunks_per_rank(s, args.virtual_stages)

    def why_not(s: str) -> str | None:
        if pieces(s) > args.n_layer:
            return (f"cuts the model into {pieces(s)} pieces (pp={pp} x {chunks_per_rank(s, args.virtual_stages)} "
                    f"per rank) but --n-layer is {args.n_layer}: use --n-layer {pieces(s)} or more")
        if s == "dualpipe_v" and args.microbatches < pieces(s):
            return (f"needs at least {pieces(s)} micro-batches on PyTorch's side (ScheduleDualPipeV: one per piece) "
                    f"but --microbatches is {args.microbatches}: use --microbatches {pieces(s)} or more")
        return None

    if args.schedules is None:
        skipped = {s: why for s in TORCH_SCHEDULES if (why := why_not(s)) is not None}
        return [s for s in TORCH_SCHEDULES if s not in skipped], skipped
    names = [s.strip() for s in args.schedules.split(",") if s.strip()]
    for s in names:
        if s not in TORCH_SCHEDULES:
            raise ValueError(f"--schedules: unknown schedule {s!r}; choose from {','.join(TORCH_SCHEDULES)}")
        if why_not(s) is not None:
            raise ValueError(f"--schedules {s} {why_not(s)}")
    return list(dict.fromkeys(names)), {}


def torch_runner(cfg, rank: int, stages: int, schedule: str, v: int, m: int, opt_kwargs: dict, device) -> PipelineRunner:
    """This rank's pieces as PipelineStages (one per piece, in chunk order), driven by the PyTorch schedule."""
    chunks = chunks_per_rank(schedule, v)
    placement = placement_of(schedule)
    gpt, pieces = GPT(cfg), stages * chunks
    ks = [virtual_stage(rank, c, stages, placement) for c in range(chunks)]
    modules = [Stage(gpt, k, pieces).to(device) for k in ks]
    # each one-piece Stage must run exactly the blocks of the matching chunk of minipar's Stage
    ref = Stage(gpt, rank, stages, chunks=chunks, placement=placement)
    for c, piece in enumerate(modules):
        lo, hi = ref.chunk_blocks[c]
        if piece.block_index != ref.block_index[lo:hi] or (piece.first, piece.last) != \
                (ref.vstages[c] == 0, ref.vstages[c] == ref.pieces - 1):
            raise RuntimeError(f"rank {rank} chunk {c}: PyTorch's piece runs blocks {piece.block_index}, "
                               f"minipar's chunk {ref.block_index[lo:hi]}")
    pipe = [PipelineStage(mod, k, pieces, device) for mod, k in zip(modules, ks)]
    driver = TORCH_SCHEDULES[schedule](pipe[0] if schedule in ("gpipe", "1f1b") else pipe, n_microbatches=m,
                                       loss_fn=gpt_loss)
    return PipelineRunner(driver, modules, 0 in ks, pieces - 1 in ks, opt_kwargs, return_outputs=False)


def exposed_table(per_rank: list, schedules: dict[str, Schedule], medians: dict[str, float]) -> dict:
    """minipar's exposed communication per runner (name -> its schedule; median over the steps of the
    mean over the ranks), the bubble measured on the last step's timeline and the simulator's, as a
    table and as figures."""
    out: dict = {"exposed": {}, "measured": {}, "simulated": {}}
    rows = []
    for name, schedule in schedules.items():
        s = name.split("/", 1)[1]
        steps = zip(*(mine[name][0] for _, mine in per_rank))  # per step: every rank's exposed seconds
        out["exposed"][s] = statistics.median(sum(ranks) / len(ranks) for ranks in steps)
        out["measured"][s] = measured_bubble([RankTimeline(stage, rank, mine[name][1])
                                              for rank, (stage, mine) in enumerate(per_rank)])
        out["simulated"][s] = float(simulate(schedule)["bubble"])
        rows.append([s, f"{medians[name] * 1e3:.1f} ms", f"{out['exposed'][s] * 1e3:.1f} ms",
                     f"{out['exposed'][s] / medians[name]:.1%}", f"{out['measured'][s]:.1%}",
                     f"{out['simulated'][s]:.1%}"])
    out["table"] = harness.table(["minipar schedule", "median step", "exposed comm (mean rank)", "of the step",
                                  "measured bubble", "simulated bubble"], rows)
    return out


def main() -> int:
    ap = harness.parser(__doc__, steps=20, warmup=3, batch=8, seq=128, vocab=2048, n_layer=4, n_embd=256, n_head=4,
                        lr=3e-3, json=None, microbatches=4, check_steps=3, tolerance=1e-4)
    ap.add_argument("--schedules", default=None, help=f"comma list out of {','.join(TORCH_SCHEDULES)} "
                                                      "(default: all the model is deep enough for)")
    ap.add_argument("--virtual-stages", type=int, default=2, help="model chunks per rank for interleaved_1f1b")
    args = ap.parse_args()
    schedules, skipped = chosen_schedules(args, PP)
    mesh = harness.init(pp=PP)
    cfg, m, v = harness.gpt_config(args, tie_weights=False, seed=0), args.microbatches, args.virtual_stages
    runners, opt_kwargs = {}, dict(lr=args.lr, weight_decay=0.1)
    for s in schedules:
        runners[f"minipar/{s}"] = MiniparRunner(cfg, mesh, opt_kwargs, schedule=s, microbatches=m,
                                                virtual_stages=chunks_per_rank(s, v), record_timeline=True)
        runners[f"torch/{s}"] = torch_runner(cfg, mesh.pp_rank, mesh.pp, s, v, m, opt_kwargs, mesh.device)
    if "dualpipe_v" in schedules:  # its synchronous version: the same order, every receive blocking
        blocking = MiniparRunner(cfg, mesh, opt_kwargs, schedule="dualpipe_v", microbatches=m, record_timeline=True)
        blocking.model.pipeline.actions = without_overlap(blocking.model.pipeline.actions)
        runners[f"minipar/{BLOCKING}"] = blocking
    exposed: dict[str, list[float]] = {k: [] for k in runners if k.startswith("minipar/")}

    def run_step(name: str, i: int):
        loss = runners[name].step(*batches[i])
        if name in exposed:  # (summing one short list: inside the timed step, a few microseconds)
            exposed[name].append(exposed_seconds(runners[name].model.timeline))
        return loss
    if mesh.rank == 0:
        print(f"pp_vs_torch: GPT {sum(p.numel() for p in GPT(cfg).parameters()) / 1e6:.2f}M parameters (untied), "
              f"{args.n_layer} layers, pp=2 on {mesh.world_size} ranks, {dist.get_backend()}, batch {args.batch} x seq "
              f"{args.seq}, {m} micro-batches, interleaved v={v}, torch {torch.__version__}", flush=True)
        for s, why in skipped.items():
            print(f"skipped {s}: it {why}", flush=True)
    batches = [harness.markov(s, 0, args, mesh.device) for s in range(args.warmup + args.steps)]
    t = harness.interleave({k: (lambda i, k=k: run_step(k, i)) for k in runners}, args.steps, args.warmup,
                           log_every=5)
    losses = harness.gathered_losses(mesh.comm.all_gather_object(t.results, mesh.world, tag="report"))
    mine = {k: (exposed[k][args.warmup:], runners[k].model.timeline) for k in exposed}
    per_rank = mesh.comm.all_gather_object((mesh.pp_rank, mine), mesh.world, tag="report")
    status = 0
    if mesh.rank == 0:
        pairs = {s: (f"minipar/{s}", f"torch/{s}") for s in schedules}
        ratios = {s: t.ratio(*pairs[s]) for s in schedules}
        diffs = harness.agreement(losses, pairs, min(args.check_steps, args.warmup + args.steps), args.tolerance,
                                  each=False)
        print("\n" + harness.ratio_table(t, pairs, dict.fromkeys(schedules, args.batch * args.seq), "schedule",
                                         {"first losses max diff": {s: f"{d:.1e}" for s, d in diffs.items()}}))
        comm = exposed_table(per_rank, {k: runners[k].model.pipeline.actions for k in exposed},
                             {k: t.median(k) for k in exposed})
        print("\n" + comm["table"])
        status = int(max(diffs.values()) > args.tolerance)
        harness.write_json(args.json, {
            "args": vars(args), "torch": torch.__version__, "schedules": schedules, "skipped": skipped,
            "median_step_s": {k: t.median(k) for k in runners}, "ratio_minipar_over_torch": ratios,
            "step_times_s": t.seconds, "losses": losses, "first_losses_diff": diffs, "first_losses_max_diff": max(diffs.values()),
            "exposed_comm_s": comm["exposed"], "measured_bubble": comm["measured"], "simulated_bubble": comm["simulated"]})
    return harness.finish(status)


if __name__ == "__main__":
    harness.run(main)
