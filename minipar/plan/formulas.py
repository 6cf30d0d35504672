"""The memory and communication arithmetic of every layout, in one place.

What a data-parallel strategy keeps and sends; what the model's activations send between tp, pp,
cp and ep ranks is `minipar.plan.model_traffic`, on the same `Call` records.

The tests prove these figures equal to what minipar measures (`memory_stats()`, the bytes the
collective layer counts), and the planner (`minipar.plan`) uses the same functions at scale, so a
prediction for 1,024 GPUs rests on arithmetic checked on 4 CPU processes.

Parameters are described by `ParamSet`: tensors (real ones, or ``meta`` stand-ins of the right
size for a model that does not fit anywhere), which are experts', and the ZeRO-3 units. The
sharded strategies' flat groups are built by the very functions the strategies use
(`minipar.data_parallel.buckets.bucket_params`, `minipar.data_parallel.flat.FlatLayout`, `minipar.core.units`), so padding (each group
rounded up to a multiple of its shard count) comes out exactly. Weights that ZeRO-3 gathers in FP8
(`Float8Config(all_gather=True)`) form a part of their own in each unit, gathered at one byte an
element after their amaxes (`fp8_gather_calls`).

Byte conventions are the collective layer's (`minipar.core.comm`): ``bytes`` is the full tensor a call
is about (all-reduce: the tensor; reduce-scatter: the full input; all-gather: the full output;
all-to-all and send: what this rank sends), ``wire`` what the ring algorithm puts on the wire:
all-reduce 2(n-1)/n B, reduce-scatter and all-gather (n-1)/n B, send B, recv 0. A group of one
rank issues nothing.

State bytes per rank (Φ parameters on the rank, N the shard count, AdamW):

    strategy   params      grads       optimizer (fp32 masters + two moments + a 4-byte step per tensor)
    ddp        4Φ          4Φ          8Φ                  (minipar's DDP computes in fp32)
    zero1      pΦ          gΦ          (12 or 8)Φ/N        p, g: compute and reduce dtype bytes (4 or 2)
    zero2      pΦ          gΦ/N        (12 or 8)Φ/N        the master is the shard itself in fp32 (8),
    zero3      pΦ/N        gΦ/N        (12 or 8)Φ/N        a separate fp32 copy under bf16 (12)

each Φ/N being Σ over flat groups of ceil(numel / N) (ZeRO-3's params and grads, ZeRO-2's grads)
or of the group's real part on this rank (the optimizer), and ZeRO-1/2's full flat buffers padded
to a multiple of N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch
import torch.nn as nn

from ..core.comm import wire_bytes  # the collective layer's own table: one copy of the ring arithmetic
from ..data_parallel.buckets import bucket_params
from ..data_parallel.flat import FlatLayout
from ..core.placement import placement_of
from ..data_parallel.strategy import strategy_entry
from ..core.units import assign_params, select_units
from ..fp8.linear import FORMS
from ..fp8.gather import all_gather_bytes, scale_groups

ADAMW_STATE = 8   # bytes per element: exp_avg and exp_avg_sq in fp32
STEP_BYTES = 4    # torch's AdamW keeps a 0-dim fp32 "step" tensor per parameter tensor it steps


def dtype_bytes(dtype: torch.dtype | int | str) -> int:
    """Bytes per element of a torch dtype, a name ("fp32", "bf16", "fp16") or a byte count."""
    if isinstance(dtype, int):
        return dtype
    if isinstance(dtype, str):
        return {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}[dtype]
    return torch.empty((), dtype=dtype).element_size()


def _canonical(strategy: str) -> str:
    """``strategy`` with an alias read as its registered name ("fsdp" as "zero3"); an unknown name
    raises, naming the registered ones. One it cannot plan (registered without ``shards``) too."""
    entry = strategy_entry(strategy)
    if entry.shards is None:
        raise ValueError(f"strategy {strategy!r} was registered without shards=...: register_strategy needs "
                         "to know what it shards before its memory and traffic can be predicted")
    return entry.name


def shards(strategy: str) -> frozenset:
    """What ``strategy`` keeps as shards: a subset of {"optimizer", "grads", "params"} (its registration).
    Every formula below reads this, never the strategy's name."""
    return strategy_entry(strategy).shards


