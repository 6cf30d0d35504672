"""The data-parallel strategy protocol: the questions `ShardedModule` asks, whatever the strategy.

DDP (`minipar.data_parallel.ddp`), ZeRO-1/2 (`minipar.data_parallel.zero12`) and ZeRO-3 (`minipar.data_parallel.zero3`)
each answer these, and the front door, the pipeline step and checkpoints ask
nothing else, so tensor, pipeline and expert parallelism compose with any of
them without knowing which one they hold::

    no_sync(local=...)   backward inside does not communicate; gradients accumulate locally
                         (``local=True``, as a pipeline asks for every micro-batch: in ``p.grad``
                         whatever the strategy, even ZeRO-2/3 which otherwise reduce every backward)
    sync_grads()         reduce what local accumulation left (the end of an accumulated step)
    unscale_()           reduce, divide out the loss scale; True if some rank overflowed
    grad_pieces()        the pieces of the reduced gradient this rank holds, each with its placement
    build_optimizer()    the torch optimizer over what this rank steps (parameter groups as torch takes them)
    zero_grad()          forget the gradients, wherever the strategy keeps them
    memory_stats()       bytes of persistent parameters, gradients and optimizer state
    full_params(), full_grads()   {id(param): full tensor} (layout-free state, for state dicts)
    stepped_ranges()     which elements of each parameter this rank's optimizer steps (checkpoints)
    offloaded_state()    a context holding offloaded optimizer state in memory (checkpoints)

A gradient's life under this protocol: backward leaves it in ``p.grad`` (or,
synchronising, the strategy moves it into its buckets and reduces it there);
anything that must touch the *local* gradient before the data-parallel
reduction, like the sum of a tied weight over pipeline stages, runs between
the last no_sync backward and ``sync_grads``.
"""

from __future__ import annotations

import abc
import math
import contextlib
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Iterator

import torch

from ..core.grad_norm import GradPiece, clip_
from .offload import Offload
from .precision import LossScaler, MixedPrecision

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")  # the built-in ones; "fsdp" is another name for "zero3"


SHARDABLE = ("optimizer", "grads", "params")  # what a strategy may keep as shards, in ZeRO's stage order


@dataclass(frozen=True)
class StrategyEntry:
    """A registered data-parallel strategy: how the front door builds it and what it takes.

    build(module, mesh, config, reshard_after_forward) -> Strategy; options: the `DataParallelConfig`
    fields it reads besides ``strategy`` (any other one given is refused, naming the strategies that
    take it); shards: what it keeps as shards over the data-parallel group, a subset of `SHARDABLE`
    (DDP nothing, ZeRO-1 the optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the
    parameters), or None: unknown, so the planner leaves it out. That declaration is all the planner's
    arithmetic reads (`minipar.plan.formulas`): what is sharded fixes the state bytes, and the traffic
    follows (a sharded optimizer needs only its shard of the gradient, a reduce-scatter, then gathers
    the updated parameters after the step, or per use when the parameters are sharded too).
    sharded: it shards the optimizer state (``ShardedModule`` then casts floating inputs to the
    compute dtype, and HSDP meshes accept it)."""

    name: str
    build: Callable[..., Any]
    options: frozenset
    shards: frozenset | None

    @property
    def sharded(self) -> bool:
        return self.shards is not None and "optimizer" in self.shards


_REGISTRY: dict[str, StrategyEntry] = {}


def register_strategy(name: str, build: Callable[..., Any], *, options: tuple[str, ...] = (),
                      shards: tuple[str, ...] | None = None, aliases: tuple[str, ...] = ()) -> None:
    """Make ``strategy=name`` (and each alias) build ``build(module, mesh, config, reshard_after_forward)``:
    a new data-parallel strategy is one module that calls this, and nothing else changes (the front
    door asks every strategy only the `Strategy` protocol; the planner reads ``shards``).
    ``options``: the config fields it reads; ``shards``: what it keeps as shards (`StrategyEntry`)."""
    unknown = set(options) - set(_OPTION_FIELDS)
    if unknown:
        raise ValueError(f"register_strategy({name!r}): unknown options {sorted(unknown)}; the config's are "
                         f"{', '.join(_OPTION_FIELDS)}")
    if shards is not None and (set(shards) - set(SHARDABLE) or
                               tuple(shards) != SHARDABLE[:len(shards)]):
        # ZeRO's stages nest: sharding the gradients without the optimizer state saves nothing
        raise ValueError(f"register_strategy({name!r}, shards={shards!r}): give a prefix of {SHARDABLE}, "
                         "e.g. () for none or ('optimizer', 'grads') for ZeRO-2's")
    entry = StrategyEntry(name, build, frozenset(options), None if shards is None else frozenset(shards))
    for key in (name, *aliases):
        _REGISTRY[key] = entry


def planned_strategies() -> tuple[str, ...]:
    """The registered strategies that declared what they shard (the planner's arithmetic covers
    them), aliases folded, in registration order."""
    return tuple(dict.fromkeys(e.name for e in _REGISTRY.values() if e.shards is not None))


