"""minipar ZeRO-1/3 against PyTorch's ZeroRedundancyOptimizer and FSDP2: speed, memory, communication.

    torchrun --nproc_per_node=2 benchmarks/zero_vs_torch.py [--model gpt|linear20 --steps N --warmup W
        --n-layer L --n-embd E --n-head H --vocab V --seq T --batch B --lr LR --seed S
        --ddp-bucket-view 0|1 --bf16-table/--no-bf16-table --impls a,b,... --unit-check 0|1 --json out.json
        --check]

Every implementation trains the same model, built from one seed (so the
weights start equal), on the same per-rank batches (different on every rank),
with the same torch optimizer:

* ``--model gpt`` (default): ``minipar.models.GPT`` (4 layers, 256 wide, 128
  tokens x 8 sequences per rank, vocabulary 2048, tied embedding; 3.7M
  parameters) on Markov-chain tokens, AdamW. A step takes a few hundred ms
  of compute on one core; the run a few minutes.
* ``--model linear20``: the model of PyTorch's ZeroRedundancyOptimizer
  tutorial, twenty ``nn.Linear(2000, 2000)`` in an ``nn.Sequential`` (80M
  parameters), MSE on one fixed random batch per rank, Adam. Implementations
  are built a few at a time (in rounds: each torch counterpart beside its
  minipar one) so that two ranks of 80M-parameter models fit in RAM; zero3
  uses ``wrap_policy=(nn.Linear,)`` and FSDP2 shards each Linear.

The implementations:

  mp_zero1     minipar.ShardedModule(strategy="zero1") + build_optimizer(opt)
  torch_zero1  DistributedDataParallel + ZeroRedundancyOptimizer(optimizer_class=opt)
  mp_zero3     minipar.ShardedModule(strategy="zero3")   (default wrap policy: each model.layers entry + root)
  torch_fsdp2  fully_shard(unit) for each unit, then fully_shard(root), on init_device_mesh("cpu", (world,))
  mp_zero2, mp_ddp, torch_ddp   (context: minipar ZeRO-2 and DDP, torch DDP + plain opt)

A step is forward, loss, backward, ``opt.step()``, ``opt.zero_grad()`` (for
minipar the plain ``loss.backward()``: no loss all-reduce, as on the torch side).
After ``--warmup`` untimed steps each, the implementations run interleaved,
one step each in turn, the starting implementation rotating every step, so
drift of the shared machine hits all alike. Each timed step starts after an
untimed barrier; its time is the slowest rank's. Torch DDP uses
``gradient_as_bucket_view=True`` by default (its fastest setting, and its
.grad then *is* its bucket memory); ``--ddp-bucket-view 0`` gives the defaults.

Rank 0 prints:
 1. median step times, minipar/torch ratios (goal <= 1.00, limit 1.25) with
    the spread of per-step paired ratios, and a per-phase breakdown;
 2. per-rank persistent memory (params / grads / optimizer bytes), measured
    after backward and optimizer.step(), before zero_grad, of the last
    warm-up step, beside the ZeRO paper's formulas, in fp32 and in bf16
    mixed precision (minipar's memory_stats(); torch's from its tensors);
 3. for --model linear20, the same figures laid out beside the tutorial's table;
 4. minipar's communication per step by op (mesh.comm.counting(), during the
    warm-up steps) and zero3/ddp against the exact expectation;
 5. sanity: max |param difference| between each minipar model and its torch
    counterpart after all steps.

On CPU each rank computes with one thread, over gloo. Exit status 0; with
``--check``, 1 when a minipar/torch ratio of medians exceeds the limit.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import minipar
from minipar.formulas import DataParallel, ParamSet, dp_calls, shard_formula, summarize
from minipar.models import GPT, GPTConfig, gpt_loss

RATIO_GOAL, RATIO_LIMIT = 1.00, 1.25
PAIRS = (("mp_zero1", "torch_zero1"), ("mp_zero3", "torch_fsdp2"))   # the timed comparisons
SANITY = (("mp_zero1", "torch_zero1"), ("mp_zero3", "torch_fsdp2"), ("mp_zero2", "torch_ddp"),
          ("mp_ddp", "torch_ddp"))
LABELS = {"mp_ddp": "minipar ddp", "mp_zero1": "minipar zero1", "mp_zero2": "minipar zero2",
          "mp_zero3": "minipar zero3", "torch_ddp": "torch DDP + opt",
          "torch_zero1": "torch DDP + ZeroRedundancyOptimizer", "torch_fsdp2": "torch FSDP2 fully_shard"}
CONTROL_TAGS = ("unused_map", "loss", "overflow", "grad_norm", "config_check", "unit_check", "batch_check")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("gpt", "linear20"), default="gpt")
    p.add_argument("--steps", type=int, default=None, help="timed steps per implementation (gpt 20, linear20 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per implementation first (>= 1; "
                   "gpt 2, linear20 1); communication is counted and memory probed in them")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (also the block size)")
    p.add_argument("--batch", type=int, default=None, help="samples per rank per step (gpt 8, linear20 20)")
    p.add_argument("--lr", type=float, default=None,
                   help="gpt 1e-3 (AdamW); linear20 1e-4 (Adam; the tutorial's 0.01 is for its single step: over "
                        "several steps the 20-layer linear stack's output overflows to inf)")
    p.add_argument("--seed", type=int, default=0, help="model and data seed")
    p.add_argument("--ddp-bucket-view", type=int, choices=(0, 1), default=1,
                   help="torch DDP gradient_as_bucket_view (1: grads are its buckets; 0: DDP's default, "
                        "which keeps a second, hidden gradient copy in its buckets)")
    p.add_argument("--bf16-table", action=argparse.BooleanOptionalAction, default=None,
                   help="also build minipar zero1/2/3 in bf16 mixed precision for the memory table "
                        "(default: on for gpt, off for linear20)")
    p.add_argument("--impls", default=None,
                   help="comma-separated subset of " + ",".join(LABELS) + " (default: all)")
    p.add_argument("--unit-check", type=int, choices=(0, 1), default=1,
                   help="minipar zero3's check that every rank runs the same units (1, the default) or not (0): "
                        "run both to see its cost")
    p.add_argument("--json", default=None, help="also write the results here as JSON")
    p.add_argument("--check", action="store_true", help=f"exit 1 when a minipar/torch ratio > {RATIO_LIMIT}")
    args = p.parse_args(argv)
    gpt = args.model == "gpt"
    args.steps = args.steps if args.steps is not None else (20 if gpt else 5)
    args.warmup = args.warmup if args.warmup is not None else (2 if gpt else 1)
    args.batch = args.batch if args.batch is not None else (8 if gpt else 20)
    args.lr = args.lr if args.lr is not None else (1e-3 if gpt else 1e-4)
    args.bf16_table = gpt if args.bf16_table is None else args.bf16_table
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1")
    args.impls = list(LABELS) if args.impls is None else [k.strip() for k in args.impls.split(",") if k.strip()]
    unknown = [k for k in args.impls if k not in LABELS]
    if unknown:
        p.error(f"unknown --impls {unknown}; choose from {', '.join(LABELS)}")
    return args


# -- workloads ------------------------------------------------------------------------------------

@dataclass
class Workload:
    name: str
    build: Callable[[], nn.Module]           # the same initial weights on every call and every rank
    units: Callable[[nn.Module], list[nn.Module]]   # the modules FSDP2 shards before the root
    wrap_policy: Any                         # minipar zero3's, picking the same units
    loss_fn: Callable
    opt_cls: type
    opt_kwargs: dict
    batches: list                            # this rank's (inputs, targets), warm-up then timed
    rounds: list[list[str]]                  # implementations built, interleaved and freed together
    describe: str


def gpt_workload(args, rank: int, n_steps: int) -> Workload:
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd, seed=args.seed)
    # A learnable synthetic language: a fixed random Markov chain, four likely successors per token,
    # so the loss visibly falls from ln(vocab); sequences differ per (step, rank).
    successors = torch.randint(args.vocab, (args.vocab, 4), generator=torch.Generator().manual_seed(args.seed + 17))
    batches = []
    for step in range(n_steps):
        g = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 1_009 + rank)
        tok = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
        tok[:, 0] = torch.randint(args.vocab, (args.batch,), generator=g)
        picks = torch.randint(4, (args.batch, args.seq), generator=g)
        for t in range(args.seq):
            tok[:, t + 1] = successors[tok[:, t], picks[:, t]]
        batches.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))
    everything = ["mp_zero1", "torch_zero1", "mp_zero3", "torch_fsdp2", "mp_zero2", "mp_ddp", "torch_ddp"]
    return Workload(
        "gpt", lambda: GPT(cfg), lambda m: list(m.layers), None, gpt_loss, torch.optim.AdamW,
        dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1), batches, [everything],
        f"GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} vocab={args.vocab} "
        f"seq={args.seq} batch={args.batch}/rank (tied embedding), AdamW lr {args.lr:g}, Markov-chain tokens")


def linear20_workload(args, rank: int, n_steps: int) -> Workload:
    def build() -> nn.Module:
        torch.manual_seed(args.seed)  # nn.Linear draws from the global RNG: reseed for equal weights
        return nn.Sequential(*[nn.Linear(2000, 2000) for _ in range(20)])

    # One fixed random batch per rank, reused every step (the tutorial draws new noise each step): the
    # stack then fits it and the loss falls instead of wandering.
    g = torch.Generator().manual_seed(args.seed * 1_009 + rank)
    fixed = (torch.randn(args.batch, 2000, generator=g), torch.randn(args.batch, 2000, generator=g))
    batches = [fixed] * n_steps
    # 80M parameters: build a few implementations at a time so the 2 ranks stay within RAM.
    rounds = [["mp_zero1", "torch_zero1"], ["mp_zero3", "torch_fsdp2"], ["mp_zero2", "mp_ddp", "torch_ddp"]]
    return Workload(
        "linear20", build, lambda m: [c for c in m if isinstance(c, nn.Linear)], (nn.Linear,), F.mse_loss,
        torch.optim.Adam, dict(lr=args.lr), batches, rounds,
        f"nn.Sequential of 20 nn.Linear(2000, 2000) (PyTorch ZeroRedundancyOptimizer tutorial), "
        f"one fixed random batch of {args.batch}/rank, MSELoss, Adam lr {args.lr:g}")


# -- implementations ------------------------------------------------------------------------------

@dataclass
class Side:
    key: str
    model: nn.Module          # what is called in forward
    inner: nn.Module          # the plain module (for state dicts and parameter lists)
    opt: Any
    sharded: minipar.ShardedModule | None = None
    times: list[float] = field(default_factory=list)
    phases: list[tuple[float, float, float, float]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    records: list = field(default_factory=list)   # minipar CommRecords of the counted steps
    counted_steps: int = 0
    memory: dict | None = None


def build_side(key: str, w: Workload, mesh: minipar.Mesh, args, mixed=None) -> Side:
    if key.startswith("mp_"):
        strategy = key[3:]
        inner = w.build()
        zero3 = dict(wrap_policy=w.wrap_policy, unit_check=bool(args.unit_check)) if strategy == "zero3" else {}
        sm = minipar.ShardedModule(inner, mesh=mesh, strategy=strategy, mixed_precision=mixed, **zero3)
        return Side(key, sm, inner, sm.build_optimizer(w.opt_cls, **w.opt_kwargs), sharded=sm)
    inner = w.build().to(mesh.device)
    if key in ("torch_ddp", "torch_zero1"):
        ddp = DistributedDataParallel(inner, gradient_as_bucket_view=bool(args.ddp_bucket_view))
        if key == "torch_ddp":
            opt = w.opt_cls(ddp.parameters(), **w.opt_kwargs)
        else:
            opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=w.opt_cls, **w.opt_kwargs)
        return Side(key, ddp, inner, opt)
    if key == "torch_fsdp2":
        dmesh = init_device_mesh(mesh.device.type, (dist.get_world_size(),))
        for unit in w.units(inner):
            fully_shard(unit, mesh=dmesh)
        fully_shard(inner, mesh=dmesh)
        return Side(key, inner, inner, w.opt_cls(inner.parameters(), **w.opt_kwargs))
    raise ValueError(key)


def run_step(side: Side, x, y, loss_fn, probe: bool = False, timed: bool = False):
    t0 = time.perf_counter()
    loss = loss_fn(side.model(x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    side.opt.step()
    t3 = time.perf_counter()
    if probe:  # after backward and the optimizer step, before zero_grad
        side.memory = measure_memory(side)
    t3p = time.perf_counter()
    side.opt.zero_grad()
    t4 = time.perf_counter()
    if timed:
        side.phases.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3p))
    return loss.detach()


# -- memory ---------------------------------------------------------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def storage_bytes(tensors, seen: set) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard), not in ``seen``."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        s = _local(t).untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def optimizer_state_tensors(opt) -> list[torch.Tensor]:
    local = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps this rank's optimizer in .optim
    return [v for st in local.state.values() for v in st.values() if torch.is_tensor(v)]


def measure_memory(side: Side) -> dict:
    if side.sharded is not None:
        stats = dict(side.sharded.memory_stats())
        stats["source"] = "memory_stats()"
        return stats
    seen: set = set()
    params = list(side.inner.parameters())
    return {"params": storage_bytes(params, seen), "grads": storage_bytes([p.grad for p in params], seen),
            "optimizer": storage_bytes(optimizer_state_tensors(side.opt), seen),
            "source": "summed parameter, .grad and optimizer-state tensors"}


def formulas(phi: int, n: int, mixed: bool) -> dict[str, tuple[float, float, float, str]]:
    """{strategy: (params, grads, optimizer) bytes per rank, and the formula as text}
    (`minipar.formulas.shard_formula`, the arithmetic the tests and the planner use)."""
    text = {True: {"ddp": "2Φ + 2Φ + 12Φ = 16Φ", "zero1": "2Φ + 2Φ + 12Φ/N", "zero2": "2Φ + 2Φ/N + 12Φ/N",
                   "zero3": "16Φ/N"},
            False: {"ddp": "4Φ + 4Φ + 8Φ = 16Φ", "zero1": "4Φ + 4Φ + 8Φ/N", "zero2": "4Φ + 4Φ/N + 8Φ/N",
                    "zero3": "16Φ/N"}}[mixed]
    out = {}
    for strategy, t in text.items():
        f = shard_formula(strategy, phi, n, param=2 if mixed else 4)
        out[strategy] = (f["params"], f["grads"], f["optimizer"], t)
    return out


def memory_rows(mem: dict[str, dict], phi: int, n: int, mixed: bool, keys: list[tuple[str, str, str]]) -> list:
    """keys: (row label, key into mem, formula strategy). Returns rows for printing and JSON."""
    f = formulas(phi, n, mixed)
    rows = []
    for label, key, strat in keys:
        m = mem.get(key)
        fp, fg, fo, text = f[strat]
        row = {"row": label, "formula": text, "formula_bytes": {"params": fp, "grads": fg, "optimizer": fo,
                                                                "total": fp + fg + fo}}
        if m is None or "unavailable" in m:
            row["measured"] = None
            row["note"] = m["unavailable"] if m else "not measured"
        else:
            tot = m["params"] + m["grads"] + m["optimizer"]
            row["measured"] = {"params": m["params"], "grads": m["grads"], "optimizer": m["optimizer"],
                               "total": tot}
            row["ratio"] = {k: (row["measured"][k] / row["formula_bytes"][k] if row["formula_bytes"][k] else None)
                            for k in ("params", "grads", "optimizer", "total")}
            row["source"] = m.get("source", "")
        rows.append(row)
    return rows


def print_memory_rows(title: str, rows: list) -> None:
    mib = 2**20
    print(f"\n{title}")
    print(f"{'':40} {'params MiB':>22} {'grads MiB':>22} {'optimizer MiB':>22} {'total MiB':>22}  formula")
    print(f"{'':40} {'meas / formula = x':>22} {'meas / formula = x':>22} {'meas / formula = x':>22} "
          f"{'meas / formula = x':>22}")
    for r in rows:
        cells = []
        for k in ("params", "grads", "optimizer", "total"):
            fb = r["formula_bytes"][k] / mib
            if r["measured"] is None:
                cells.append(f"{'n/a':>7} / {fb:8.2f}     ")
            else:
                mb = r["measured"][k] / mib
                ratio = r["ratio"][k]
                cells.append(f"{mb:7.2f} / {fb:8.2f} ={ratio:5.2f}" if ratio is not None else f"{mb:7.2f} / 0")
        print(f"{r['row']:40} " + " ".join(f"{c:>22}" for c in cells) + f"  {r['formula']}")
        if r["measured"] is None:
            print(f"{'':40}   ({r['note']})")


# -- communication --------------------------------------------------------------------------------

def comm_per_step(side: Side) -> dict:
    out: dict[str, dict[str, float]] = {}
    for r in side.records:
        for key in (r.op, f"{r.op}/{r.tag}"):
            row = out.setdefault(key, {"calls": 0, "bytes": 0, "wire_bytes": 0})
            row["calls"] += 1
            row["bytes"] += r.bytes
            row["wire_bytes"] += r.wire_bytes
    n = max(side.counted_steps, 1)
    per = {k: {kk: vv / n for kk, vv in v.items()} for k, v in sorted(out.items())}
    total = sum(r.wire_bytes for r in side.records) / n
    data = sum(r.wire_bytes for r in side.records if r.tag not in CONTROL_TAGS) / n
    return {"by_op": per, "wire_bytes_total": total, "wire_bytes_data": data, "steps_counted": side.counted_steps}


def zero3_expected(sm: minipar.ShardedModule, wrap_policy) -> dict:
    """Exact wire bytes per step of minipar zero3 (`minipar.formulas.dp_calls`: units gathered twice,
    root once, every gradient reduce-scattered, padded flat groups), and the unpadded closed form."""
    st = sm.strategy
    n = st.group.size
    pes = torch.empty((), dtype=st.policy.param_dtype).element_size()
    ges = torch.empty((), dtype=st.policy.grad_dtype).element_size()
    ps = ParamSet.of(sm.module, wrap_policy)
    calls = dp_calls(ps, DataParallel("zero3", n, param=pes, grad=ges))
    wire = {op: summarize([c for c in calls if c.op == op])["dp"]["wire"]
            for op in ("all_gather", "reduce_scatter")}
    phi_root = sum(ps.tensors[i].numel() for i in ps.units[-1]) if ps.has_root else 0
    phi_units = ps.numel - phi_root
    f = (n - 1) / n
    return {**wire, "total": summarize(calls)["dp"]["wire"], "phi_units": phi_units, "phi_root": phi_root,
            "unpadded_total": f * (pes * (2 * phi_units + phi_root) + ges * (phi_units + phi_root))}


# -- main -----------------------------------------------------------------------------------------

def source_state() -> str:
    """Which minipar was measured: the git commit, and whether minipar/ had uncommitted changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(minipar.__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "minipar", "models"],
                               capture_output=True, text=True, timeout=10).stdout.split("\n")
        dirty = [line[3:] for line in dirty if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if not head:
        return f"{os.path.dirname(os.path.abspath(minipar.__file__))} (not a git checkout)"
    return f"{head}" + (f" + uncommitted changes in {', '.join(dirty)}" if dirty else " (clean)")


def interleave(sides: list[Side], w: Workload, args, mesh) -> float:
    """Warm-up (counted, memory probed at the last), then timed steps interleaved with rotation."""
    t_start = time.perf_counter()
    for i in range(args.warmup):
        x, y = w.batches[i]
        for s in sides:
            probe = i == args.warmup - 1
            if s.sharded is not None:
                with mesh.comm.counting() as stats:
                    s.losses.append(run_step(s, x, y, w.loss_fn, probe=probe).item())
                s.records += stats.records
                s.counted_steps += 1
            else:
                s.losses.append(run_step(s, x, y, w.loss_fn, probe=probe).item())
    for i in range(args.steps):
        x, y = w.batches[args.warmup + i]
        k = i % len(sides)
        for s in sides[k:] + sides[:k]:
            dist.barrier()  # aligned start, not timed
            t0 = time.perf_counter()
            loss = run_step(s, x, y, w.loss_fn, timed=True)
            s.times.append(time.perf_counter() - t0)
            s.losses.append(loss.item())
    return time.perf_counter() - t_start


def max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def full_params(side: Side) -> dict[str, torch.Tensor]:
    """Full fp32 tensors of the model's state dict, on every rank (collective for the sharded ones)."""
    if side.sharded is not None:
        return side.sharded.full_state_dict()
    out = {}
    for k, v in side.inner.state_dict().items():
        out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().clone()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    mesh = minipar.init()
    device = mesh.device
    if device.type == "cpu":
        torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    main_rank = rank == 0
    n_batches = args.warmup + args.steps
    w = gpt_workload(args, rank, n_batches) if args.model == "gpt" else linear20_workload(args, rank, n_batches)
    w.batches = [(x.to(device), y.to(device)) for x, y in w.batches]

    probe_model = w.build()
    phi = sum(p.numel() for p in probe_model.parameters() if p.requires_grad)  # a tied weight counts once
    del probe_model
    if main_rank:
        print(f"minipar ZeRO vs torch: world {world}, {dist.get_backend()} on {device}, "
              f"{torch.get_num_threads()} thread(s)/rank, torch {torch.__version__}; minipar {source_state()}")
        print(f"model: {w.describe}; Φ = {phi:,} parameters ({4 * phi / 2**20:.1f} MiB fp32)")
        print(f"{args.warmup} warm-up + {args.steps} timed steps per implementation; torch DDP "
              f"gradient_as_bucket_view={bool(args.ddp_bucket_view)}", flush=True)

    results: dict[str, Any] = {
        "command": " ".join(["torchrun", f"--nproc_per_node={world}", os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "torch": torch.__version__, "backend": dist.get_backend(), "device": str(device), "world_size": world,
        "threads_per_rank": torch.get_num_threads(), "model": args.model, "phi": phi,
        "minipar_source": source_state(),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "check")},
    }

    done: dict[str, Side] = {}
    finals: dict[str, dict[str, torch.Tensor]] = {}
    initial = {k: v.detach().float().clone() for k, v in w.build().state_dict().items()} if main_rank else {}
    expected3 = None
    wall = 0.0
    for rnd in w.rounds:
        keys = [k for k in rnd if k in args.impls]
        if not keys:
            continue
        sides = [build_side(k, w, mesh, args) for k in keys]
        wall += interleave(sides, w, args, mesh)
        for s in sides:
            full = full_params(s)  # collective: every rank takes part, rank 0 keeps the result
            if main_rank:
                finals[s.key] = {k: v.cpu() for k, v in full.items()}
            del full
            if s.key == "mp_zero3":
                expected3 = zero3_expected(s.sharded, w.wrap_policy)
            s.times = max_over_ranks(s.times)
            done[s.key] = s
            s.model = s.inner = s.opt = s.sharded = None  # free the model and optimizer; keep the figures
        del sides

    # bf16 mixed precision: one step each of minipar zero1/2/3, for the memory table and the comm bytes.
    mixed_mem: dict[str, dict] = {"ddp": {"unavailable": "minipar ddp takes no mixed_precision "
                                          "(ShardedModule raises ValueError); formula only"}}
    mixed_comm: dict[str, dict] = {}
    if args.bf16_table:
        mp = minipar.MixedPrecision(param_dtype=torch.bfloat16)
        for strat in ("zero1", "zero2", "zero3"):
            s = build_side(f"mp_{strat}", w, mesh, args, mixed=mp)
            x, y = w.batches[0]
            with mesh.comm.counting() as stats:
                run_step(s, x, y, w.loss_fn, probe=True)
            s.records, s.counted_steps = stats.records, 1
            mixed_mem[strat] = s.memory
            mixed_comm[strat] = comm_per_step(s)
            del s

    # ---- gather figures -----------------------------------------------------------------------
    speed = {}
    for k, s in done.items():
        speed[k] = {"median_s": statistics.median(s.times), "min_s": min(s.times), "max_s": max(s.times),
                    "step_s": s.times,
                    "phase_median_s_rank0": {name: statistics.median(p[j] for p in s.phases)
                                             for j, name in enumerate(("forward+loss", "backward", "opt.step",
                                                                       "zero_grad"))},
                    "loss_first_last": [s.losses[0], s.losses[-1]]}
    ratios = {}
    for a, b in PAIRS:
        if a not in done or b not in done:
            continue
        pair = [ta / tb for ta, tb in zip(done[a].times, done[b].times)]
        r = speed[a]["median_s"] / speed[b]["median_s"]
        ratios[f"{a}/{b}"] = {"ratio_of_medians": r, "paired_median": statistics.median(pair),
                              "paired_min": min(pair), "paired_max": max(pair),
                              "ratio_of_minima": speed[a]["min_s"] / speed[b]["min_s"],
                              "ok": r <= RATIO_LIMIT, "goal_met": r <= RATIO_GOAL}
    results["speed"] = speed
    results["ratios"] = ratios

    if main_rank:
        sanity = {}
        for a, b in SANITY:
            fa, fb = finals.get(a), finals.get(b)
            if fa is None or fb is None:
                continue
            keys = sorted(set(fa) & set(fb))
            diff = max((fa[k] - fb[k]).abs().max().item() for k in keys)
            sanity[f"{a} vs {b}"] = {"max_abs_diff": diff, "tensors": len(keys),
                                     "keys_mismatch": sorted(set(fa) ^ set(fb))}
        results["sanity"] = sanity
        any_final = next(iter(finals.values()))
        results["max_abs_param"] = max(v.abs().max().item() for v in any_final.values())
        results["max_abs_change_from_init"] = max((any_final[k] - initial[k]).abs().max().item()
                                                  for k in any_final if k in initial)

    fp32_mem = {k: s.memory for k, s in done.items()}
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, {"fp32": fp32_mem, "bf16": mixed_mem})
    results["memory_per_rank_raw"] = per_rank
    results["memory_fp32_raw"] = fp32_mem
    results["memory_bf16_raw"] = mixed_mem
    mp_keys = [("minipar ddp", "mp_ddp", "ddp"), ("minipar zero1", "mp_zero1", "zero1"),
               ("minipar zero2", "mp_zero2", "zero2"), ("minipar zero3", "mp_zero3", "zero3")]
    torch_keys = [("torch DDP + opt", "torch_ddp", "ddp"),
                  ("torch DDP + ZeroRedundancyOptimizer", "torch_zero1", "zero1"),
                  ("torch FSDP2", "torch_fsdp2", "zero3")]
    rows_fp32 = memory_rows(fp32_mem, phi, world, False, [k for k in mp_keys + torch_keys if k[1] in fp32_mem])
    rows_bf16 = memory_rows(mixed_mem, phi, world, True, [(l, s, s) for l, s in
                                                          (("minipar ddp", "ddp"), ("minipar zero1", "zero1"),
                                                           ("minipar zero2", "zero2"), ("minipar zero3", "zero3"))]) \
        if args.bf16_table else []
    results["memory_fp32"] = rows_fp32
    results["memory_bf16"] = rows_bf16

    comm = {k[3:]: comm_per_step(s) for k, s in done.items() if k.startswith("mp_")}
    results["comm_fp32"] = comm
    results["comm_bf16"] = mixed_comm
    if "ddp" in comm and "zero3" in comm:
        ddp_data = comm["ddp"]["wire_bytes_data"]
        z3 = comm["zero3"]
        results["zero3_over_ddp"] = {
            "measured_total": z3["wire_bytes_total"] / comm["ddp"]["wire_bytes_total"],
            "measured_data": z3["wire_bytes_data"] / ddp_data,
            "expected_bytes": expected3, "expected_ratio": expected3["total"] / ddp_data,
            "theory_full_reshard": 1.5}
    results["wall_s"] = wall

    if main_rank:
        report(results, args, w)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2, default=str)
            print(f"\nresults written to {args.json}")
    dist.barrier()
    minipar.shutdown()
    failed = args.check and not all(r["ok"] for r in ratios.values())
    return 1 if failed else 0