# -- what is sharded ----------------------------------------------------------------------------


class Fp8Weight(NamedTuple):
    """A weight ZeRO-3 gathers in FP8 (`Float8Config(all_gather=True)`, `minipar.fp8.gather`): its (N, K)
    shape on this rank, its scale form ("tensor": one amax; "block": one per 128 x 128 block), and the size
    of the tensor-parallel group its tensorwise amax is agreed over too (1: none)."""

    shape: tuple[int, int]
    form: str
    tp: int = 1

    @property
    def n_amax(self) -> int:
        return math.prod(scale_groups(self.shape, self.form))


@dataclass
class ParamSet:
    """One rank's trainable parameters as its data-parallel strategy sees them.

    tensors: in registration order (real parameters or ``meta`` tensors of their size, fp32);
    expert: per tensor, whether it is an expert's (sharded over edp rather than dp);
    units: ZeRO-3's units, each a list of indices into ``tensors``, the root unit last;
    fp8: per tensor, its `Fp8Weight` when ZeRO-3 gathers it in FP8, else None (empty: none is).
    """

    tensors: list[torch.Tensor]
    expert: list[bool]
    units: list[list[int]] = field(default_factory=list)
    has_root: bool = True  # the last unit is the root (what no wrapped module owns), not a wrapped module
    fp8: list[Fp8Weight | None] = field(default_factory=list)

    @classmethod
    def of(cls, module: nn.Module, wrap_policy=None) -> "ParamSet":
        """The parameters of ``module`` (after tensor/expert parallelism cut them), units as ZeRO-3 cuts
        them under ``wrap_policy`` (`minipar.core.units.select_units`; None: each nn.ModuleList entry),
        and the weights of FP8 layers whose recipe gathers in FP8 (`minipar.fp8.apply_fp8`)."""
        params = [p for _, p in module.named_parameters() if p.requires_grad]
        index = {id(p): i for i, p in enumerate(params)}
        units = [[index[id(p)] for p in ps] for ps in assign_params(module, select_units(module, wrap_policy))]
        fp8: list[Fp8Weight | None] = [None] * len(params)
        for m in module.modules():
            config = getattr(m, "fp8_config", None)
            if config is not None and config.all_gather and id(m.weight) in index:
                form = FORMS[config.scaling][1]
                group = getattr(m, "group", None)  # a tensor-parallel layer's: its tensorwise amax spans it
                tp = group.size if group is not None and form == "tensor" else 1
                fp8[index[id(m.weight)]] = Fp8Weight(tuple(m.weight.shape), form, tp)
        return cls(params, [placement_of(p).expert for p in params], [u for u in units if u], bool(units[-1]),
                   fp8 if any(fp8) else [])

    @classmethod
    def of_sizes(cls, blocks: Sequence[Sequence[tuple]], root: Sequence[tuple[int, bool]],
                 root_first: int = 0, fp8: tuple[str, int] | None = None) -> "ParamSet":
        """From sizes: ``blocks`` (one ZeRO-3 unit each, [(numel, expert)] or [(numel, expert, (N, K))] for
        a linear layer's weight), ``root`` (the rest); the first ``root_first`` root tensors are registered
        before the blocks (embeddings), the others after. ``fp8`` (form, tp): the blocks' linear weights
        are gathered in FP8 with that scale form, their tensorwise amax agreed over tp ranks."""
        order = list(root[:root_first]) + [t for b in blocks for t in b] + list(root[root_first:])
        tensors = [torch.empty(t[0], device="meta") for t in order]
        units, i = [], root_first
        for b in blocks:
            units.append(list(range(i, i + len(b))))
            i += len(b)
        units.append(list(range(root_first)) + list(range(i, len(order))))
        marks = [Fp8Weight(t[2], fp8[0], fp8[1] if fp8[0] == "tensor" else 1) if fp8 and len(t) > 2 else None
                 for t in order]
        return cls(tensors, [t[1] for t in order], [u for u in units if u], fp8=marks if any(marks) else [])

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.tensors)


