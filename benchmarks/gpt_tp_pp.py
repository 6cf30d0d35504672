"""The main job: a GPT trained with tensor and pipeline parallelism (and data parallelism on the rest).

    torchrun --nproc_per_node=4 benchmarks/gpt_tp_pp.py [--tp 2 --pp 2 --schedule 1f1b --model tiny --dtype fp32
        --check-bubble 15 --out results --cp 2 --context-parallel ring|ulysses --checkpoint-dir DIR --moe [classic|deepseek]]

tp=2 x pp=2 by default, dp the rest; gloo and fp32 on CPU, NCCL and bf16 (ZeRO-1, fp32 masters) on GPUs.
``--model`` tiny (~0.8M), small (~30M), medium (GPT-2 small); the size flags override. Data: the Markov
"language" of ``minipar.models.data``, on the host. Printed: median step, tokens/s, each stage's busy
fraction and the bubble (1 - their mean over the schedule's window) beside the simulator's
(``--check-bubble PCT``: exit 1 beyond it), communication per step, every rank's memory, the MFU on a GPU
(tokens/s x (6 N + 12 n_layer seq n_embd) over world x peak bf16 FLOP/s). Reference check: the first
``--check-steps`` steps replayed in one process (fp32; under bf16 an fp32 run of the layout first, the bf16
run then within 1.6e-2 relative); exit 1 beyond ``--tolerance``. OUT/gpt_tp_pp.json, the last step's
timeline in OUT/trace.json and OUT/timeline.png. ``--checkpoint-dir``: save every ``--checkpoint-every``
steps, resume from the newest (survives ``torchrun --max-restarts``, bit for bit).
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

import minipar
from minipar import ShardedModule, checkpoint
from minipar.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig, deepseek_moe_config, gpt_loss
from minipar.moe.balance import update_expert_bias
from minipar.models.data import markov_batch
from minipar.moe.layer import moe_layers
from minipar.pipeline import SCHEDULES, RankTimeline, chunks_per_rank, simulate, write_trace
from minipar.pipeline.timeline import draw_timeline, measured_bubble
from minipar.context_parallel.ring_attention import zigzag_positions

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # loaded by its path (tests/test_main_job.py)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (benchmarks/harness.py, beside this file)

PRESETS = {
    "tiny": dict(n_layer=4, n_embd=128, n_head=4, vocab=256, seq=64),
    "small": dict(n_layer=8, n_embd=512, n_head=8, vocab=8192, seq=256),
    "medium": dict(n_layer=12, n_embd=768, n_head=12, vocab=50304, seq=1024),
}
# Peak dense bf16 tensor-core FLOP/s per GPU (data sheets); the first name in the device's name wins.
PEAK_BF16_FLOPS = [("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12)]
BF16_RTOL = 1.6e-2  # torch.testing.assert_close's default relative tolerance for bfloat16
STEADY_FROM = 3     # the first steps warm up allocators and process groups: not in the figures


def parse_args():
    ap = harness.parser(__doc__, steps=30, batch=8, seq=None, vocab=None, n_layer=None, n_embd=None, n_head=None,
                        lr=3e-3, microbatches=4, check_steps=3, tolerance=1e-4,
                        help={"batch": "sequences per data-parallel rank per step",
                              "tolerance": "largest fp32 loss difference to the reference"})
    add = ap.add_argument
    for flag, default, text in (("--tp", 2, None), ("--pp", 2, None), ("--experts", 4, None), ("--top-k", 2, None),
                                ("--checkpoint-every", 10, None), ("--dp", None, "default: world / (tp * cp * pp)"),
                                ("--cp", 1, "context-parallel size: the ranks that split each sequence"),
                                ("--virtual-stages", None, "model chunks per rank for interleaved_1f1b (default 2)"),
                                ("--ep", None, "expert-parallel size (splits dp); default: dp with --moe")):
        add(flag, type=int, default=default, help=text)
    add("--context-parallel", default="ring", choices=("ring", "ulysses"), help="how the cp ranks attend")
    add("--strategy", default=None, choices=("ddp", "zero1", "zero2", "zero3"),
        help="data-parallel strategy (default: ddp in fp32, zero1 in bf16)")
    add("--schedule", default="1f1b", choices=tuple(SCHEDULES))
    add("--model", default="tiny", choices=sorted(PRESETS), help="shape preset (see above)")
    add("--dtype", default=None, choices=("fp32", "bf16"), help="default: bf16 on CUDA (fp32 with ddp), fp32 on CPU")
    add("--check-bubble", type=float, default=None, metavar="PCT",
        help="exit 1 if the measured bubble is more than PCT percent away from the schedule's theory")
    add("--peak-tflops", type=float, default=None, help="one GPU's peak bf16 TFLOP/s, for the MFU")
    add("--out", default="results")
    add("--checkpoint-dir", default=None, help="save checkpoints here; resume from the newest")
    add("--moe", nargs="?", const="classic", choices=("classic", "deepseek"), default=None,
        help="mixture-of-experts MLPs (minipar.models.MoEGPT): classic top-k with a capacity, or deepseek "
             "(minipar.models.deepseek_moe_config: fine-grained + shared experts, sigmoid gate, bias balancing, "
             "dropless, group-limited routing; --experts/--top-k/--capacity-factor do not apply); default: none")
    add("--capacity-factor", type=float, default=1.25)
    args = ap.parse_args()
    args.__dict__.update({k: v for k, v in PRESETS[args.model].items() if getattr(args, k) is None})
    if args.cp < 1:
        ap.error(f"--cp {args.cp}: the context-parallel size must be 1 or more")
    if args.cp > 1:
        multiple = 2 * args.cp if args.context_parallel == "ring" else args.cp
        if args.seq % multiple:
            why = "2 x cp zig-zag chunks" if args.context_parallel == "ring" else "cp contiguous pieces"
            ap.error(f"--seq {args.seq} must be a multiple of {multiple} for --context-parallel "
                     f"{args.context_parallel} at --cp {args.cp} (the sequence is cut into {why}); "
                     f"try --seq {(args.seq // multiple + 1) * multiple}")
        if args.context_parallel == "ulysses" and (args.n_head // args.tp) % args.cp:
            ap.error(f"--context-parallel ulysses gives each cp rank heads / cp of a tp rank's heads, but "
                     f"{args.n_head} heads over --tp {args.tp} do not divide by --cp {args.cp}; choose "
                     f"--n-head divisible by tp x cp = {args.tp * args.cp}, or --context-parallel ring")
    if args.virtual_stages is not None and args.virtual_stages != chunks_per_rank(args.schedule, args.virtual_stages):
        ap.error(f"--virtual-stages {args.virtual_stages}: --schedule {args.schedule} holds "
                 f"{chunks_per_rank(args.schedule)} chunk(s) per rank; use --schedule interleaved_1f1b for more")
    if args.strategy == "ddp" and args.dtype == "bf16":
        ap.error("--strategy ddp computes in the parameters' own dtype (fp32): use --dtype fp32, or a ZeRO "
                 "strategy for bf16 compute with fp32 masters")
    if args.check_bubble is not None and args.pp < 2:
        ap.error("--check-bubble needs --pp 2 or more: without a pipeline there is no bubble")
    if args.steps <= STEADY_FROM and args.pp > 1:
        ap.error(f"--steps must exceed {STEADY_FROM}: the first {STEADY_FROM} steps are warm-up, not measured")
    return args


def strategy_of(args, dtype: str) -> str:
    """--strategy, or the default: ZeRO-1 for bf16 (fp32 masters sharded), DDP for fp32."""
    return getattr(args, "strategy", None) or ("zero1" if dtype == "bf16" else "ddp")  # soak.py: no --strategy


def build_model(build, cfg, mesh, args, dtype: str, strategy: str | None = None) -> tuple[ShardedModule, object]:
    context = getattr(args, "context_parallel", None) if mesh.cp > 1 else None  # soak.py's args have no cp
    precision = dict(mixed_precision=harness.BF16) if dtype == "bf16" else {}
    model = ShardedModule(build(cfg), mesh=mesh, strategy=strategy or strategy_of(args, dtype),
                          context_parallel=context, schedule=args.schedule, microbatches=args.microbatches,
                          virtual_stages=getattr(args, "virtual_stages", None), record_timeline=True, **precision)
    return model, model.build_optimizer(torch.optim.AdamW, lr=args.lr, weight_decay=0.1)


def train_step(model: ShardedModule, opt, x: torch.Tensor, before_step=None) -> torch.Tensor:
    loss = model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy)
    model.clip_grad_norm_(1.0)
    if before_step is not None:
        before_step()
    opt.step()
    model.update_expert_bias()  # bias-balanced MoE layers (--moe deepseek); nothing for the others
    opt.zero_grad()
    return loss


def model_flops(gpt: torch.nn.Module, seq: int) -> tuple[int, int]:
    """(parameters, training FLOPs per token: 6 x the parameters a token is multiplied by, plus attention's
    12 n_layer seq n_embd). Multiplied by: all but the embedding tables; the LM head's weight even when
    tied (it is a matmul there); each MoE layer's experts by top_k / n_experts."""
    cfg, tables = gpt.config, {id(gpt.wte.weight)} | ({id(gpt.wpe.weight)} if gpt.wpe is not None else set())
    n = sum(p.numel() for p in gpt.parameters() if id(p) not in tables)
    n += gpt.lm_head.weight.numel() if gpt.lm_head.weight is gpt.wte.weight else 0
    for layer in moe_layers(gpt):
        experts = sum(p.numel() for p in (layer.w1, layer.b1, layer.w2, layer.b2))
        n -= experts - experts * layer.top_k // layer.n_experts
    return sum(p.numel() for p in gpt.parameters()), 6 * n + 12 * cfg.n_layer * seq * cfg.n_embd


