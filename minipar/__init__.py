"""minipar: the parallelism strategies of large-model training, by hand, on torch.distributed.

Public API:
    init, Mesh, shutdown  -- the process mesh and the end of a job (minipar.core.mesh)
    ShardedModule         -- wrap a model with a strategy (minipar.sharded)
    DataParallelConfig, TensorParallelConfig, PipelineConfig -- its options, grouped
    Comm, CommStats       -- the counted collective layer (minipar.core.comm)
    regions               -- autograd-aware conjugate collectives (minipar.core.regions)
    checkpoint            -- sharded save/load, resharding, consolidation (minipar.checkpoint)
    recompute             -- activation checkpointing (minipar.recompute; ShardedModule(activation_checkpointing=))
    OneBitAdam            -- 1-bit Adam, its compressed momentum exchange replacing DDP's all-reduce (minipar.data_parallel.onebit)
    plan                  -- the layout planner and its formulas (python -m minipar.plan; minipar.plan.formulas)
    ParameterServer       -- servers own parameter partitions, workers push and pull (minipar.data_parallel.parameter_server)
    data_parallel         -- the data-parallel family: DDP, ZeRO-1/2/3, HSDP, offload, 1-bit Adam, the parameter
                             server, and single-process DataParallel (minipar.data_parallel.single_process)
    Offload               -- optimizer state and zero3 parameters to host memory or disk (minipar.data_parallel.offload)
"""

from . import checkpoint, recompute
from .core import regions
from .core.comm import AxisGroup, Comm, CommStats
from .core.comm_errors import CollectiveError
from .core.mesh import Mesh, init, shutdown
from .data_parallel.offload import Offload, OffloadError
from .data_parallel.onebit import OneBitAdam
from .data_parallel.parameter_server import ParameterServer
from .data_parallel.precision import MixedPrecision
from .pipeline import PipelineConfig, StageSpec
from .sharded import ShardedModule
from .data_parallel.strategy import STRATEGIES, DataParallelConfig
from .tensor_parallel import TensorParallelConfig

__all__ = ["init", "shutdown", "Mesh", "ShardedModule", "STRATEGIES", "DataParallelConfig", "TensorParallelConfig",
           "PipelineConfig", "StageSpec", "MixedPrecision", "Comm", "CommStats", "CollectiveError", "AxisGroup", "regions", "checkpoint", "recompute",
           "OneBitAdam", "ParameterServer", "Offload", "OffloadError"]
__version__ = "0.1.0"
