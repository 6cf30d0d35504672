"""Context parallelism on long sequences: attention memory per rank, tokens/s and the bytes of the ring.

    torchrun --nproc_per_node=4 benchmarks/cp_long_seq.py [--seq 8192 --cp-sizes 1,2,4 --forms ring,ulysses --smoke]

The world trains the GPT in every layout: cp = 1 (the baseline) and, per cp size C dividing the world and
form, ``minipar.init(cp=C)`` with ``context_parallel=form`` (dp = world / C groups, each given ``--batch``
full sequences). Per layout and rank: the peak bytes autograd keeps inside attention (`ActivationMemory`,
on while an attention module runs) over cp = 1's (goals <= 0.55 at cp = 2, <= 0.30 at cp = 4), the whole
model's (warm-up step), tokens/s, and the attention bytes sent on the cp axis against `theory_bytes`.
torch's ``context_parallel`` is timed alike where it runs, or its exception printed (on a CPU it has no
sharding rule for SDPA's CPU flash op). The default (seq 8192) takes minutes on 4 CPU ranks.
"""

from __future__ import annotations

import contextlib
import gc
import os

import torch
import torch.distributed as dist

import harness
import minipar
from minipar import ShardedModule
from minipar.context_parallel.context import attention_modules
from minipar.plan.model_traffic import ring_bytes
from minipar.models import GPT, gpt_loss
from minipar.models.data import markov_batch
from minipar.recompute import ActivationMemory
from references import ddp

GOALS = {2: 0.55, 4: 0.30}  # attention activation memory per rank at cp = C over cp = 1
TIME_GOAL = 1.00            # minipar's ring step time over torch context_parallel's
SMOKE = dict(n_layer=1, n_embd=16, n_head=4, vocab=64, seq=64, batch=1, steps=1, warmup=1, cp_sizes="1,2")


