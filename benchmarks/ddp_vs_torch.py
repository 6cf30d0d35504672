"""minipar DDP against torch.nn.parallel.DistributedDataParallel, step for step.

    torchrun --nproc_per_node=2 benchmarks/ddp_vs_torch.py [--steps N --warmup W --bucket-cap-mb B
        --n-layer L --n-embd E --n-head H --vocab V --seq T --batch B --json out.json --check]

Both sides train the same reference GPT (``minipar.models.GPT``, built twice
from one config seed, so the weights start equal) on the same per-rank batches
(different data on every rank, seeded by step and rank) with the same AdamW:

  A  minipar.ShardedModule(model, mesh=mesh, strategy="ddp", bucket_cap_mb=B)
  B  torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=B)   (defaults otherwise)

One step is forward, ``gpt_loss``, backward, ``opt.step()``, ``opt.zero_grad()``.
After the warm-up the two run interleaved, A B A B ..., so drift of the
machine (clock, other load) hits both alike. Every timed step starts after a
barrier (not timed) so no rank carries the previous step's lag into it; a
step's time is the slowest rank's ``time.perf_counter`` interval (CUDA is
synchronised before reading the clock). Rank 0 prints:

* the per-step table, the median step time of each and their ratio
  minipar/torch (the headline figure), and the median of the per-step ratios
  (each pair ran back to back, so it is the less load-sensitive figure);
* minipar's communication per step, counted with ``mesh.comm.counting()``:
  bytes all-reduced under the tag "grad" (must equal the parameter bytes) and
  under any other tag, and the number of buckets of each implementation
  (torch's from its DDP logging data);
* the largest parameter difference between the two models after the run:
  a sanity check that both trained the same thing, not a speed figure.

Exit status 0; with ``--check``, 1 when the ratio exceeds 1.10 or the "grad"
bytes differ from the parameter bytes.

On CPU each rank computes with one thread (torch.set_num_threads(1)), over gloo;
on GPUs, nccl with one device per rank. The defaults (4 layers, n_embd 256,
vocab 2048, 128 tokens x 4 sequences per rank: 3.7M parameters, 14.2 MiB of
gradients) take about 0.3 s a step on an idle 2-core machine, ~25 s a run;
the gradient all-reduce is a few percent of a step and Python overhead less,
so the step is compute plus communication. Smaller ``--bucket-cap-mb`` (e.g. 1) puts more
weight on how each implementation buckets and launches its all-reduces.
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
from torch.nn.parallel import DistributedDataParallel

import minipar
from minipar.models import GPT, GPTConfig, gpt_loss

RATIO_LIMIT = 1.10


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="timed steps per implementation")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per implementation first")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="gradient bucket cap, both sides")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (also the block size)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0, help="model and data seed")
    p.add_argument("--json", default=None, help="also write the results here as JSON")
    p.add_argument("--check", action="store_true",
                   help=f"exit 1 when minipar/torch > {RATIO_LIMIT} or grad bytes != parameter bytes")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def make_batches(n: int, rank: int, args, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (inputs, targets) pairs for this rank: the same for both implementations, different per rank."""
    out = []
    for step in range(n):
        gen = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 1_009 + rank)
        tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
    return out


