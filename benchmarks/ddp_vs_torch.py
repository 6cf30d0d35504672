"""minipar DDP against torch.nn.parallel.DistributedDataParallel, step for step.

    torchrun --nproc_per_node=2 benchmarks/ddp_vs_torch.py [--bucket-cap-mb B --json out.json --check]  # --help: all

The same GPT, per-rank batches and AdamW under ``ShardedModule(strategy="ddp", bucket_cap_mb=B)`` and
``DistributedDataParallel(bucket_cap_mb=B)``. Printed: the per-step table, the medians and ratios; minipar's
bytes per step (the "grad" all-reduce must equal the parameter bytes); both sides' buckets; the largest
parameter difference. ``--check``: exit 1 when the ratio exceeds 1.10 or the "grad" bytes differ.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import harness
import minipar
from minipar.models import GPT, gpt_loss
from references import ddp

RATIO_LIMIT = 1.10


def torch_bucket_info(ddp: DistributedDataParallel) -> dict:
    """Torch's bucket layout from its (prototype) logging data, or a note saying it is not available."""
    try:
        data = ddp._get_ddp_logging_data()
    except Exception as e:  # a private interface: say so rather than fail the benchmark
        return {"num_buckets": None, "note": f"DDP logging data not accessible ({type(e).__name__}: {e})"}
    for key in ("rebuilt_bucket_sizes", "bucket_sizes"):
        if isinstance(sizes := data.get(key), str) and sizes.strip():
            parsed = [int(s) for s in sizes.replace(" ", "").split(",") if s]
            return {"num_buckets": len(parsed), "bucket_bytes": parsed, "source": f"logging data {key!r}"}
    return {"num_buckets": None, "note": "DDP logging data has no bucket sizes"}


def main() -> int:
    ap = harness.parser(__doc__, steps=30, warmup=3, n_layer=4, n_embd=256, n_head=4, vocab=2048, seq=128, batch=4,
                        lr=1e-3, seed=0, json=None, check=False)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="gradient bucket cap, both sides")
    args = ap.parse_args()
    mesh = harness.init()
    cfg, opt_kwargs = harness.gpt_config(args, seed=args.seed), dict(lr=args.lr, **harness.ADAMW)
    model_a, model_b = GPT(cfg), GPT(cfg).to(mesh.device)
    mp_model = minipar.ShardedModule(model_a, mesh=mesh, strategy="ddp", bucket_cap_mb=args.bucket_cap_mb)
    pt_model = ddp(model_b, mesh.device, bucket_cap_mb=args.bucket_cap_mb)
    opts = {"minipar": mp_model.build_optimizer(torch.optim.AdamW, **opt_kwargs),
            "torch": torch.optim.AdamW(pt_model.parameters(), **opt_kwargs)}
    params = [p for p in model_a.parameters() if p.requires_grad]  # a tied weight counts once
    param_bytes, n_params = sum(p.numel() * p.element_size() for p in params), sum(p.numel() for p in params)
    batches = [harness.tokens((args.seed * 1_000_003 + s) * 1_009 + mesh.rank, args.batch, args, mesh.device)
               for s in range(args.warmup + args.steps)]
    records = []  # minipar's collectives in the timed steps (only minipar's go through mesh.comm)

    def step(model, opt, i: int) -> float:
        with mesh.comm.counting() as stats:
            loss = gpt_loss(model(batches[i][0]), batches[i][1])
            loss.backward()
            opt.step()
            opt.zero_grad()
        records.extend(stats.records if i >= args.warmup else [])
        return loss.item()

    t = harness.interleave({"minipar": lambda i: step(mp_model, opts["minipar"], i),
                            "torch": lambda i: step(pt_model, opts["torch"], i)}, args.steps, args.warmup)
    losses = torch.tensor([t.results[k][args.warmup:] for k in opts], dtype=torch.float64)
    dist.all_reduce(losses)  # the mean over ranks
    losses /= mesh.world_size
    with torch.no_grad():
        diff = max((pa - pb).abs().max().item() for pa, pb in zip(model_a.parameters(), model_b.parameters()))
        scale = max(pa.abs().max().item() for pa in model_a.parameters())
    diff, c = harness.slowest_rank([diff])[0], harness.compare(t, "minipar", "torch", limit=RATIO_LIMIT)
    comm = harness.per_op_tag(records, args.steps)
    grad = comm.get("all_reduce/grad", {"calls": 0, "bytes": 0})
    other = {k: v for k, v in comm.items() if "/" in k and k != "all_reduce/grad"}
    bytes_ok = grad["bytes"] == param_bytes
    mp_buckets = [b.flat.numel() * b.flat.element_size() for b in mp_model.strategy.buckets]
    torch_buckets = torch_bucket_info(pt_model)
    result = {
        **harness.run_info(args, mesh), "n_params": n_params, "param_bytes": param_bytes,
        "step_s": {k: t.timed(k) for k in opts}, "minipar_over_torch": c,
        "loss_first_last": {k: [losses[j, 0].item(), losses[j, -1].item()] for j, k in enumerate(opts)},
        "minipar_comm_per_step": {**comm, "grad_bytes_equal_param_bytes": bytes_ok},
        "buckets": {"minipar": {"num_buckets": len(mp_buckets), "bucket_bytes": mp_buckets}, "torch": torch_buckets},
        "max_abs_param_diff": diff, "max_abs_param": scale, "wall_s": t.wall_s}
    if mesh.rank == 0:
        print(f"minipar DDP vs torch DDP: {harness.setting(mesh)}")
        print(f"{harness.shape(args)} batch={args.batch}/rank: {n_params:,} parameters, {param_bytes / 2**20:.2f} "
              f"MiB; bucket_cap_mb={args.bucket_cap_mb:g}; {args.warmup} warm-up + {args.steps} timed steps each\n")
        print(harness.step_table(t, "minipar", "torch"))
        harness.print_comparison(c)
        print(f"loss first/last timed step: minipar {losses[0, 0]:.4f}/{losses[0, -1]:.4f}, "
              f"torch {losses[1, 0]:.4f}/{losses[1, -1]:.4f}")
        print("\nminipar communication per step (mesh.comm.counting()):")
        print(f"  all_reduce tag 'grad': {grad['bytes']:,.0f} B in {grad['calls']:g} call(s); "
              f"parameter bytes {param_bytes:,} -> {'equal' if bytes_ok else 'NOT EQUAL'}")
        print("\n".join(f"  {k}: {v['bytes']:,.0f} B in {v['calls']:g} call(s)" for k, v in other.items())
              or "  other tags: none")
        mib = ", ".join(f"{n / 2**20:.2f}" for n in mp_buckets)
        print(f"buckets: minipar {len(mp_buckets)} ({mib} MiB)" + (
            f"; torch {torch_buckets['num_buckets']} ({', '.join(f'{n / 2**20:.2f}' for n in torch_buckets['bucket_bytes'])}"
            f" MiB, from its {torch_buckets['source']})" if torch_buckets.get("num_buckets") is not None
            else f"; torch unknown: {torch_buckets['note']}"))
        print(f"\nsanity: max |param_minipar - param_torch| after {args.warmup + args.steps} steps = {diff:.3e} "
              f"(largest |param| {scale:.3g})\nwall time of the training loops: {t.wall_s:.1f} s")
        harness.write_json(args.json, result)
    return harness.finish(args.check and not (c["ok"] and bytes_ok))


if __name__ == "__main__":
    harness.run(main)
