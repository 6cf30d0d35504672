"""minipar DDP against torch.nn.parallel.DistributedDataParallel, step for step.

    torchrun --nproc_per_node=2 benchmarks/ddp_vs_torch.py [--steps N --warmup W --bucket-cap-mb B
        --n-layer L --n-embd E --n-head H --vocab V --seq T --batch B --json out.json --check]

Both train the same GPT on the same per-rank batches with the same AdamW: ``ShardedModule(strategy=
"ddp", bucket_cap_mb=B)`` and ``DistributedDataParallel(bucket_cap_mb=B)``, timed by `harness.interleave`.
Printed: the per-step table, the medians, minipar/torch and the paired ratios; minipar's bytes per step
(the "grad" all-reduce must equal the parameter bytes); both sides' buckets; the largest parameter
difference. ``--check``: exit 1 when the ratio exceeds 1.10 or the "grad" bytes differ.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import harness
import minipar
from minipar.models import GPT, gpt_loss

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
    device, cuda, rank, world = mesh.device, mesh.device.type == "cuda", mesh.rank, mesh.world_size
    cfg, opt_kwargs = harness.gpt_config(args, seed=args.seed), dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    model_a, model_b = GPT(cfg), GPT(cfg).to(device)
    mp_model = minipar.ShardedModule(model_a, mesh=mesh, strategy="ddp", bucket_cap_mb=args.bucket_cap_mb)
    pt_model = DistributedDataParallel(model_b, bucket_cap_mb=args.bucket_cap_mb,
                                       device_ids=[int(os.environ.get("LOCAL_RANK", 0))] if cuda else None)
    opts = {"minipar": mp_model.build_optimizer(torch.optim.AdamW, **opt_kwargs),
            "torch": torch.optim.AdamW(pt_model.parameters(), **opt_kwargs)}
    params = [p for p in model_a.parameters() if p.requires_grad]  # a tied weight counts once
    param_bytes, n_params = sum(p.numel() * p.element_size() for p in params), sum(p.numel() for p in params)
    batches = [harness.tokens((args.seed * 1_000_003 + s) * 1_009 + rank, args.batch, args, device)
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

    t_start = time.perf_counter()
    t = harness.interleave({"minipar": lambda i: step(mp_model, opts["minipar"], i),
                            "torch": lambda i: step(pt_model, opts["torch"], i)}, args.steps, args.warmup)
    wall = time.perf_counter() - t_start
    times = {k: t.timed(k) for k in opts}
    losses = torch.tensor([t.results[k][args.warmup:] for k in opts], dtype=torch.float64)
    dist.all_reduce(losses)  # the mean over ranks
    losses /= world
    with torch.no_grad():
        diff = max((pa - pb).abs().max().item() for pa, pb in zip(model_a.parameters(), model_b.parameters()))
        scale = max(pa.abs().max().item() for pa in model_a.parameters())
    diff, (med_a, med_b), ratio = harness.slowest_rank([diff])[0], map(t.median, opts), t.ratio("minipar", "torch")
    pair, (min_a, min_b) = t.paired("minipar", "torch"), (min(v) for v in times.values())
    grad = [r for r in records if r.op == "all_reduce" and r.tag == "grad"]
    other: dict = {}
    for r in records:
        if r.tag != "grad":
            row = other.setdefault(f"{r.op}/{r.tag}", {"calls": 0, "bytes": 0})
            row["calls"], row["bytes"] = row["calls"] + 1 / args.steps, row["bytes"] + r.bytes / args.steps
    grad_bytes = sum(r.bytes for r in grad) / args.steps
    bytes_ok, ratio_ok = grad_bytes == param_bytes, ratio <= RATIO_LIMIT
    mp_buckets = [b.flat.numel() * b.flat.element_size() for b in mp_model.strategy.buckets]
    torch_buckets = torch_bucket_info(pt_model)
    result = {
        "command": harness.command(), "torch": torch.__version__, "backend": dist.get_backend(), "device": str(device),
        "world_size": world, "threads_per_rank": torch.get_num_threads(),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "check")},
        "n_params": n_params, "param_bytes": param_bytes, "step_s": times,
        "median_step_s": {"minipar": med_a, "torch": med_b},
        "ratio_minipar_over_torch": ratio, "ratio_limit": RATIO_LIMIT, "ratio_ok": ratio_ok,
        "min_step_s": {"minipar": min_a, "torch": min_b},
        "pair_ratio_median": t.paired_median("minipar", "torch"), "pair_ratio_min_max": [min(pair), max(pair)],
        "loss_first_last": {k: [losses[j, 0].item(), losses[j, -1].item()] for j, k in enumerate(times)},
        "minipar_comm_per_step": {"grad_all_reduce_bytes": grad_bytes, "grad_all_reduce_calls": len(grad) / args.steps,
                                  "other": other, "grad_bytes_equal_param_bytes": bytes_ok},
        "buckets": {"minipar": {"num_buckets": len(mp_buckets), "bucket_bytes": mp_buckets}, "torch": torch_buckets},
        "max_abs_param_diff": diff, "max_abs_param": scale, "wall_s": wall}
    if rank == 0:
        print(f"minipar DDP vs torch DDP: world {world}, {dist.get_backend()} on {device}, "
              f"{torch.get_num_threads()} thread(s)/rank, torch {torch.__version__}")
        print(f"GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} vocab={args.vocab} "
              f"seq={args.seq} batch={args.batch}/rank: {n_params:,} parameters, {param_bytes / 2**20:.2f} MiB; "
              f"bucket_cap_mb={args.bucket_cap_mb:g}; {args.warmup} warm-up + {args.steps} timed steps each\n")
        print(harness.table(["step", "minipar ms", "torch ms", "ratio"], [
            [i, f"{a * 1e3:.2f}", f"{b * 1e3:.2f}", f"{a / b:.3f}"] for i, (a, b) in enumerate(zip(*times.values()))]))
        print(f"\nmedian step: minipar {med_a * 1e3:.2f} ms, torch {med_b * 1e3:.2f} ms")
        print(f"ratio minipar/torch (of medians): {ratio:.3f}  (goal <= 1.00, limit {RATIO_LIMIT:.2f}: "
              f"{'OK' if ratio_ok else 'OVER'})")
        print(f"per-step ratios: median {result['pair_ratio_median']:.3f}, range {min(pair):.3f} .. {max(pair):.3f}; "
              f"fastest step: minipar {min_a * 1e3:.2f} ms, torch {min_b * 1e3:.2f} ms ({min_a / min_b:.3f})")
        print(f"loss first/last timed step: minipar {losses[0, 0]:.4f}/{losses[0, -1]:.4f}, "
              f"torch {losses[1, 0]:.4f}/{losses[1, -1]:.4f}")
        print("\nminipar communication per step (mesh.comm.counting()):")
        print(f"  all_reduce tag 'grad': {grad_bytes:,.0f} B in {len(grad) / args.steps:g} call(s); "
              f"parameter bytes {param_bytes:,} -> {'equal' if bytes_ok else 'NOT EQUAL'}")
        print("\n".join(f"  {k}: {v['bytes']:,.0f} B in {v['calls']:g} call(s)" for k, v in other.items())
              or "  other tags: none")
        mib = ", ".join(f"{n / 2**20:.2f}" for n in mp_buckets)
        print(f"buckets: minipar {len(mp_buckets)} ({mib} MiB)" + (
            f"; torch {torch_buckets['num_buckets']} ({', '.join(f'{n / 2**20:.2f}' for n in torch_buckets['bucket_bytes'])}"
            f" MiB, from its {torch_buckets['source']})" if torch_buckets.get("num_buckets") is not None
            else f"; torch unknown: {torch_buckets['note']}"))
        print(f"\nsanity: max |param_minipar - param_torch| after {args.warmup + args.steps} steps = {diff:.3e} "
              f"(largest |param| {scale:.3g})\nwall time of the training loops: {wall:.1f} s")
        harness.write_json(args.json, result)
    dist.barrier()
    minipar.shutdown()
    return 1 if args.check and not (ratio_ok and bytes_ok) else 0


if __name__ == "__main__":
    harness.run(main)
