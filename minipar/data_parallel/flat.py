"""Flat shards: a group of parameters laid end to end, padded, and cut into equal shards.

Both ZeRO-1/2 (a group is a gradient bucket) and ZeRO-3 (a group is a wrapped
unit) keep model state this way. For a group of ``numel`` elements over
``n`` ranks::

    padded = ceil(numel / n) * n          shard_size S = padded / n
    full flat:  | p0 | p1 | p2 ...  | pad |      (padded elements)
    rank r owns [r*S, (r+1)*S); its *real* part is the first real_len of those,
    real_len = clamp(numel - r*S, 0, S)   (0: an empty shard, which works)

Padding is zero, is never given to the optimizer (its parameter is the real
part only), never enters a gradient norm, and never appears in a state dict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..core.comm import AxisGroup


@dataclass
class FlatLayout:
    """Where each parameter of a group sits in the flat buffer, and this rank's shard."""

    params: list[nn.Parameter]
    numel: int
    world: int
    rank: int

    @classmethod
    def of(cls, params: list[nn.Parameter], world: int, rank: int) -> "FlatLayout":
        return cls(params, sum(p.numel() for p in params), world, rank)

    @property
    def shard_size(self) -> int:
        return max(1, math.ceil(self.numel / self.world))

    @property
    def padded(self) -> int:
        return self.shard_size * self.world

    @property
    def lo(self) -> int:
        """First full-flat index of this rank's shard."""
        return self.rank * self.shard_size

    @property
    def real_len(self) -> int:
        return min(max(self.numel - self.lo, 0), self.shard_size)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view into a full flat buffer (padded length)."""
        out, off = [], 0
        for p in self.params:
            out.append(flat[off:off + p.numel()].view(p.shape))
            off += p.numel()
        return out

    def local_pieces(self) -> list[tuple[nn.Parameter, int, int]]:
        """(parameter, start, end) for each parameter overlapping this rank's shard; start/end index the shard."""
        out, off = [], 0
        lo, hi = self.lo, self.lo + self.real_len
        for p in self.params:
            a, b = max(off, lo), min(off + p.numel(), hi)
            if a < b:
                out.append((p, a - lo, b - lo))
            off += p.numel()
        return out

    def span(self, param: nn.Parameter) -> tuple[int, int]:
        """(start, end) of ``param`` in the full flat buffer."""
        off = 0
        for p in self.params:
            if p is param:
                return off, off + p.numel()
            off += p.numel()
        raise KeyError("parameter not in this layout")

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype, device) -> torch.Tensor:
        """A new padded full flat buffer holding ``tensors`` (one per parameter) end to end."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for view, t in zip(self.views(flat), tensors):
            view.copy_(t)
        return flat

    def signature(self) -> tuple:
        return (self.numel, self.world, tuple(tuple(p.shape) for p in self.params))


@dataclass
class ShardGroup:
    """One flat group as this rank holds it, and the axes it lives on.

    ``axis``: the ranks that hold the other shards (dp; edp for experts; dp_shard under HSDP).
    ``divisor``: the data-parallel size its gradient is averaged over (always the whole dp: an
    expert's local gradient already sums what its expert-parallel group sent it).
    ``replicas``: the ranks that hold this same shard (dp_replicate under HSDP; else None). Their
    gradient shards are all-reduced once per step; ``replicated`` says that happened since the
    shard last changed.
    """

    layout: FlatLayout
    shard: torch.Tensor               # (shard_size,), compute dtype
    master: nn.Parameter              # (real_len,), fp32, on the optimizer's device
    grad_shard: torch.Tensor | None   # (shard_size,), reduce dtype
    axis: AxisGroup
    divisor: int
    replicas: AxisGroup | None = None
    replicated: bool = False

    @property
    def real_grad(self) -> torch.Tensor:
        return self.grad_shard[: self.layout.real_len]

    def unreplicate(self) -> None:
        """Before new gradients add into a shard already all-reduced over the replicas: divide it by
        their count, so that the next all-reduce restores it once and adds only what is new."""
        if self.replicated:
            self.grad_shard.div_(self.replicas.size)
            self.replicated = False
