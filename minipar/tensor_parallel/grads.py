"""Gradient bookkeeping under tensor parallelism.

Two kinds of parameters live in a tensor-parallel model: *shards* (marked
``tensor_parallel``: each tp rank holds a different slice) and *replicated*
parameters (norms, the row-parallel bias, position embeddings). For the norm
of the whole gradient each shard's contribution is summed over tp, each
replicated one counted once. (Replicated parameters that see only a sequence
slice get their gradients summed over tp by a hook: see
``layers.mark_sequence_parallel``.)
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..mesh import Mesh


@torch.no_grad()
def tp_grad_norm(module: nn.Module, mesh: Mesh, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the full model's gradient: shards summed over tp, replicated parameters once."""
    norm_type = float(norm_type)
    params = [p for p in module.parameters() if p.grad is not None]
    device = params[0].grad.device if params else mesh.device
    parts = torch.zeros(2, dtype=torch.float32, device=device)  # [shards, replicated]
    for p in params:
        g = p.grad.float()
        i = 0 if getattr(p, "tensor_parallel", False) else 1
        if math.isinf(norm_type):
            parts[i] = torch.maximum(parts[i], g.abs().max())
        else:
            parts[i] += g.abs().pow(norm_type).sum()
    shards = parts[:1].clone()
    mesh.comm.all_reduce(shards, mesh.group("tp"), op="max" if math.isinf(norm_type) else "sum", tag="grad_norm")
    if math.isinf(norm_type):
        return torch.maximum(shards[0], parts[1])
    return (shards[0] + parts[1]).pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(module: nn.Module, mesh: Mesh, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a tensor-parallel module; returns the full-model norm."""
    total = tp_grad_norm(module, mesh, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in module.parameters():
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return total
