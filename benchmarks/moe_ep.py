"""Expert parallelism against the same MoE layer in one process, dropless against capacity, and the experts'
grouped product against a loop over experts; all-to-all bytes against theory.

    torchrun --nproc_per_node=2 benchmarks/moe_ep.py [--tokens 2048 --experts 8 --top-k 2 --json PATH]  # --help: all

Each rank routes its tokens through a `minipar.moe.layer.MoELayer` with its experts split over the ranks; the
baseline is the whole layer on rank 0 on the global batch, routed as P groups (the same capacity
decisions). Beside it, with the same weights: the dropless layer (``capacity_factor=None``: every assignment
reaches its expert, the all-to-all splits as uneven as the routing), and the dropless layer with its experts
computed by the former loop (one addmm pair per expert) instead of two grouped products
(`minipar.moe.experts`). Forward + backward of each, timed by `harness.interleave`. Printed: tokens/s and
their ratios; each rank's all-to-all bytes per step (forward + backward), capacity and dropless, beside what
its routing implies (exit 1 unless equal) and the uniform-routing estimate 4 T k (P-1)/P d_model 4; the
largest output difference to the one-process layer (exit 1 beyond --tolerance).
"""

from __future__ import annotations

import os

import torch

import harness
from minipar.kernels import gelu
from minipar.moe.layer import MoELayer

TAGS = ("moe_dispatch", "moe_combine", "moe_counts")


def loop_experts(layer: MoELayer) -> MoELayer:
    """The layer with its local experts computed one addmm pair per expert (the form before the grouped
    product): the grouped-vs-loop comparison's baseline."""
    def experts(x, counts):
        outs = []
        for j, rows in enumerate(x.split(counts.tolist())):
            h = gelu(torch.addmm(layer.b1[j], rows, layer.w1[j]))
            outs.append(torch.addmm(layer.b2[j], h, layer.w2[j]))
        return torch.cat(outs)
    layer._local_experts = experts
    return layer


def step_bytes(mesh, layer: MoELayer, x: torch.Tensor, p: int, n_experts: int, row: int) -> dict:
    """One forward + backward: this rank's all-to-all bytes to other ranks (counted), and what its routing
    implies: dispatch sends its rows for other ranks' experts, combine returns the rows it received from
    other ranks, the backward the same again; the counts exchange E/P int64 to each other rank."""
    with mesh.comm.counting() as stats:
        layer(x).sum().backward()
    sent = sum(r.wire_bytes for r in stats.records if r.tag in TAGS)
    figures = mesh.comm.all_gather_object({"counts": layer.last_counts[0], "dropped": layer.last_dropped}, mesh.world)
    per_rank = torch.stack([f["counts"].view(p, -1).sum(dim=1) for f in figures])  # [src, dst] rows
    r = mesh.rank
    out_rows = per_rank[r].sum().item() - per_rank[r, r].item()
    in_rows = per_rank[:, r].sum().item() - per_rank[r, r].item()
    implied = 2 * (out_rows + in_rows) * row + n_experts // p * 8 * (p - 1)
    return {"rank": r, "sent": sent, "implied": implied, "dropped": layer.last_dropped,
            "rows": int(layer.last_counts[0].sum())}


