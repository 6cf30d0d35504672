"""Single-process DataParallel (k threads) beside minipar DDP (k processes), on CPU, one command.

    python benchmarks/dp_vs_ddp.py [--workers K --steps N --warmup W --n-layer L --n-embd E
        --n-head H --vocab V --seq T --batch B --json out.json]

Three ways to train the same GPT (``minipar.models.GPT``, one config seed: equal initial weights) on
the same global batches of K*B sequences with the same AdamW, each worker computing with one
thread (torch.set_num_threads(1)):

  one      the GPT alone in this process, one thread, the whole batch (the baseline)
  dp       minipar.data_parallel.DataParallel(gpt, devices=["cpu"] * K) in this process:
           K replicas in K threads, B sequences each
  ddp      minipar.ShardedModule(gpt, strategy="ddp") in K processes (a minipar.testing.RankPool,
           gloo), B sequences each

``one`` and ``dp`` run interleaved (one dp one dp ...), then ``ddp`` (its ranks wait idle on a queue
meanwhile, so the runs do not compete for cores). A ddp step is the slowest rank's, each step
starting after a barrier. Printed: the median step of each, the ratios, where DataParallel's step
goes (scatter, replicate, parallel forward, gather, loss, backward split into the gather's backward,
the replicas' backward and the reduction of their gradients, the optimizer), the bytes copied per
step (here, and what K separate devices would copy), the losses of the three (equal up to rounding:
they train the same thing), and the machine's load. ``--json PATH`` writes the same figures.

Why DataParallel is slower than DDP even on one machine: it rebuilds the replicas every step
(Python work proportional to the number of modules), the K threads share one interpreter (the GIL:
only PyTorch's kernels run in parallel, each layer's Python runs one thread at a time), on CPU the
replicas' backward runs in the single thread that called backward() (autograd has one worker per
device, and the K "cpu" devices are one), and the K gradients are summed by one device after the
whole backward, where DDP all-reduces buckets while the backward still runs, K processes each
doing 1/K of the reduction's work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import minipar
from minipar.data_parallel import DataParallel
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.testing import RankPool

PHASES = ["scatter", "replicate", "forward", "gather", "loss", "gather (backward)", "replicas' backward",
          "reduce (backward)", "optimizer"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="K: DataParallel threads = DDP processes")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (also the block size)")
    p.add_argument("--batch", type=int, default=4, help="B: sequences per worker per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0, help="model and data seed")
    p.add_argument("--json", default=None, help="also write the results here as JSON")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.workers < 1:
        p.error("--steps and --workers must be >= 1 and --warmup >= 0")
    return args


def gpt_config(args) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd, seed=args.seed)


def global_batch(step: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s (inputs, targets), K*B sequences: the same for every variant."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    tokens = torch.randint(args.vocab, (args.workers * args.batch, args.seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def make_optimizer(params, args) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)


# -- DDP: runs on every rank of the pool -------------------------------------------------------------


def ddp_side(ctx, args) -> dict:
    """Rank ``ctx.rank`` trains its B rows of each global batch under minipar DDP; per-step times (the
    slowest rank's), mean losses over ranks, and the gradient bytes all-reduced per step."""
    mesh = minipar.Mesh()
    model = minipar.ShardedModule(GPT(gpt_config(args)), mesh=mesh, strategy="ddp")
    opt = model.build_optimizer(torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rows = slice(ctx.rank * args.batch, (ctx.rank + 1) * args.batch)
    times, losses = [], []
    with mesh.comm.counting() as stats:
        for step in range(args.warmup + args.steps):
            x, y = (t[rows] for t in global_batch(step, args))
            dist.barrier()  # aligned start; not timed
            t0 = time.perf_counter()
            loss = gpt_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
                losses.append(loss.item())
            if step == args.warmup - 1:
                stats.records.clear()
    t = torch.tensor([times, losses], dtype=torch.float64)
    worst = t[0].clone()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    mean_loss = t[1].clone()
    dist.all_reduce(mean_loss)
    return {"step_s": worst.tolist(), "loss": (mean_loss / ctx.world_size).tolist(),
            "all_reduce_bytes_per_step": stats.bytes(op="all_reduce", tag="grad") / args.steps,
            "all_reduce_wire_bytes_per_step": stats.wire_bytes(op="all_reduce", tag="grad") / args.steps}


# -- one and DataParallel: in this process -----------------------------------------------------------


def one_step(model, opt, x, y) -> tuple[float, float]:
    t0 = time.perf_counter()
    loss = gpt_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if x.is_cuda:  # the optimizer's kernels, not only their launch
        torch.cuda.synchronize()
    return time.perf_counter() - t0, loss.item()


def dp_step(dp: DataParallel, opt, x, y, profile) -> tuple[float, float]:
    """One DataParallel step; adds the phases the wrapper does not time itself (loss, backward, optimizer)."""
    t0 = time.perf_counter()
    logits = dp(x)
    t1 = time.perf_counter()
    loss = gpt_loss(logits, y)
    t2 = time.perf_counter()
    loss.backward()
    t3 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    if x.is_cuda:
        torch.cuda.synchronize()
    t4 = time.perf_counter()
    if profile is not None:
        profile.add("loss", t2 - t1)
        profile.add("backward", t3 - t2)
        profile.add("optimizer", t4 - t3)
    return t4 - t0, loss.item()


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    k = args.workers
    cfg = gpt_config(args)

    pool = RankPool(k)  # started first: its start-up is not timed
    pool.start()
    try:
        one_model = GPT(cfg)
        one_opt = make_optimizer(one_model.parameters(), args)
        dp_model = GPT(cfg)
        dp = DataParallel(dp_model, devices=["cpu"] * k)
        dp_opt = make_optimizer(dp_model.parameters(), args)
        params = list(dp_model.parameters())  # a tied weight counts once
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        n_params = sum(p.numel() for p in params)

        times = {"one": [], "dp": [], "ddp": []}
        losses = {"one": [], "dp": [], "ddp": []}
        t_start = time.perf_counter()
        with dp.profiling() as prof:
            for step in range(args.warmup + args.steps):
                x, y = global_batch(step, args)
                if step == args.warmup:
                    prof.seconds.clear()
                    prof.bytes_copied.clear()
                for name, run in (("one", lambda: one_step(one_model, one_opt, x, y)),
                                  ("dp", lambda: dp_step(dp, dp_opt, x, y, prof))):
                    seconds, loss = run()
                    if step >= args.warmup:
                        times[name].append(seconds)
                        losses[name].append(loss)
        ddp = pool.run(ddp_side, args)[0]
        wall = time.perf_counter() - t_start
    finally:
        pool.close()
    times["ddp"], losses["ddp"] = ddp["step_s"], ddp["loss"]
    load = os.getloadavg()

    median = {name: statistics.median(t) for name, t in times.items()}
    per_step = {phase: prof.seconds.get(phase, 0.0) / args.steps for phase in prof.seconds}
    # backward as measured around loss.backward(), less the two phases timed inside it
    per_step["replicas' backward"] = (per_step.pop("backward") - per_step.get("gather (backward)", 0.0)
                                      - per_step.get("reduce (backward)", 0.0))
    copied = {phase: nbytes / args.steps for phase, nbytes in prof.bytes_copied.items() if nbytes}
    x, y = global_batch(0, args)
    input_bytes = x.numel() * x.element_size()
    logits_bytes = x.numel() * args.vocab * 4
    # what K separate devices would copy per step: every phase but one slice / replica crosses a device
    devices_bytes = {"replicate": (k - 1) * param_bytes, "scatter": (k - 1) * input_bytes // k,
                     "gather": (k - 1) * logits_bytes // k, "gather (backward)": (k - 1) * logits_bytes // k,
                     "reduce (backward)": (k - 1) * param_bytes}
    loss_diff = {name: max(abs(a - b) for a, b in zip(losses[name], losses["one"])) for name in ("dp", "ddp")}

    result = {
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "torch": torch.__version__, "workers": k, "threads_per_worker": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "loadavg": list(load),
        "config": {key: v for key, v in vars(args).items() if key != "json"},
        "n_params": n_params, "param_bytes": param_bytes,
        "step_s": times, "median_step_s": median,
        "ratio_dp_over_ddp": median["dp"] / median["ddp"],
        "speedup_over_one": {name: median["one"] / median[name] for name in ("dp", "ddp")},
        "dp_phase_s_per_step": per_step,
        "dp_bytes_copied_per_step": copied, "dp_bytes_on_k_devices_per_step": devices_bytes,
        "ddp_all_reduce_bytes_per_step": ddp["all_reduce_bytes_per_step"],
        "ddp_all_reduce_wire_bytes_per_step": ddp["all_reduce_wire_bytes_per_step"],
        "loss_max_diff_from_one": loss_diff, "wall_s": wall,
    }

    print(f"DataParallel (1 process, {k} threads) vs minipar DDP ({k} processes, gloo) vs one thread, "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s) per worker, {os.cpu_count()} CPUs")
    print(f"GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} vocab={args.vocab} "
          f"seq={args.seq}, global batch {k}x{args.batch}: {n_params:,} parameters, {param_bytes / 2**20:.2f} MiB; "
          f"{args.warmup} warm-up + {args.steps} timed steps each")
    print(f"load average (1/5/15 min, at the end): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print("| variant | median step | speed-up over one thread |")
    print("|---|---:|---:|")
    labels = {"one": "one thread, whole batch", "dp": f"DataParallel, {k} threads",
              "ddp": f"minipar DDP, {k} processes"}
    for name in ("one", "dp", "ddp"):
        print(f"| {labels[name]} | {median[name] * 1e3:.1f} ms | {median['one'] / median[name]:.2f} |")
    print(f"\nratio DataParallel/DDP (of medians): {result['ratio_dp_over_ddp']:.2f}")

    total = sum(per_step.values())
    print(f"\nDataParallel's step by phase (mean per step; sum {total * 1e3:.1f} ms, "
          f"median step {median['dp'] * 1e3:.1f} ms):")
    print("| phase | ms/step | share | bytes copied here | bytes on k devices |")
    print("|---|---:|---:|---:|---:|")
    for phase in PHASES:
        if phase in per_step:
            print(f"| {phase} | {per_step[phase] * 1e3:.2f} | {per_step[phase] / total:.0%} | "
                  f"{copied.get(phase, 0):,.0f} | {devices_bytes.get(phase, 0):,} |")
    print(f"bytes copied per step: {sum(copied.values()):,.0f} here (the replicas' weights are views of the "
          f"module's, the slices views of the batch); {sum(devices_bytes.values()):,} on {k} separate devices")
    print(f"minipar DDP per step and rank: all_reduce tag 'grad' {ddp['all_reduce_bytes_per_step']:,.0f} B "
          f"(parameter bytes {param_bytes:,}), {ddp['all_reduce_wire_bytes_per_step']:,.0f} B on the wire")
    print("\nlosses, first/last timed step: " + ", ".join(
        f"{name} {losses[name][0]:.4f}/{losses[name][-1]:.4f}" for name in ("one", "dp", "ddp")))
    print(f"largest loss difference from one thread: dp {loss_diff['dp']:.2e}, ddp {loss_diff['ddp']:.2e}")
    print(f"wall time: {wall:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
