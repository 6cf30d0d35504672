"""Soak: the main job's layout for many steps, watching every rank's resident memory.

    torchrun --nproc_per_node=4 benchmarks/soak.py [--steps 1000 --every 50 --json PATH --check --smoke]

The main job's model, layout and step (``gpt_tp_pp``). Each rank's RSS every ``--every`` steps, after the
warm-up (default 10%) and at the end; growth from the warm-up to the end, goal < 2%. The batch check
(`minipar.checks.check_batch`) timed alone beside the median step, goal < 1%, with its all-gather alone
(its floor). ``--check``: exit 1 on a missed goal.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import harness
import minipar
from gpt_tp_pp import PRESETS, build_model, train_step
from minipar.checks import check_batch
from minipar.models import GPT
from minipar.models.data import markov_batch

RSS_GOAL = 0.02    # largest growth of RSS from the end of the warm-up to the end
CHECK_GOAL = 0.01  # largest share of the step the batch check may take
CHECK_INTS = 15    # check_batch gathers 6 + 2 * 4 + 1 int64 per rank (six flags, two shapes, the join flag)
PAGE = os.sysconf("SC_PAGE_SIZE")


def parse_args():
    ap = harness.parser(__doc__, steps=1000, warmup=None, batch=8, lr=3e-3, json=None, check=False, microbatches=4,
                        smoke=dict(steps=20, every=5, check_reps=20),
                        help={"warmup": "steps before the growth is measured; default 10%%",
                              "batch": "sequences per data-parallel rank per step"})
    for flag, default, text in (("--every", 50, "steps between RSS samples"), ("--tp", 2, None), ("--pp", 2, None),
                                ("--dp", None, "default: world / (tp * pp)"), ("--check-reps", 500, "batch-check calls timed")):
        ap.add_argument(flag, type=int, default=default, help=text)
    ap.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    ap.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="the main job's shape preset")
    args = ap.parse_args()
    args.warmup = max(1, args.steps // 10) if args.warmup is None else args.warmup
    if not 0 < args.warmup < args.steps:
        ap.error(f"--warmup {args.warmup} must lie between 0 and --steps {args.steps}")
    args.__dict__.update(PRESETS[args.model])  # seq, vocab, n_layer, n_embd, n_head
    return args


def everyones_rss(mesh) -> list[int]:
    """Every rank's resident set now (not the peak), in world-rank order (one small all-gather)."""
    with open("/proc/self/statm") as f:
        mine = torch.tensor([int(f.read().split()[1]) * PAGE], dtype=torch.int64, device=mesh.device)
    out = torch.empty(mesh.world_size, dtype=torch.int64, device=mesh.device)
    mesh.comm.all_gather(out, mine, mesh.world, tag="soak_rss")
    return out.tolist()


def time_batch_check(mesh, x: torch.Tensor, cfg, reps: int) -> tuple[float, float]:
    """This rank's median seconds of one `check_batch` call on the job's batch, and of its all-gather
    alone (``CHECK_INTS`` int64 per rank over the host group it uses): the floor of the check. Back to
    back on each rank (unaligned: the check's own wait for the other ranks is part of its cost)."""
    local = torch.zeros(CHECK_INTS, dtype=torch.int64)
    everyone = torch.empty(mesh.world_size * CHECK_INTS, dtype=torch.int64)
    dist.barrier()
    t = harness.interleave({
        "check": lambda i: check_batch(mesh, x[:, :-1], x[:, 1:], cfg.vocab_size, cfg.block_size),
        "floor": lambda i: mesh.comm.all_gather(everyone, local, mesh.host_world, tag="soak_floor")},
        reps, aligned=False)
    return t.median("check"), t.median("floor")


