"""Soak: the main job's layout for many steps, watching every rank's resident memory.

    torchrun --nproc_per_node=4 benchmarks/soak.py [--steps 1000 --every 50 --warmup 100
        --tp 2 --pp 2 --schedule 1f1b --microbatches 4 --batch 8 --model tiny --json PATH --check]

The model, the layout and the step are the main job's (``benchmarks/gpt_tp_pp.py``,
imported from it): a GPT as tp=2 x pp=2 (dp the rest of the world), 1F1B over 4
micro-batches, fp32 on a CPU (gloo), each step timed as the job times it
(after a barrier, inside ``Comm.counting``, with the pipeline timeline kept:
``record_timeline=True``), then clipping and AdamW. The default model is the
job's CPU default, the ``tiny`` preset (~0.8M parameters): 1000 steps take
about 3-4 minutes with 4 ranks on 2 CPU cores. The soak keeps nothing per
step itself (step times go into a preallocated array), so what grows is the
library's.

Resident memory: each rank's RSS (``/proc/self/statm``, Linux), sampled after
every ``--every`` steps, after the warm-up and after the last step, and printed
as one line per sample: the steps done and every rank's RSS in MiB. The growth
is RSS after the last step over RSS at the end of the warm-up (default: the
first 10% of the steps), per rank and the largest; the goal is growth < 2%.

Batch check: the per-step check `ShardedModule.train_step` runs first
(`minipar.checks.check_batch`: one all-gather of 15 int64 per rank over the
world, then a host sync) timed alone, ``--check-reps`` calls in a loop on the
same mesh with a batch of the job's shape, its median beside the median step
time of the soak (the steps after the warm-up); the goal is under 1% of the
step. Both figures are per rank; the largest share is reported, with the
all-gather alone in a loop beside it (the check's floor). The check's own
tensor and Python work is small (about 0.25 ms on the 2-core CPU): where ranks
outnumber CPU cores (the job's 4 ranks on 2) most of the check is the
all-gather waiting for a core.

``--check`` exits 1 when either goal is missed. ``--json PATH`` writes the
figures. ``--smoke``: 20 steps, a sample every 5, 20 check calls (for tests).
"""

from __future__ import annotations

import argparse
import array
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import minipar
from minipar.checks import check_batch
from minipar.models import GPT, GPTConfig
from minipar.models.data import markov_batch

from gpt_tp_pp import PRESETS, build_model, train_step

