"""One gradient norm for every layout: the norm of the whole single-process model's gradient.

Each rank holds pieces of the gradient. A piece's contribution (the sum of
|g|^p over its elements, or its max for the inf-norm) must be added over
exactly the ranks that hold *other* elements of the same tensor, and over
none that hold copies:

    held as                               summed over
    a data-parallel shard (ZeRO)          its shard axis (dp; dp_shard under HSDP; edp for experts)
    a tensor-parallel shard               tp  (a tp-replicated parameter: counted once)
    one of this rank's experts            ep
    a pipeline stage's parameters         pp  (the last stage's copy of a tied weight left out)

So every piece falls into one of a fixed set of slots (shard axis x tp-split
x expert), each slot is summed over its axes, and the slots' total over pp.
The slot layout is the same on every rank whatever it holds, so every rank
issues the same collectives.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from .mesh import Mesh
from .placement import placement_of

# A dense shard's axis is dp, or dp_shard under HSDP: one slot, reduced over the dp_shard group (the
# dp group itself without HSDP), so no layout pays a collective for a slot it cannot fill.
_SHARD_AXES = (None, "dp_shard", "edp")
_SLOTS = list(itertools.product(_SHARD_AXES, (False, True), (False, True)))  # (shard axis, tp, expert)


@dataclass
class GradPiece:
    """A piece of one parameter's gradient that this rank holds.

    grad: the whole (local) gradient, or this rank's slice of it when ``shard_axis`` names the
    data-parallel axis whose ranks hold the other slices (ZeRO). Scaling ``grad`` scales the
    gradient the optimizer will use."""

    param: nn.Parameter
    grad: torch.Tensor
    shard_axis: str | None = None


@torch.no_grad()
def global_grad_norm(pieces: list[GradPiece], mesh: Mesh, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the whole model's gradient, equal on every rank. A replica's pieces
    (`Placement.replica_of`: the last pipeline stage's copy of a tied weight) are not counted: the
    original's are."""
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    by_slot: dict[int, list[torch.Tensor]] = {}
    for piece in pieces:
        where = placement_of(piece.param)
        if where.replica_of is not None or piece.grad.numel() == 0:
            continue
        axis = "dp_shard" if piece.shard_axis in ("dp", "dp_cp") else piece.shard_axis  # the dense slot
        by_slot.setdefault(_SLOTS.index((axis, where.tensor_parallel, where.expert)), []).append(piece.grad)
    parts = torch.zeros(len(_SLOTS), dtype=torch.float32, device=mesh.device)
    for i, grads in by_slot.items():
        norms = torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float32))
        parts[i] = norms.max() if inf else norms.pow(norm_type).sum()
    op = "max" if inf else "sum"
    for axis, split in (("dp_shard", lambda s: s[0] == "dp_shard"), ("edp", lambda s: s[0] == "edp"),
                        ("tp", lambda s: s[1]), ("ep", lambda s: s[2])):
        axis = mesh.shard_axis if axis == "dp_shard" else axis
        if mesh.size(axis) == 1:
            continue
        idx = torch.tensor([i for i, s in enumerate(_SLOTS) if split(s)], device=parts.device)
        sub = parts[idx]
        mesh.comm.all_reduce(sub, mesh.group(axis), op=op, tag="grad_norm")
        parts[idx] = sub
    total = (parts.max() if inf else parts.sum()).reshape(1)
    mesh.comm.all_reduce(total, mesh.group("pp"), op=op, tag="grad_norm")
    return total[0] if inf else total[0].pow(1.0 / norm_type)


@torch.no_grad()
def clip_(pieces: list[GradPiece], mesh: Mesh, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every piece by min(1, max_norm / (norm + 1e-6)), as ``torch.nn.utils.clip_grad_norm_``;
    returns the norm. A nan norm writes nan into the pieces only (never a shard's padding)."""
    total = global_grad_norm(pieces, mesh, norm_type)
    scale_by_norm_([piece.grad for piece in pieces], total, max_norm)
    return total


@torch.no_grad()
def scale_by_norm_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place by min(1, max_norm / (norm + 1e-6)), ``torch.nn.utils.clip_grad_norm_``'s
    rule. ``norm``: a 0-d tensor on the grads' device; the factor stays there (no host sync), so a nan
    norm writes nan into the grads, as torch's does. Empty grads (a shard's empty piece) are skipped."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        if grad.numel():
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for dtype, same in by_dtype.items():
        torch._foreach_mul_(same, coef.to(dtype))
