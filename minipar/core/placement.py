"""Where a parameter lives across the mesh: one small record per parameter.

Every strategy needs the same few facts about a parameter: is it split over
tensor-parallel ranks (and along which dim), is it one of this rank's experts
(split over the expert-parallel ranks along dim 0), does it see only a slice
of the sequence (replicated over tp, but its gradient is a partial sum). The
layers that split a parameter say so once, with `place`; everything that
reads it (gradient norms, DDP/ZeRO groups, checkpoints, ``full_state_dict``)
asks `placement_of`. A copy of a parameter held elsewhere (a tied weight's second
copy) says whose replica it is, once, and nothing else works that out again. A parameter nobody placed is replicated everywhere.

A parameter's data-parallel placement is not recorded here: it belongs to the
data-parallel strategy, which says, per gradient piece it hands out, whether
the piece is a shard (`minipar.data_parallel.strategy.GradPiece`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.nn as nn


@dataclass(frozen=True)
class Placement:
    tp_dim: int | None = None        # split over tp along this dim (a tensor-parallel shard)
    expert: bool = False             # an expert's parameter: split over ep along dim 0
    sequence_parallel: bool = False  # replicated over tp, sees a sequence shard: gradient summed over tp
    # A copy of a parameter another rank holds and counts: the last pipeline stage's tied LM head is
    # a replica of the first stage's embedding (`minipar.pipeline.cut`). Its gradient is summed with
    # the original's, so norms count it once and checkpoints save it once: the original's.
    replica_of: str | None = None

    @property
    def tensor_parallel(self) -> bool:
        return self.tp_dim is not None


REPLICATED = Placement()


def placement_of(p: nn.Parameter) -> Placement:
    return getattr(p, "placement", REPLICATED)


def place(p: nn.Parameter, **changes) -> nn.Parameter:
    """Record ``changes`` (fields of `Placement`) on ``p``; returns ``p``."""
    p.placement = replace(placement_of(p), **changes)
    return p