def main() -> int:
    ap = harness.parser(__doc__, steps=20, warmup=3, json=None, tolerance=1e-4)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    args = ap.parse_args()
    mesh = harness.init(ep=int(os.environ.get("WORLD_SIZE", 1)))  # every rank one expert-parallel rank
    p = mesh.world_size
    dims = (args.d_model, args.d_hidden, args.experts, args.top_k)
    layers = {"ep": MoELayer(*dims, args.capacity_factor, seed=0), "dropless": MoELayer(*dims, None, seed=0),
              "dropless_loop": loop_experts(MoELayer(*dims, None, seed=0))}
    for layer in layers.values():
        layer.shard_experts(mesh.comm, mesh.group("ep"))
    x_global = torch.randn(p * args.tokens, args.d_model, generator=torch.Generator().manual_seed(1))
    x_local = x_global.chunk(p)[mesh.rank].clone().requires_grad_()
    one, x_one = None, x_global.clone().requires_grad_()
    if mesh.rank == 0:
        one = MoELayer(*dims, args.capacity_factor, seed=0)
        one.route_groups = p
    variants = {name: (lambda i, layer=layer: layer(x_local).sum().backward()) for name, layer in layers.items()}
    variants["one"] = lambda i: one is not None and one(x_one).sum().backward()
    t = harness.interleave(variants, args.steps, args.warmup)

    row = 4 * args.d_model
    bytes_of = {name: step_bytes(mesh, layers[name], x_local, p, args.experts, row) for name in ("ep", "dropless")}
    with torch.no_grad():
        out_local = layers["ep"](x_local)
    figures = mesh.comm.all_gather_object({name: b for name, b in bytes_of.items()} | {"out": out_local}, mesh.world)
    uniform = 4 * args.tokens * args.top_k * (p - 1) / p * row
    status = 0 if all(f[n]["sent"] == f[n]["implied"] for f in figures for n in bytes_of) else 1
    if mesh.rank == 0:
        with torch.no_grad():
            diff = (torch.cat([f["out"] for f in figures]) - one(x_global)).abs().max().item()
        status |= 0 if diff <= args.tolerance else 1
        tok = p * args.tokens
        med = {name: t.median(name) for name in variants}
        print(f"MoE layer: {args.experts} experts, top-{args.top_k}, capacity factor {args.capacity_factor} or "
              f"dropless, d_model {args.d_model}, d_hidden {args.d_hidden}, {args.tokens} tokens per rank, "
              f"ep={p} ({torch.distributed.get_backend()})\n")
        speed = [[label, f"{med[name] * 1e3:.1f} ms, {tok / med[name]:,.0f} tokens/s"] for name, label in (
            ("one", f"one process, {tok} tokens, capacity {args.capacity_factor} (fwd+bwd)"),
            ("ep", f"ep={p}, capacity {args.capacity_factor}, grouped experts"),
            ("dropless", f"ep={p}, dropless, grouped experts"),
            ("dropless_loop", f"ep={p}, dropless, a loop over experts"))]
        ratios = [[f"tokens/s ratio, {a} / {b}", f"{med[b] / med[a]:.2f} (per-step median {1 / t.paired_median(a, b):.2f})"]
                  for a, b in (("ep", "one"), ("dropless", "ep"), ("dropless", "dropless_loop"))]
        moved = [[f"rank {i} {name} all-to-all bytes to other ranks per step",
                  f"{f[name]['sent']:,} measured, {f[name]['implied']:,} implied by its routing "
                  f"({'equal' if f[name]['sent'] == f[name]['implied'] else 'DIFFERENT'}); {f[name]['rows']} rows "
                  f"routed, {f[name]['dropped']} assignments dropped"] for i, f in enumerate(figures) for name in bytes_of]
        print(harness.table(["figure", "value"], speed + ratios + moved + [
            ["uniform-routing estimate per rank and step", f"{uniform:,.0f} bytes"],
            [f"outputs, ep={p} vs one process", f"largest difference {diff:.2e}: "
                                               f"{'ok' if diff <= args.tolerance else 'MISMATCH'}"]]))
        harness.write_json(args.json, {
            "args": vars(args), "ms_one_process": med["one"] * 1e3, "ms_ep": med["ep"] * 1e3,
            "ms_dropless": med["dropless"] * 1e3, "ms_dropless_loop": med["dropless_loop"] * 1e3,
            "ratio": med["one"] / med["ep"], "dropless_over_capacity": med["ep"] / med["dropless"],
            "grouped_over_loop": med["dropless_loop"] / med["dropless"],
            "bytes": [dict(f["ep"], rank=i) for i, f in enumerate(figures)],
            "bytes_dropless": [dict(f["dropless"], rank=i) for i, f in enumerate(figures)],
            "uniform_estimate": uniform, "max_diff": diff})
    return harness.finish(status)


if __name__ == "__main__":
    harness.run(main)
