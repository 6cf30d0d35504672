"""Context parallelism on long sequences: attention memory per rank, tokens/s and the bytes of the ring.

    torchrun --nproc_per_node=4 benchmarks/cp_long_seq.py [--seq 8192 --cp-sizes 1,2,4 --forms ring,ulysses
        --steps 3 --warmup 1 --batch 1 --n-layer 2 --n-embd 128 --n-head 4 --vocab 256 --json PATH] [--smoke]

Layouts. The whole world trains in every layout: for each cp size C dividing the world, ``minipar.init(cp=C)``
(dp = world / C replicas, each a cp group given ``--batch`` full sequences of ``--seq`` tokens), once per
form in ``--forms`` (``ShardedModule(..., context_parallel=form)``, DDP over dp x cp), and cp = 1 once as the
baseline (plain DDP, every rank its own sequences). So at cp = C a rank holds T/C tokens of each of its
group's sequences where at cp = 1 it held all T: per rank, activation memory should fall to about 1/C,
while the world's tokens per step stay dp x batch x seq in every layout (tokens/s: those over the median
step, a step's time being its slowest rank's). The layouts' steps are interleaved (step 1 of each, then
step 2 of each, ...), so all see the same load on the machine.

The model is minipar's GPT (``minipar.models.GPT``, dropout 0, tied embedding), AdamW, fp32 on a CPU.

Memory. Each rank's attention modules (``minipar.context_parallel.attention_modules``: the blocks'
``CausalSelfAttention``) switch the saved-tensor meter `minipar.recompute.ActivationMemory` on for the
duration of their forward, so it counts exactly the bytes autograd keeps for backward *inside attention*
(the attention's input, q, k, v, what the attention kernel or ring attention saves, the output
projection's input; parameters excluded), and their peak over the timed steps. The ratio is each rank's
peak against the cp = 1 layout's on the same rank; the goals are <= 0.55 at cp = 2 and <= 0.30 at cp = 4.
The whole model's saved bytes (the same meter around the whole forward) are measured in the warm-up
step and printed beside them. What to expect: ring attention keeps exactly what cp = 1 keeps for its
tokens (1/C), since its output, like SDPA's, is laid out so that the output projection's input is a view
of it; so does Ulysses, whose local attention recomputes its output in backward instead of keeping it in
the heads layout beside the output projection's input in the tokens layout (which would make 1.2/C).

Communication. Each step runs inside ``mesh.comm.counting()``; the attention traffic of a rank is what it
sends on the cp axis: ring attention's K/V (and dK/dV) sends (op "send", tags "cp_kv*"), Ulysses'
all-to-alls over "cp" (wire bytes: the (C-1)/C of each tensor that leaves the rank). The theory beside
it, per step, for n_layer layers, local batch B, heads H, head_dim D, fp32:

    ring     n_layer x (ring_bytes(B, H, T, D, C)["forward"] + ["backward"])   (minipar.formulas)
    ulysses  n_layer x 8 all-to-alls (q, k, v, out forward; their gradients backward) x (C-1)/C x B·H·(T/C)·D·4

Everything else counted (the gradient all-reduce over dp x cp, the same in every layout, the loss and
the batch check) is printed as "other".

PyTorch's reference. For each cp > 1, the same model, layout and data under
``torch.distributed.tensor.experimental.context_parallel`` (its ring attention, head-tail load balancing:
the zig-zag split; DDP over the world; the positions given as a sharded buffer) is tried. If it runs,
its tokens/s and minipar's ring step time over torch's are printed (goal <= 1.00), and its first loss
beside minipar's; if it cannot run here (on a CPU, torch 2.13: DTensor has no sharding rule for the CPU
flash-attention op that SDPA dispatches to), the exception is printed as PyTorch raised it.

Sizes. The default (2 layers, n_embd 128, 4 heads, vocab 256: 1.5M parameters; seq 8192, batch 1) is
the longest sequence the 2-core CPU machine trains in a few minutes: five layouts x four steps on 4
ranks took 168 s (seq 4096: 65 s). ``--smoke``: 1 layer, n_embd 16, 4 heads, seq 64, one timed step,
cp sizes 1 and 2: seconds on 2 ranks (for tests). ``--json PATH`` writes every figure, per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import minipar
from minipar import ShardedModule
from minipar.context_parallel import attention_modules
from minipar.formulas import ring_bytes
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.models.data import markov_batch
from minipar.recompute import ActivationMemory

GOALS = {2: 0.55, 4: 0.30}  # attention activation memory per rank at cp = C over cp = 1
TIME_GOAL = 1.00            # minipar's ring step time over torch context_parallel's
SMOKE = dict(n_layer=1, n_embd=16, n_head=4, vocab=64, seq=64, batch=1, steps=1, warmup=1, cp_sizes="1,2")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192, help="tokens per sequence (ring: a multiple of 2 x cp)")
    ap.add_argument("--cp-sizes", default="1,2,4", help="comma-separated; those not dividing the world are skipped")
    ap.add_argument("--forms", default="ring,ulysses")
    ap.add_argument("--batch", type=int, default=1, help="sequences per cp group (per dp replica) per step")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (the whole model's memory is read here)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--no-torch", action="store_true", help="skip torch's context_parallel")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--smoke", action="store_true", help="a tiny model and sequence, one timed step (for tests)")
    args = ap.parse_args()
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    world = int(os.environ.get("WORLD_SIZE", 1))
    wanted = sorted({int(c) for c in str(args.cp_sizes).split(",")} | {1})
    args.cp_sizes = [c for c in wanted if world % c == 0]
    args.skipped_cp_sizes = [c for c in wanted if world % c]
    args.forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be at least 1 (the warm-up step measures the whole model's memory)")
    for c in args.cp_sizes[1:]:  # refused here, on every rank, before any process group exists
        if "ring" in args.forms and args.seq % (2 * c):
            ap.error(f"--seq {args.seq} must be a multiple of 2 x cp = {2 * c} for ring attention (zig-zag chunks)")
        if "ulysses" in args.forms and (args.n_head % c or args.seq % c):
            ap.error(f"Ulysses at cp = {c} needs --n-head ({args.n_head}) and --seq ({args.seq}) divisible by {c}")
    return args


class AttentionMemory:
    """The saved-tensor meter, on only while an attention module runs its forward (module docstring).

    ``measure()`` starts a fresh meter and returns it; ``stop()`` switches it off. It stays off in the
    warm-up step, where a whole-model meter is open instead: nested saved-tensor hooks replace the outer
    ones, so with both on the whole-model figure would miss attention's tensors.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())
        self.meter: ActivationMemory | None = None
        for module in attention_modules(model):
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._exit)

    def measure(self) -> ActivationMemory:
        self.meter = ActivationMemory(self.params)
        return self.meter

    def stop(self) -> None:
        self.meter = None

    def _enter(self, module, args) -> None:
        if self.meter is not None:
            self.meter.__enter__()

    def _exit(self, module, args, output) -> None:
        if self.meter is not None:
            self.meter.__exit__(None, None, None)


