"""Expert parallelism against the same MoE layer in one process, and its all-to-all bytes against theory.

    torchrun --nproc_per_node=2 benchmarks/moe_ep.py [--tokens 2048 --d-model 256 --d-hidden 1024
        --experts 8 --top-k 2 --capacity-factor 1.25 --steps 20 --warmup 3 --json PATH]

Each of the P ranks (ep = P, gloo on CPU, one thread each) routes ``--tokens``
tokens of its own through one `minipar.moe.MoELayer` whose E experts are split
E/P per rank; tokens travel to their experts and back by all-to-all. The
single-process baseline is the same layer (all E experts, same weights) on one
rank running the global batch, P x tokens, routed as P groups so it makes the
same capacity decisions; the other ranks wait meanwhile. Timed: forward +
backward of ``sum(out)``. Printed:

* tokens/s of both and their ratio (expert-parallel / one process): above 1 when
  spreading the experts over P ranks pays for the all-to-all;
* bytes each rank sent to other ranks per forward, as counted by the collective
  layer, beside the figure the routing implies: 2 exchanges (dispatch, combine)
  rows: those routed to experts on other ranks (dispatch) plus those received
  from other ranks (combine), x d_model x 4 bytes, plus the counts exchange; and beside the uniform-routing estimate 2 x T k (P-1)/P x d_model x 4
  (no drops). The first two must agree exactly (exit 1 otherwise);
* the outputs of the two agree (exit 1 if not, beyond --tolerance).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import minipar
from minipar.moe import MoELayer


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--json", default=None)
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    mesh = minipar.init(ep=int(os.environ.get("WORLD_SIZE", 1)))  # every rank one expert-parallel rank
    p = mesh.world_size
    torch.set_num_threads(1)
    layer_args = (args.d_model, args.d_hidden, args.experts, args.top_k, args.capacity_factor)
    ep_layer = MoELayer(*layer_args, seed=0)
    ep_layer.shard_experts(mesh.comm, mesh.group("ep"))
    gen = torch.Generator().manual_seed(1)
    x_global = torch.randn(p * args.tokens, args.d_model, generator=gen)
    x_local = x_global.chunk(p)[mesh.rank].clone().requires_grad_()
    one = None
    if mesh.rank == 0:
        one = MoELayer(*layer_args, seed=0)
        one.route_groups = p
        x_one = x_global.clone().requires_grad_()

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()  # the slowest rank's time
        return time.perf_counter() - t0

    def ep_step():
        ep_layer(x_local).sum().backward()

    def one_step():
        if one is not None:
            one(x_one).sum().backward()

    t_ep, t_one = [], []
    for step in range(args.warmup + args.steps):  # interleaved, so machine noise hits both alike
        a, b = timed(ep_step), timed(one_step)
        if step >= args.warmup:
            t_ep.append(a)
            t_one.append(b)

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
            ref = one(x_global)
        out = torch.cat([f["out"] for f in figures])
        diff = (out - ref).abs().max().item()
        status |= 0 if diff <= args.tolerance else 1
        med_ep, med_one = statistics.median(t_ep), statistics.median(t_one)
        tok = p * args.tokens
        print(f"MoE layer: {args.experts} experts, top-{args.top_k}, capacity factor {args.capacity_factor}, "
              f"d_model {args.d_model}, d_hidden {args.d_hidden}, {args.tokens} tokens per rank, "
              f"ep={p} ({dist.get_backend()})")
        print("\n| figure | value |\n|---|---|")
        print(f"| one process, {tok} tokens (fwd+bwd) | {med_one * 1e3:.1f} ms, {tok / med_one:,.0f} tokens/s |")
        print(f"| ep={p}, {args.tokens} tokens per rank | {med_ep * 1e3:.1f} ms, {tok / med_ep:,.0f} tokens/s |")
        print(f"| tokens/s ratio, ep={p} / one process | {med_one / med_ep:.2f} |")
        for f in figures:
            print(f"| rank {f['rank']} all-to-all bytes to other ranks per forward | {f['sent']:,} measured, "
                  f"{f['implied']:,} implied by its routing ({'equal' if f['sent'] == f['implied'] else 'DIFFERENT'}); "
                  f"uniform-routing estimate {uniform:,.0f}; {f['dropped']} assignments dropped |")
        print(f"| outputs, ep={p} vs one process | largest difference {diff:.2e}: {'ok' if diff <= args.tolerance else 'MISMATCH'} |")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"args": vars(args), "ms_one_process": med_one * 1e3, "ms_ep": med_ep * 1e3,
                           "ratio": med_one / med_ep,
                           "bytes": [{k: f[k] for k in ("rank", "sent", "implied", "dropped")} for f in figures],
                           "uniform_estimate": uniform, "max_diff": diff}, fh, indent=2)
    verdict = torch.tensor([status])
    mesh.comm.broadcast(verdict, 0, mesh.world, tag="verdict")
    minipar.shutdown()
    return int(verdict.item())


if __name__ == "__main__":
    code = main()
    gc.collect()  # free what reference cycles hold (process groups) before interpreter teardown
    sys.exit(code)
