"""Which tensor-parallel plan a model gets: the one the user passed, else the model's own.

A plan maps module-name patterns to styles ('colwise', 'rowwise', 'vocab', ...;
`minipar.tensor_parallel.parallelize`). minipar's models build theirs with
``model.tp_plan(tp, sequence_parallel=...)``, which also checks its sizes (heads,
vocabulary) against tp. A Hugging Face model carries its own as a dict
(``model.tp_plan``), translated to minipar's styles where they mean the same
(`minipar.tensor_parallel.hf_plan`). The front door calls `plan_for` on every rank
before any collective, so a model without a plan is refused with the fix.
"""

from __future__ import annotations

import torch.nn as nn

from .hf_plan import hf_plan, is_hf_plan
from .parallelize import TensorParallelConfig


def plan_for(module: nn.Module, tp: int, config: TensorParallelConfig) -> dict:
    """The plan to apply at ``tp`` > 1: ``config.plan`` when given, else ``module.tp_plan(...)``, else a
    Hugging Face model's own plan translated (`hf_plan`); ValueError naming what to pass when there is none."""
    if is_hf_plan(module) and config.sequence_parallel:
        # Its layers derive position ids and the attention mask from the sequence they hold, which
        # sequence parallelism splits: the rotary tables and masks would be 1/tp long (a shape error
        # after the first collectives, or worse).
        raise ValueError(f"sequence_parallel=True with a Hugging Face model ({type(module).__name__}): its layers "
                         "compute positions and masks from the sequence they hold, which sequence parallelism "
                         "splits; pass sequence_parallel=False (tensor parallelism itself takes the model)")
    if config.plan is not None:
        return config.plan
    if is_hf_plan(module):
        return hf_plan(module, tp)
    if callable(getattr(module, "tp_plan", None)):
        return module.tp_plan(tp, sequence_parallel=config.sequence_parallel)
    raise ValueError(f"the mesh has tp={tp} but {type(module).__name__} has no tp_plan(); pass "
                     "tp_plan={'module.pattern': 'colwise' | 'rowwise' | 'vocab', ...}")