def main() -> int:
    args = parse_args()
    mesh = harness.init(dp=args.dp, tp=args.tp, pp=args.pp)
    main_rank, cfg = mesh.rank == 0, harness.gpt_config(args, seed=0)
    model, opt = build_model(GPT, cfg, mesh, args, "fp32")
    if main_rank:
        schedule = f"{args.schedule} with {args.microbatches} micro-batches" if mesh.pp > 1 else "no pipeline"
        print(f"soak: the main job's GPT '{args.model}' on {mesh.world_size} ranks: dp={mesh.dp} tp={mesh.tp} "
              f"pp={mesh.pp}, {schedule}, fp32, {dist.get_backend()}; {args.steps} steps, warm-up {args.warmup}, "
              f"RSS every {args.every}", flush=True)
        print(f"{'steps':>6}  RSS MiB per rank", flush=True)
    samples: dict[int, list[int]] = {}  # steps done -> every rank's RSS

    def sample(done: int) -> None:
        if done == 0 or done % args.every == 0 or done in (args.warmup, args.steps):
            samples[done] = everyones_rss(mesh)
            if main_rank:
                print(f"{done:6d}  " + " ".join(f"{b / 2**20:7.1f}" for b in samples[done]), flush=True)

    def step(i: int) -> float:
        x = markov_batch(i, mesh.dp_rank, args.batch, args.seq, args.vocab).to(mesh.device)
        with mesh.comm.counting():
            return train_step(model, opt, x).item()

    sample(0)
    start = time.perf_counter()
    t = harness.interleave({"soak": step}, args.steps - args.warmup, args.warmup, after=lambda i: sample(i + 1))
    wall, loss, warm, last = time.perf_counter() - start, t.results["soak"][-1], samples[args.warmup], samples[args.steps]
    growth = [(b - a) / a for a, b in zip(warm, last)]
    x = markov_batch(args.steps - 1, mesh.dp_rank, args.batch, args.seq, args.vocab).to(mesh.device)
    check_s, gather_s = time_batch_check(mesh, x, cfg, args.check_reps)
    per_rank = mesh.comm.all_gather_object((t.median("soak"), check_s, gather_s), mesh.world, tag="soak_report")
    ratios = [c / s for s, c, _ in per_rank]
    worst = max(range(mesh.world_size), key=ratios.__getitem__)
    rss_ok, check_ok = max(growth) < RSS_GOAL, ratios[worst] < CHECK_GOAL
    if main_rank:
        print(f"\nwall time {wall:.1f} s for {args.steps} steps; median step (steps {args.warmup}+) "
              f"{per_rank[0][0] * 1e3:.1f} ms, loss {loss:.3f} at the end\n")
        print(harness.table(["rank", f"RSS after warm-up (step {args.warmup})", f"RSS at the end (step {args.steps})",
                             "growth"], [[r, f"{warm[r] / 2**20:.1f} MiB", f"{last[r] / 2**20:.1f} MiB",
                                          f"{growth[r]:+.2%}"] for r in range(mesh.world_size)]))
        print(f"RSS growth after warm-up: max {max(growth):+.2%} (goal < {RSS_GOAL:.0%}): "
              f"{'met' if rss_ok else 'NOT met'}")
        s, c, g = per_rank[worst]
        print(f"batch check: {c * 1e3:.3f} ms = {ratios[worst]:.2%} of the step ({s * 1e3:.1f} ms), rank {worst}, "
              f"the largest share; median of {args.check_reps} calls (goal < {CHECK_GOAL:.0%}): "
              f"{'met' if check_ok else 'NOT met'}; its all-gather alone {g * 1e3:.3f} ms")
        harness.write_json(args.json, {
            "args": vars(args), "torch": torch.__version__, "world_size": mesh.world_size, "wall_s": wall,
            "rss_bytes": {str(k): v for k, v in samples.items()}, "rss_growth": growth, "rss_growth_max": max(growth),
            "rss_goal": RSS_GOAL, "rss_goal_met": rss_ok, "median_step_s": [s for s, _, _ in per_rank],
            "batch_check_s": [c for _, c, _ in per_rank], "batch_check_all_gather_s": [g for _, _, g in per_rank],
            "batch_check_share": ratios, "batch_check_goal": CHECK_GOAL, "batch_check_goal_met": check_ok})
    minipar.shutdown()
    return 1 if args.check and not (rss_ok and check_ok) else 0


if __name__ == "__main__":
    harness.run(main)
