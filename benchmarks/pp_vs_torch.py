"""minipar pipeline parallelism beside torch.distributed.pipelining, pp=2 on CPU, schedule by schedule.

    torchrun --nproc_per_node=2 benchmarks/pp_vs_torch.py [--schedules gpipe,1f1b,interleaved_1f1b,zb_h1,zb_v
        --steps 20 --warmup 3 --microbatches 4 --virtual-stages 2 --batch 8 --seq 128 --n-layer 4
        --n-embd 256 --n-head 4 --vocab 2048 --json PATH]

Two CPU processes (gloo, one thread each). For each schedule two models train on the same data
from the same initialisation (GPT with untied embedding / LM head, ``tie_weights=False``):

* minipar: ``ShardedModule(GPT(cfg), mesh=minipar.init(pp=2), schedule=S, microbatches=m,
  virtual_stages=v)``, ``train_step(x, y, gpt_loss)``;
* PyTorch: one ``torch.distributed.pipelining.PipelineStage`` per model piece this rank holds,
  each around ``minipar.pipeline.Stage(GPT(cfg), k, pieces)`` (piece k alone: the same blocks as
  minipar's chunk holding virtual stage k, which the benchmark checks), driven by the schedule's
  PyTorch counterpart with ``loss_fn=gpt_loss`` (gradients scaled by 1/m, so both sides take the
  gradient of the mean loss over the batch):

    minipar            PyTorch                          pieces (virtual stages) on rank r
    gpipe              ScheduleGPipe                    r
    1f1b               Schedule1F1B                     r
    interleaved_1f1b   ScheduleInterleaved1F1B          r, p + r, ... (v of them, --virtual-stages)
    zb_h1              ScheduleInterleavedZeroBubble    r  (one stage per rank: its ZB1P order is ZB-H1's)
    zb_v               ScheduleZBVZeroBubble            r and 2p-1-r (the V)

  Both zero-bubble sides split the backward into the input's gradient (minipar's B, PyTorch's I)
  and the weights' (W). The schedules with two or more pieces per rank need n_layer >= pp * v
  (every piece at least one block); by default those the model is too shallow for are skipped
  with a note, and naming one in ``--schedules`` is then an error.

Both use AdamW (no gradient clipping, to keep the PyTorch side plain). A step is forward +
backward + optimizer step + zero_grad, timed on every rank after a barrier; the step time is the
slowest rank's. All variants run interleaved step by step (minipar gpipe, torch gpipe, minipar
1f1b, torch 1f1b, ...) so machine noise hits them alike; the first ``--warmup`` steps are left out
of the medians. Printed per schedule: median step times, the ratio minipar / torch (goal
<= 1.00) and the largest difference of the first ``--check-steps`` losses; then those losses of
every variant, which must agree (exit 1 if any minipar loss differs from the PyTorch loss of its
schedule by more than --tolerance, else 0). ``--json PATH`` writes the figures, every step's
time included, to PATH. On a machine shared with other work the medians move by several percent
from run to run: compare ratios of one run, and rerun before reading a few percent into them.

Notes: minipar's ``train_step`` also does what PyTorch's schedule leaves out, and its time counts
it: the batch check (one small all-gather over the world), DDP's gradient hooks and bucket (the
default strategy, even at dp=1), and the loss all-reduce so every rank reports the loss (PyTorch
returns the per-micro-batch losses on the rank holding the last piece only). PyTorch's ``step``
is called with ``return_outputs=False``: minipar's step returns no logits, so neither side keeps
or concatenates them.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

import minipar
from minipar import ShardedModule
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.models.data import markov_batch
from minipar.pipeline import Stage, chunks_per_rank, virtual_stage

# minipar's schedule -> its PyTorch counterpart; the schedules with one stage per rank take a
# PipelineStage, the others (PipelineScheduleMulti) a list of this rank's PipelineStages.
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
                   "zb_h1": ScheduleInterleavedZeroBubble, "zb_v": ScheduleZBVZeroBubble}
SINGLE_STAGE = ("gpipe", "1f1b")
PP = 2


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", default=None,
                    help=f"comma list out of {','.join(TORCH_SCHEDULES)} (default: all the model is deep enough for)")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per variant (after warm-up)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--virtual-stages", type=int, default=2, help="model chunks per rank for interleaved_1f1b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--check-steps", type=int, default=3, help="first steps whose losses are compared")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--json", default=None, help="write the results here")
    return ap.parse_args()


def chosen_schedules(args: argparse.Namespace, pp: int) -> tuple[list[str], list[str]]:
    """(the schedules to run, those of the default set skipped because the model is too shallow).
    Raises ValueError, on every rank before any collective, for an unknown schedule or one the
    model has too few layers for."""
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
    def __init__(self, cfg: GPTConfig, mesh, schedule: str, m: int, v: int, lr: float) -> None:
        self.model = ShardedModule(GPT(cfg), mesh=mesh, schedule=schedule, microbatches=m,
                                   virtual_stages=chunks_per_rank(schedule, v))
        self.opt = self.model.build_optimizer(torch.optim.AdamW, lr=lr, weight_decay=0.1)

    def step(self, x: torch.Tensor) -> float | None:
        loss = self.model.train_step(x[:, :-1], x[:, 1:], gpt_loss)
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()


class TorchRunner:
    """This rank's pieces of the model as PipelineStages (one per piece, in chunk order), driven by
    the schedule's PyTorch counterpart."""

    def __init__(self, cfg: GPTConfig, rank: int, stages: int, schedule: str, m: int, v: int, lr: float,
                 device: torch.device) -> None:
        chunks = chunks_per_rank(schedule, v)
        placement = "v" if schedule == "zb_v" else "interleaved"
        gpt, pieces = GPT(cfg), stages * chunks
        ks = [virtual_stage(rank, c, stages, placement) for c in range(chunks)]
        self.modules = [Stage(gpt, k, pieces).to(device) for k in ks]
        check_same_cut(gpt, self.modules, rank, stages, chunks, placement)
        self.first, self.last = 0 in ks, pieces - 1 in ks
        pipe_stages = [PipelineStage(mod, k, pieces, device) for mod, k in zip(self.modules, ks)]
        cls = TORCH_SCHEDULES[schedule]
        self.schedule = cls(pipe_stages[0] if schedule in SINGLE_STAGE else pipe_stages, n_microbatches=m,
                            loss_fn=gpt_loss)
        self.opt = torch.optim.AdamW([p for mod in self.modules for p in mod.parameters()], lr=lr, weight_decay=0.1)

    def step(self, x: torch.Tensor) -> float | None:
        losses: list = []
        self.schedule.step(*((x[:, :-1],) if self.first else ()), target=x[:, 1:] if self.last else None,
                           losses=losses if self.last else None, return_outputs=False)
        self.opt.step()
        self.opt.zero_grad()
        return torch.stack([l.detach() for l in losses]).mean().item() if self.last else None


