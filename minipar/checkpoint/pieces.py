"""A rank's parameters and optimizer state as layout-free pieces, and back.

A piece is what one rank holds of one parameter, under the parameter's
single-process name: ``chunks`` (the tensor-/expert-parallel cut from the full
tensor to the rank's local one), ``[lo, hi)`` (the elements of that local
tensor this rank's optimizer steps: all under DDP, its shard under ZeRO), the
values and the per-element optimizer state of that range. `slots_of` says
where each piece lives in a model under any layout; `assemble_full` rebuilds a
full tensor from pieces saved under another; `cut_local` cuts this rank's part
out of it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..full_state import global_names, local_cut
from ..core.placement import placement_of
from .files import CheckpointError

@dataclass
class Slot:
    """One parameter as this rank holds it, and where its optimizer steps it."""

    name: str               # the single-process name
    param: nn.Parameter     # this rank's (tensor-/expert-parallel local) parameter
    full_shape: tuple
    chunks: list            # [(dim, index, count), ...] from the full tensor to ``param``
    lo: int                 # [lo, hi): the elements of ``param`` (flattened) the optimizer steps here
    hi: int
    owner: torch.Tensor     # the tensor the optimizer steps: ``param`` (DDP) or a ZeRO master shard
    at: int                 # where element ``lo`` sits in ``owner`` (flattened)
    writes: bool            # this rank is the one that saves these elements


def slots_of(model) -> list[Slot]:
    mesh, strategy = model.mesh, model.strategy
    names, _ = global_names(model)
    shard_of = strategy.stepped_ranges()  # id(param) -> (master, at, lo, hi, primary) under ZeRO
    out = []
    for p in model.module.parameters():
        cuts, full = local_cut(p, mesh)
        chunks, where = [(dim, index, count) for _, dim, index, count in cuts], placement_of(p)
        if id(p) in shard_of:  # ZeRO: each shard group's rank steps (and writes) its own range
            owner, at, lo, hi, first_replica = shard_of[id(p)]
        else:
            owner, at, lo, hi = p, 0, 0, p.numel()
            first_replica = (mesh.edp_rank if where.expert else mesh.dp_rank) == 0 and mesh.cp_rank == 0
        replicated_over_tp = not where.tensor_parallel and mesh.tp_rank != 0
        # a replica (a last stage's tied LM head) is saved once, by its original (the embedding)
        writes = first_replica and not replicated_over_tp and where.replica_of is None and hi > lo
        out.append(Slot(names[id(p)], p, tuple(full), chunks, lo, hi, owner, at, writes))
    return out


def optimizer_of(optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # a ShardedOptimizer wraps a torch optimizer


def split_state(state: dict, owner: torch.Tensor) -> tuple[dict, dict]:
    """(per-element state tensors, scalar state) of one optimizer entry: a tensor shaped like the
    stepped tensor is per element (exp_avg...), anything else (step, counters) is scalar."""
    per_elem = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0 and v.shape == owner.shape}
    return per_elem, {k: v for k, v in state.items() if k not in per_elem}


def layout_of(model) -> dict:
    m = model.mesh
    return {"world": m.world_size, "dp": m.dp, "tp": m.tp, "pp": m.pp, "ep": m.ep, "dp_shard": m.dp_shard, "cp": m.cp,
            "strategy": model.strategy_name}


def assemble_full(name: str, shape: list, pieces: list[dict], get) -> torch.Tensor:
    """The full tensor ``name`` from its pieces; ``get(piece)`` picks the values (parameter or a state)."""
    full = torch.empty(shape, dtype=get(pieces[0]).dtype)
    count = torch.zeros(shape, dtype=torch.int32)
    by_cut: dict[tuple, list[dict]] = defaultdict(list)
    for pc in pieces:
        by_cut[tuple(tuple(c) for c in pc["chunks"])].append(pc)
    for cut, same_cut in by_cut.items():
        view, seen = full, count
        for d, i, n in cut:
            if not (0 <= d < view.dim() and 0 <= i < n and view.shape[d] % n == 0):
                raise CheckpointError(f"{name}: piece cut {cut} does not fit the shape {tuple(shape)}")
            view, seen = view.chunk(n, d)[i], seen.chunk(n, d)[i]
        local, local_seen = view.clone().reshape(-1), torch.zeros(view.numel(), dtype=torch.int32)
        for pc in same_cut:
            values = get(pc)
            if not (0 <= pc["lo"] <= pc["hi"] <= local.numel()) or values.numel() != pc["hi"] - pc["lo"]:
                raise CheckpointError(f"{name}: a piece's range [{pc['lo']}, {pc['hi']}) does not fit its values")
            local[pc["lo"]:pc["hi"]] = values
            local_seen[pc["lo"]:pc["hi"]] += 1
        view.copy_(local.view(view.shape))
        seen += local_seen.view(seen.shape)
    if not bool((count == 1).all()):
        raise CheckpointError(f"{name}: the checkpoint's pieces cover {int((count > 0).sum())} of {full.numel()} "
                              f"elements ({int((count > 1).sum())} more than once): it is incomplete or inconsistent")
    return full


def cut_local(full: torch.Tensor, slot: Slot) -> torch.Tensor:
    """This rank's elements [lo, hi) of its local part of ``full``."""
    for d, i, n in slot.chunks:
        full = full.chunk(n, d)[i]
    return full.reshape(-1)[slot.lo:slot.hi]


def same_value(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def agreed(values: list, what: str) -> Any:
    """The single value all of ``values`` agree on."""
    if any(not same_value(v, values[0]) for v in values[1:]):
        raise CheckpointError(f"{what} differs between parameters this layout keeps in one tensor "
                              f"({values[0]!r} vs another); this checkpoint cannot be resharded into it")
    return values[0]


def missing_or_different(manifest: dict, params: dict, buffers: dict) -> str | None:
    problems = []
    for kind, mine, theirs in (("parameter", params, manifest["params"]), ("buffer", buffers, manifest["buffers"])):
        missing = sorted(set(mine) - set(theirs))
        extra = sorted(set(theirs) - set(mine))
        shapes = [f"{k} {tuple(theirs[k])} (model {tuple(mine[k])})" for k in sorted(set(mine) & set(theirs))
                  if list(theirs[k]) != list(mine[k])]
        for what, names in (("missing", missing), ("unexpected", extra), ("of another shape", shapes)):
            if names:
                problems.append(f"{len(names)} {kind}s {what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}")
    if problems:
        return "the checkpoint holds another model: " + "; ".join(problems)
    return None
