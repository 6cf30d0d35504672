"""Train a small GPT with minipar DDP and check it against the single-process run.

    torchrun --nproc_per_node=2 benchmarks/train_gpt_ddp.py [--steps 60 --check-steps 5 ...]

Data is a synthetic "language": a fixed random Markov chain in which every token
has four likely successors, so the loss falls from ln(vocab) towards ln(4)
(~1.39) as the model learns the transitions. Each rank draws its own sequences.

At the start, the first ``--check-steps`` steps are replayed on rank 0 in a
single process on the global batch (every rank's data); the largest loss
difference is printed, and the script exits with status 1 if it exceeds
``--tolerance``. On GPUs the run uses NCCL; the reference check then compares
GPU runs with TF32 off.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist

import minipar
from minipar import ShardedModule
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.models.data import markov_batch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--check-steps", type=int, default=5, help="steps replayed by the single-process reference")
    ap.add_argument("--tolerance", type=float, default=1e-4, help="largest allowed loss difference")
    ap.add_argument("--json", type=str, default=None, help="write the results here")
    args = ap.parse_args()

    mesh = minipar.init()
    if mesh.device.type == "cpu":
        torch.set_num_threads(1)
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    is_main = mesh.rank == 0
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd, seed=0)
    model = ShardedModule(GPT(cfg), mesh=mesh, strategy="ddp", bucket_cap_mb=args.bucket_cap_mb)
    opt = model.build_optimizer(torch.optim.AdamW, lr=args.lr, weight_decay=0.1)
    n_params = sum(p.numel() for p in model.parameters())
    if is_main:
        print(f"minipar DDP: {mesh}\nGPT {n_params / 1e6:.2f}M parameters, {mesh.dp} ranks x {args.batch} "
              f"sequences x {args.seq} tokens per step, backend {dist.get_backend()}", flush=True)

    losses, times = [], []
    with mesh.comm.counting() as stats:
        for step in range(args.steps):
            x = markov_batch(step, mesh.dp_rank, args.batch, args.seq, args.vocab).to(mesh.device)
            t0 = time.perf_counter()
            loss = model.train_step(x[:, :-1], x[:, 1:], gpt_loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            if mesh.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            if is_main and (step % 10 == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {losses[-1]:.4f}  {times[-1] * 1e3:7.1f} ms", flush=True)

    status = 0
    max_diff = float("nan")
    if is_main and args.check_steps > 0:
        ref = GPT(cfg).to(mesh.device)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr, weight_decay=0.1)
        diffs = []
        for step in range(min(args.check_steps, args.steps)):
            x = torch.cat([markov_batch(step, r, args.batch, args.seq, args.vocab) for r in range(mesh.dp)])
            x = x.to(mesh.device)
            ref_loss = gpt_loss(ref(x[:, :-1]), x[:, 1:])
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            diffs.append(abs(ref_loss.item() - losses[step]))
        max_diff = max(diffs)
        ok = max_diff <= args.tolerance
        status = 0 if ok else 1
        print(f"reference check: first {len(diffs)} losses against one process on the global batch, "
              f"largest difference {max_diff:.2e} ({'ok' if ok else 'MISMATCH'}, tolerance {args.tolerance:.0e})")

    steady = times[min(5, len(times) - 1):]
    grad_bytes = stats.bytes(op="all_reduce", tag="grad") / args.steps
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {
        "world_size": mesh.world_size, "params": n_params, "first_loss": losses[0], "last_loss": losses[-1],
        "median_step_ms": statistics.median(steady) * 1e3,
        "tokens_per_s": mesh.dp * args.batch * args.seq / statistics.median(steady),
        "grad_bytes_all_reduced_per_step": grad_bytes, "param_bytes": param_bytes,
        "reference_max_loss_diff": max_diff,
    }
    if is_main:
        print("\n| figure | value |\n|---|---|")
        print(f"| loss, first -> last step | {losses[0]:.3f} -> {losses[-1]:.3f} (ln vocab = {math.log(args.vocab):.3f}, "
              f"floor ln 4 = {math.log(4):.3f}) |")
        print(f"| median step time | {result['median_step_ms']:.1f} ms |")
        print(f"| tokens / s (all ranks) | {result['tokens_per_s']:.0f} |")
        print(f"| gradient bytes all-reduced per step | {grad_bytes:.0f} (parameter bytes {param_bytes}) |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    # Every rank leaves with rank 0's verdict.
    verdict = torch.tensor([status], device=mesh.device)
    mesh.comm.broadcast(verdict, 0, mesh.world, tag="verdict")
    minipar.shutdown()
    return int(verdict.item())


if __name__ == "__main__":
    code = main()
    gc.collect()  # free what reference cycles hold (process groups) before interpreter teardown
    sys.exit(code)
