"""Gradient norms under tensor parallelism, for a module trained without `ShardedModule`.

Two kinds of parameters live in a tensor-parallel model: *shards* (placed
``tp_dim``: each tp rank holds a different slice) and *replicated* parameters
(norms, the row-parallel bias, position embeddings). For the norm of the
whole gradient each shard's contribution is summed over tp, each replicated
one counted once: `minipar.core.grad_norm` does that for every layout. (Replicated
parameters that see only a sequence slice get their gradients summed over tp
by a hook: see ``layers.mark_sequence_parallel``.)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..core.grad_norm import GradPiece, clip_, global_grad_norm
from ..core.mesh import Mesh


def _pieces(module: nn.Module) -> list[GradPiece]:
    return [GradPiece(p, p.grad) for p in module.parameters() if p.grad is not None]


def tp_grad_norm(module: nn.Module, mesh: Mesh, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the full model's gradient: shards summed over tp, replicated parameters once."""
    return global_grad_norm(_pieces(module), mesh, norm_type)


def clip_grad_norm_(module: nn.Module, mesh: Mesh, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a tensor-parallel module; returns the full-model norm."""
    return clip_(_pieces(module), mesh, max_norm, norm_type)