@dataclass(frozen=True)
class DataParallelShape:
    """A data-parallel strategy over its axes, as the planner and the tests describe it.

    dp: the ranks gradients are averaged over (dp x cp: cp names the axis "dp_cp" when > 1); shard:
    the dense shard axis (dp_shard x cp under HSDP, else dp); edp: the experts' shard axis; param/grad: compute and reduce dtype bytes
    (4/4: fp32; 2/2: bf16 with fp32 masters); rank / edp_rank: this rank's index on the shard axes
    (the real part of a padded group's last shard is shorter). ``strategy`` "fsdp", zero3's other
    name, is stored as "zero3"."""

    strategy: str
    dp: int
    shard: int | None = None
    edp: int = 1
    param: int = 4
    grad: int | None = None
    bucket_cap_mb: float = 25.0
    reshard_after_forward: bool = True
    rank: int = 0
    edp_rank: int = 0
    cp: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", _canonical(self.strategy))  # frozen: set once, here

    @property
    def grad_axis(self) -> str:
        return "dp" if self.cp == 1 else "dp_cp"

    @property
    def shards(self) -> int:
        return self.shard or self.dp

    @property
    def replicas(self) -> int:
        return self.dp // self.shards

    @property
    def grad_bytes(self) -> int:
        return self.grad or self.param

    @property
    def shard_axis(self) -> str:
        return "dp_shard" if self.replicas > 1 else self.grad_axis


class Group(NamedTuple):
    """One flat group (a ZeRO-1/2 bucket, a ZeRO-3 unit's part, a DDP bucket) on its axis; ``fp8``: the
    `Fp8Weight`s of a ZeRO-3 part gathered in FP8 (empty for any other group)."""

    layout: FlatLayout
    axis: str
    fp8: tuple = ()


def unit_parts(ps: ParamSet, unit: list[int]) -> list[tuple[list[int], bool]]:
    """ZeRO-3's parts of one unit, as `Zero3` cuts them: per shard axis (dense, experts; in the order
    first met) the weights gathered in FP8, then the rest, leaving out an empty one; [(indices, expert)]."""
    out = []
    for expert in dict.fromkeys(ps.expert[i] for i in unit):
        on_axis = [i for i in unit if ps.expert[i] == expert]
        fp8 = [i for i in on_axis if ps.fp8 and ps.fp8[i] is not None]
        rest = [i for i in on_axis if i not in fp8]
        out += [(part, expert) for part in (fp8, rest) if part]
    return out


def flat_groups(ps: ParamSet, dp: DataParallelShape) -> list[Group]:
    """The strategy's flat groups, built as the strategy builds them: DDP and ZeRO-1/2 bucket the
    parameters in backward order, dense ones first (over dp, or dp_shard), experts after (over edp);
    ZeRO-3 makes one part per unit and axis (two where some of them gather in FP8: `unit_parts`)."""
    axes = {False: (dp.shard_axis, dp.shards, dp.rank), True: ("edp", dp.edp, dp.edp_rank)}
    if not shards(dp.strategy):
        axes = {False: (dp.grad_axis, dp.dp, 0), True: ("edp", dp.edp, 0)}  # DDP shards nothing: numel only

    def group(indices: list[int], expert: bool) -> Group:
        axis, n, rank = axes[expert]
        fp8 = tuple(ps.fp8[i] for i in indices if ps.fp8 and ps.fp8[i] is not None)
        return Group(FlatLayout([], sum(ps.tensors[i].numel() for i in indices), n, rank), axis, fp8)

    if "params" in shards(dp.strategy):  # gathered per use, unit by unit
        return [group(indices, e) for unit in ps.units for indices, e in unit_parts(ps, unit)]
    cap = max(1, int(dp.bucket_cap_mb * 2**20))
    out = []
    for expert in (False, True):
        order = [i for i in reversed(range(len(ps.tensors))) if ps.expert[i] == expert]
        by_id = {id(ps.tensors[i]): i for i in order}
        for bucket in bucket_params([ps.tensors[i] for i in order], cap):
            out.append(group([by_id[id(t)] for t in bucket], expert))
    return out


