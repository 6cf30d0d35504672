"""minipar pipeline parallelism beside torch.distributed.pipelining, pp=2 on CPU.

    torchrun --nproc_per_node=2 benchmarks/pp_vs_torch.py [--steps 20 --warmup 3 --microbatches 4
        --batch 8 --seq 128 --n-layer 4 --n-embd 256 --n-head 4 --vocab 2048 --json PATH]

Two CPU processes (gloo, one thread each), one pipeline stage per process.
For each schedule (gpipe, 1f1b) two models train on the same data from the same
initialisation (GPT with untied embedding / LM head, ``tie_weights=False``):

* minipar: ``ShardedModule(GPT(cfg), mesh=minipar.init(pp=2), schedule=S, microbatches=m)``,
  ``train_step(x, y, gpt_loss)``;
* PyTorch: each rank's ``minipar.pipeline.GPTStage(GPT(cfg), rank, 2)`` in a
  ``torch.distributed.pipelining.PipelineStage``, driven by ``ScheduleGPipe`` /
  ``Schedule1F1B(stage, m, loss_fn=gpt_loss)`` (gradients scaled by 1/m, so both
  sides take the gradient of the mean loss over the batch).

Both use AdamW (no gradient clipping, to keep the PyTorch side plain). A step
is forward + backward + optimizer step + zero_grad, timed on every rank after
a barrier; the step time is the slowest rank's. The four variants run
interleaved step by step (minipar gpipe, torch gpipe, minipar 1f1b, torch 1f1b)
so machine noise hits them alike; the first ``--warmup`` steps are left out of
the medians. Printed: median step times, the ratio minipar / torch for each
schedule (goal <= 1.00), and the first steps' losses of all four, which must
agree (exit 1 if any differs from the PyTorch loss by more than --tolerance,
else 0). ``--json PATH`` writes the figures to PATH.

Note: minipar's ``train_step`` also all-reduces the loss so every rank reports it;
PyTorch's schedule returns the loss on the last stage only. That small collective
is counted in minipar's time.
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
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import minipar
from minipar import ShardedModule
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.models.data import markov_batch
from minipar.pipeline import GPTStage

SCHEDULES = ("gpipe", "1f1b")
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="measured steps per variant (after warm-up)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=4)
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


class MiniparRunner:
    def __init__(self, cfg: GPTConfig, mesh, schedule: str, m: int, lr: float) -> None:
        self.model = ShardedModule(GPT(cfg), mesh=mesh, schedule=schedule, microbatches=m)
        self.opt = self.model.build_optimizer(torch.optim.AdamW, lr=lr, weight_decay=0.1)

    def step(self, x: torch.Tensor) -> float | None:
        loss = self.model.train_step(x[:, :-1], x[:, 1:], gpt_loss)
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()


class TorchRunner:
    def __init__(self, cfg: GPTConfig, rank: int, stages: int, schedule: str, m: int, lr: float,
                 device: torch.device) -> None:
        self.module = GPTStage(GPT(cfg), rank, stages).to(device)
        self.first, self.last = rank == 0, rank == stages - 1
        self.stage = PipelineStage(self.module, rank, stages, device)
        self.schedule = TORCH_SCHEDULES[schedule](self.stage, n_microbatches=m, loss_fn=gpt_loss)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=lr, weight_decay=0.1)

    def step(self, x: torch.Tensor) -> float | None:
        loss = None
        if self.first:
            self.schedule.step(x[:, :-1])
        elif self.last:
            losses: list = []
            self.schedule.step(target=x[:, 1:], losses=losses)
            loss = torch.stack([l.detach() for l in losses]).mean().item()
        else:
            self.schedule.step()
        self.opt.step()
        self.opt.zero_grad()
        return loss


def main() -> int:
    args = parse_args()
    mesh = minipar.init(pp=2)
    torch.set_num_threads(1)
    main_rank = mesh.rank == 0
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd, tie_weights=False, seed=0)
    m = args.microbatches
    runners = {}
    for s in SCHEDULES:
        runners[("minipar", s)] = MiniparRunner(cfg, mesh, s, m, args.lr)
        runners[("torch", s)] = TorchRunner(cfg, mesh.pp_rank, mesh.pp, s, m, args.lr, mesh.device)
    if main_rank:
        n = sum(p.numel() for p in GPT(cfg).parameters())
        print(f"pp_vs_torch: GPT {n / 1e6:.2f}M parameters (untied), pp=2 on {dist.get_world_size()} ranks, "
              f"{dist.get_backend()}, batch {args.batch} x seq {args.seq}, {m} micro-batches, torch {torch.__version__}",
              flush=True)

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

    # Every rank's times and the last stage's losses, on rank 0.
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"times": times, "losses": losses, "last": mesh.pp_rank == mesh.pp - 1})
    status = 0
    if main_rank:
        # A step's time is the slowest rank's (each rank timed from the same barrier).
        step_times = {k: [max(r["times"][k][i] for r in everyone) for i in range(total)] for k in runners}
        last = next(r for r in everyone if r["last"])
        med = {k: statistics.median(v[args.warmup:]) for k, v in step_times.items()}
        ratios = {s: med[("minipar", s)] / med[("torch", s)] for s in SCHEDULES}
        nchk = min(args.check_steps, total)
        first_losses = {k: last["losses"][k][:nchk] for k in runners}
        max_diff = max(abs(first_losses[("minipar", s)][i] - first_losses[("torch", s)][i])
                       for s in SCHEDULES for i in range(nchk))
        status = 0 if max_diff <= args.tolerance else 1
        tokens = args.batch * args.seq
        print("\n| schedule | minipar median step | torch median step | minipar / torch | minipar tok/s | torch tok/s |")
        print("|---|---|---|---|---|---|")
        for s in SCHEDULES:
            a, b = med[("minipar", s)], med[("torch", s)]
            print(f"| {s} | {a * 1e3:.1f} ms | {b * 1e3:.1f} ms | {ratios[s]:.2f} | {tokens / a:.0f} | {tokens / b:.0f} |")
        print(f"\nfirst {nchk} steps' losses:")
        for k in runners:
            print(f"  {k[0]:8s} {k[1]:6s} " + "  ".join(f"{v:.6f}" for v in first_losses[k]))
        print(f"largest difference minipar vs torch: {max_diff:.2e} ({'ok' if status == 0 else 'MISMATCH'}, "
              f"tolerance {args.tolerance:g})")
        print("last step losses: " + ", ".join(f"{k[0]} {k[1]} {last['losses'][k][-1]:.4f}" for k in runners))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "torch": torch.__version__,
                           "median_step_s": {f"{k[0]}/{k[1]}": v for k, v in med.items()},
                           "ratio_minipar_over_torch": ratios,
                           "step_times_s": {f"{k[0]}/{k[1]}": v for k, v in step_times.items()},
                           "losses": {f"{k[0]}/{k[1]}": v for k, v in last["losses"].items()},
                           "first_losses_max_diff": max_diff}, f, indent=2)
            print(f"results: {args.json}")
    verdict = [status]
    dist.broadcast_object_list(verdict, src=0)
    minipar.shutdown()
    return int(verdict[0])


if __name__ == "__main__":
    code = main()
    gc.collect()  # free what reference cycles hold (process groups) before interpreter teardown
    sys.exit(code)