def peak_flops(args, cpu: bool) -> tuple[float | None, str]:
    """(one device's peak bf16 FLOP/s or None, where the figure comes from or why there is none)."""
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12, "--peak-tflops"
    if cpu:
        return None, "n/a on CPU"
    name = torch.cuda.get_device_name()
    flops = next((f for key, f in PEAK_BF16_FLOPS if key in name), None)
    return (flops, f"{name}, {flops / 1e12:.0f} TFLOP/s bf16 dense") if flops else \
        (None, f"n/a: unknown GPU {name!r}; pass --peak-tflops")


def bubble_of_step(ranks: list[dict], step: int, stages: int) -> tuple[float, dict[int, float]]:
    """(bubble, {stage: busy fraction}) of one step from every rank's events of that step."""
    events = [ev for r in ranks for ev in r["steps"][step]]
    window = max(e for _, _, e in events) - min(s for _, s, _ in events)
    busy: dict[int, list[float]] = {s: [] for s in range(stages)}
    for r in ranks:  # every rank of a stage (its tp and dp peers) counts: their mean is the stage's
        busy[r["stage"]].append(sum(e - s for a, s, e in r["steps"][step] if a[:1] in ("F", "B", "W")) / window)
    per_stage = {s: statistics.mean(v) for s, v in busy.items()}
    return 1 - statistics.mean(per_stage.values()), per_stage


