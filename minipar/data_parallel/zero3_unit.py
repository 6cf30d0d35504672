"""A ZeRO-3 unit: its parameters' flat parts and the state `Zero3` moves it through.

    SHARDED --unshard()--> (GATHERING, async) --> FULL --reshard()--> SHARDED

A unit has one `Part` per kind of flat group: its parameters of each shard axis (dense over dp,
experts over edp), and, with ``Float8Config(all_gather=True)``, its FP8 layers' weights apart from
the rest, since they travel in FP8 (`minipar.fp8.gather`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.nn as nn

from ..fp8.gather import Fp8Gather
from .buckets import GradStaging
from .flat import ShardGroup


class UnitState(Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    FULL = "full"


@dataclass
class Part:
    """A unit's parameters of one flat group (one shard axis; FP8 weights or the rest)."""

    group: ShardGroup
    full: torch.Tensor                      # (padded,) compute dtype; storage empty while SHARDED
    grads: GradStaging                      # the part's gradient on its way to the shard
    index: int = -1                         # of its group in the strategy's groups
    fp8: Fp8Gather | None = None            # gathered in FP8 (all FP8 weights), else in the compute dtype


@dataclass
class Unit:
    """A wrapped module (or the root's leftover parameters), its parts, and where it stands in the state
    machine; the counters tell `Zero3` when its backward has delivered every gradient."""

    name: str
    module: nn.Module
    parts: list[Part]
    state: UnitState = UnitState.SHARDED
    works: list = field(default_factory=list)  # the all-gathers in flight while GATHERING
    backward_started: bool = False
    received: int = 0                       # gradients that arrived in this backward
    is_root: bool = False

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.group.layout.params]

    @property
    def n_params(self) -> int:
        return sum(len(part.group.layout.params) for part in self.parts)

    @property
    def full_bytes(self) -> int:
        """Bytes of gathered parameters this unit holds now (0 while SHARDED)."""
        return sum(part.full.untyped_storage().nbytes() for part in self.parts)


def following(order: list[Unit], u: Unit) -> Unit | None:
    """The unit after ``u`` in ``order`` (None if ``u`` is last or absent)."""
    for i, x in enumerate(order[:-1]):
        if x is u:
            return order[i + 1]
    return None