def cp_traffic(stats) -> int:
    """The bytes this rank put on the wire for attention: ring sends and Ulysses all-to-alls on cp."""
    return sum(r.wire_bytes for r in stats.records
               if (r.op == "send" and (r.tag or "").startswith("cp_kv")) or (r.op == "all_to_all" and r.group == "cp"))


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

    def __init__(self, args, cfg: GPTConfig, cp: int, form: str | None) -> None:
        self.args, self.cp, self.form = args, cp, form
        self.name = "minipar " + (f"cp={cp} {form}" if cp > 1 else "cp=1 (baseline)")
        self.mesh = minipar.init(cp=cp)  # dp = world / cp
        self.model = ShardedModule(GPT(cfg), mesh=self.mesh, context_parallel=form)
        self.opt = self.model.build_optimizer(torch.optim.AdamW, lr=args.lr)
        self.attention = AttentionMemory(self.model)
        self.times: list[float] = []
        self.losses: list[float] = []
        self.attention_peak = 0
        self.model_peak = 0
        self.traffic: list[int] = []
        self.other: list[int] = []

    def step(self, step: int, timed: bool) -> None:
        x = markov_batch(step, self.mesh.dp_rank, self.args.batch, self.args.seq, self.args.vocab).to(self.mesh.device)
        whole = None if timed else ActivationMemory(self.model.parameters())  # the warm-up: the whole model
        attention = self.attention.measure() if timed else None
        dist.barrier()  # straight from torch.distributed, outside the counting: lines the ranks up
        t0 = time.perf_counter()
        with self.mesh.comm.counting() as stats, (whole or contextlib.nullcontext()):
            loss = self.model.train_step(x[:, :-1], x[:, 1:], gpt_loss)
        self.opt.step()
        self.opt.zero_grad()
        _sync(self.mesh.device)
        elapsed = time.perf_counter() - t0
        self.attention.stop()
        self.losses.append(loss.item())
        if timed:
            self.times.append(elapsed)
            self.attention_peak = max(self.attention_peak, attention.peak_bytes)
            self.traffic.append(cp_traffic(stats))
            self.other.append(sum(r.wire_bytes for r in stats.records) - self.traffic[-1])
        else:
            self.model_peak = max(self.model_peak, whole.peak_bytes)

    def report(self) -> dict:
        return {"attention_peak": self.attention_peak, "model_peak": self.model_peak, "traffic": self.traffic,
                "other": self.other, "times": self.times, "losses": self.losses}

    def close(self) -> None:
        self.mesh.destroy()


