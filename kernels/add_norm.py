"""The residual add fused with the norm that follows it, for pre-norm blocks: (h, y) = (x + delta, norm(x + delta)).

A pre-norm transformer block ends with ``x = x + delta`` (delta the attention
or MLP output) and the next block starts with ``norm(x)``. Done apart, that is
three passes over (rows, D) in and two out; fused, one kernel reads x and
delta once and writes h and y, and its backward writes one gradient:

    h = x + delta              in x's dtype, rounded once (as torch's x + delta)
    y = norm(h)                layer_norm or rms_norm of h, as in ``norm``
    d x = d delta = dh + dnorm(h; dy)        dnorm: norm.py's dx formula

computed in fp32 and rounded once. Both inputs receive that one tensor
(autograd accumulates it into each; neither aliases the other's ``.grad``).
dw and db are the norm's. dh or dy may be absent (an output unused by the
loss): its term is left out.

x and delta must have one shape and one dtype (so h's dtype is x's, exactly as
in the composition). PyTorch path (``use_triton`` false, or fp64): the
composition itself, ``h = x + delta`` then ``layer_norm(h)`` / ``rms_norm(h)``
on their PyTorch paths. Triton path: ``minipar::add_norm_fwd`` and
``minipar::norm_bwd``, the custom ops of ``norm`` (kernels
``add_layer_norm_*_kernel``, ``add_rms_norm_*_kernel`` in ``norm_triton``),
so ``torch.compile`` traces it with fullgraph.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .norm import _check_shapes, _triton_for, add_norm_fwd, layer_norm, norm_bwd, rms_norm, rows_of


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + delta; (h, F.layer_norm(h, (D,), weight, bias, eps))``: x, delta (..., D) of one dtype,
    weight and bias (D,) or None -> h, y (..., D) in x's dtype; differentiable in all four."""
    _check_pair(x, delta)
    _check_shapes(x, weight=weight, bias=bias)
    if not _triton_for(x):
        h = x + delta
        return h, layer_norm(h, weight, bias, eps)
    return _TritonAddNorm.apply(x, delta, weight, bias, eps, False)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + delta; (h, rms_norm(h, weight, eps))``: x, delta (..., D) of one dtype, weight (D,) or None
    -> h, y (..., D) in x's dtype; differentiable in all three."""
    _check_pair(x, delta)
    _check_shapes(x, weight=weight)
    if not _triton_for(x):
        h = x + delta
        return h, rms_norm(h, weight, eps)
    return _TritonAddNorm.apply(x, delta, weight, None, eps, True)


def _check_pair(x: torch.Tensor, delta: torch.Tensor) -> None:
    if x.shape != delta.shape or x.dtype != delta.dtype:
        raise ValueError(f"add-norm needs x and delta of one shape and dtype, got {tuple(x.shape)} {x.dtype} "
                         f"and {tuple(delta.shape)} {delta.dtype}; broadcast or cast them first")


class _TritonAddNorm(torch.autograd.Function):
    """h = x + delta and y = norm(h) (layer_norm, or rms_norm when rms) through the Triton kernels."""

    @staticmethod
    def forward(ctx, x, delta, weight, bias, eps, rms):
        h, y, mean, rstd = add_norm_fwd(rows_of(x), rows_of(delta), weight, bias, eps, rms)
        ctx.save_for_backward(h, weight, mean, rstd)
        ctx.rms = rms
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros to read
        return h.view(x.shape), y.view(x.shape)

    @staticmethod
    @once_differentiable  # the backward is a kernel, not torch ops: a double backward must fail loudly
    def backward(ctx, dh, dy):
        h, weight, mean, rstd = ctx.saved_tensors
        if dy is None:  # y unused: x and delta get dh alone, the parameters nothing
            return dh, dh, None, None, None, None
        dh2d = None if dh is None else dh.contiguous().view(h.shape)
        dx, dw, db = norm_bwd(dy.contiguous().view(h.shape), dh2d, h, weight, ctx.bias_dtype, mean, rstd, ctx.rms)
        dx = dx.view(dy.shape)
        return (dx, dx, dw if weight is not None else None, db if ctx.bias_dtype is not None else None,
                None, None)
