"""``parallelize(module, mesh, plan)``: make a model built for one process tensor-parallel, in place.

A plan maps module-name patterns (``fnmatch``: ``"layers.*.attn.q_proj"``) to a
style. Each matched ``nn.Linear`` / ``nn.Embedding`` is replaced by its parallel
counterpart holding this rank's shard of the original weights, so the
parallel model computes what the original did:

    "colwise"         ColumnParallelLinear, output stays split (feeds a rowwise layer or a vocab-parallel loss)
    "colwise_gather"  ColumnParallelLinear, output all-gathered (a replicated result)
    "colwise_in_region"  ColumnParallelLinear whose input already entered the region (see "enter_region")
    "enter_region"    keep this module; its first input enters the tp region once (identity forward,
                      all-reduce backward; all-gather / reduce-scatter under sequence parallelism), so the
                      colwise_in_region layers inside it (q, k, v) share one collective instead of three
    "rowwise"         RowParallelLinear, input already split, output summed
    "rowwise_scatter" RowParallelLinear whose input is replicated: each rank takes its slice of the
                      input features (no sequence parallelism: there the input is a sequence shard)
    "partial_grad"    keep this module whole on every rank, but sum its parameters' gradients over tp:
                      it sees only this rank's part (a per-head norm after a colwise projection)
    "vocab"           VocabParallelEmbedding
    SequenceShard(d)  keep this module, but (under sequence parallelism) split its output along dim d
                      over tp, e.g. a position embedding added to sequence-split activations

Column-parallel siblings that enter the region themselves ('colwise' q, k, v under one attention,
as in a Hugging Face model's own plan) share the entry of an input they all read, so its gradient
is all-reduced once, as under "enter_region".
Weights tied in the original model (an LM head sharing the embedding) stay
tied when both sides are sharded the same way (vocab rows = column rows).
Dropout masks follow `TPRandom` (see ``minipar.tensor_parallel.rng``).
With ``sequence_parallel=True`` the linear and embedding layers switch to their
sequence-parallel forms, and every parameter of a normalisation layer
(LayerNorm, RMSNorm) is marked so its gradient is summed over tp. ``async_comm=True``
(sequence parallelism only) makes the linear layers overlap their sequence all-gather /
reduce-scatter with the matmul (`minipar.tensor_parallel.collective_matmul`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..core.mesh import Mesh
from ..core.regions import scatter_to_region
from .rng import TPRandom
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, check_async_comm, \
    enter_region, mark_sequence_parallel

STYLES = ("colwise", "colwise_gather", "colwise_in_region", "rowwise", "rowwise_scatter", "vocab", "enter_region",
          "partial_grad")
_KEPT = ("enter_region", "partial_grad")  # styles that keep their module and add hooks
_NORMS = (nn.LayerNorm,) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


@dataclass(frozen=True)
class SequenceShard:
    dim: int


def _split_output_hook(mesh: Mesh, dim: int):
    def hook(module: nn.Module, args, output):
        # Backward all-gathers the gradient, so the module's (replicated) parameters get full gradients.
        return scatter_to_region(output, mesh.comm, mesh.group("tp"), dim=dim, tag="tp")
    return hook


def _enter_region_hook(mesh: Mesh, sequence_parallel: bool):
    """Pre-hook: the module's main input (first positional, else first floating-point keyword) enters the region."""
    def hook(module, args, kwargs):
        module._minipar_in_region = True  # checked by the colwise_in_region layers inside
        if args:
            return (enter_region(args[0], mesh.comm, mesh.group("tp"), sequence_parallel),) + tuple(args[1:]), kwargs
        key = next((k for k, v in kwargs.items() if torch.is_tensor(v) and v.is_floating_point()), None)
        if key is None:
            raise ValueError(f"enter_region on {type(module).__name__}: its call passed no tensor to enter the region")
        kwargs = dict(kwargs)
        kwargs[key] = enter_region(kwargs[key], mesh.comm, mesh.group("tp"), sequence_parallel)
        return args, kwargs
    return hook


