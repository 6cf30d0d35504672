"""minipar: the parallelism strategies of large-model training, by hand, on torch.distributed.

Public API:
    init, Mesh, shutdown  -- the process mesh and the end of a job (minipar.mesh)
    ShardedModule         -- wrap a model with a strategy (minipar.sharded)
    DataParallelConfig, TensorParallelConfig, PipelineConfig -- its options, grouped
    Comm, CommStats       -- the counted collective layer (minipar.comm)
    regions               -- autograd-aware conjugate collectives (minipar.regions)
    checkpoint            -- sharded save/load, resharding, consolidation (minipar.checkpoint)
    recompute             -- activation checkpointing (minipar.recompute; ShardedModule(activation_checkpointing=))
    OneBitAdam            -- 1-bit Adam, its compressed momentum exchange replacing DDP's all-reduce (minipar.onebit)
    formulas, plan        -- the state/traffic/activation arithmetic and the layout planner (python -m minipar.plan)
    ParameterServer       -- servers own parameter partitions, workers push and pull (minipar.parameter_server)
    data_parallel         -- single-process DataParallel, the teaching contrast to DDP (minipar.data_parallel)
    Offload               -- optimizer state and zero3 parameters to host memory or disk (minipar.offload)
"""

from . import checkpoint, recompute, regions
from .comm import AxisGroup, Comm, CommStats
from .comm_errors import CollectiveError
from .mesh import Mesh, init, shutdown
from .offload import Offload, OffloadError
from .onebit import OneBitAdam
from .parameter_server import ParameterServer
from .precision import MixedPrecision
from .pipeline import PipelineConfig, StageSpec
from .sharded import ShardedModule
from .strategy import STRATEGIES, DataParallelConfig
from .tensor_parallel import TensorParallelConfig

__all__ = ["init", "shutdown", "Mesh", "ShardedModule", "STRATEGIES", "DataParallelConfig", "TensorParallelConfig",
           "PipelineConfig", "StageSpec", "MixedPrecision", "Comm", "CommStats", "CollectiveError", "AxisGroup", "regions", "checkpoint", "recompute",
           "OneBitAdam", "ParameterServer", "Offload", "OffloadError"]
__version__ = "0.1.0"