def parse_args():
    ap = harness.parser(__doc__, seq=8192, batch=1, n_layer=2, n_embd=128, n_head=4, vocab=256, steps=3, warmup=1,
                        lr=3e-4, json=None, smoke=SMOKE,
                        help={"seq": "tokens per sequence (ring: a multiple of 2 x cp)",
                              "batch": "sequences per cp group (per dp replica) per step",
                              "warmup": "untimed steps first (the whole model's memory is read here)"})
    ap.add_argument("--cp-sizes", default="1,2,4", help="comma-separated; those not dividing the world are skipped")
    ap.add_argument("--forms", default="ring,ulysses")
    ap.add_argument("--no-torch", action="store_true", help="skip torch's context_parallel")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    wanted = sorted({int(c) for c in str(args.cp_sizes).split(",")} | {1})
    args.cp_sizes, args.skipped_cp_sizes = [c for c in wanted if world % c == 0], [c for c in wanted if world % c]
    args.forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be at least 1 (the warm-up step measures the whole model's memory)")
    for c in args.cp_sizes[1:]:  # refused here, on every rank, before any process group exists
        if "ring" in args.forms and args.seq % (2 * c):
            ap.error(f"--seq {args.seq} must be a multiple of 2 x cp = {2 * c} for ring attention (zig-zag chunks)")
        if "ulysses" in args.forms and (args.n_head % c or args.seq % c):
            ap.error(f"Ulysses at cp = {c} needs --n-head ({args.n_head}) and --seq ({args.seq}) divisible by {c}")
    return args


def theory_bytes(args, cp: int, form: str | None) -> int:
    """Attention bytes one rank sends per step (module docstring), fp32."""
    if cp == 1:
        return 0
    head_dim = args.n_embd // args.n_head
    if form == "ring":
        per_layer = ring_bytes(args.batch, args.n_head, args.seq, head_dim, cp, torch.float32)
        return args.n_layer * (per_layer["forward"] + per_layer["backward"])
    block = args.batch * args.n_head * (args.seq // cp) * head_dim * 4  # q, k, v or out of this rank's tokens
    return args.n_layer * 8 * (cp - 1) * block // cp


class MiniparRun:
    """One layout: minipar's GPT under ``minipar.init(cp=cp)`` and ``context_parallel=form``."""

    def __init__(self, args, cfg, cp: int, form: str | None) -> None:
        self.args, self.cp, self.form = args, cp, form
        self.name = "minipar " + (f"cp={cp} {form}" if cp > 1 else "cp=1 (baseline)")
        self.mesh = minipar.init(cp=cp)  # dp = world / cp
        self.model = ShardedModule(GPT(cfg), mesh=self.mesh, context_parallel=form)
        self.opt = self.model.build_optimizer(torch.optim.AdamW, lr=args.lr)
        # The saved-tensor meter is on only while an attention module runs its forward; off in the warm-up
        # step, where a whole-model meter is open instead (nested saved-tensor hooks replace the outer ones).
        self.meter: ActivationMemory | None = None
        for module in attention_modules(self.model):
            module.register_forward_pre_hook(lambda *_: self._meter("__enter__"))
            module.register_forward_hook(lambda *_: self._meter("__exit__", None, None, None))
        self.report = {"attention_peak": 0, "model_peak": 0, "traffic": [], "other": [], "losses": []}

    def _meter(self, method: str, *args) -> None:  # None: a forward hook's result would replace the args
        if self.meter is not None:
            getattr(self.meter, method)(*args)

    def step(self, step: int) -> None:
        a, timed = self.args, step >= self.args.warmup
        x = markov_batch(step, self.mesh.dp_rank, a.batch, a.seq, a.vocab).to(self.mesh.device)
        whole = None if timed else ActivationMemory(self.model.parameters())  # the warm-up: the whole model
        self.meter = attention = ActivationMemory(self.model.parameters()) if timed else None
        with self.mesh.comm.counting() as stats, (whole or contextlib.nullcontext()):
            loss = self.model.train_step(x[:, :-1], x[:, 1:], gpt_loss)
        self.opt.step()
        self.opt.zero_grad()
        self.meter = None
        r = self.report
        r["losses"].append(loss.item())
        if timed:
            r["attention_peak"] = max(r["attention_peak"], attention.peak_bytes)
            r["traffic"].append(sum(x.wire_bytes for x in stats.records if (x.op == "send" and (
                x.tag or "").startswith("cp_kv")) or (x.op == "all_to_all" and x.group == "cp")))
            r["other"].append(sum(x.wire_bytes for x in stats.records) - r["traffic"][-1])
        else:
            r["model_peak"] = max(r["model_peak"], whole.peak_bytes)


class TorchRun:
    """The same model, layout and data under torch's ``context_parallel`` (ring attention on the "cp"
    dimension of a DeviceMesh, head-tail load balancing), DDP over the world."""

    def __init__(self, args, cfg, cp: int, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.args, self.cp, self.device, self.form = args, cp, device, "torch"
        self.name = f"torch context_parallel cp={cp}"
        self.dmesh = init_device_mesh(device.type, (dist.get_world_size() // cp, cp), mesh_dim_names=("dp", "cp"))
        self.dp_rank = self.dmesh.get_local_rank("dp")  # rank = dp_rank * cp + cp_rank, as in minipar's Mesh
        self.model = GPT(cfg).to(device)
        self.ddp = ddp(self.model, device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.positions: torch.Tensor | None = None  # this rank's tokens' positions, a sharded buffer
        self.model.wpe.register_forward_pre_hook(lambda m, a: (self.positions[a[0]],))
        self.report = {"losses": []}

    def step(self, step: int) -> None:
        from torch.distributed.tensor.experimental import context_parallel

        inputs, targets = harness.markov(step, self.dp_rank, self.args, self.device)
        positions = torch.arange(self.args.seq, device=self.device)
        buffers = [inputs, targets, positions]
        with context_parallel(self.dmesh["cp"], buffers=buffers, buffer_seq_dims=[1, 1, 0],
                              no_restore_buffers=set(buffers)):
            self.positions = positions
            loss = gpt_loss(self.ddp(inputs), targets)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.report["losses"].append(loss.detach().reshape(1).clone())  # this rank's mean over its tokens


def try_torch(args, cfg, cp: int, device: torch.device) -> tuple[TorchRun | None, str | None]:
    """(the run, None) when torch's context_parallel trains a step here, else (None, the exception as
    PyTorch raised it); every rank agrees (each raises the same before any collective)."""
    run, error = None, None
    try:
        run = TorchRun(args, cfg, cp, device)
        run.step(0)
    except Exception as e:  # noqa: BLE001: the point is to report whatever torch raises here
        run, error = None, f"{type(e).__name__}: {e}".strip()
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    reasons = sorted({e for e in errors if e is not None})
    return (None if reasons else run), ("; ".join(reasons) if reasons else None)


def main() -> int:
    args = parse_args()
    base = harness.init(exact=True)  # on a GPU, the layouts must not round matmul inputs to TF32
    world, device = base.world_size, base.device
    cfg = harness.gpt_config(args, dropout=0.0, seed=0)
    runs = [MiniparRun(args, cfg, 1, None)] + [MiniparRun(args, cfg, c, f) for c in args.cp_sizes[1:] for f in args.forms]
    torch_errors: dict[int, str] = {}
    for c in [] if args.no_torch else args.cp_sizes[1:]:
        run, error = try_torch(args, cfg, c, device)
        runs += [run] if run is not None else []
        torch_errors.update({} if run is not None else {c: error})
    if base.rank == 0:
        print(f"GPT {sum(p.numel() for p in GPT(cfg).parameters()) / 1e6:.2f}M parameters ({args.n_layer} layers x "
              f"{args.n_embd}, {args.n_head} heads, vocab {args.vocab}), seq {args.seq}, batch {args.batch} per cp "
              f"group, {world} ranks, {device.type}/{dist.get_backend()}; cp sizes {args.cp_sizes}" +
              (f" (skipped {args.skipped_cp_sizes}: they do not divide the world)" if args.skipped_cp_sizes else ""),
              flush=True)
    # torch's warm-up step ran in try_torch
    t = harness.interleave({r.name: (lambda i, r=r: None if i == 0 and r.form == "torch" else r.step(i))
                            for r in runs}, args.steps, args.warmup, log_every=1)
    for run in runs:
        if run.form == "torch":  # each rank's loss is the mean over its tokens, equal counts: the mean is global
            losses = torch.cat(run.report["losses"])
            dist.all_reduce(losses)
            run.report["losses"] = (losses / world).tolist()
    reports = [base.comm.all_gather_object(run.report, base.world, tag="report") for run in runs]
    if base.rank == 0:
        report(args, world, runs, reports, t, torch_errors)
    for run in runs:
        if run.form != "torch":
            run.mesh.destroy()
    del runs
    gc.collect()
    minipar.shutdown()
    return 0


def report(args, world, runs, reports, t: harness.Timings, torch_errors) -> None:
    """The table of layouts, the torch comparison, and --json."""
    result, rows, ring_times, first_loss = {"args": vars(args), "world": world, "runs": [], "torch": []}, [], {}, {}
    mib = lambda values: ", ".join(f"{v / 2**20:,.2f}" for v in values) + " MiB"  # noqa: E731
    for run, per_rank in ((r, p) for r, p in zip(runs, reports) if r.form != "torch"):
        cp, form, dp, median = run.cp, run.form, world // run.cp, t.median(run.name)
        attn, whole = [r["attention_peak"] for r in per_rank], [r["model_peak"] for r in per_rank]
        ratios = [a / b["attention_peak"] for a, b in zip(attn, reports[0])]
        tokens_per_s, every_step = dp * args.batch * args.seq / median, {b for r in per_rank for b in r["traffic"]}
        theory, other, goal = theory_bytes(args, cp, form), max(per_rank[0]["other"]), GOALS.get(cp)
        met = None if goal is None else max(ratios) <= goal
        rows.append([run.name, dp, mib(attn), ", ".join(f"{v:.3f}" for v in ratios),
                     "-" if goal is None else f"<= {goal:.2f} {'met' if met else 'NOT met'}", mib(whole),
                     f"{tokens_per_s:,.0f}", f"{median * 1e3:,.0f} ms", ", ".join(f"{v:,}" for v in sorted(every_step)),
                     f"{theory:,} {'=' if every_step == {theory} else '!='}", f"{other:,}"])
        ring_times.update({cp: median} if form == "ring" else {})
        first_loss[(cp, form)] = per_rank[0]["losses"][0]
        result["runs"].append({"cp": cp, "form": form, "dp": dp, "attention_saved_bytes": attn,
                               "attention_ratio": ratios, "attention_ratio_max": max(ratios), "goal": goal,
                               "goal_met": met, "model_saved_bytes": whole, "median_step_s": median,
                               "tokens_per_s": tokens_per_s, "cp_bytes_counted": [max(r["traffic"]) for r in per_rank],
                               "cp_bytes_per_step": [r["traffic"] for r in per_rank], "cp_bytes_theory": theory,
                               "other_bytes": other, "first_loss": first_loss[(cp, form)], "losses": per_rank[0]["losses"]})
    print("\n" + harness.table(["layout", "dp", "attention saved per rank (peak)", "/ cp=1", "goal", "whole model saved",
                                "tokens/s", "median step", "cp bytes/step counted", "theory", "other bytes/step"], rows))
    for cp in sorted({c for c, f in first_loss if c > 1 and (c, "ring") in first_loss and (c, "ulysses") in first_loss}):
        ring, ulysses = first_loss[(cp, "ring")], first_loss[(cp, "ulysses")]
        print(f"cp={cp}: first-step loss ring {ring:.6f}, ulysses {ulysses:.6f} (same data and weights): "
              f"difference {abs(ring - ulysses):.1e}")
    print()
    for run, per_rank in ((r, p) for r, p in zip(runs, reports) if r.form == "torch"):
        median = t.median(run.name)
        tokens_per_s, ratio = world // run.cp * args.batch * args.seq / median, ring_times.get(run.cp)
        ratio = ratio / median if ratio is not None else None
        loss0, mine = per_rank[0]["losses"][0], first_loss.get((run.cp, "ring"))
        print(f"torch context_parallel cp={run.cp}: {tokens_per_s:,.0f} tokens/s, median step {median * 1e3:,.0f} ms; "
              + (f"minipar ring step / torch step = {ratio:.2f} (goal <= {TIME_GOAL:.2f}: "
                 f"{'met' if ratio <= TIME_GOAL else 'NOT met'}); " if ratio is not None else "")
              + f"first-step loss {loss0:.6f}" + (f" vs minipar ring {mine:.6f}" if mine is not None else ""))
        result["torch"].append({"cp": run.cp, "ran": True, "median_step_s": median, "tokens_per_s": tokens_per_s,
                                "minipar_ring_over_torch": ratio, "first_loss": loss0})
    for cp, error in sorted(torch_errors.items()):
        print(f"torch context_parallel cp={cp}: does not run here ({'cuda' if torch.cuda.is_available() else 'cpu'}/"
              f"{dist.get_backend()}): {error}")
        result["torch"].append({"cp": cp, "ran": False, "error": error})
    harness.write_json(args.json, result)


if __name__ == "__main__":
    harness.run(main)