@dataclass(frozen=True)
class TensorParallelConfig:
    """How `ShardedModule` splits the model over tp > 1: ``plan`` (module-name patterns -> styles;
    default: the model's ``tp_plan(tp, sequence_parallel)``), sequence parallelism, the seed
    of the dropout streams (`TPRandom`), and ``async_comm``: under sequence parallelism, overlap the
    linear layers' all-gather / reduce-scatter with their matmul (collective matmul)."""

    plan: dict | None = None
    sequence_parallel: bool = False
    dropout_seed: int = 0
    async_comm: bool = False

    def __post_init__(self) -> None:
        if self.plan is not None and not isinstance(self.plan, dict):
            raise ValueError(f"tp_plan must be a dict {{'module.pattern': style}}, got {type(self.plan).__name__}")
        if not isinstance(self.dropout_seed, int) or isinstance(self.dropout_seed, bool):
            raise ValueError(f"dropout_seed={self.dropout_seed!r} must be an integer")
        if not isinstance(self.async_comm, bool):
            raise ValueError(f"async_comm={self.async_comm!r} must be True or False")
        check_async_comm(self.async_comm, self.sequence_parallel, "TensorParallelConfig")


def parallelize(module: nn.Module, mesh: Mesh, plan: dict[str, object], sequence_parallel: bool = False,
                dropout_seed: int = 0, async_comm: bool = False) -> nn.Module:
    """Swap the planned layers of ``module`` for tensor-parallel ones (in place); returns ``module``.

    Dropout gets its randomness from a `TPRandom` seeded with ``dropout_seed``:
    every "enter_region" module (attention, MLP: sharded activations inside)
    runs in the per-rank "sharded" stream; every ``nn.Dropout`` outside them
    in the "replicated" stream (the same mask on each tp rank), or the
    "sharded" one under sequence parallelism (each rank holds other positions).

    Raises ValueError, before any communication, for an unknown style, a
    pattern that matches no module, a style that does not fit the module it
    matched, sizes the tp size does not divide, or attention heads it does not
    (a projection inside a module with an integer ``head_dim``).
    """
    check_async_comm(async_comm, sequence_parallel, "parallelize")
    targets, region_of = check_plan(module, plan, mesh.tp)
    regions = [n for n, style in targets if style == "enter_region"]
    # Build every replacement first, so that nothing is changed if one fails.
    shared: dict[int, nn.Parameter] = {}  # id(original weight) -> its shard, so tied weights stay tied
    swaps = []
    for name, style in targets:
        if style in _KEPT or isinstance(style, SequenceShard):
            continue  # hooks, added below
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        old = getattr(parent, child)
        new = _convert(old, style, mesh, sequence_parallel, name, async_comm)
        if name in region_of:
            new.region = [module.get_submodule(region_of[name])]  # a list: not registered as a submodule
        if id(old.weight) in shared:
            new.weight = shared[id(old.weight)]
        else:
            shared[id(old.weight)] = new.weight
        swaps.append((parent, child, new))
    for parent, child, new in swaps:
        setattr(parent, child, new)
    _share_entries(swaps)
    for name, style in targets:
        if style == "enter_region":
            m = module.get_submodule(name)
            m.register_forward_pre_hook(_enter_region_hook(mesh, sequence_parallel), with_kwargs=True)
            m.register_forward_hook(lambda mod, args, output: setattr(mod, "_minipar_in_region", False))
        elif style == "partial_grad":
            for p in module.get_submodule(name).parameters():
                mark_sequence_parallel(p, mesh)  # replicated over tp, its gradient summed over tp
        elif isinstance(style, SequenceShard) and sequence_parallel:
            # a hook, not a wrapper: parameter names stay as they were
            module.get_submodule(name).register_forward_hook(_split_output_hook(mesh, style.dim))

    rng = TPRandom(mesh, dropout_seed)
    module.tp_random = rng  # kept for inspection; plain attribute, not state
    region_modules = [module.get_submodule(n) for n in regions]
    inside = {id(sub) for r in region_modules for sub in r.modules()}
    for r in region_modules:
        rng.attach(r, "sharded")
    for m in module.modules():
        if isinstance(m, nn.Dropout) and id(m) not in inside:
            rng.attach(m, "sharded" if sequence_parallel else "replicated")

    if sequence_parallel:
        for m in module.modules():
            if isinstance(m, _NORMS):
                for p in m.parameters():
                    mark_sequence_parallel(p, mesh)
    return module