def strategy_entry(name: str) -> StrategyEntry:
    """The registered strategy ``name`` (ValueError listing the registered ones)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


# The config fields a strategy may take, with the values that mean "not given". Those in _REFUSED change
# what is computed or kept, and a strategy that does not take them refuses them; the others (bucket size,
# resharding, the unit check) tune how, and a strategy that has no such thing ignores them.
_OPTION_FIELDS = {"bucket_cap_mb": 25.0, "mixed_precision": None, "offload": None, "wrap_policy": None,
                  "reshard_after_forward": None, "unit_check": True}
_REFUSED = ("mixed_precision", "offload", "wrap_policy")


def _fp8_only(policy: Any) -> bool:
    """A policy that keeps parameters and gradients in fp32 and only runs the linear layers' matmuls in
    FP8: the front door converts those layers (`minipar.fp8.apply_fp8`), and the strategy keeps and
    reduces what it always does, so every strategy takes it, DDP included."""
    return (isinstance(policy, MixedPrecision) and policy.fp8 is not None
            and policy.param_dtype == torch.float32 and policy.grad_dtype == torch.float32)


@dataclass(frozen=True)
class DataParallelConfig:
    """The data-parallel strategy and its options, checked together.

    strategy: one of `STRATEGIES`; bucket_cap_mb: gradient bucket size of DDP, ZeRO-1 and ZeRO-2
    (MiB, > 0); mixed_precision, offload (`minipar.Offload`; cpu_offload=True is
    Offload(optimizer="cpu")): the ZeRO stages' (DDP computes in the parameters' own
    dtype: ZeRO-1 is DDP with fp32 masters; DDP takes only an FP8 policy over fp32, `_fp8_only`); wrap_policy: how zero3 cuts units
    (`minipar.core.units.select_units`); reshard_after_forward: zero3 frees a unit after its forward
    (default: yes without a pipeline, no under one); unit_check: zero3's ranks exchange, before each
    unit's gathers and reduce-scatters, what they are about to do (`minipar.data_parallel.unit_turns`), so
    units that only some ranks run are served (`minipar.data_parallel.zero3`) instead of hanging; False saves one
    8-byte exchange per collective when every rank surely runs the same units. ValueError names
    what to change."""

    strategy: str = "ddp"
    bucket_cap_mb: float = 25.0
    mixed_precision: MixedPrecision | None = None
    cpu_offload: bool = False
    offload: Offload | None = None
    wrap_policy: Any = None
    reshard_after_forward: bool | None = None
    unit_check: bool = True

    def __post_init__(self) -> None:
        entry = strategy_entry(self.strategy)
        cap = self.bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf:
            raise ValueError(f"bucket_cap_mb={cap!r} must be a finite number > 0 (MiB per gradient bucket; "
                             "PyTorch DDP uses 25)")
        if self.reshard_after_forward not in (None, True, False):
            raise ValueError(f"reshard_after_forward={self.reshard_after_forward!r} must be True, False or None")
        if self.unit_check not in (True, False):
            raise ValueError(f"unit_check={self.unit_check!r} must be True or False")
        if self.offload is not None and not isinstance(self.offload, Offload):
            raise ValueError(f"offload={self.offload!r} must be a minipar.Offload(optimizer=..., params=..., path=...)")
        if self.cpu_offload not in (True, False):
            raise ValueError(f"cpu_offload={self.cpu_offload!r} must be True or False")
        if self.cpu_offload and self.offload is not None:
            raise ValueError("pass cpu_offload=True or offload=Offload(...), not both; cpu_offload=True is "
                             "Offload(optimizer='cpu')")
        if self.cpu_offload:  # the older spelling of the same thing: one place reads it, `offload`
            object.__setattr__(self, "offload", Offload(optimizer="cpu"))
        if self.offload is not None and self.offload.optimizer is None:  # offloads nothing (params needs
            # optimizer): the plain strategy, fused step and all
            object.__setattr__(self, "offload", None)
        if self.offload is not None and self.offload.params is not None and "wrap_policy" not in entry.options:
            raise ValueError(f"Offload(params={self.offload.params!r}) offloads zero3's parameter shards; "
                             f"{self.strategy} keeps the full parameters on every rank: use strategy='zero3', or "
                             "offload only the optimizer (Offload(optimizer=...))")
        given = [k for k in _REFUSED if getattr(self, k) != _OPTION_FIELDS[k] and k not in entry.options
                 and not (k == "mixed_precision" and _fp8_only(self.mixed_precision))]
        if given:
            takers = sorted({e.name for e in _REGISTRY.values() if set(given) <= e.options})
            raise ValueError(f"{', '.join(given)} {'do' if len(given) > 1 else 'does'} not apply to "
                             f"strategy={self.strategy!r} (it takes "
                             f"{', '.join(sorted(entry.options)) or 'no options'}); use "
                             f"{' or '.join(repr(t) for t in takers) or 'another strategy'} for "
                             f"{'them' if len(given) > 1 else 'it'}"
                             + (" (zero1 is DDP with fp32 masters and a sharded optimizer)"
                                if not entry.sharded else ""))
        if self.mixed_precision is not None and not isinstance(self.mixed_precision, MixedPrecision):
            raise ValueError("mixed_precision must be a minipar.MixedPrecision(param_dtype=..., reduce_dtype=...)")

    @property
    def sharded(self) -> bool:
        return strategy_entry(self.strategy).sharded

    @property
    def zero3(self) -> bool:
        """It cuts the model into units (what a wrap policy chooses, what recomputation must not split)."""
        return "wrap_policy" in strategy_entry(self.strategy).options


class GradState(Enum):
    """Where a strategy's gradients of this step are, the one lifecycle every strategy runs (ZeRO-3's
    parameters have their own `UnitState` besides):

        EMPTY --backward under no_sync (local accumulation)--> LOCAL --sync_grads--> REDUCED
        EMPTY --synchronising backward--> REDUCED --unscale_--> UNSCALED --step--> REDUCED
        any --zero_grad--> EMPTY

    DDP keeps its reduced gradients in ``p.grad`` and never scales (fp32), so it runs EMPTY, LOCAL
    and REDUCED only.
    """

    EMPTY = "empty"        # after zero_grad: no gradient yet
    LOCAL = "local"        # some wait unreduced (no_sync backwards)
    REDUCED = "reduced"    # every gradient so far is reduced
    UNSCALED = "unscaled"  # and the loss scale divided out, overflow agreed: ready to step


class Strategy(abc.ABC):
    """Base of every data-parallel strategy (see the module docstring)."""

    scaler: LossScaler
    local_accumulation: bool  # what no_sync does by default: True for DDP and ZeRO-1 (full gradients anyway)
    mesh: Any
    grad_state = GradState.EMPTY
    _sync = True  # False inside no_sync with local accumulation: backward hooks keep gradients local

    @contextlib.contextmanager
    def no_sync(self, local: bool | None = None) -> Iterator[None]:
        """With local accumulation (``local``, or by default ``local_accumulation``: DDP and ZeRO-1):
        backward accumulates locally and sends nothing; the next synchronising backward, ``sync_grads``
        or the step reduces the sum. Without it, nothing changes: ZeRO-2 and ZeRO-3 exist not to hold
        the full gradient, so every backward reduce-scatters and the shards accumulate. A pipeline
        asks ``local=True`` for every micro-batch: the tied weight's gradient must be summed over
        its stages before any reduction, and one reduction per step is cheaper than m."""
        previous = self._sync
        self._sync = previous and not (self.local_accumulation if local is None else local)
        try:
            yield
        finally:
            self._sync = previous

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Reduce and unscale (`unscale_`), then clip this rank's pieces by the whole model's norm
        (`minipar.core.grad_norm.clip_`); returns that norm, equal on every rank. The one question
        the front door asks to clip."""
        self.unscale_()
        return clip_(self.grad_pieces(), self.mesh, max_norm, norm_type)

    @abc.abstractmethod
    def sync_grads(self) -> None:
        ...

    def unscale_(self) -> bool:
        self.sync_grads()
        return False

    @abc.abstractmethod
    def grad_pieces(self) -> list[GradPiece]:
        ...

    @abc.abstractmethod
    def build_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], params: Any = None, **kwargs: Any):
        """A ``torch.optim.Optimizer`` (``optimizer_cls`` over what this rank steps): ``params`` the
        model's parameters or parameter groups as torch takes them (None: one group of all)."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        ...

    @abc.abstractmethod
    def memory_stats(self) -> dict[str, int]:
        ...

    def full_params(self) -> dict[int, torch.Tensor]:
        """{id(param): its full value} for parameters whose module tensor is not the full value."""
        return {}

    @abc.abstractmethod
    def full_grads(self) -> dict[int, torch.Tensor]:
        ...

    def stepped_ranges(self) -> dict[int, tuple[torch.Tensor, int, int, int, bool]]:
        """{id(param): (owner, at, lo, hi, primary)} for each parameter the optimizer does not step
        in place (ZeRO): elements [lo, hi) of the flattened parameter are ``owner[at:at + hi - lo]``;
        ``primary``: this rank is the first of the ranks holding that same range (HSDP replicas)."""
        return {}

    def refresh_params(self) -> None:
        """After the tensors the optimizer steps were overwritten (a checkpoint load): make the
        module's parameters follow them."""

    def offloaded_state(self, write_back: bool = False) -> contextlib.AbstractContextManager:
        """A context in which the tensors the optimizer steps, and its state, are ordinary tensors
        (they may live in files between steps: `minipar.data_parallel.offload`); ``write_back`` keeps what the
        block wrote into them."""
        return contextlib.nullcontext()


def storage_bytes(tensors, seen: set[int]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped) not already in ``seen``."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
