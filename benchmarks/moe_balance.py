"""Expert load balance of one MoE layer on a skewed routing: the expert bias against the auxiliary loss.

    python benchmarks/moe_balance.py [--steps 300 --experts 16 --top-k 4 --tokens 256 --skew 1.0 --rate 1e-2 --aux 0.01]

One `MoELayer` (sigmoid gate, dropless, so a load is every assignment) learns a fixed random
teacher MLP from tokens drawn around a common direction, its gate started tilted towards the first
quarter of the experts along that direction: at step 0 a few experts take most of the tokens. Three
variants train from the same weights on the same batches (AdamW): no balancing, the auxiliary loss
(``balance="aux"``), and the auxiliary-loss-free bias (``balance="bias"``, `update_expert_bias`
after each step). The figure is the imbalance max_e load_e / mean_e load_e of each step's batch
(1.0 is perfect; E / k is every token on the same k experts), reported at the start, its mean over
the last quarter of the steps, and the final teacher loss. One process: the balancing rule does not
depend on the layout (the load is summed over the ranks that route tokens; tests/test_moe_deepseek.py
shows the distributed bias equals the single-process one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import harness
from minipar.moe.balance import update_expert_bias
from minipar.moe.layer import MoELayer

VARIANTS = {"none": dict(balance="aux", aux_loss_coef=0.0), "aux": dict(balance="aux"),
            "bias": dict(balance="bias", aux_loss_coef=0.0)}


def parse_args():
    ap = harness.parser(__doc__, steps=300, lr=3e-3, seed=0, json=None,
                        smoke=dict(steps=6), help={"steps": "training steps per variant"})
    add = ap.add_argument
    add("--experts", type=int, default=16)
    add("--top-k", type=int, default=4)
    add("--d-model", type=int, default=32)
    add("--hidden", type=int, default=8, help="each expert's hidden width (fine-grained: small)")
    add("--tokens", type=int, default=256, help="tokens per step")
    add("--skew", type=float, default=1.0, help="how far the gate starts tilted towards the first E/4 experts")
    add("--rate", type=float, default=1e-2,
        help="the bias update rate (balance='bias'; DeepSeek-V3 uses 1e-3 over far more steps)")
    add("--aux", type=float, default=0.01, help="the auxiliary loss weight (balance='aux')")
    return ap.parse_args()


def train(args, variant: str) -> dict:
    d, e = args.d_model, args.experts
    options = dict(aux_loss_coef=args.aux, bias_update_rate=args.rate) | VARIANTS[variant]
    layer = MoELayer(d, args.hidden, e, args.top_k, capacity_factor=None, gate="sigmoid", seed=args.seed, **options)
    g = torch.Generator().manual_seed(args.seed + 1)
    direction = F.normalize(torch.randn(d, generator=g), dim=0)
    teacher_in = torch.randn(d, 4 * d, generator=g) / d ** 0.5
    teacher_out = torch.randn(4 * d, d, generator=g) / (2 * d) ** 0.5
    with torch.no_grad():  # the skew: the first quarter of the experts score high on every token
        layer.gate.weight[:max(1, e // 4)] += args.skew * direction
    opt = torch.optim.AdamW(layer.parameters(), lr=args.lr, weight_decay=0.1)
    imbalance, losses = [], []
    for step in range(args.steps):
        x = torch.randn(args.tokens, d, generator=g) + 2.0 * direction
        loss = F.mse_loss(layer(x), torch.tanh(x @ teacher_in) @ teacher_out)
        loss.backward()
        opt.step()
        update_expert_bias(layer)
        opt.zero_grad()
        load = layer.last_counts[0].double()
        imbalance.append(float(load.max() / load.mean()))
        losses.append(loss.item())
    tail = imbalance[-max(1, args.steps // 4):]
    return {"first": imbalance[0], "last_quarter": sum(tail) / len(tail), "worst_last_quarter": max(tail),
            "final_loss": losses[-1]}


def main() -> int:
    args = parse_args()
    torch.manual_seed(args.seed)
    results = {v: train(args, v) for v in VARIANTS}
    print(f"MoE balance: {args.experts} experts, top-{args.top_k}, sigmoid gate, dropless, {args.tokens} tokens/step, "
          f"{args.steps} steps, skew {args.skew}, bias rate {args.rate}, aux weight {args.aux}")
    print(harness.table(["balancing", "max/mean load, step 1", "max/mean, last quarter (mean)",
                         "max/mean, last quarter (worst)", "final loss"],
                        [[v, f"{r['first']:.2f}", f"{r['last_quarter']:.2f}", f"{r['worst_last_quarter']:.2f}",
                          f"{r['final_loss']:.4f}"] for v, r in results.items()]))
    harness.write_json(args.json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    harness.run(main)