def _share_entries(swaps: list) -> None:
    """Column-parallel siblings that enter the region themselves ('colwise', 'colwise_gather': a
    Hugging Face plan's q, k, v) share their entries within each call of their parent: an input they
    all read enters once, so backward all-reduces its gradient once, not once per layer."""
    by_parent: dict[int, tuple[nn.Module, list]] = {}
    for parent, _, new in swaps:
        if isinstance(new, ColumnParallelLinear) and not new.input_in_region:
            by_parent.setdefault(id(parent), (parent, []))[1].append(new)
    for parent, layers in by_parent.values():
        if len(layers) < 2:
            continue
        cache: dict = {}
        for layer in layers:
            layer.shared_entry = cache
        # cleared before and after each call: nothing is kept between forwards (a recomputed forward
        # in backward enters afresh)
        parent.register_forward_pre_hook(lambda module, args, cache=cache: cache.clear())
        parent.register_forward_hook(lambda module, args, output, cache=cache: cache.clear())


def check_plan(module: nn.Module, plan: dict[str, object], tp: int) -> tuple[list, dict[str, str]]:
    """Validate ``plan`` against ``module`` without changing it: ([(module name, style)], {name of a
    'colwise_in_region' module: its region's name}). ValueError, saying what to change, for an
    unknown style, a pattern that matches nothing, a style that does not fit its module, a size or
    a head count tp does not divide, or a tied weight planned on one side only (or two ways)."""
    names = [n for n, _ in module.named_modules() if n]
    targets: list[tuple[str, object]] = []
    for pattern, style in plan.items():
        if style not in STYLES and not isinstance(style, SequenceShard):
            raise ValueError(f"plan[{pattern!r}] = {style!r}: unknown style; use one of {STYLES} or SequenceShard(dim)")
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise ValueError(f"plan entry {pattern!r} matches no module of {type(module).__name__}")
        targets += [(n, style) for n in matched]
    regions = [n for n, style in targets if style == "enter_region"]
    region_of: dict[str, str] = {}
    for name, style in targets:
        if style == "colwise_in_region":
            owner = max((r for r in regions if name.startswith(r + ".")), key=len, default=None)
            if owner is None:
                raise ValueError(f"plan: {name!r} is 'colwise_in_region' but no module above it is 'enter_region'; "
                                 "mark its parent 'enter_region' or use 'colwise'")
            region_of[name] = owner
    _check_heads(module, targets, tp)
    split: dict[int, tuple[int, str]] = {}  # id(weight) -> (the dim the plan splits it along, who)
    for name, style in targets:
        if style == "partial_grad" and not any(True for _ in module.get_submodule(name).parameters()):
            raise ValueError(f"plan: {name!r} is 'partial_grad' but has no parameters whose gradient to sum")
        if style in _KEPT or isinstance(style, SequenceShard):
            continue
        old = module.get_submodule(name)
        _check_replaceable(name, old, style)
        dim = 1 if style in ("rowwise", "rowwise_scatter") else 0
        if old.weight.shape[dim] % tp:
            raise ValueError(f"{name}: size {old.weight.shape[dim]} along dim {dim} is not divisible by tp={tp}; "
                             "use a tp that divides it, or leave this module out of the plan")
        other_dim, other = split.setdefault(id(old.weight), (dim, name))
        if other_dim != dim:
            raise ValueError(f"{name!r} and {other!r} share a weight but the plan shards it along "
                             f"different dims ({dim} and {other_dim}); give them compatible styles")
    planned = {n for n, _ in targets}
    for n, m in module.named_modules():
        for p in m._parameters.values():
            if p is not None and id(p) in split and n not in planned:
                raise ValueError(f"{n!r} shares a weight with {split[id(p)][1]!r}, which the plan shards, but "
                                 f"{n!r} is not in the plan: give it a compatible style too (or untie them)")
    return targets, region_of