def report(res: dict, args, w: Workload) -> None:
    ms, mib = 1e3, 2**20
    sp = res["speed"]
    order = [k for k in ("mp_zero1", "torch_zero1", "mp_zero3", "torch_fsdp2", "mp_zero2", "mp_ddp", "torch_ddp")
             if k in sp]
    print(f"\n== 1. step time (forward, loss, backward, opt.step, zero_grad; slowest rank; "
          f"{args.steps} interleaved steps) ==")
    print(f"{'implementation':40} {'median ms':>10} {'min ms':>9} {'max ms':>9}   "
          f"{'fwd':>7} {'bwd':>7} {'step':>7} {'zero':>6}  (phase medians, ms, rank 0)")
    for k in order:
        s = sp[k]
        ph = s["phase_median_s_rank0"]
        print(f"{LABELS[k]:40} {s['median_s'] * ms:10.1f} {s['min_s'] * ms:9.1f} {s['max_s'] * ms:9.1f}   "
              f"{ph['forward+loss'] * ms:7.1f} {ph['backward'] * ms:7.1f} {ph['opt.step'] * ms:7.1f} "
              f"{ph['zero_grad'] * ms:6.2f}")
    print()
    for name, r in res["ratios"].items():
        verdict = "goal met" if r["goal_met"] else ("within limit" if r["ok"] else "OVER LIMIT")
        print(f"ratio {name}: {r['ratio_of_medians']:.3f} of medians  (goal <= {RATIO_GOAL:.2f}, limit "
              f"{RATIO_LIMIT:.2f}: {verdict}); per-step paired ratios median {r['paired_median']:.3f}, "
              f"range {r['paired_min']:.3f} .. {r['paired_max']:.3f}; ratio of minima {r['ratio_of_minima']:.3f}")
    if order:
        print("loss first -> last step: " + ", ".join(
            f"{k} {sp[k]['loss_first_last'][0]:.4f} -> {sp[k]['loss_first_last'][1]:.4f}" for k in order))

    phi, n = res["phi"], res["world_size"]
    print(f"\n== 2. persistent memory per rank: Φ = {phi:,}, N = {n}; measured after backward and "
          f"optimizer.step(), before zero_grad, in warm-up step {args.warmup} (bf16 rows: in their only step) ==")
    print("minipar rows: ShardedModule.memory_stats() (for ddp: the state of the optimizer build_optimizer made).")
    print("torch rows: distinct storages behind parameters, .grad and optimizer state (DTensors: the local "
          "shard). " + ("torch DDP grads are its buckets (gradient_as_bucket_view=True)." if args.ddp_bucket_view
                        else "torch DDP (defaults) also keeps a hidden params-sized bucket copy, not counted."))
    print("Optimizer bytes include Adam's 'step' scalars; ZeroRedundancyOptimizer gives whole parameters to "
          "ranks, so its optimizer share is only about 1/N. Table: rank 0.")
    print_memory_rows("fp32 parameters and Adam (the fp32 master is the parameter itself):", res["memory_fp32"])
    if res["memory_bf16"]:
        print_memory_rows("bf16 mixed precision: MixedPrecision(param_dtype=torch.bfloat16), reduce dtype bf16, "
                          "fp32 master + m + v:", res["memory_bf16"])
    totals = []
    for table in ("fp32", "bf16"):
        for key in res["memory_per_rank_raw"][0][table]:
            per = [r[table].get(key) for r in res["memory_per_rank_raw"]]
            if any(m is None or "unavailable" in m for m in per):
                continue
            tot = [(m["params"] + m["grads"] + m["optimizer"]) / mib for m in per]
            totals.append(f"{table} {key} " + "/".join(f"{t:.2f}" for t in tot))
    print("total MiB on each rank (rank 0/1/...): " + "; ".join(totals))

    if args.model == "linear20":
        print_tutorial_table(res)

    print(f"\n== 4. minipar communication per step (mesh.comm.counting() over the {args.warmup} warm-up "
          "step(s); bytes = full tensor, wire = ring bytes this rank sends) ==")
    for label, table in (("fp32", res["comm_fp32"]), ("bf16", res["comm_bf16"])):
        for strat in ("ddp", "zero1", "zero2", "zero3"):
            if strat not in table:
                continue
            c = table[strat]
            ops = [k for k in c["by_op"] if "/" not in k]
            parts = [f"{k}: {c['by_op'][k]['calls']:g} calls, {c['by_op'][k]['bytes'] / mib:.2f} MiB, "
                     f"wire {c['by_op'][k]['wire_bytes'] / mib:.2f} MiB" for k in ops]
            tags = ", ".join(f"{k} {c['by_op'][k]['wire_bytes'] / mib:.3f}" for k in c["by_op"] if "/" in k)
            print(f"  {label} {strat:6} wire total {c['wire_bytes_total'] / mib:8.3f} MiB | " + "; ".join(parts))
            print(f"  {'':11} by op/tag (wire MiB): {tags}")
    z = res.get("zero3_over_ddp")
    if z:
        e = z["expected_bytes"]
        print(f"zero3/ddp wire bytes: measured {z['measured_data']:.4f} (gradient and parameter traffic; "
              f"{z['measured_total']:.4f} with control messages); theory 1.5 when every unit reshards;")
        print(f"  expected exactly, the root unit staying gathered from forward to backward: all-gather "
              f"(N-1)/N*(2*Φ_units + Φ_root) + reduce-scatter (N-1)/N*Φ = {e['all_gather']:,.0f} + "
              f"{e['reduce_scatter']:,.0f} = {e['total']:,.0f} B/step (padded flat groups; unpadded "
              f"{e['unpadded_total']:,.0f}); Φ_units {e['phi_units']:,}, Φ_root {e['phi_root']:,}; "
              f"ratio {z['expected_ratio']:.4f}")

    if "sanity" in res:
        print(f"\n== 5. sanity: max |param difference| after {args.warmup + args.steps} steps (largest |param| "
              f"{res['max_abs_param']:.3g}; parameters moved up to {res['max_abs_change_from_init']:.3g} "
              "from their initial values) ==")
        for name, s in res["sanity"].items():
            extra = f", key mismatch {s['keys_mismatch']}" if s["keys_mismatch"] else ""
            print(f"  {name}: {s['max_abs_diff']:.3e} over {s['tensors']} tensors{extra}")
    print(f"wall time of the training loops: {res['wall_s']:.1f} s")


