"""Activation checkpointing: the activation memory it saves and the time it costs.

    python benchmarks/activation_checkpointing.py [--n-layer 8 --n-embd 256 --seq 256 --batch 8 --steps 10]
    torchrun --nproc_per_node=2 benchmarks/activation_checkpointing.py --strategy zero3

The GPT with and without ``activation_checkpointing=True``: what autograd keeps (`ActivationMemory`)
after forward and at its peak, the allocator's peak on CUDA, the median step (expect ~1.3x).
"""

from __future__ import annotations

import gc

import torch

import harness
import minipar
from minipar import ShardedModule
from minipar.models import GPT, gpt_loss
from minipar.recompute import ActivationMemory


def main() -> int:
    ap = harness.parser(__doc__, n_layer=8, n_embd=256, n_head=8, vocab=2048, seq=256, batch=8, steps=10)
    ap.add_argument("--strategy", default="ddp", choices=("ddp", "zero1", "zero2", "zero3"))
    ap.add_argument("--dropout", type=float, default=0.1)
    args = ap.parse_args()
    mesh = minipar.init()
    cuda, cfg = mesh.device.type == "cuda", harness.gpt_config(args, dropout=args.dropout)
    gen = torch.Generator().manual_seed(mesh.rank)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(mesh.device)
               for _ in range(args.steps + 1)]
    memory: dict[str, tuple[int, int, int]] = {}

    def variant(ckpt: bool):
        model = ShardedModule(GPT(cfg), mesh=mesh, strategy=args.strategy, activation_checkpointing=ckpt)
        opt = model.build_optimizer(torch.optim.AdamW, lr=1e-4)

        def step(i: int) -> None:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            x = batches[i]
            with ActivationMemory(model.parameters()) as mem:
                loss = gpt_loss(model(x[:, :-1]), x[:, 1:])
                mem.mark_forward_done()
                loss.backward()
            opt.step()
            opt.zero_grad()
            memory["on" if ckpt else "off"] = (mem.after_forward_bytes, mem.peak_bytes,
                                               torch.cuda.max_memory_allocated() if cuda else 0)
        return step

    t = harness.interleave({"off": variant(False), "on": variant(True)}, args.steps, 1)
    if mesh.rank == 0:
        n_params = sum(p.numel() for p in GPT(cfg).parameters())
        print(f"GPT {n_params / 1e6:.1f}M parameters, {args.n_layer} layers x {args.n_embd}, batch {args.batch} x "
              f"seq {args.seq} per rank, {args.strategy} on {mesh.world_size} rank(s), {mesh.device.type}\n")
        print(harness.table(["activation checkpointing", "after forward", "peak in backward", "allocator peak",
                             "median step"], [
            [k, f"{memory[k][0] / 2**20:,.1f} MiB", f"{memory[k][1] / 2**20:,.1f} MiB",
             f"{memory[k][2] / 2**20:,.1f} MiB" if memory[k][2] else "n/a (CPU)", f"{t.median(k) * 1e3:,.1f} ms"]
            for k in ("off", "on")]))
        print(f"\npeak activation memory on / off: {memory['on'][1] / memory['off'][1]:.3f}; "
              f"step time on / off: {t.ratio('on', 'off'):.2f}")
    gc.collect()
    minipar.shutdown()
    return 0


if __name__ == "__main__":
    harness.run(main)