def state_bytes(ps: ParamSet, dp: DataParallelShape, optimizer: str = "adamw") -> dict[str, int]:
    """{"params", "grads", "optimizer"}: the persistent bytes `memory_stats()` reports on this rank
    (``optimizer``: "adamw", or "sgd" without momentum: no state)."""
    adam = optimizer == "adamw"
    sharded = shards(dp.strategy)
    if not sharded:  # the optimizer steps each parameter tensor in place
        n = ps.numel
        return {"params": n * dp.param, "grads": n * dp.param,
                "optimizer": (ADAMW_STATE * n + STEP_BYTES * len(ps.tensors)) if adam else 0}
    separate_master = dp.param != 4  # else the fp32 shard itself is the master
    params = grads = opt = 0
    for g in flat_groups(ps, dp):
        lay = g.layout
        params += (lay.shard_size if "params" in sharded else lay.padded) * dp.param
        grads += (lay.shard_size if "grads" in sharded else lay.padded) * dp.grad_bytes
        opt += 4 * lay.real_len if separate_master else 0
        opt += (ADAMW_STATE * lay.real_len + STEP_BYTES) if adam else 0
    return {"params": params, "grads": grads, "optimizer": opt}


def shard_formula(strategy: str, phi: float, n: int, param: int = 4) -> dict[str, float]:
    """The ZeRO paper's closed form per rank, without padding or step counters (AdamW): params,
    grads, optimizer bytes for Φ parameters over N ranks (gradients reduced in the compute dtype)."""
    master_and_moments = ADAMW_STATE + (4 if param != 4 else 0)
    split = {what: n if what in shards(strategy) else 1 for what in ("params", "grads", "optimizer")}
    return {"params": param * phi / split["params"], "grads": param * phi / split["grads"],
            "optimizer": master_and_moments * phi / split["optimizer"]}


# -- communication ------------------------------------------------------------------------------


class Call(NamedTuple):
    """One collective as the collective layer records it on this rank."""

    op: str
    axis: str
    tag: str
    bytes: int
    wire: int


def call(op: str, axis: str, n: int, tag: str, payload: int) -> list[Call]:
    """[the call], or [] for a group of one (which issues nothing)."""
    return [] if n == 1 else [Call(op, axis, tag, int(payload), wire_bytes(op, n, payload))]


def dp_calls(ps: ParamSet, dp: DataParallelShape, backwards: int = 1, pipeline: bool = False) -> list[Call]:
    """The gradient ("grad") and parameter ("param") traffic of one optimizer step of ``backwards``
    micro-batches (no_sync on all but the last, as `ShardedModule` accumulates).

    What a strategy shards decides it (`shards`): nothing sharded (DDP) all-reduces once per step; a
    sharded optimizer needs only its shard of the gradient, a reduce-scatter, once per step while the
    full gradient is kept (ZeRO-1), at every backward once it is not (ZeRO-2, ZeRO-3), except under a
    pipeline (once, from p.grad); then it all-gathers each group after the step (ZeRO-1/2), or per use
    when the parameters are sharded too (ZeRO-3, as `zero3_gathers` says). HSDP all-reduces each
    gradient shard over the replicas once per step."""
    return [c for calls, per_step, per_backward in dp_repeats(ps, dp, pipeline)
            for c in calls * (per_step + per_backward * backwards)]