def print_tutorial_table(res: dict) -> None:
    mib = 2**20
    print("\n== 3. beside PyTorch's ZeroRedundancyOptimizer tutorial (20 x nn.Linear(2000, 2000), Adam, 2 ranks) ==")
    print("The tutorial reports peak CUDA memory (torch.cuda.max_memory_allocated) after optimizer.step(): "
          "1697 MB with plain Adam, 1361 MB with ZeroRedundancyOptimizer; its DDP has default settings, so its "
          "656 MB 'after creating DDP' is the parameters plus DDP's bucket copy of the gradients.")
    print("Here, on CPU: persistent state per rank, params + grads + optimizer state, after the optimizer step "
          "(rank 0; MB = MiB = 2**20 bytes, as the tutorial's):")
    print(f"{'implementation':40} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} {'total MB':>9}")
    for key in ("torch_ddp", "torch_zero1", "mp_ddp", "mp_zero1", "mp_zero2", "mp_zero3", "torch_fsdp2"):
        m = res["memory_fp32_raw"].get(key)
        if m is None:
            continue
        tot = m["params"] + m["grads"] + m["optimizer"]
        print(f"{LABELS[key]:40} {m['params'] / mib:10.1f} {m['grads'] / mib:9.1f} {m['optimizer'] / mib:9.1f} "
              f"{tot / mib:9.1f}")


if __name__ == "__main__":
    code = main()
    gc.collect()  # free what reference cycles hold (process groups) before interpreter teardown
    sys.exit(code)
