"""The front door's options: config objects and flat keywords resolved into the three configs, and
the data-parallel strategy a config names, built over the (tensor- and expert-parallel local) model.

`minipar.sharded.ShardedModule` takes either ``strategy=DataParallelConfig(...)``,
``tensor_parallel=TensorParallelConfig(...)``, ``pipeline=PipelineConfig(...)`` or their fields as flat
keywords (``bucket_cap_mb=``, ``tp_plan=``, ``microbatches=``...); each config validates itself when
built, so a bad option is a ValueError before anything is wrapped.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from .data_parallel import ddp, zero12, zero3  # noqa: F401 -- the built-in strategies register themselves
from .core.mesh import Mesh
from .pipeline.step import PipelineConfig
from .data_parallel.strategy import DataParallelConfig, Strategy, strategy_entry
from .tensor_parallel import TensorParallelConfig

# The flat keyword arguments ShardedModule also takes, and the config each belongs to (and its field).
_FLAT_OPTIONS = {
    "bucket_cap_mb": ("strategy", "bucket_cap_mb"), "mixed_precision": ("strategy", "mixed_precision"),
    "cpu_offload": ("strategy", "cpu_offload"), "offload": ("strategy", "offload"),
    "wrap_policy": ("strategy", "wrap_policy"),
    "reshard_after_forward": ("strategy", "reshard_after_forward"),
    "unit_check": ("strategy", "unit_check"),
    "tp_plan": ("tensor_parallel", "plan"), "sequence_parallel": ("tensor_parallel", "sequence_parallel"),
    "dropout_seed": ("tensor_parallel", "dropout_seed"), "async_comm": ("tensor_parallel", "async_comm"),
    "schedule": ("pipeline", "schedule"), "microbatches": ("pipeline", "microbatches"),
    "pipeline_boundaries": ("pipeline", "boundaries"), "record_timeline": ("pipeline", "record_timeline"),
    "stage_spec": ("pipeline", "stage_spec"), "virtual_stages": ("pipeline", "virtual_stages"),
}
_CONFIGS = {"strategy": DataParallelConfig, "tensor_parallel": TensorParallelConfig, "pipeline": PipelineConfig}


def resolve_configs(strategy: str | DataParallelConfig, tensor_parallel: TensorParallelConfig | None,
                    pipeline: PipelineConfig | None, flat: dict[str, Any]):
    """The three configs from config objects and/or the flat keyword arguments (each config built,
    and so validated, by its own class). Mixing a config object with its own flat keywords raises."""
    given = {"strategy": strategy if isinstance(strategy, DataParallelConfig) else None,
             "tensor_parallel": tensor_parallel, "pipeline": pipeline}
    fields: dict[str, dict[str, Any]] = {k: {} for k in _CONFIGS}
    if not isinstance(strategy, DataParallelConfig):
        fields["strategy"]["strategy"] = strategy
    for key, value in flat.items():
        if key not in _FLAT_OPTIONS:
            raise ValueError(f"ShardedModule got an unknown option {key!r}; the options are strategy, "
                             f"tensor_parallel, pipeline, activation_checkpointing, {', '.join(_FLAT_OPTIONS)}")
        owner, field = _FLAT_OPTIONS[key]
        if given[owner] is not None:
            raise ValueError(f"{key}= is part of {owner}={type(given[owner]).__name__}(...): pass it there, "
                             "not both")
        fields[owner][field] = value
    return tuple(given[k] if given[k] is not None else _CONFIGS[k](**fields[k]) for k in _CONFIGS)


def build_strategy(config: DataParallelConfig, module: nn.Module, mesh: Mesh, reshard_after_forward: bool) -> Strategy:
    """The data-parallel strategy of ``config`` over ``module``'s (tensor-/expert-parallel local) parameters:
    whatever `minipar.data_parallel.strategy.register_strategy` registered under its name."""
    return strategy_entry(config.strategy).build(module, mesh, config, reshard_after_forward)
