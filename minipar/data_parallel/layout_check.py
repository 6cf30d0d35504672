"""The data-parallel family's checks at the front door, on every rank before any collective: what
the mesh and the other families ask of the strategy the config names."""

from __future__ import annotations

import torch.nn as nn

from ..core.mesh import Mesh
from ..core.units import select_units
from ..recompute import check_units
from .strategy import DataParallelConfig


def check_data_parallel(module: nn.Module, mesh: Mesh, config: DataParallelConfig,
                        checkpointed: list[tuple[str, nn.Module]]) -> None:
    """ValueError, saying what to change, for HSDP under a strategy that shards nothing, a ZeRO-3
    wrap policy that matches nothing, or a ZeRO-3 unit inside a checkpointed module (its gather
    hooks would have to run inside the recompute)."""
    if mesh.hsdp and not config.sharded:
        raise ValueError(f"the mesh has dp_shard={mesh.dp_shard} (HSDP) but {config.strategy.upper()} shards nothing; use "
                         "strategy='zero1', 'zero2' or 'zero3', or build the mesh without dp_shard")
    if config.zero3:
        check_units(checkpointed, [name for name, _ in select_units(module, config.wrap_policy)])