class TorchRun:
    """The same model, layout (dp = world / cp, cp) and data under torch's ``context_parallel`` (ring
    attention on the "cp" dimension of a DeviceMesh, head-tail load balancing), DDP over the world."""

    def __init__(self, args, cfg: GPTConfig, cp: int, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.nn.parallel import DistributedDataParallel

        self.args, self.cp, self.device = args, cp, device
        self.name = f"torch context_parallel cp={cp}"
        world = dist.get_world_size()
        self.dmesh = init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
        self.dp_rank = self.dmesh.get_local_rank("dp")  # rank = dp_rank * cp + cp_rank, as in minipar's Mesh
        self.model = GPT(cfg).to(device)
        self.ddp = DistributedDataParallel(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.positions: torch.Tensor | None = None  # this rank's tokens' positions, a sharded buffer
        self.model.wpe.register_forward_pre_hook(lambda m, a: (self.positions[a[0]],))
        self.times: list[float] = []
        self.losses: list[float] = []

    def step(self, step: int, timed: bool) -> None:
        from torch.distributed.tensor.experimental import context_parallel

        x = markov_batch(step, self.dp_rank, self.args.batch, self.args.seq, self.args.vocab).to(self.device)
        inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        positions = torch.arange(self.args.seq, device=self.device)
        buffers = [inputs, targets, positions]
        dist.barrier()
        t0 = time.perf_counter()
        with context_parallel(self.dmesh["cp"], buffers=buffers, buffer_seq_dims=[1, 1, 0],
                              no_restore_buffers=set(buffers)):
            self.positions = positions
            loss = gpt_loss(self.ddp(inputs), targets)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        _sync(self.device)
        elapsed = time.perf_counter() - t0
        global_loss = loss.detach().reshape(1).clone()
        dist.all_reduce(global_loss)  # each rank's mean over its tokens; equal counts: the mean is the global one
        self.losses.append(global_loss.item() / dist.get_world_size())
        if timed:
            self.times.append(elapsed)

    def report(self) -> dict:
        return {"times": self.times, "losses": self.losses}

    def close(self) -> None:
        pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def try_torch(args, cfg, cp: int, device: torch.device) -> tuple[TorchRun | None, str | None]:
    """(the run, None) when torch's context_parallel trains a warm-up step here, else (None, why) with
    the exception as PyTorch raised it; every rank agrees (each raises the same before any collective)."""
    run, error = None, None
    try:
        run = TorchRun(args, cfg, cp, device)
        run.step(0, timed=False)
    except Exception as e:  # noqa: BLE001: the point is to report whatever torch raises here
        run, error = None, f"{type(e).__name__}: {e}".strip()
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    reasons = sorted({e for e in errors if e is not None})
    if reasons and run is not None:  # some rank failed: none of them trains it
        run = None
    return run, ("; ".join(reasons) if reasons else None)


def main() -> int:
    args = parse_args()
    base = minipar.init()
    world, rank, device = base.world_size, base.rank, base.device
    if device.type == "cpu":
        torch.set_num_threads(1)
    else:  # the reference and minipar must not round matmul inputs to TF32
        torch.backends.cuda.matmul.allow_tf32 = False
    cp_sizes, skipped = args.cp_sizes, args.skipped_cp_sizes
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd, dropout=0.0, seed=0)
    runs = [MiniparRun(args, cfg, 1, None)]
    runs += [MiniparRun(args, cfg, c, form) for c in cp_sizes if c > 1 for form in args.forms]
    torch_errors: dict[int, str] = {}
    if not args.no_torch:
        for c in (c for c in cp_sizes if c > 1):
            run, error = try_torch(args, cfg, c, device)
            if run is not None:
                runs.append(run)
            else:
                torch_errors[c] = error
    if rank == 0:
        n_params = sum(p.numel() for p in GPT(cfg).parameters())
        print(f"GPT {n_params / 1e6:.2f}M parameters ({args.n_layer} layers x {args.n_embd}, {args.n_head} heads, "
              f"vocab {args.vocab}), seq {args.seq}, batch {args.batch} per cp group, {world} ranks, "
              f"{device.type}/{dist.get_backend()}; cp sizes {cp_sizes}"
              + (f" (skipped {skipped}: they do not divide the world)" if skipped else ""), flush=True)
    for step in range(args.warmup + args.steps):
        for run in runs:  # interleaved: every layout sees the same load on the machine
            if isinstance(run, TorchRun) and step == 0:
                continue  # its warm-up step ran in try_torch
            run.step(step, timed=step >= args.warmup)
        if rank == 0:
            print(f"step {step} done", flush=True)

    reports = [base.comm.all_gather_object(run.report(), base.world, tag="report") for run in runs]
    if rank == 0:
        print_tables(args, world, runs, reports, torch_errors)
    for run in runs:
        run.close()
    del runs
    gc.collect()
    minipar.shutdown()
    return 0


def print_tables(args, world, runs, reports, torch_errors) -> None:
    """The table of layouts, the torch comparison, and --json."""
    baseline = reports[0]
    result = {"args": {k: v for k, v in vars(args).items()}, "world": world, "runs": [], "torch": []}
    print("\n| layout | dp | attention saved per rank (peak) | / cp=1 | goal | whole model saved | "
          "tokens/s | median step | cp bytes/step counted | theory | other bytes/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ring_times: dict[int, float] = {}
    first_loss: dict[tuple[int, str | None], float] = {}
    for run, per_rank in zip(runs, reports):
        if isinstance(run, TorchRun):
            continue
        cp, form, dp = run.cp, run.form, world // run.cp
        attn = [r["attention_peak"] for r in per_rank]
        ratios = [a / b["attention_peak"] for a, b in zip(attn, baseline)]
        whole = [r["model_peak"] for r in per_rank]
        median = statistics.median(max(r["times"][i] for r in per_rank) for i in range(args.steps))
        tokens_per_s = dp * args.batch * args.seq / median
        counted = [max(r["traffic"]) for r in per_rank]
        every_step = {b for r in per_rank for b in r["traffic"]}  # every rank, every step
        theory = theory_bytes(args, cp, form)
        other = max(per_rank[0]["other"])
        goal = GOALS.get(cp)
        met = "" if goal is None else (" met" if max(ratios) <= goal else " NOT met")
        print(f"| {run.name} | {dp} | {_mib(attn)} | {_ratios(ratios)} | "
              f"{f'<= {goal:.2f}{met}' if goal is not None else '-'} | {_mib(whole)} | {tokens_per_s:,.0f} | "
              f"{median * 1e3:,.0f} ms | {_ints(every_step)} | {theory:,} {'=' if every_step == {theory} else '!='} | "
              f"{other:,} |")
        if form == "ring":
            ring_times[cp] = median
        first_loss[(cp, form)] = per_rank[0]["losses"][0]
        result["runs"].append({"cp": cp, "form": form, "dp": dp, "attention_saved_bytes": attn,
                               "attention_ratio": ratios, "attention_ratio_max": max(ratios), "goal": goal,
                               "goal_met": None if goal is None else max(ratios) <= goal,
                               "model_saved_bytes": whole, "median_step_s": median, "tokens_per_s": tokens_per_s,
                               "cp_bytes_counted": counted, "cp_bytes_per_step": [r["traffic"] for r in per_rank],
                               "cp_bytes_theory": theory, "other_bytes": other,
                               "first_loss": per_rank[0]["losses"][0], "losses": per_rank[0]["losses"]})
    for cp in sorted({c for c, f in first_loss if c > 1}):
        if (cp, "ring") in first_loss and (cp, "ulysses") in first_loss:
            diff = abs(first_loss[(cp, "ring")] - first_loss[(cp, "ulysses")])
            print(f"cp={cp}: first-step loss ring {first_loss[(cp, 'ring')]:.6f}, ulysses "
                  f"{first_loss[(cp, 'ulysses')]:.6f} (same data and weights): difference {diff:.1e}")
    print()
    for run, per_rank in zip(runs, reports):
        if not isinstance(run, TorchRun):
            continue
        median = statistics.median(max(r["times"][i] for r in per_rank) for i in range(args.steps))
        dp = world // run.cp
        tokens_per_s = dp * args.batch * args.seq / median
        ratio = ring_times[run.cp] / median if run.cp in ring_times else None
        loss0, mine = per_rank[0]["losses"][0], first_loss.get((run.cp, "ring"))
        print(f"torch context_parallel cp={run.cp}: {tokens_per_s:,.0f} tokens/s, median step {median * 1e3:,.0f} ms; "
              + (f"minipar ring step / torch step = {ratio:.2f} (goal <= {TIME_GOAL:.2f}: "
                 f"{'met' if ratio <= TIME_GOAL else 'NOT met'}); " if ratio is not None else "")
              + f"first-step loss {loss0:.6f}" + (f" vs minipar ring {mine:.6f}" if mine is not None else ""))
        result["torch"].append({"cp": run.cp, "ran": True, "median_step_s": median, "tokens_per_s": tokens_per_s,
                                "minipar_ring_over_torch": ratio, "first_loss": loss0})
    for cp, error in sorted(torch_errors.items()):
        print(f"torch context_parallel cp={cp}: does not run here ({args_device()}): {error}")
        result["torch"].append({"cp": cp, "ran": False, "error": error})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def args_device() -> str:
    return f"{'cuda' if torch.cuda.is_available() else 'cpu'}/{dist.get_backend()}"


def _mib(values: list[int]) -> str:
    return ", ".join(f"{v / 2**20:,.2f}" for v in values) + " MiB"


def _ratios(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def _ints(values) -> str:
    return ", ".join(f"{v:,}" for v in sorted(set(values)))


if __name__ == "__main__":
    code = main()
    gc.collect()  # free what reference cycles hold (process groups) before interpreter teardown
    sys.exit(code)