def train_step(model, opt, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = gpt_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def timed_step(model, opt, x, y, cuda: bool) -> tuple[float, torch.Tensor]:
    dist.barrier()  # aligned start; not timed
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = train_step(model, opt, x, y)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, loss


def torch_bucket_info(ddp: DistributedDataParallel) -> dict:
    """Torch's bucket layout from its (prototype) logging data, or a note saying it is not available."""
    try:
        data = ddp._get_ddp_logging_data()
    except Exception as e:  # a private interface: say so rather than fail the benchmark
        return {"num_buckets": None, "note": f"DDP logging data not accessible ({type(e).__name__}: {e})"}
    for key in ("rebuilt_bucket_sizes", "bucket_sizes"):
        sizes = data.get(key)
        if isinstance(sizes, str) and sizes.strip():
            parsed = [int(s) for s in sizes.replace(" ", "").split(",") if s]
            return {"num_buckets": len(parsed), "bucket_bytes": parsed, "source": f"logging data {key!r}"}
    return {"num_buckets": None, "note": "DDP logging data has no bucket sizes"}


def main(argv=None) -> int:
    args = parse_args(argv)
    mesh = minipar.init()
    device = mesh.device
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))

    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd, seed=args.seed)
    opt_kwargs = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    model_a = GPT(cfg)
    mp_model = minipar.ShardedModule(model_a, mesh=mesh, strategy="ddp", bucket_cap_mb=args.bucket_cap_mb)
    opt_a = mp_model.build_optimizer(torch.optim.AdamW, **opt_kwargs)

    model_b = GPT(cfg).to(device)
    pt_model = DistributedDataParallel(model_b, bucket_cap_mb=args.bucket_cap_mb,
                                       device_ids=[local_rank] if cuda else None)
    opt_b = torch.optim.AdamW(pt_model.parameters(), **opt_kwargs)

    params = [p for p in model_a.parameters() if p.requires_grad]  # a tied weight counts once
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    n_params = sum(p.numel() for p in params)

    batches = make_batches(args.warmup + args.steps, rank, args, device)
    sides = (("minipar", mp_model, opt_a), ("torch", pt_model, opt_b))

    t_start = time.perf_counter()
    for x, y in batches[:args.warmup]:
        for _, model, opt in sides:
            train_step(model, opt, x, y)

    times = torch.zeros(args.steps, 2, dtype=torch.float64)
    losses = torch.zeros(args.steps, 2, dtype=torch.float64)
    with mesh.comm.counting() as stats:  # only minipar's collectives go through mesh.comm
        for i, (x, y) in enumerate(batches[args.warmup:]):
            for j, (_, model, opt) in enumerate(sides):
                times[i, j], loss = timed_step(model, opt, x, y, cuda)
                losses[i, j] = loss.item()
    wall = time.perf_counter() - t_start

    # Outside the timed region: the job's step time is the slowest rank's; losses averaged over ranks.
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(losses)
    losses /= world

    with torch.no_grad():
        diff = max((pa - pb).abs().max().item() for pa, pb in zip(model_a.parameters(), model_b.parameters()))
        scale = max(pa.abs().max().item() for pa in model_a.parameters())
    diff_t = torch.tensor([diff], dtype=torch.float64)
    dist.all_reduce(diff_t, op=dist.ReduceOp.MAX)
    diff = diff_t.item()

    med_a = statistics.median(times[:, 0].tolist())
    med_b = statistics.median(times[:, 1].tolist())
    ratio = med_a / med_b
    pair_ratios = (times[:, 0] / times[:, 1]).tolist()
    pair_median = statistics.median(pair_ratios)  # each pair ran back to back: robust to slow drift
    min_a, min_b = times[:, 0].min().item(), times[:, 1].min().item()  # least disturbed step of each

    grad_bytes_total = stats.bytes(op="all_reduce", tag="grad")
    grad_calls_total = stats.calls(op="all_reduce", tag="grad")
    other = {}
    for r in stats.records:
        if r.tag != "grad":
            row = other.setdefault(f"{r.op}/{r.tag}", {"calls": 0, "bytes": 0})
            row["calls"] += 1
            row["bytes"] += r.bytes
    grad_bytes_step = grad_bytes_total / args.steps
    other_per_step = {k: {"calls": v["calls"] / args.steps, "bytes": v["bytes"] / args.steps}
                      for k, v in other.items()}
    bytes_ok = grad_bytes_total == args.steps * param_bytes
    ratio_ok = ratio <= RATIO_LIMIT
    mp_buckets = mp_model.strategy.buckets
    torch_buckets = torch_bucket_info(pt_model)

    result = {
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "torch": torch.__version__, "backend": dist.get_backend(), "device": str(device),
        "world_size": world, "threads_per_rank": torch.get_num_threads(),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "check")},
        "n_params": n_params, "param_bytes": param_bytes,
        "step_s": {"minipar": times[:, 0].tolist(), "torch": times[:, 1].tolist()},
        "median_step_s": {"minipar": med_a, "torch": med_b},
        "ratio_minipar_over_torch": ratio, "ratio_limit": RATIO_LIMIT, "ratio_ok": ratio_ok,
        "min_step_s": {"minipar": min_a, "torch": min_b},
        "pair_ratio_median": pair_median, "pair_ratio_min_max": [min(pair_ratios), max(pair_ratios)],
        "loss_first_last": {"minipar": [losses[0, 0].item(), losses[-1, 0].item()],
                            "torch": [losses[0, 1].item(), losses[-1, 1].item()]},
        "minipar_comm_per_step": {"grad_all_reduce_bytes": grad_bytes_step,
                                  "grad_all_reduce_calls": grad_calls_total / args.steps,
                                  "other": other_per_step, "grad_bytes_equal_param_bytes": bytes_ok},
        "buckets": {"minipar": {"num_buckets": len(mp_buckets),
                                "bucket_bytes": [b.flat.numel() * b.flat.element_size() for b in mp_buckets]},
                    "torch": torch_buckets},
        "max_abs_param_diff": diff, "max_abs_param": scale,
        "wall_s": wall,
    }

    if rank == 0:
        print(f"minipar DDP vs torch DDP: world {world}, {dist.get_backend()} on {device}, "
              f"{torch.get_num_threads()} thread(s)/rank, torch {torch.__version__}")
        print(f"GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} vocab={args.vocab} "
              f"seq={args.seq} batch={args.batch}/rank: {n_params:,} parameters, {param_bytes / 2**20:.2f} MiB; "
              f"bucket_cap_mb={args.bucket_cap_mb:g}; {args.warmup} warm-up + {args.steps} timed steps each")
        print(f"\n{'step':>4} {'minipar ms':>11} {'torch ms':>9} {'ratio':>6}")
        for i in range(args.steps):
            a, b = times[i, 0].item() * 1e3, times[i, 1].item() * 1e3
            print(f"{i:>4} {a:>11.2f} {b:>9.2f} {a / b:>6.3f}")
        print(f"\nmedian step: minipar {med_a * 1e3:.2f} ms, torch {med_b * 1e3:.2f} ms")
        print(f"ratio minipar/torch (of medians): {ratio:.3f}  (goal <= 1.00, limit {RATIO_LIMIT:.2f}: "
              f"{'OK' if ratio_ok else 'OVER'})")
        print(f"per-step ratios: median {pair_median:.3f}, range {min(pair_ratios):.3f} .. {max(pair_ratios):.3f}; "
              f"fastest step: minipar {min_a * 1e3:.2f} ms, torch {min_b * 1e3:.2f} ms ({min_a / min_b:.3f})")
        print(f"loss first/last timed step: minipar {losses[0, 0]:.4f}/{losses[-1, 0]:.4f}, "
              f"torch {losses[0, 1]:.4f}/{losses[-1, 1]:.4f}")
        print("\nminipar communication per step (mesh.comm.counting()):")
        print(f"  all_reduce tag 'grad': {grad_bytes_step:,.0f} B in {grad_calls_total / args.steps:g} call(s); "
              f"parameter bytes {param_bytes:,} -> {'equal' if bytes_ok else 'NOT EQUAL'}")
        for k, v in other_per_step.items():
            print(f"  {k}: {v['bytes']:,.0f} B in {v['calls']:g} call(s)")
        if not other_per_step:
            print("  other tags: none")
        print(f"buckets: minipar {len(mp_buckets)} "
              f"({', '.join(f'{n / 2**20:.2f}' for n in result['buckets']['minipar']['bucket_bytes'])} MiB)", end="")
        if torch_buckets.get("num_buckets") is not None:
            print(f"; torch {torch_buckets['num_buckets']} "
                  f"({', '.join(f'{n / 2**20:.2f}' for n in torch_buckets['bucket_bytes'])} MiB, "
                  f"from its {torch_buckets['source']})")
        else:
            print(f"; torch unknown: {torch_buckets['note']}")
        print(f"\nsanity: max |param_minipar - param_torch| after {args.warmup + args.steps} steps = {diff:.3e} "
              f"(largest |param| {scale:.3g})")
        print(f"wall time of the training loops: {wall:.1f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
            print(f"results written to {args.json}")

    dist.barrier()
    minipar.shutdown()
    failed = args.check and not (ratio_ok and bytes_ok)
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    gc.collect()  # free what reference cycles hold (process groups) before interpreter teardown
    sys.exit(code)
