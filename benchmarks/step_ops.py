"""The host's work in one training step on one device: the operators it issues, counted on any machine.

    python benchmarks/step_ops.py [--n-layer 24] [--own-loss] [--fused-qkv]

On a GPU every operator below autograd is a kernel launch. This counts one step's operators
(`minipar.core.syncs.count_launches`: views excluded, a minipar kernel one custom operator) of
``gpt_1gpu.py``'s setting (ZeRO-1, bf16 parameters, fp32 masters) at a tiny width on the CPU (under
``TRITON_INTERPRET=1`` the kernels take their GPU path): the total, the parameters, the most issued.
"""

from __future__ import annotations

import torch

import harness
import minipar
from minipar import ShardedModule
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.core.syncs import count_launches


def main() -> None:
    ap = harness.parser(__doc__, n_layer=24)
    ap.add_argument("--own-loss", action="store_true", help="train_step without a loss_fn: the chunked head loss")
    ap.add_argument("--fused-qkv", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    mesh = minipar.init()
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=args.n_layer, n_head=2, n_embd=32, fused_qkv=args.fused_qkv)
    model = ShardedModule(GPT(cfg), mesh=mesh, strategy="zero1", mixed_precision=harness.BF16)
    opt = model.build_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), generator=torch.Generator().manual_seed(0))

    def step():
        model.train_step(x[:, :-1], x[:, 1:], *(() if args.own_loss else (gpt_loss,)))
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    step()  # the optimizer's state is created in the first step
    with count_launches() as ops:
        step()
    n_params = sum(1 for _ in model.module.parameters())
    print(f"step_ops: {ops.total} operators per step ({args.n_layer} blocks, {n_params} parameters, "
          f"Triton path: {minipar.kernels.use_triton(torch.empty(0))})")
    print("most issued: " + ", ".join(f"{name} {n}" for name, n in ops.ops.most_common(10)))
    minipar.shutdown()


if __name__ == "__main__":
    main()