RSS_GOAL = 0.02    # largest growth of RSS from the end of the warm-up to the end
CHECK_GOAL = 0.01  # largest share of the step the batch check may take
CHECK_INTS = 15    # check_batch gathers 6 + 2 * 4 + 1 int64 per rank (six flags, two shapes, the join flag)
PAGE = os.sysconf("SC_PAGE_SIZE")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50, help="steps between RSS samples")
    ap.add_argument("--warmup", type=int, default=None, help="steps before the growth is measured; default 10%%")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=None, help="default: world / (tp * pp)")
    ap.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank per step")
    ap.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="the main job's shape preset")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--check-reps", type=int, default=500, help="batch-check calls timed")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--check", action="store_true", help="exit 1 if RSS grows >= 2%% or the check takes >= 1%%")
    ap.add_argument("--smoke", action="store_true", help="20 steps, a sample every 5, 20 check calls")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.every, args.check_reps = 20, 5, 20
    if args.warmup is None:
        args.warmup = max(1, args.steps // 10)
    if not 0 < args.warmup < args.steps:
        ap.error(f"--warmup {args.warmup} must lie between 0 and --steps {args.steps}")
    args.__dict__.update(PRESETS[args.model])  # seq, vocab, n_layer, n_embd, n_head
    return args


def rss_bytes() -> int:
    """This process's resident set now (not the peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def everyones_rss(mesh) -> list[int]:
    """Every rank's RSS, in world-rank order (one small all-gather)."""
    mine = torch.tensor([rss_bytes()], dtype=torch.int64, device=mesh.device)
    out = torch.empty(mesh.world_size, dtype=torch.int64, device=mesh.device)
    mesh.comm.all_gather(out, mine, mesh.world, tag="soak_rss")
    return out.tolist()


def time_batch_check(mesh, x: torch.Tensor, cfg: GPTConfig, reps: int) -> tuple[float, float]:
    """Median seconds of one `check_batch` call on the job's batch, as train_step makes it, and of
    its all-gather alone (the same ``CHECK_INTS`` int64 per rank over the host group it uses): the floor
    of the check."""
    inputs, targets = x[:, :-1], x[:, 1:]
    local = torch.zeros(CHECK_INTS, dtype=torch.int64)
    everyone = torch.empty(mesh.world_size * CHECK_INTS, dtype=torch.int64)
    calls = (lambda: check_batch(mesh, inputs, targets, cfg.vocab_size, cfg.block_size),
             lambda: mesh.comm.all_gather(everyone, local, mesh.host_world, tag="soak_floor"))
    sync = torch.cuda.synchronize if mesh.device.type == "cuda" else (lambda: None)  # NCCL returns early
    medians = []
    for call in calls:
        dist.barrier()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            call()
            sync()
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    return medians[0], medians[1]


def main() -> int:
    args = parse_args()
    mesh = minipar.init(dp=args.dp, tp=args.tp, pp=args.pp)
    if mesh.device.type == "cpu":
        torch.set_num_threads(1)
    main_rank = mesh.rank == 0
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd, seed=0)
    model, opt = build_model(GPT, cfg, mesh, args, "fp32")
    if main_rank:
        schedule = f"{args.schedule} with {args.microbatches} micro-batches" if mesh.pp > 1 else "no pipeline"
        print(f"soak: the main job's GPT '{args.model}' on {mesh.world_size} ranks: dp={mesh.dp} tp={mesh.tp} "
              f"pp={mesh.pp}, {schedule}, fp32, {dist.get_backend()}; {args.steps} steps, warm-up {args.warmup}, "
              f"RSS every {args.every}", flush=True)
        print(f"{'steps':>6}  RSS MiB per rank", flush=True)

    samples: dict[int, list[int]] = {}  # steps done -> every rank's RSS

    def sample(done: int) -> None:
        samples[done] = everyones_rss(mesh)
        if main_rank:
            print(f"{done:6d}  " + " ".join(f"{b / 2**20:7.1f}" for b in samples[done]), flush=True)

    sample(0)
    times = array.array("d", bytes(8 * args.steps))  # preallocated: the soak's own lists must not grow
    start = time.perf_counter()
    for step in range(args.steps):
        x = markov_batch(step, mesh.dp_rank, args.batch, args.seq, args.vocab).to(mesh.device)
        dist.barrier()  # as the main job: the ranks start each step together
        t0 = time.perf_counter()
        with mesh.comm.counting():
            loss = train_step(model, opt, x)
        if mesh.device.type == "cuda":
            torch.cuda.synchronize()
        times[step] = time.perf_counter() - t0
        loss.item()
        done = step + 1
        if done % args.every == 0 or done in (args.warmup, args.steps):
            sample(done)
    wall = time.perf_counter() - start

    warm, last = samples[args.warmup], samples[args.steps]
    growth = [(b - a) / a for a, b in zip(warm, last)]
    step_s = statistics.median(times[args.warmup:])
    check_s, gather_s = time_batch_check(mesh, x, cfg, args.check_reps)
    per_rank = mesh.comm.all_gather_object((step_s, check_s, gather_s), mesh.world, tag="soak_report")
    ratios = [c / s for s, c, _ in per_rank]
    worst = max(range(mesh.world_size), key=ratios.__getitem__)
    rss_ok, check_ok = max(growth) < RSS_GOAL, ratios[worst] < CHECK_GOAL

    if main_rank:
        print(f"\nwall time {wall:.1f} s for {args.steps} steps; median step (steps {args.warmup}+) "
              f"{per_rank[0][0] * 1e3:.1f} ms on rank 0, loss {loss.item():.3f} at the end")
        print("\n| rank | RSS after warm-up (step {w}) | RSS at the end (step {n}) | growth |\n|---|---|---|---|"
              .format(w=args.warmup, n=args.steps))
        for r in range(mesh.world_size):
            print(f"| {r} | {warm[r] / 2**20:.1f} MiB | {last[r] / 2**20:.1f} MiB | {growth[r]:+.2%} |")
        print(f"RSS growth after warm-up: max {max(growth):+.2%} (goal < {RSS_GOAL:.0%}): "
              f"{'met' if rss_ok else 'NOT met'}")
        s, c, g = per_rank[worst]
        print(f"batch check: {c * 1e3:.3f} ms = {ratios[worst]:.2%} of the step ({s * 1e3:.1f} ms), rank {worst}, "
              f"the largest share; median of {args.check_reps} calls (goal < {CHECK_GOAL:.0%}): "
              f"{'met' if check_ok else 'NOT met'}; its all-gather alone {g * 1e3:.3f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "torch": torch.__version__, "world_size": mesh.world_size,
                           "wall_s": wall, "rss_bytes": {str(k): v for k, v in samples.items()},
                           "rss_growth": growth, "rss_growth_max": max(growth), "rss_goal": RSS_GOAL,
                           "rss_goal_met": rss_ok, "median_step_s": [s for s, _, _ in per_rank],
                           "batch_check_s": [c for _, c, _ in per_rank],
                           "batch_check_all_gather_s": [g for _, _, g in per_rank], "batch_check_share": ratios,
                           "batch_check_goal": CHECK_GOAL, "batch_check_goal_met": check_ok}, f, indent=2)
            print(f"results: {args.json}")
    minipar.shutdown()
    return 1 if args.check and not (rss_ok and check_ok) else 0


if __name__ == "__main__":
    code = main()
    gc.collect()  # free what reference cycles hold (process groups) before interpreter teardown
    sys.exit(code)
