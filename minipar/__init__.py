"""minipar: the parallelism strategies of large-model training, by hand, on torch.distributed.

Public API:
    init, Mesh            -- the process mesh (minipar.mesh)
    ShardedModule         -- wrap a model with a strategy (minipar.sharded)
    Comm, CommStats       -- the counted collective layer (minipar.comm)
    regions               -- autograd-aware conjugate collectives (minipar.regions)
"""

from . import regions
from .comm import AxisGroup, Comm, CommStats
from .mesh import Mesh, init
from .precision import MixedPrecision
from .sharded import STRATEGIES, ShardedModule

__all__ = ["init", "Mesh", "ShardedModule", "STRATEGIES", "MixedPrecision", "Comm", "CommStats", "AxisGroup", "regions"]
__version__ = "0.1.0"
