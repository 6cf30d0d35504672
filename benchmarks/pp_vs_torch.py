"""minipar pipeline parallelism beside torch.distributed.pipelining, pp=2 on CPU, schedule by schedule.

    torchrun --nproc_per_node=2 benchmarks/pp_vs_torch.py [--schedules gpipe,1f1b,interleaved_1f1b,zb_h1,zb_v
        --steps 20 --warmup 3 --microbatches 4 --virtual-stages 2 --batch 8 --seq 128 --n-layer 4
        --n-embd 256 --n-head 4 --vocab 2048 --json PATH]

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
import minipar
from minipar import ShardedModule
from minipar.models import GPT, gpt_loss
from minipar.models.data import markov_batch
from minipar.pipeline import Stage, chunks_per_rank, virtual_stage

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


class MiniparRunner:
    def __init__(self, cfg, mesh, schedule: str, m: int, v: int, lr: float) -> None:
        self.model = ShardedModule(GPT(cfg), mesh=mesh, schedule=schedule, microbatches=m,
                                   virtual_stages=chunks_per_rank(schedule, v))
        self.opt = self.model.build_optimizer(torch.optim.AdamW, lr=lr, weight_decay=0.1)

    def step(self, x: torch.Tensor) -> float | None:
        loss = self.model.train_step(x[:, :-1], x[:, 1:], gpt_loss)
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()


class TorchRunner:
    """This rank's pieces as PipelineStages (one per piece, in chunk order), driven by the PyTorch schedule.
    ``step`` returns the mean micro-batch loss on the rank holding the last piece, None elsewhere."""

    def __init__(self, cfg, rank: int, stages: int, schedule: str, m: int, v: int, lr: float, device) -> None:
        chunks = chunks_per_rank(schedule, v)
        placement = "v" if schedule == "zb_v" else "interleaved"
        gpt, pieces = GPT(cfg), stages * chunks
        ks = [virtual_stage(rank, c, stages, placement) for c in range(chunks)]
        self.modules = [Stage(gpt, k, pieces).to(device) for k in ks]
        # each one-piece Stage must run exactly the blocks of the matching chunk of minipar's Stage
        ref = Stage(gpt, rank, stages, chunks=chunks, placement=placement)
        for c, piece in enumerate(self.modules):
            lo, hi = ref.chunk_blocks[c]
            if piece.block_index != ref.block_index[lo:hi] or (piece.first, piece.last) != \
                    (ref.vstages[c] == 0, ref.vstages[c] == ref.pieces - 1):
                raise RuntimeError(f"rank {rank} chunk {c}: PyTorch's piece runs blocks {piece.block_index}, "
                                   f"minipar's chunk {ref.block_index[lo:hi]}")
        self.first, self.last = 0 in ks, pieces - 1 in ks
        pipe = [PipelineStage(mod, k, pieces, device) for mod, k in zip(self.modules, ks)]
        self.schedule = TORCH_SCHEDULES[schedule](pipe[0] if schedule in ("gpipe", "1f1b") else pipe,
                                                  n_microbatches=m, loss_fn=gpt_loss)
        self.opt = torch.optim.AdamW([p for mod in self.modules for p in mod.parameters()], lr=lr, weight_decay=0.1)

    def step(self, x: torch.Tensor) -> float | None:
        losses: list = []
        self.schedule.step(*((x[:, :-1],) if self.first else ()), target=x[:, 1:] if self.last else None,
                           losses=losses if self.last else None, return_outputs=False)
        self.opt.step()
        self.opt.zero_grad()
        return torch.stack([loss.detach() for loss in losses]).mean().item() if self.last else None


def main() -> int:
    ap = harness.parser(__doc__, steps=20, warmup=3, batch=8, seq=128, vocab=2048, n_layer=4, n_embd=256, n_head=4,
                        lr=3e-3, json=None)
    ap.add_argument("--schedules", default=None, help=f"comma list out of {','.join(TORCH_SCHEDULES)} "
                                                      "(default: all the model is deep enough for)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--virtual-stages", type=int, default=2, help="model chunks per rank for interleaved_1f1b")
    ap.add_argument("--check-steps", type=int, default=3, help="first steps whose losses are compared")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    args = ap.parse_args()
    schedules, skipped = chosen_schedules(args, PP)
    mesh = harness.init(pp=PP)
    cfg, m, v = harness.gpt_config(args, tie_weights=False, seed=0), args.microbatches, args.virtual_stages
    runners = {}
    for s in schedules:
        runners[f"minipar/{s}"] = MiniparRunner(cfg, mesh, s, m, v, args.lr)
        runners[f"torch/{s}"] = TorchRunner(cfg, mesh.pp_rank, mesh.pp, s, m, v, args.lr, mesh.device)
    if mesh.rank == 0:
        print(f"pp_vs_torch: GPT {sum(p.numel() for p in GPT(cfg).parameters()) / 1e6:.2f}M parameters (untied), "
              f"{args.n_layer} layers, pp=2 on {mesh.world_size} ranks, {dist.get_backend()}, batch {args.batch} x seq "
              f"{args.seq}, {m} micro-batches, interleaved v={v}, torch {torch.__version__}", flush=True)
        if skipped:
            print(f"skipped {', '.join(skipped)}: their pieces need --n-layer >= "
                  f"{max(mesh.pp * chunks_per_rank(s, v) for s in skipped)}", flush=True)
    batches = [markov_batch(s, 0, args.batch, args.seq, args.vocab).to(mesh.device)
               for s in range(args.warmup + args.steps)]
    t = harness.interleave({k: (lambda i, r=r: r.step(batches[i])) for k, r in runners.items()}, args.steps,
                           args.warmup, log_every=5)
    losses = harness.gathered_losses(mesh.comm.all_gather_object(t.results, mesh.world, tag="report"))
    status = 0
    if mesh.rank == 0:
        med, nchk = {k: t.median(k) for k in runners}, min(args.check_steps, args.warmup + args.steps)
        ratios = {s: t.ratio(f"minipar/{s}", f"torch/{s}") for s in schedules}
        diffs = {s: max(abs(a - b) for a, b in zip(losses[f"minipar/{s}"][:nchk], losses[f"torch/{s}"][:nchk]))
                 for s in schedules}
        max_diff, tokens = max(diffs.values()), args.batch * args.seq
        status = 0 if max_diff <= args.tolerance else 1
        print("\n" + harness.table(["schedule", "minipar median step", "torch median step", "minipar / torch",
                                    "minipar tok/s", "torch tok/s", "first losses max diff"], [
            [s, f"{med[f'minipar/{s}'] * 1e3:.1f} ms", f"{med[f'torch/{s}'] * 1e3:.1f} ms", f"{ratios[s]:.2f}",
             f"{tokens / med[f'minipar/{s}']:.0f}", f"{tokens / med[f'torch/{s}']:.0f}", f"{diffs[s]:.1e}"]
            for s in schedules]))
        print(f"\nfirst {nchk} steps' losses:\n" + "\n".join(
            f"  {k.split('/')[0]:8s} {k.split('/')[1]:16s} " + "  ".join(f"{x:.6f}" for x in losses[k][:nchk])
            for k in runners))
        print(f"largest difference minipar vs torch: {max_diff:.2e} ({'ok' if status == 0 else 'MISMATCH'}, "
              f"tolerance {args.tolerance:g})")
        print("last step losses: " + ", ".join(f"{k.replace('/', ' ')} {losses[k][-1]:.4f}" for k in runners))
        harness.write_json(args.json, {
            "args": vars(args), "torch": torch.__version__, "schedules": schedules, "skipped": skipped,
            "median_step_s": med, "ratio_minipar_over_torch": ratios, "step_times_s": t.seconds, "losses": losses,
            "first_losses_diff": diffs, "first_losses_max_diff": max_diff})
    status = harness.agree(status)
    minipar.shutdown()
    return status


if __name__ == "__main__":
    harness.run(main)