def check_same_cut(gpt: GPT, pieces: list[Stage], rank: int, stages: int, chunks: int, placement: str) -> None:
    """Each one-piece Stage runs exactly the blocks of the matching chunk of minipar's multi-chunk
    Stage for this rank (the cut minipar's ShardedModule makes). Raises RuntimeError otherwise."""
    ref = Stage(gpt, rank, stages, chunks=chunks, placement=placement)
    for c, piece in enumerate(pieces):
        lo, hi = ref.chunk_blocks[c]
        if piece.block_index != ref.block_index[lo:hi] or (piece.first, piece.last) != \
                (ref.vstages[c] == 0, ref.vstages[c] == ref.pieces - 1):
            raise RuntimeError(f"rank {rank} chunk {c}: PyTorch's piece runs blocks {piece.block_index}, "
                               f"minipar's chunk {ref.block_index[lo:hi]}")


def main() -> int:
    args = parse_args()
    schedules, skipped = chosen_schedules(args, PP)
    mesh = minipar.init(pp=PP)
    torch.set_num_threads(1)
    main_rank = mesh.rank == 0
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd, tie_weights=False, seed=0)
    m, v = args.microbatches, args.virtual_stages
    runners = {}
    for s in schedules:
        runners[("minipar", s)] = MiniparRunner(cfg, mesh, s, m, v, args.lr)
        runners[("torch", s)] = TorchRunner(cfg, mesh.pp_rank, mesh.pp, s, m, v, args.lr, mesh.device)
    if main_rank:
        n = sum(p.numel() for p in GPT(cfg).parameters())
        print(f"pp_vs_torch: GPT {n / 1e6:.2f}M parameters (untied), {args.n_layer} layers, pp=2 on "
              f"{dist.get_world_size()} ranks, {dist.get_backend()}, batch {args.batch} x seq {args.seq}, "
              f"{m} micro-batches, interleaved v={v}, torch {torch.__version__}", flush=True)
        if skipped:
            print(f"skipped {', '.join(skipped)}: their pieces need --n-layer >= "
                  f"{max(mesh.pp * chunks_per_rank(s, v) for s in skipped)}", flush=True)

    times = {k: [] for k in runners}
    losses = {k: [] for k in runners}
    total = args.warmup + args.steps
    for step in range(total):
        x = markov_batch(step, 0, args.batch, args.seq, args.vocab).to(mesh.device)
        for key, runner in runners.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss = runner.step(x)
            times[key].append(time.perf_counter() - t0)
            losses[key].append(loss)
        if main_rank and (step % 5 == 0 or step == total - 1):
            print(f"step {step:3d}  " + "  ".join(f"{k[0]} {k[1]} {times[k][-1] * 1e3:6.1f} ms" for k in runners),
                  flush=True)

    # Every rank's times and losses (None where a rank has none), on rank 0.
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"times": times, "losses": losses})
    status = 0
    if main_rank:
        # A step's time is the slowest rank's (each rank timed from the same barrier).
        step_times = {k: [max(r["times"][k][i] for r in everyone) for i in range(total)] for k in runners}
        # A variant's losses: from the rank that has them (PyTorch: the rank holding the last piece).
        run_losses = {k: next(r["losses"][k] for r in everyone if r["losses"][k][0] is not None) for k in runners}
        med = {k: statistics.median(v[args.warmup:]) for k, v in step_times.items()}
        ratios = {s: med[("minipar", s)] / med[("torch", s)] for s in schedules}
        nchk = min(args.check_steps, total)
        first_losses = {k: run_losses[k][:nchk] for k in runners}
        diffs = {s: max(abs(first_losses[("minipar", s)][i] - first_losses[("torch", s)][i]) for i in range(nchk))
                 for s in schedules}
        max_diff = max(diffs.values())
        status = 0 if max_diff <= args.tolerance else 1
        tokens = args.batch * args.seq
        print("\n| schedule | minipar median step | torch median step | minipar / torch | minipar tok/s | torch tok/s "
              "| first losses max diff |")
        print("|---|---|---|---|---|---|---|")
        for s in schedules:
            a, b = med[("minipar", s)], med[("torch", s)]
            print(f"| {s} | {a * 1e3:.1f} ms | {b * 1e3:.1f} ms | {ratios[s]:.2f} | {tokens / a:.0f} | "
                  f"{tokens / b:.0f} | {diffs[s]:.1e} |")
        print(f"\nfirst {nchk} steps' losses:")
        for k in runners:
            print(f"  {k[0]:8s} {k[1]:16s} " + "  ".join(f"{v:.6f}" for v in first_losses[k]))
        print(f"largest difference minipar vs torch: {max_diff:.2e} ({'ok' if status == 0 else 'MISMATCH'}, "
              f"tolerance {args.tolerance:g})")
        print("last step losses: " + ", ".join(f"{k[0]} {k[1]} {run_losses[k][-1]:.4f}" for k in runners))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "torch": torch.__version__, "schedules": schedules, "skipped": skipped,
                           "median_step_s": {f"{k[0]}/{k[1]}": v for k, v in med.items()},
                           "ratio_minipar_over_torch": ratios,
                           "step_times_s": {f"{k[0]}/{k[1]}": v for k, v in step_times.items()},
                           "losses": {f"{k[0]}/{k[1]}": v for k, v in run_losses.items()},
                           "first_losses_diff": diffs, "first_losses_max_diff": max_diff}, f, indent=2)
            print(f"results: {args.json}")
    verdict = [status]
    dist.broadcast_object_list(verdict, src=0)
    minipar.shutdown()
    return int(verdict[0])


if __name__ == "__main__":
    code = main()
    gc.collect()  # free what reference cycles hold (process groups) before interpreter teardown
    sys.exit(code)
