"""Single-process DataParallel (k threads) beside minipar DDP (k processes), on CPU, one command.

    python benchmarks/dp_vs_ddp.py [--workers K --steps N --json out.json]  # --help: every flag

The same GPT on the same global batches (K*B sequences), one thread per worker: ``one`` (one thread, the
whole batch), ``dp`` (`minipar.data_parallel.single_process.DataParallel`: K replicas in K threads), ``ddp``
(``strategy="ddp"`` in K processes of a `minipar.testing.RankPool`). Printed: medians and ratios;
DataParallel's step by phase with the bytes copied (here and on K devices); the losses. DataParallel loses
even on one machine: it rebuilds the replicas every step, its threads share the GIL, on CPU the replicas'
backward runs in one thread, and one device sums the gradients after the whole backward.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

import harness
import minipar
from minipar.data_parallel.single_process import DataParallel
from minipar.models import GPT, gpt_loss
from minipar.testing import RankPool

PHASES = ["scatter", "replicate", "forward", "gather", "loss", "gather (backward)", "replicas' backward",
          "reduce (backward)", "optimizer"]


def parse_args():
    ap = harness.parser(__doc__, steps=20, warmup=3, n_layer=4, n_embd=256, n_head=4, vocab=2048, seq=128, batch=4,
                        lr=1e-3, seed=0, json=None, help={"batch": "B: sequences per worker per step"})
    ap.add_argument("--workers", type=int, default=2, help="K: DataParallel threads = DDP processes")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.workers < 1:
        ap.error("--steps and --workers must be >= 1 and --warmup >= 0")
    return args


def global_batch(step: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s (inputs, targets), K*B sequences: the same for every variant."""
    return harness.tokens(args.seed * 1_000_003 + step, args.workers * args.batch, args)