def dp_repeats(ps: ParamSet, dp: DataParallelShape, pipeline: bool = False) -> list[tuple[list[Call], int, int]]:
    """`dp_calls` as [(calls, times per step, times per backward)], to sum without listing each call."""
    groups, out = flat_groups(ps, dp), []
    sizes = {dp.grad_axis: dp.dp, "dp_shard": dp.shards, "edp": dp.edp}
    sharded = shards(dp.strategy)
    if not sharded:
        return [(call("all_reduce", g.axis, sizes[g.axis], "grad", g.layout.numel * dp.param), 1, 0) for g in groups]
    # once: reduce once per step, from a full gradient kept until then
    per_use, once = "params" in sharded, "grads" not in sharded or pipeline
    for g in groups:
        n = sizes[g.axis]
        out.append((call("reduce_scatter", g.axis, n, "grad", g.layout.padded * dp.grad_bytes), int(once), int(not once)))
        if g.axis == "dp_shard":
            out.append((call("all_reduce", "dp_replicate", dp.replicas, "grad", g.layout.shard_size * dp.grad_bytes), 1, 0))
        if not per_use:
            out.append((call("all_gather", g.axis, n, "param", g.layout.padded * dp.param), 1, 0))
    if per_use:  # zero3_gathers of one backward: per step under a pipeline, else per backward
        for g, gathers in zip(groups, zero3_gathers(ps, dp, 1, pipeline)):
            gather = fp8_gather_calls(g, sizes[g.axis]) if g.fp8 else \
                call("all_gather", g.axis, sizes[g.axis], "param", g.layout.padded * dp.param)
            out.append((gather, gathers, 0) if pipeline else (gather, 0, gathers))
    return out


def fp8_gather_calls(g: Group, n: int) -> list[Call]:
    """One FP8 gather of a ZeRO-3 part, its bytes `minipar.fp8.gather.all_gather_bytes`: the amaxes of
    its scale groups all-reduced over the shard axis ("param_amax"), the tensorwise ones of
    tensor-parallel weights again over tp, then the e4m3 bytes all-gathered, one byte per element."""
    tp = [w for w in g.fp8 if w.tp > 1]
    shard = all_gather_bytes(g.layout.numel, sum(w.n_amax for w in g.fp8), n)
    return (call("all_reduce", g.axis, n, "param_amax", shard["param_amax"])
            + (call("all_reduce", "tp", tp[0].tp, "param_amax", 4 * sum(w.n_amax for w in tp)) if tp else [])
            + call("all_gather", g.axis, n, "param", shard["param"]))


def zero3_gathers(ps: ParamSet, dp: DataParallelShape, backwards: int = 1, pipeline: bool = False) -> list[int]:
    """How many times ZeRO-3 gathers each flat group (`flat_groups` order) in one step: the root
    unit once per forward, every other unit once per forward and again in backward when it
    reshards after forward; under a pipeline (kept gathered), once per step."""
    out = []
    for u, unit in enumerate(ps.units):
        is_root = ps.has_root and u == len(ps.units) - 1
        gathers = 1 if pipeline else backwards * (1 if is_root or not dp.reshard_after_forward else 2)
        out += [gathers] * len(unit_parts(ps, unit))
    return out


def summarize(calls: Sequence[Call], times: int = 1) -> dict[str, dict[str, int]]:
    """{axis: {"bytes", "wire"}} summed over ``calls`` issued ``times`` times (summing one micro-batch's
    list and scaling it: the list of all m held millions of calls)."""
    out: dict[str, dict[str, int]] = {}
    for c in calls:
        row = out.setdefault(c.axis, {"bytes": 0, "wire": 0})
        row["bytes"] += c.bytes
        row["wire"] += c.wire
    for row in out.values():
        row["bytes"] *= times
        row["wire"] *= times
    return out