def reference_losses(build, ref_cfg, args, dp: int, device) -> list[float]:
    """The first check steps in one process, fp32, on the global batch (every data-parallel rank's)."""
    ref = build(ref_cfg).to(device)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr, weight_decay=0.1)
    out = []
    for step in range(args.check_steps):
        x = torch.cat([markov_batch(step, r, args.batch, args.seq, args.vocab) for r in range(dp)]).to(device)
        loss = gpt_loss(ref(x[:, :-1]), x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        update_expert_bias(ref)
        ref_opt.zero_grad()
        out.append(loss.item())
    return out


def main() -> int:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    dp = args.dp or world // (args.tp * args.cp * args.pp)
    mesh = harness.init(exact=True, dp=args.dp, tp=args.tp, pp=args.pp, ep=(args.ep or dp) if args.moe else 1,
                        cp=args.cp)  # exact: the fp32 check run and its reference
    cpu = mesh.device.type == "cpu"
    dtype = args.dtype or ("fp32" if cpu or args.strategy == "ddp" else "bf16")  # DDP has no mixed precision
    main_rank = mesh.rank == 0
    shape = dict(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                 n_embd=args.n_embd, seed=0)
    build, cfg = GPT, GPTConfig(**shape)
    ref_cfg = cfg
    if args.moe:
        build, cfg = MoEGPT, deepseek_moe_config(**shape) if args.moe == "deepseek" else \
            MoEGPTConfig(**shape, n_experts=args.experts, top_k=args.top_k, capacity_factor=args.capacity_factor)
        # The reference routes each rank's (each micro-batch's, each cp rank's sequence slice's) share of
        # the global batch as its own group; ring cp ranks hold zig-zag chunks, routed in that order.
        order = tuple(torch.cat([zigzag_positions(args.seq, mesh.cp, r) for r in range(mesh.cp)]).tolist()) \
            if mesh.cp > 1 and args.context_parallel == "ring" else None
        ref_cfg = MoEGPTConfig(**{**vars(cfg), "route_groups": mesh.dp * (args.microbatches if mesh.pp > 1 else 1),
                                  "route_seq_chunks": mesh.cp, "route_seq_order": order})
    n_params, flops_per_token = model_flops(build(cfg), args.seq)
    if main_rank:
        kind = f"MoE GPT ({cfg.n_experts} experts, top-{cfg.top_k}, ep={mesh.ep}" \
            f"{', DeepSeekMoE' if args.moe == 'deepseek' else ''})" if args.moe else "GPT"
        print(f"minipar: {kind} '{args.model}' {n_params / 1e6:.2f}M parameters on {mesh.world_size} ranks: "
              f"dp={mesh.dp} tp={mesh.tp} pp={mesh.pp}" + (f" cp={mesh.cp} ({args.context_parallel})" if mesh.cp > 1
                                                          else "") + ", "
              + (f"{args.schedule} with {args.microbatches} micro-batches, " if mesh.pp > 1 else "no pipeline, ")
              + f"{dtype}, {strategy_of(args, dtype)}, {dist.get_backend()} on {mesh.device.type}", flush=True)

    check_steps = min(args.check_steps, args.steps)
    fp32_check_losses = None
    if dtype == "bf16" and check_steps:  # the strict reference check runs on an fp32 run of this layout
        model, opt = build_model(build, cfg, mesh, args, "fp32", strategy=strategy_of(args, dtype))
        fp32_check_losses = [train_step(model, opt, markov_batch(s, mesh.dp_rank, args.batch, args.seq,
                                                                 args.vocab)).item() for s in range(check_steps)]
        del model, opt
        if not cpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(mesh.device)
    model, opt = build_model(build, cfg, mesh, args, dtype)

    losses, start = [], 0
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
    timelines: list = []
    state: dict[str, int] = {}  # the state this rank holds in the last step, before its optimizer step
    counted: dict = {}

    def step(i: int) -> float:
        # The cp ranks of a group share their dp_rank, so they are given the same full sequences;
        # ShardedModule.train_step keeps each rank's tokens of them. The batch stays on the host.
        t0, last = time.perf_counter(), start + i == args.steps - 1
        x = markov_batch(start + i, mesh.dp_rank, args.batch, args.seq, args.vocab)
        with mesh.comm.counting() as counted["stats"]:
            loss = train_step(model, opt, x, (lambda: state.update(model.memory_stats())) if last else None)
        if mesh.pp > 1:  # this step's actions, in seconds after the aligned start
            timelines.append([(a, s - t0, e - t0) for a, s, e in model.timeline])
        losses.append(loss.item())
        return losses[-1]

    def save(i: int) -> None:
        done = start + i + 1
        if args.checkpoint_dir and (done % args.checkpoint_every == 0 or done == args.steps):
            checkpoint.save(checkpoint.step_path(args.checkpoint_dir, done), model, opt,
                            extra_state={"step": done, "losses": losses})

    total = args.steps - start
    warmup = STEADY_FROM if total > STEADY_FROM else 0
    t = harness.interleave({"job": step}, total - warmup, warmup, log_every=5, after=save)
    step_stats = counted["stats"]

    status, max_diff, bf16_rel, failures = 0, 0.0, None, []
    if main_rank and check_steps:
        ref = reference_losses(build, ref_cfg, args, mesh.dp, mesh.device)
        checked = fp32_check_losses if fp32_check_losses is not None else losses
        max_diff = max(abs(r - x) for r, x in zip(ref, checked))
        if max_diff > args.tolerance:
            failures.append(f"fp32 losses differ from the reference by {max_diff:.2e} > {args.tolerance:g}")
        if dtype == "bf16":
            bf16_rel = max(abs(r - x) / abs(r) for r, x in zip(ref, losses))
            if bf16_rel > BF16_RTOL:
                failures.append(f"bf16 losses differ from the fp32 reference by {bf16_rel:.2e} relative > {BF16_RTOL}")

    peak = {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024} if cpu else {  # Linux: KiB
        "peak_cuda_allocated": torch.cuda.max_memory_allocated(mesh.device)}
    mine = {"rank": mesh.rank, "stage": mesh.pp_rank, "tp": mesh.tp_rank, "dp": mesh.dp_rank, "cp": mesh.cp_rank,
            "steps": timelines[STEADY_FROM:] or timelines[-1:], "memory": {**state, **peak}}
    everyone = mesh.comm.all_gather_object(mine, mesh.world, tag="report")
    if main_rank:
        failures += report(args, mesh, everyone, t, losses, dtype, flops_per_token, cpu, step_stats, check_steps,
                           max_diff, bf16_rel)
        for why in failures:
            print(f"FAILED: {why}")
        status = 1 if failures else 0
    return harness.finish(status)


def report(args, mesh, everyone, t, losses, dtype, flops_per_token, cpu, step_stats, check_steps, max_diff,
           bf16_rel) -> list[str]:
    """The figures table, the timeline and OUT/gpt_tp_pp.json (rank 0); the failed goals."""
    p, m, failures = mesh.pp, args.microbatches, []
    median = t.median("job")
    tokens_per_s = mesh.dp * args.batch * args.seq / median
    peak, peak_note = peak_flops(args, cpu)
    mfu = flops_per_token * tokens_per_s / (mesh.world_size * peak) if peak else None
    comm = step_stats.summary()
    result = {"args": vars(args), "dtype": dtype, "strategy": strategy_of(args, dtype), "losses": losses,
              "median_step_s": median, "tokens_per_s": tokens_per_s, "flops_per_token": flops_per_token, "mfu": mfu,
              "peak": peak_note, "reference_max_diff": max_diff, "bf16_max_rel_diff": bf16_rel,
              "comm": {f"{k[0]}/{k[1]}": v for k, v in comm.items()}, "memory": {r["rank"]: r["memory"] for r in everyone}}
    rows = [["loss, first -> last step", f"{losses[0]:.3f} -> {losses[-1]:.3f}"],
            [f"median step time (steps {t.warmup}+)", f"{median * 1e3:.1f} ms"], ["tokens / s", f"{tokens_per_s:.0f}"]]
    chunks = chunks_per_rank(args.schedule, args.virtual_stages)
    theory = float(simulate(SCHEDULES[args.schedule](p, m, chunks))["bubble"]) if p > 1 else None
    if p > 1:
        # the schedule's idle share with equal stages and free communication: the simulator's
        formula = {"gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)", "interleaved_1f1b": "(p-1)/(v*m+p-1)",
                   "zb_h1": "(p-1)/(3m+p-1)"}.get(args.schedule, "the simulated schedule")
        per_step = [bubble_of_step(everyone, k, p) for k in range(len(everyone[0]["steps"]))]
        bubble = statistics.median(b for b, _ in per_step)
        busy = {s: statistics.median(b[s] for _, b in per_step) for s in range(p)}
        rel = (bubble - theory) / theory
        rows += [[f"stage {s} busy fraction (median over steps)", f"{busy[s]:.2f}"] for s in range(p)]
        rows.append([f"measured bubble (median over {len(per_step)} steps)",
                     f"{bubble:.3f} beside {formula} = {theory:.3f}: {rel:+.0%}"])
        result.update(busy=busy, bubble=bubble, bubble_per_step=[b for b, _ in per_step], bubble_theory=theory,
                      bubble_rel_diff=rel)
        local_ranks, cores = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), len(os.sched_getaffinity(0))
        if cpu and local_ranks > cores:
            rows.append(["note", f"{local_ranks} ranks share {cores} CPU cores: the stages cannot all compute at "
                                 "once, so the busy fractions and the bubble include waiting for a core, not only "
                                 "the schedule's idle time"])
            result["oversubscribed"] = {"local_ranks": local_ranks, "cores": cores}
        if args.check_bubble is not None and abs(rel) * 100 > args.check_bubble:
            failures.append(f"the bubble is {rel:+.0%} away from theory, beyond --check-bubble {args.check_bubble:g}%")
    else:
        rows.append(["busy fractions, bubble", "n/a: pp=1, no pipeline"])
    rows += [[f"{op} over {group} per step", f"{row['calls']} calls, {row['bytes']:,} B, wire {row['wire_bytes']:,} B"]
             for (op, group), row in sorted(comm.items())]
    for r in everyone:
        mem = r["memory"]
        peak_mem = (f"peak CUDA allocated {mem['peak_cuda_allocated']:,} B" if "peak_cuda_allocated" in mem
                    else f"peak RSS {mem['peak_rss'] / 2**20:.0f} MiB")
        where = f"stage {r['stage']}, tp {r['tp']}, dp {r['dp']}" + (f", cp {r['cp']}" if mesh.cp > 1 else "")
        rows.append([f"rank {r['rank']} ({where}) state before the step", f"params {mem['params']:,} B, grads "
                     f"{mem['grads']:,} B, optimizer {mem['optimizer']:,} B; {peak_mem}"])
    rows.append(["MFU", f"{mfu:.1%} ({peak_note})" if mfu is not None else peak_note])
    if check_steps:
        which = "an fp32 run of this layout" if dtype == "bf16" else "this run"
        rows.append([f"reference check (first {check_steps} steps, {which})", f"largest loss difference "
                     f"{max_diff:.2e}: {'ok' if max_diff <= args.tolerance else 'MISMATCH'}"])
        if bf16_rel is not None:
            rows.append(["bf16 run vs the fp32 reference", f"largest relative loss difference {bf16_rel:.2e} "
                         f"(allowed {BF16_RTOL}): {'ok' if bf16_rel <= BF16_RTOL else 'MISMATCH'}"])
    os.makedirs(args.out, exist_ok=True)
    if p > 1:  # the last step's timeline, one row per stage, beside the simulator's exact bubble
        drawn = [RankTimeline(r["stage"], r["rank"], r["steps"][-1]) for r in everyone]
        measured = measured_bubble(drawn)
        rows.append(["bubble of the drawn timeline (last step, one rank per stage)",
                     f"measured {measured:.3f} beside {args.schedule}'s simulated {theory:.3f}"])
        result["timeline_bubble"] = {"measured": measured, "theory": theory}
    print("\n" + harness.table(["figure", "value"], rows))
    if p > 1:
        title = (f"pp={p} tp={mesh.tp} dp={mesh.dp}" + (f" cp={mesh.cp}" if mesh.cp > 1 else "")
                 + f", {args.schedule}" + (f" v={chunks}" if chunks > 1 else "") + f", m={m}")
        trace = write_trace(drawn, os.path.join(args.out, "trace.json"))
        png = draw_timeline(drawn, os.path.join(args.out, "timeline.png"), title=title, theory_bubble=theory)
        print(f"timeline: {trace}; {png}")
    else:
        print("timeline: none written (pp=1: no pipeline schedule to draw)")
    harness.write_json(os.path.join(args.out, "gpt_tp_pp.json"), result)
    return failures


if __name__ == "__main__":
    harness.run(main)