def train(model, opt, x, y) -> float:
    loss = gpt_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def ddp_side(ctx, args) -> dict:
    """On every rank of the pool: its B rows of each global batch under minipar DDP."""
    mesh = minipar.Mesh()
    model = minipar.ShardedModule(GPT(harness.gpt_config(args, seed=args.seed)), mesh=mesh, strategy="ddp")
    opt = model.build_optimizer(torch.optim.AdamW, lr=args.lr, **harness.ADAMW)
    rows, records = slice(ctx.rank * args.batch, (ctx.rank + 1) * args.batch), []

    def step(i: int) -> float:
        with mesh.comm.counting() as stats:
            loss = train(model, opt, *(t[rows] for t in global_batch(i, args)))
        records.extend(stats.records if i >= args.warmup else [])
        return loss

    t = harness.interleave({"ddp": step}, args.steps, args.warmup)
    grad = [r for r in records if r.op == "all_reduce" and r.tag == "grad"]
    return {"step_s": t.timed("ddp"),
            "loss": harness.gathered_losses(mesh.comm.all_gather_object(t.results, mesh.world))["ddp"][args.warmup:],
            "all_reduce_bytes_per_step": sum(r.bytes for r in grad) / args.steps,
            "all_reduce_wire_bytes_per_step": sum(r.wire_bytes for r in grad) / args.steps}


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    k = args.workers
    cfg = harness.gpt_config(args, seed=args.seed)
    pool = RankPool(k)  # started first: its start-up is not timed
    pool.start()
    try:
        one_model, dp_model = GPT(cfg), GPT(cfg)
        one_opt, dp_opt = (torch.optim.AdamW(m.parameters(), lr=args.lr, **harness.ADAMW) for m in (one_model, dp_model))
        dp = DataParallel(dp_model, devices=["cpu"] * k)
        param_bytes = sum(p.numel() * p.element_size() for p in dp_model.parameters())  # a tied weight once
        n_params = sum(p.numel() for p in dp_model.parameters())

        def dp_step(i: int) -> float:
            """Adds the phases the wrapper does not time itself (loss, backward, optimizer)."""
            x, y = global_batch(i, args)
            if i == args.warmup:
                prof.seconds.clear()
                prof.bytes_copied.clear()
            logits = dp(x)
            clock = [time.perf_counter()]
            loss = gpt_loss(logits, y)
            clock.append(time.perf_counter())
            loss.backward()
            clock.append(time.perf_counter())
            dp_opt.step()
            dp_opt.zero_grad()
            clock.append(time.perf_counter())
            for name, a, b in (("loss", 0, 1), ("backward", 1, 2), ("optimizer", 2, 3)):
                prof.add(name, clock[b] - clock[a])
            return loss.item()

        t_start = time.perf_counter()
        with dp.profiling() as prof:
            t = harness.interleave({"one": lambda i: train(one_model, one_opt, *global_batch(i, args)), "dp": dp_step},
                                   args.steps, args.warmup)
        ddp = pool.run(ddp_side, args)[0]
        wall = time.perf_counter() - t_start
    finally:
        pool.close()
    load = os.getloadavg()
    times, losses = {"one": t.timed("one"), "dp": t.timed("dp"), "ddp": ddp["step_s"]}, {
        "one": t.results["one"][args.warmup:], "dp": t.results["dp"][args.warmup:], "ddp": ddp["loss"]}
    median = {name: statistics.median(v) for name, v in times.items()}
    per_step = {phase: s / args.steps for phase, s in prof.seconds.items()}
    # backward as measured around loss.backward(), less the two phases timed inside it
    per_step["replicas' backward"] = (per_step.pop("backward") - per_step.get("gather (backward)", 0.0)
                                      - per_step.get("reduce (backward)", 0.0))
    copied = {phase: nbytes / args.steps for phase, nbytes in prof.bytes_copied.items() if nbytes}
    x, _ = global_batch(0, args)
    input_bytes, logits_bytes = x.numel() * x.element_size(), x.numel() * args.vocab * 4
    # what K separate devices would copy per step: every phase but one slice / replica crosses a device
    devices_bytes = {"replicate": (k - 1) * param_bytes, "scatter": (k - 1) * input_bytes // k,
                     "gather": (k - 1) * logits_bytes // k, "gather (backward)": (k - 1) * logits_bytes // k,
                     "reduce (backward)": (k - 1) * param_bytes}
    loss_diff = {name: max(abs(a - b) for a, b in zip(losses[name], losses["one"])) for name in ("dp", "ddp")}
    result = {
        "command": harness.command(), "torch": torch.__version__, "workers": k, "threads_per_worker":
        torch.get_num_threads(), "cpu_count": os.cpu_count(), "loadavg": list(load), "config": {
            key: v for key, v in vars(args).items() if key != "json"}, "n_params": n_params, "param_bytes": param_bytes,
        "step_s": times, "median_step_s": median, "ratio_dp_over_ddp": median["dp"] / median["ddp"],
        "speedup_over_one": {name: median["one"] / median[name] for name in ("dp", "ddp")},
        "dp_phase_s_per_step": per_step, "dp_bytes_copied_per_step": copied, "dp_bytes_on_k_devices_per_step":
        devices_bytes, **{f"ddp_{key}": ddp[key] for key in ("all_reduce_bytes_per_step",
                                                              "all_reduce_wire_bytes_per_step")},
        "loss_max_diff_from_one": loss_diff, "wall_s": wall}
    print(f"DataParallel (1 process, {k} threads) vs minipar DDP ({k} processes, gloo) vs one thread, "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s) per worker, {os.cpu_count()} CPUs")
    print(f"{harness.shape(args)}, global batch {k}x{args.batch}: {n_params:,} parameters, {param_bytes / 2**20:.2f} "
          f"MiB; {args.warmup} warm-up + {args.steps} timed steps each")
    print(f"load average (1/5/15 min, at the end): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    labels = {"one": "one thread, whole batch", "dp": f"DataParallel, {k} threads", "ddp": f"minipar DDP, {k} processes"}
    print(harness.table(["variant", "median step", "speed-up over one thread"], [
        [labels[n], f"{median[n] * 1e3:.1f} ms", f"{median['one'] / median[n]:.2f}"] for n in labels]))
    print(f"\nratio DataParallel/DDP (of medians): {result['ratio_dp_over_ddp']:.2f}")
    total = sum(per_step.values())
    print(f"\nDataParallel's step by phase (mean per step; sum {total * 1e3:.1f} ms, "
          f"median step {median['dp'] * 1e3:.1f} ms):")
    print(harness.table(["phase", "ms/step", "share", "bytes copied here", "bytes on k devices"], [
        [p, f"{per_step[p] * 1e3:.2f}", f"{per_step[p] / total:.0%}", f"{copied.get(p, 0):,.0f}",
         f"{devices_bytes.get(p, 0):,}"] for p in PHASES if p in per_step]))
    print(f"bytes copied per step: {sum(copied.values()):,.0f} here (the replicas' weights are views of the "
          f"module's, the slices views of the batch); {sum(devices_bytes.values()):,} on {k} separate devices")
    print(f"minipar DDP per step and rank: all_reduce tag 'grad' {ddp['all_reduce_bytes_per_step']:,.0f} B "
          f"(parameter bytes {param_bytes:,}), {ddp['all_reduce_wire_bytes_per_step']:,.0f} B on the wire")
    print("\nlosses, first/last timed step: " + ", ".join(
        f"{name} {losses[name][0]:.4f}/{losses[name][-1]:.4f}" for name in labels))
    print(f"largest loss difference from one thread: dp {loss_diff['dp']:.2e}, ddp {loss_diff['ddp']:.2e}")
    print(f"wall time: {wall:.1f} s")
    harness.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    harness.run(main)
