"""`apply_fp8`: turn a model's linear layers into FP8 ones, in place.

Which layers: every ``nn.Linear`` and tensor-parallel Column/RowParallelLinear,
except the LM head (named ``lm_head``, or any Linear whose weight is an
embedding's: a tied head), an MoE router (``MoELayer.gate``) and the names in
``skip``. The head and the router stay in high precision, as every FP8 recipe
keeps them: the logits' and the routing's small differences are what the loss
and the expert choice are most sensitive to.

Each chosen layer changes class in place (``nn.Linear`` -> `Float8Linear`,
``ColumnParallelLinear`` -> `Float8ColumnParallelLinear`, ...): its parameters,
their names, the hooks on it and whatever a data-parallel strategy holds stay as
they are, so the call may come before or after a strategy is built. Under
tensor parallelism it must come after ``parallelize`` (the plan refuses Linear
subclasses with their own forward). The FP8 tensor-parallel layers run their
parent's forward with its ``F.linear`` routed to `fp8_linear` (`LinearInFp8`),
their amaxes agreed over the tp group (`AmaxSync`).

Every layer is checked before any is changed: a weight (a tp shard of it) whose
dimensions are not multiples of the recipe's tile (16, or 128 for blockwise)
is a ValueError naming the layer and the fix.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from ..moe.layer import MoELayer
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from .config import Float8Config
from .linear import AmaxSync, Float8Linear, LinearInFp8, check_gathered


class Float8ColumnParallelLinear(ColumnParallelLinear):
    """`ColumnParallelLinear` with its matmul in FP8; W's rows (dY's features) are split over tp."""

    fp8_config: Float8Config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_gathered(self)
        with LinearInFp8(self.weight, self.fp8_config, AmaxSync(self.comm, self.group, "out")):
            return super().forward(x)


class Float8RowParallelLinear(RowParallelLinear):
    """`RowParallelLinear` with its matmul in FP8; W's columns (X's features) are split over tp."""

    fp8_config: Float8Config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_gathered(self)
        with LinearInFp8(self.weight, self.fp8_config, AmaxSync(self.comm, self.group, "in")):
            return super().forward(x)


# the class each convertible layer becomes (exact types: a subclass may have its own forward)
FP8_CLASS = {nn.Linear: Float8Linear, ColumnParallelLinear: Float8ColumnParallelLinear,
             RowParallelLinear: Float8RowParallelLinear}


def apply_fp8(module: nn.Module, config: Float8Config, skip: Iterable[str] = ()) -> list[str]:
    """Convert ``module``'s linear layers to FP8 in place (see the module docstring); returns their names.

    ``skip``: names (full, or the last component, e.g. "proj") of layers to keep in high precision.
    Layers already in FP8 are left as they are, so a second call changes nothing.
    """
    chosen = check_fp8(module, config, skip)
    for _, m in chosen:
        m.__class__ = FP8_CLASS[type(m)]
        m.fp8_config = config
    return [name for name, _ in chosen]


def check_fp8(module: nn.Module, config: Float8Config, skip: Iterable[str] = (),
              zero3: bool | None = None) -> list[tuple[str, nn.Module]]:
    """The layers `apply_fp8` would convert, as (name, module), after checking each one's weight dims; raises
    the ValueError apply_fp8 would, changing nothing. On a model not yet split by tensor parallelism this
    checks the whole weights (a necessary condition: the shards are checked when apply_fp8 runs after
    ``parallelize``), so a front door can call it on every rank before its first collective. ``zero3``:
    whether the data-parallel strategy is ZeRO-3 (False refuses ``all_gather=True``; None: not known)."""
    if not isinstance(config, Float8Config):
        raise ValueError(f"apply_fp8 takes a Float8Config, got {type(config).__name__}")
    if config.all_gather and zero3 is False:
        raise ValueError("Float8Config(all_gather=True) gathers parameters in FP8, which only ZeRO-3 gathers: use "
                         "strategy='zero3' (HSDP too: a mesh with dp_shard), or Float8Config(all_gather=False)")
    skip = set(skip)
    chosen = [(name, m) for name, m in module.named_modules() if _chosen(module, name, m, skip)]
    for name, m in chosen:
        _check_dims(name, m, config)
    return chosen


def _chosen(root: nn.Module, name: str, m: nn.Module, skip: set[str]) -> bool:
    if type(m) not in FP8_CLASS:
        if isinstance(m, nn.Linear) and type(m) not in FP8_CLASS.values() and not _skipped(root, name, m, skip):
            raise ValueError(f"apply_fp8: {name} is a {type(m).__name__}, an nn.Linear subclass whose forward FP8 "
                             f"cannot take over; keep it in high precision with apply_fp8(..., skip=[{name!r}])")
        return False
    return not _skipped(root, name, m, skip)


def _skipped(root: nn.Module, name: str, m: nn.Module, skip: set[str]) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    if name in skip or leaf in skip or leaf == "lm_head":
        return True
    if any(m.weight is e.weight for e in root.modules() if isinstance(e, nn.Embedding)):
        return True  # a tied LM head
    parent = root.get_submodule(name.rsplit(".", 1)[0]) if "." in name else root
    return isinstance(parent, MoELayer) and leaf == "gate"  # the router


def _check_dims(name: str, m: nn.Module, config: Float8Config) -> None:
    n, k = m.weight.shape
    tile = config.tile
    if n % tile or k % tile:
        where = " (this rank's tensor-parallel shard)" if type(m) is not nn.Linear else ""
        raise ValueError(f"apply_fp8 ({config.scaling}): {name} has a weight of shape ({n}, {k}){where}; FP8 "
                         f"{'tiles it in blocks of 128' if tile == 128 else 'needs _scaled_mm dims'} that are "
                         f"multiples of {tile}: choose sizes that are multiples of {tile}, or keep the layer in "
                         f"high precision with apply_fp8(..., skip=[{name!r}])")
