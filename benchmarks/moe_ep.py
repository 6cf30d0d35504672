"""Expert parallelism against the same MoE layer in one process, and its all-to-all bytes against theory.

    torchrun --nproc_per_node=2 benchmarks/moe_ep.py [--tokens 2048 --experts 8 --top-k 2 --json PATH]  # --help: all

Each rank routes its tokens through a `minipar.moe.layer.MoELayer` with its experts split over the ranks; the
baseline is the whole layer on rank 0 on the global batch, routed as P groups (the same capacity
decisions). Forward + backward timed by `harness.interleave`. Printed: tokens/s and their ratio; each
rank's bytes per forward beside what its routing implies (exit 1 unless equal) and the uniform-routing
estimate 2 T k (P-1)/P d_model 4; the largest output difference (exit 1 beyond --tolerance).
"""

from __future__ import annotations

import os

import torch

import harness
from minipar.moe.layer import MoELayer


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
    layer_args = (args.d_model, args.d_hidden, args.experts, args.top_k, args.capacity_factor)
    ep_layer = MoELayer(*layer_args, seed=0)
    ep_layer.shard_experts(mesh.comm, mesh.group("ep"))
    x_global = torch.randn(p * args.tokens, args.d_model, generator=torch.Generator().manual_seed(1))
    x_local = x_global.chunk(p)[mesh.rank].clone().requires_grad_()
    one, x_one = None, x_global.clone().requires_grad_()
    if mesh.rank == 0:
        one = MoELayer(*layer_args, seed=0)
        one.route_groups = p
    t = harness.interleave({"ep": lambda i: ep_layer(x_local).sum().backward(),
                            "one": lambda i: one is not None and one(x_one).sum().backward()},
                           args.steps, args.warmup)

    # Communication of one forward, counted by the collective layer.
    with mesh.comm.counting() as stats, torch.no_grad():
        out_local = ep_layer(x_local)
    row = 4 * args.d_model
    sent = sum(r.wire_bytes for r in stats.records if r.tag in ("moe_dispatch", "moe_combine", "moe_counts"))
    uniform = 2 * args.tokens * args.top_k * (p - 1) / p * row
    figures = mesh.comm.all_gather_object({"rank": mesh.rank, "sent": sent, "counts": ep_layer.last_counts[0],
                                           "dropped": ep_layer.last_dropped, "out": out_local}, mesh.world)
    # What the routing implies: dispatch sends rank r's rows for other ranks' experts; combine sends
    # back the rows r received from other ranks; the counts exchange sends E/P int64 to each other rank.
    per_rank = torch.stack([f["counts"].view(p, -1).sum(dim=1) for f in figures])  # [src, dst] rows
    for r, f in enumerate(figures):
        out_rows = per_rank[r].sum().item() - per_rank[r, r].item()
        in_rows = per_rank[:, r].sum().item() - per_rank[r, r].item()
        f["implied"] = (out_rows + in_rows) * row + args.experts // p * 8 * (p - 1)
    status = 0 if all(f["sent"] == f["implied"] for f in figures) else 1
    if mesh.rank == 0:
        with torch.no_grad():
            diff = (torch.cat([f["out"] for f in figures]) - one(x_global)).abs().max().item()
        status |= 0 if diff <= args.tolerance else 1
        med_ep, med_one, tok = t.median("ep"), t.median("one"), p * args.tokens
        print(f"MoE layer: {args.experts} experts, top-{args.top_k}, capacity factor {args.capacity_factor}, "
              f"d_model {args.d_model}, d_hidden {args.d_hidden}, {args.tokens} tokens per rank, "
              f"ep={p} ({torch.distributed.get_backend()})\n")
        print(harness.table(["figure", "value"], [
            [f"one process, {tok} tokens (fwd+bwd)", f"{med_one * 1e3:.1f} ms, {tok / med_one:,.0f} tokens/s"],
            [f"ep={p}, {args.tokens} tokens per rank", f"{med_ep * 1e3:.1f} ms, {tok / med_ep:,.0f} tokens/s"],
            [f"tokens/s ratio, ep={p} / one process", f"{med_one / med_ep:.2f}"]] + [
            [f"rank {f['rank']} all-to-all bytes to other ranks per forward", f"{f['sent']:,} measured, "
             f"{f['implied']:,} implied by its routing ({'equal' if f['sent'] == f['implied'] else 'DIFFERENT'}); "
             f"uniform-routing estimate {uniform:,.0f}; {f['dropped']} assignments dropped"] for f in figures] + [
            [f"outputs, ep={p} vs one process", f"largest difference {diff:.2e}: "
                                               f"{'ok' if diff <= args.tolerance else 'MISMATCH'}"]]))
        harness.write_json(args.json, {
            "args": vars(args), "ms_one_process": med_one * 1e3, "ms_ep": med_ep * 1e3, "ratio": med_one / med_ep,
            "bytes": [{k: f[k] for k in ("rank", "sent", "implied", "dropped")} for f in figures],
            "uniform_estimate": uniform, "max_diff": diff})
    return harness.finish(status)


if __name__ == "__main__":
    harness.run(main)
