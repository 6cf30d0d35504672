"""The main job: a GPT trained with tensor and pipeline parallelism (and data parallelism on the rest).

    torchrun --nproc_per_node=4 benchmarks/gpt_tp_pp.py [--tp 2 --pp 2 --schedule 1f1b --microbatches 4
        --steps 30 --batch 8 --seq 64 --n-layer 4 --n-embd 128 --n-head 4 --vocab 256 --out results]

By default 4 CPU processes (gloo) as tp=2 x pp=2; dp is what is left of the
world. On GPUs NCCL is chosen (fp32 for now: mixed precision does not compose with pp yet).
Data is the synthetic Markov "language" of ``minipar.models.data``.

It prints progress, then a table: median step time, tokens/s, each stage's
busy fraction and the measured bubble beside (p-1)/(m+p-1), communication
bytes per step by kind, per-rank memory. It replays the first
``--check-steps`` steps in one process on the global batch and exits 1 if
the losses disagree. Results go to OUT/gpt_tp_pp.json; the last step's
timeline to OUT/trace.json (open in chrome://tracing or Perfetto) and, when
matplotlib is installed, OUT/timeline.png.

With ``--checkpoint-dir DIR`` it saves a sharded checkpoint (``minipar.checkpoint``)
every ``--checkpoint-every`` steps and after the last, and when started again
resumes from the newest complete one, so a job under
``torchrun --max-restarts=N`` survives a dead rank: torchrun restarts every
rank and they continue from the last checkpoint, bit for bit.
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
from minipar import ShardedModule, checkpoint
from minipar.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig, gpt_loss
from minipar.models.data import markov_batch


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=None, help="default: world / (tp * pp)")
    ap.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--out", default="results")
    ap.add_argument("--checkpoint-dir", default=None, help="save checkpoints here; resume from the newest")
    ap.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (with --checkpoint-dir)")
    ap.add_argument("--moe", action="store_true", help="mixture-of-experts MLPs (minipar.models.MoEGPT)")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--ep", type=int, default=None, help="expert-parallel size (splits dp); default: dp with --moe")
    return ap.parse_args()


def memory_bytes(model: ShardedModule, opt) -> dict[str, int]:
    ps = list(model.parameters())
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return {"params": sum(p.numel() * p.element_size() for p in ps),
            "grads": sum(b.flat.numel() * b.flat.element_size() for b in model.strategy.buckets),
            "optimizer": sum(t.numel() * t.element_size() for t in state)}


def main() -> int:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    dp = args.dp or world // (args.tp * args.pp)
    ep = (args.ep or dp) if args.moe else 1  # experts spread over the data-parallel ranks
    mesh = minipar.init(dp=args.dp, tp=args.tp, pp=args.pp, ep=ep)
    cpu = mesh.device.type == "cpu"
    if cpu:
        torch.set_num_threads(1)
    main_rank = mesh.rank == 0
    shape = dict(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                 n_embd=args.n_embd, seed=0)
    if args.moe:
        cfg = MoEGPTConfig(**shape, n_experts=args.experts, top_k=args.top_k, capacity_factor=args.capacity_factor)
        # The reference routes each rank's (each micro-batch's) share of the global batch as its own group.
        groups = mesh.dp * (args.microbatches if mesh.pp > 1 else 1)
        build, ref_cfg = MoEGPT, MoEGPTConfig(**{**vars(cfg), "route_groups": groups})
    else:
        cfg = ref_cfg = GPTConfig(**shape)
        build = GPT
    model = ShardedModule(build(cfg), mesh=mesh, schedule=args.schedule, microbatches=args.microbatches)
    opt = model.build_optimizer(torch.optim.AdamW, lr=args.lr, weight_decay=0.1)
    if main_rank:
        n = sum(p.numel() for p in build(cfg).parameters())
        kind = f"MoE GPT ({args.experts} experts, top-{args.top_k}, ep={mesh.ep})" if args.moe else "GPT"
        print(f"minipar: {kind} {n / 1e6:.2f}M parameters on {mesh.world_size} ranks: dp={mesh.dp} tp={mesh.tp} "
              f"pp={mesh.pp}, {args.schedule} with {args.microbatches} micro-batches, {dist.get_backend()}", flush=True)

    losses, times, start = [], [], 0
    if args.checkpoint_dir:  # resume: rank 0's view of the newest complete checkpoint, on every rank
        latest = mesh.comm.all_gather_object(checkpoint.find_latest(args.checkpoint_dir), mesh.world)[0]
        if latest is not None:
            resumed = checkpoint.load(latest, model, opt)
            start, losses = resumed["step"], resumed["losses"]
            if main_rank:
                print(f"resumed from {latest} at step {start}", flush=True)
        if start >= args.steps:
            if main_rank:
                print(f"all {args.steps} steps were done before this start; nothing to do", flush=True)
            minipar.shutdown()
            return 0
    for step in range(start, args.steps):
        x = markov_batch(step, mesh.dp_rank, args.batch, args.seq, args.vocab).to(mesh.device)
        last = step == args.steps - 1
        dist.barrier()
        t0 = time.perf_counter()
        with mesh.comm.counting() as stats:
            loss = model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy)
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        if not cpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if last:
            step_start, step_stats = t0, stats
        if main_rank and (step % 5 == 0 or last):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  {times[-1] * 1e3:8.1f} ms", flush=True)
        if args.checkpoint_dir and ((step + 1) % args.checkpoint_every == 0 or last):
            checkpoint.save(checkpoint.step_path(args.checkpoint_dir, step + 1), model, opt,
                            extra_state={"step": step + 1, "losses": losses})

    # Reference: the first steps in one process on the global batch (every data-parallel rank's data).
    status, max_diff = 0, 0.0
    if main_rank and args.check_steps:
        ref = build(ref_cfg).to(mesh.device)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr, weight_decay=0.1)
        for step in range(min(args.check_steps, args.steps)):
            x = torch.cat([markov_batch(step, r, args.batch, args.seq, args.vocab) for r in range(mesh.dp)])
            x = x.to(mesh.device)
            ref_loss = gpt_loss(ref(x[:, :-1]), x[:, 1:])
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            max_diff = max(max_diff, abs(ref_loss.item() - losses[step]))
        status = 0 if max_diff <= args.tolerance else 1

    # The last step's timeline, from every rank.
    mine = {"rank": mesh.rank, "stage": mesh.pp_rank, "tp": mesh.tp_rank, "dp": mesh.dp_rank,
            "events": [(a, s - step_start, e - step_start) for a, s, e in model.timeline],
            "step_s": times[-1], "memory": memory_bytes(model, opt)}
    everyone = mesh.comm.all_gather_object(mine, mesh.world, tag="report")
    if main_rank:
        p, m = mesh.pp, args.microbatches
        steady = times[min(3, len(times) - 1):]
        median = statistics.median(steady)
        # The schedule's window (first action of any stage to last), not the whole step: clipping and
        # the optimizer step are outside any pipeline bubble. Times are relative to each rank's step
        # start, which a barrier aligns.
        window = max(e for r in everyone for _, _, e in r["events"]) - min(s for r in everyone for _, s, _ in r["events"])
        busy = {}
        for r in everyone:
            if r["tp"] == 0 and r["dp"] == 0:
                compute = sum(e - s for a, s, e in r["events"] if a[:1] in ("F", "B"))
                busy[r["stage"]] = compute / window
        bubble = 1 - statistics.mean(busy.values())
        theory = (p - 1) / (m + p - 1)
        print("\n| figure | value |\n|---|---|")
        print(f"| loss, first -> last step | {losses[0]:.3f} -> {losses[-1]:.3f} |")
        print(f"| median step time | {median * 1e3:.1f} ms |")
        print(f"| tokens / s | {mesh.dp * args.batch * args.seq / median:.0f} |")
        for s in sorted(busy):
            print(f"| stage {s} busy fraction (last step) | {busy[s]:.2f} |")
        print(f"| measured bubble | {bubble:.2f} (theory (p-1)/(m+p-1) = {theory:.2f}) |")
        for (op, group), row in sorted(step_stats.summary().items()):
            print(f"| {op} over {group} per step | {row['calls']} calls, {row['bytes']:,} B, wire {row['wire_bytes']:,} B |")
        mem = everyone[0]["memory"]
        print(f"| rank 0 memory | params {mem['params']:,} B, grads {mem['grads']:,} B, optimizer {mem['optimizer']:,} B |")
        print(f"| MFU | {'n/a on CPU' if cpu else 'see tokens/s'} |")
        print(f"| reference check (first {args.check_steps} steps) | largest loss difference {max_diff:.2e}: "
              f"{'ok' if status == 0 else 'MISMATCH'} |")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpt_tp_pp.json"), "w") as f:
            json.dump({"args": vars(args), "losses": losses, "median_step_s": median, "busy": busy,
                       "bubble": bubble, "bubble_theory": theory, "reference_max_diff": max_diff,
                       "comm": {f"{k[0]}/{k[1]}": v for k, v in step_stats.summary().items()},
                       "memory_rank0": mem}, f, indent=2)
        trace = [{"name": a, "ph": "X", "pid": 0, "tid": f"stage {r['stage']} rank {r['rank']}",
                  "ts": s * 1e6, "dur": (e - s) * 1e6} for r in everyone for a, s, e in r["events"]]
        with open(os.path.join(args.out, "trace.json"), "w") as f:
            json.dump({"traceEvents": trace}, f)
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots(figsize=(10, 1 + p))
            for r in everyone:
                if r["tp"] == 0 and r["dp"] == 0:
                    for a, s, e in r["events"]:
                        if a[:1] in ("F", "B"):
                            ax.barh(r["stage"], e - s, left=s, color="tab:blue" if a[0] == "F" else "tab:orange")
                            ax.text(s, r["stage"], a, fontsize=6, va="center")
            ax.set_xlabel("seconds into the last step")
            ax.set_ylabel("stage")
            ax.invert_yaxis()
            fig.savefig(os.path.join(args.out, "timeline.png"), dpi=120, bbox_inches="tight")
            print(f"timeline: {args.out}/trace.json and {args.out}/timeline.png")
        except ImportError:
            print(f"timeline: {args.out}/trace.json (install matplotlib for the PNG)")
    verdict = torch.tensor([status], device=mesh.device)
    mesh.comm.broadcast(verdict, 0, mesh.world, tag="verdict")
    minipar.shutdown()
    return int(verdict.item())


if __name__ == "__main__":
    code = main()
    gc.collect()  # free what reference cycles hold (process groups) before interpreter teardown
    sys.exit(code)
