"""Which tensor-parallel plan a model gets: the one the user passed, else the model's own.

A plan maps module-name patterns to styles ('colwise', 'rowwise', 'vocab', ...;
`minipar.tensor_parallel.parallelize`). minipar's models build theirs with
``model.tp_plan(tp, sequence_parallel=...)``, which also checks its sizes (heads,
vocabulary) against tp. The front door calls `plan_for` on every rank before any
collective, so a model without a plan is refused with the fix.
"""

from __future__ import annotations

import torch.nn as nn

from .parallelize import TensorParallelConfig


def plan_for(module: nn.Module, tp: int, config: TensorParallelConfig) -> dict:
    """The plan to apply at ``tp`` > 1: ``config.plan`` when given, else ``module.tp_plan(...)``;
    ValueError naming what to pass when there is neither."""
    if config.plan is not None:
        return config.plan
    if callable(getattr(module, "tp_plan", None)):
        return module.tp_plan(tp, sequence_parallel=config.sequence_parallel)
    raise ValueError(f"the mesh has tp={tp} but {type(module).__name__} has no tp_plan(); pass "
                     "tp_plan={'module.pattern': 'colwise' | 'rowwise' | 'vocab', ...}")