def _check_replaceable(name: str, old: nn.Module, style: str) -> None:
    """``old`` must be a plain nn.Linear (nn.Embedding for 'vocab'): minipar's parallel layer replaces it,
    so a subclass's own forward (a scaled embedding) would be dropped, and the model would train silently
    differently; transformers' Conv1D (GPT-2) is a Linear stored transposed whose c_attn fuses q, k, v."""
    want = nn.Embedding if style == "vocab" else nn.Linear
    kind = type(old).__name__
    if kind == "Conv1D" and not isinstance(old, want):
        raise ValueError(f"plan: {name!r} is transformers' Conv1D (GPT-2's projections: an nn.Linear stored "
                         "transposed, weight (in, out)), which minipar's tensor-parallel layers do not take; GPT-2's "
                         "c_attn also fuses q, k and v in one matrix, which a contiguous column split would cut "
                         "across q/k/v. Train it with tp=1 (data, ZeRO and pipeline parallelism take it), or use a "
                         "model with separate nn.Linear projections (Llama, Mistral, Qwen; minipar.models.GPT)")
    if not isinstance(old, want):
        raise ValueError(f"plan style {style!r} needs an nn.{want.__name__}, but {name!r} is {kind}")
    if type(old).forward is not want.forward:
        raise ValueError(f"plan: {name!r} is {kind}, an nn.{want.__name__} with its own forward, which the "
                         f"tensor-parallel layer replacing it would drop (the model would compute something "
                         f"else); leave {name!r} out of the plan (and what shares its weight)")


def _check_heads(module: nn.Module, targets: list[tuple[str, object]], tp: int) -> None:
    """Attention heads must split whole over tp. A column-split projection whose parent module has an
    integer ``head_dim`` (the attention module, as in Hugging Face's and minipar's models) whose
    output is a whole number of heads must have a number of heads tp divides: otherwise each rank
    would hold a fraction of a head, and the model would fail later in a reshape, or compute wrongly."""
    for name, style in targets:
        if style not in ("colwise", "colwise_in_region", "colwise_gather"):
            continue
        parent_name = name.rpartition(".")[0]
        parent = module.get_submodule(parent_name) if parent_name else module  # the attention module, if any
        head_dim = parent.head_dim if isinstance(getattr(parent, "head_dim", None), int) else None
        out = getattr(module.get_submodule(name), "out_features", None)
        if head_dim and out is not None and out % head_dim == 0 and (out // head_dim) % tp:
            raise ValueError(f"plan: {name!r} projects onto {out // head_dim} heads of {head_dim} (head_dim of its "
                             f"attention module), which tp={tp} does not split into whole heads; use a tp that "
                             "divides the number of heads (key/value heads too)")


def _convert(old: nn.Module, style: str, mesh: Mesh, sequence_parallel: bool, name: str,
             async_comm: bool) -> nn.Module:
    if style == "vocab":
        return VocabParallelEmbedding(old, mesh, sequence_parallel=sequence_parallel)
    if style in ("rowwise", "rowwise_scatter"):
        if style == "rowwise_scatter" and sequence_parallel:
            raise ValueError(f"plan: {name!r} is 'rowwise_scatter', whose input is replicated, but under sequence "
                             "parallelism it is a sequence shard; use 'rowwise' after a 'colwise' layer, or "
                             "sequence_parallel=False")
        return RowParallelLinear(old, mesh, input_is_parallel=style == "rowwise", sequence_parallel=sequence_parallel,
                                 async_comm=async_comm)
    return ColumnParallelLinear(old, mesh, gather_output=style == "colwise_gather",
                                sequence_parallel=sequence_parallel, input_in_region=style == "colwise_in_region",
                                async_comm=async_comm)
