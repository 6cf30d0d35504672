"""Activation checkpointing: the activation memory it saves and the time it costs.

    python benchmarks/activation_checkpointing.py [--n-layer 8 --n-embd 256 --seq 256 --batch 8 --steps 10]
    torchrun --nproc_per_node=2 benchmarks/activation_checkpointing.py --strategy zero3

The same GPT trained with and without ``ShardedModule(activation_checkpointing=True)``
(each transformer block recomputed in backward), steps interleaved. Activation
memory is what autograd keeps for backward, measured by `minipar.recompute.ActivationMemory`
(a saved-tensor hook that counts each storage once, parameters excluded):
after forward and at its peak during backward. On CUDA the allocator's peak
(``torch.cuda.max_memory_allocated``) is printed too. Expect the after-forward
figure to drop to about the blocks' inputs, the peak to roughly that plus one
block's activations, and the step to cost about one extra forward (~1.3x).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import minipar
from minipar import ShardedModule
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.recompute import ActivationMemory


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", default="ddp", choices=("ddp", "zero1", "zero2", "zero3"))
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=10)
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    mesh = minipar.init()
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd, dropout=args.dropout)
    runs = {}
    for ckpt in (False, True):
        model = ShardedModule(GPT(cfg), mesh=mesh, strategy=args.strategy, activation_checkpointing=ckpt)
        runs[ckpt] = (model, model.build_optimizer(torch.optim.AdamW, lr=1e-4))
    gen = torch.Generator().manual_seed(mesh.rank)
    times: dict[bool, list[float]] = {False: [], True: []}
    memory: dict[bool, tuple[int, int, int]] = {}
    for step in range(args.steps + 1):
        x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(mesh.device)
        for ckpt, (model, opt) in runs.items():  # interleaved: both see the same load on the machine
            if mesh.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            with ActivationMemory(model.parameters()) as mem:
                loss = gpt_loss(model(x[:, :-1]), x[:, 1:])
                mem.mark_forward_done()
                loss.backward()
            opt.step()
            opt.zero_grad()
            if mesh.device.type == "cuda":
                torch.cuda.synchronize()
            if step:  # the first step warms up
                times[ckpt].append(time.perf_counter() - t0)
            cuda_peak = torch.cuda.max_memory_allocated() if mesh.device.type == "cuda" else 0
            memory[ckpt] = (mem.after_forward_bytes, mem.peak_bytes, cuda_peak)
    if mesh.rank == 0:
        n_params = sum(p.numel() for p in GPT(cfg).parameters())
        print(f"GPT {n_params / 1e6:.1f}M parameters, {args.n_layer} layers x {args.n_embd}, batch {args.batch} x "
              f"seq {args.seq} per rank, {args.strategy} on {mesh.world_size} rank(s), {mesh.device.type}")
        print("\n| activation checkpointing | after forward | peak in backward | allocator peak | median step |")
        print("|---|---|---|---|---|")
        for ckpt in (False, True):
            fwd, peak, cuda_peak = memory[ckpt]
            cuda = f"{cuda_peak / 2**20:,.1f} MiB" if cuda_peak else "n/a (CPU)"
            print(f"| {'on' if ckpt else 'off'} | {fwd / 2**20:,.1f} MiB | {peak / 2**20:,.1f} MiB | {cuda} | "
                  f"{statistics.median(times[ckpt]) * 1e3:,.1f} ms |")
        print(f"\npeak activation memory on / off: {memory[True][1] / memory[False][1]:.3f}; "
              f"step time on / off: {statistics.median(times[True]) / statistics.median(times[False]):.2f}")
    del runs
    gc.collect()
    minipar.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
