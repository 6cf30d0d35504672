"""Train a small GPT with minipar DDP and check it against the single-process run.

    torchrun --nproc_per_node=2 benchmarks/train_gpt_ddp.py [--steps 60 --check-steps 5 ...]

Data: the Markov "language" (four likely successors per token: the loss falls from ln(vocab) towards
ln 4), each rank its own sequences. The first ``--check-steps`` steps are replayed in one process on the
global batch (the main job's `reference_losses`); exit 1 beyond ``--tolerance``. TF32 off for the check.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import harness
from gpt_tp_pp import reference_losses
from minipar import ShardedModule
from minipar.models import GPT, gpt_loss


def main() -> int:
    ap = harness.parser(__doc__, steps=100, batch=8, seq=64, vocab=256, n_layer=2, n_head=4, n_embd=128, lr=3e-3,
                        json=None, check_steps=5, tolerance=1e-4, help={"check_steps": "steps replayed by the "
                                                                         "single-process reference"})
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    args = ap.parse_args()
    mesh = harness.init(exact=True)  # the reference check
    is_main, cfg = mesh.rank == 0, harness.gpt_config(args, seed=0)
    model = ShardedModule(GPT(cfg), mesh=mesh, strategy="ddp", bucket_cap_mb=args.bucket_cap_mb)
    opt = model.build_optimizer(torch.optim.AdamW, lr=args.lr, weight_decay=0.1)
    n_params, param_bytes = (sum(f(p) for p in model.parameters()) for f in (torch.numel, lambda p: p.nbytes))
    if is_main:
        print(f"minipar DDP: {mesh}\nGPT {n_params / 1e6:.2f}M parameters, {mesh.dp} ranks x {args.batch} "
              f"sequences x {args.seq} tokens per step, backend {dist.get_backend()}", flush=True)

    def step(i: int) -> float:
        loss = model.train_step(*harness.markov(i, mesh.dp_rank, args, mesh.device), gpt_loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.item()

    warmup = min(5, args.steps - 1)
    with mesh.comm.counting() as stats:
        t = harness.interleave({"ddp": step}, args.steps - warmup, warmup, log_every=10)
    losses = t.results["ddp"]
    status, max_diff = 0, float("nan")
    if is_main and args.check_steps > 0:
        args.check_steps = min(args.check_steps, args.steps)
        ref = reference_losses(GPT, cfg, args, mesh.dp, mesh.device)
        max_diff = max(abs(r - x) for r, x in zip(ref, losses))
        status = 0 if max_diff <= args.tolerance else 1
        print(f"reference check: first {len(ref)} losses against one process on the global batch, largest "
              f"difference {max_diff:.2e} ({'ok' if status == 0 else 'MISMATCH'}, tolerance {args.tolerance:.0e})")
    grad_bytes = stats.bytes(op="all_reduce", tag="grad") / args.steps
    result = {"world_size": mesh.world_size, "params": n_params, "first_loss": losses[0], "last_loss": losses[-1],
              "median_step_ms": t.median("ddp") * 1e3, "tokens_per_s": mesh.dp * args.batch * args.seq / t.median("ddp"),
              "grad_bytes_all_reduced_per_step": grad_bytes, "param_bytes": param_bytes,
              "reference_max_loss_diff": max_diff}
    if is_main:
        print("\n" + harness.table(["figure", "value"], [
            ["loss, first -> last step", f"{losses[0]:.3f} -> {losses[-1]:.3f} (ln vocab = {math.log(args.vocab):.3f}, "
                                         f"floor ln 4 = {math.log(4):.3f})"],
            ["median step time", f"{result['median_step_ms']:.1f} ms"],
            ["tokens / s (all ranks)", f"{result['tokens_per_s']:.0f}"],
            ["gradient bytes all-reduced per step", f"{grad_bytes:.0f} (parameter bytes {param_bytes})"]]))
        harness.write_json(args.json, result)
    return harness.finish(status)  # every rank leaves with rank 0's verdict


if __name__ == "__main__":
    harness.run(main)
