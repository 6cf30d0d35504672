"""minipar pipeline parallelism beside torch.distributed.pipelining, pp=2 on CPU, schedule by schedule.

    torchrun --nproc_per_node=2 benchmarks/pp_vs_torch.py [--schedules gpipe,1f1b,interleaved_1f1b,zb_h1,zb_v
        --microbatches 4 --virtual-stages 2 --json PATH]  # --help: every flag

Per schedule, the same GPT (untied head) trains on both sides with AdamW: minipar's ``ShardedModule(
schedule=S, ...).train_step`` and PyTorch's counterpart (TORCH_SCHEDULES) over one ``PipelineStage`` per
piece, each a ``minipar.pipeline.Stage`` (the same blocks as minipar's chunk, checked); schedules the
model is too shallow for are skipped. Timed by `harness.interleave`. Printed: medians, minipar / torch
(goal <= 1.00), the first losses of every variant: exit 1 if minipar's differ by more than --tolerance.
minipar's step also does the batch check, DDP's hooks and the loss all-reduce, in its time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

import harness
from minipar.models import GPT, gpt_loss
from minipar.pipeline import Stage, chunks_per_rank, virtual_stage
from references import MiniparRunner, PipelineRunner

# minipar's schedule -> its PyTorch counterpart; gpipe and 1f1b take one PipelineStage, the others a list.
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
                   "zb_h1": ScheduleInterleavedZeroBubble, "zb_v": ScheduleZBVZeroBubble}
PP = 2


def chosen_schedules(args, pp: int) -> tuple[list[str], list[str]]:
    """(the schedules to run, those of the default set skipped because the model is too shallow).
    Raises ValueError, on every rank before any collective, for an unknown or too deep schedule."""
    def pieces(s: str) -> int:
        return pp * chunks_per_rank(s, args.virtual_stages)

    if args.schedules is None:
        fits = [s for s in TORCH_SCHEDULES if pieces(s) <= args.n_layer]
        return fits, [s for s in TORCH_SCHEDULES if s not in fits]
    names = [s.strip() for s in args.schedules.split(",") if s.strip()]
    for s in names:
        if s not in TORCH_SCHEDULES:
            raise ValueError(f"--schedules: unknown schedule {s!r}; choose from {','.join(TORCH_SCHEDULES)}")
        if pieces(s) > args.n_layer:
            raise ValueError(f"--schedules {s} cuts the model into {pieces(s)} pieces (pp={pp} x "
                             f"{chunks_per_rank(s, args.virtual_stages)} per rank) but --n-layer is {args.n_layer}: "
                             f"use --n-layer {pieces(s)} or more")
    return list(dict.fromkeys(names)), []


def torch_runner(cfg, rank: int, stages: int, schedule: str, v: int, m: int, opt_kwargs: dict, device) -> PipelineRunner:
    """This rank's pieces as PipelineStages (one per piece, in chunk order), driven by the PyTorch schedule."""
    chunks = chunks_per_rank(schedule, v)
    placement = "v" if schedule == "zb_v" else "interleaved"
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
                                                virtual_stages=chunks_per_rank(s, v))
        runners[f"torch/{s}"] = torch_runner(cfg, mesh.pp_rank, mesh.pp, s, v, m, opt_kwargs, mesh.device)
    if mesh.rank == 0:
        print(f"pp_vs_torch: GPT {sum(p.numel() for p in GPT(cfg).parameters()) / 1e6:.2f}M parameters (untied), "
              f"{args.n_layer} layers, pp=2 on {mesh.world_size} ranks, {dist.get_backend()}, batch {args.batch} x seq "
              f"{args.seq}, {m} micro-batches, interleaved v={v}, torch {torch.__version__}", flush=True)
        if skipped:
            print(f"skipped {', '.join(skipped)}: their pieces need --n-layer >= "
                  f"{max(mesh.pp * chunks_per_rank(s, v) for s in skipped)}", flush=True)
    batches = [harness.markov(s, 0, args, mesh.device) for s in range(args.warmup + args.steps)]
    t = harness.interleave({k: (lambda i, r=r: r.step(*batches[i])) for k, r in runners.items()}, args.steps,
                           args.warmup, log_every=5)
    losses = harness.gathered_losses(mesh.comm.all_gather_object(t.results, mesh.world, tag="report"))
    status = 0
    if mesh.rank == 0:
        pairs = {s: (f"minipar/{s}", f"torch/{s}") for s in schedules}
        ratios = {s: t.ratio(*pairs[s]) for s in schedules}
        diffs = harness.agreement(losses, pairs, min(args.check_steps, args.warmup + args.steps), args.tolerance,
                                  each=False)
        print("\n" + harness.ratio_table(t, pairs, dict.fromkeys(schedules, args.batch * args.seq), "schedule",
                                         {"first losses max diff": {s: f"{d:.1e}" for s, d in diffs.items()}}))
        status = int(max(diffs.values()) > args.tolerance)
        harness.write_json(args.json, {
            "args": vars(args), "torch": torch.__version__, "schedules": schedules, "skipped": skipped,
            "median_step_s": {k: t.median(k) for k in runners}, "ratio_minipar_over_torch": ratios,
            "step_times_s": t.seconds, "losses": losses, "first_losses_diff": diffs, "first_losses_max_diff": max(diffs.values())})
    return harness.finish(status)


if __name__ == "__main__":
    harness.run(main)
