"""LayerNorm and RMSNorm over the last dimension, forward and backward.

For each row x (D,) of x (..., D), with weight w (D,) and bias b (D,), either
of which may be absent (w = 1, b = 0), all in fp32 whatever the storage dtype:

    layer_norm   mu = mean(x)    rstd = 1 / sqrt(mean((x - mu)^2) + eps)    y = (x - mu) rstd w + b
    rms_norm     mu = 0          rstd = 1 / sqrt(mean(x^2) + eps)           y = x rstd w

With xhat = (x - mu) rstd, dy the gradient of y (..., D) and g = dy w:

    dx = rstd (g - xhat mean(g xhat) - mean(g))        rms_norm: no mean(g) term
    dw = sum over rows of dy xhat  (D,)                db = sum over rows of dy  (D,)

(dx: y depends on x directly and through rstd, and for layer_norm through mu;
the two mean terms are those paths, projecting g off xhat and off the constant.)

y is returned in x.dtype, and each gradient in its input's dtype; x may be
non-contiguous (it is copied) and of any leading shape.

Triton path, forward: one program per row; it saves mu and rstd per row (fp32,
(rows,)) for the backward. mu is the mean rounded to fp32, so every x - mu is
off by that one rounding, an error rstd amplifies when |mu| is large against
the spread. Both directions measure it as c = mean(x - mu) and use x - mu - c,
with var = mean((x - mu)^2) - c^2 (the corrected two-pass algorithm): layer_norm
stays at fp32 accuracy on such rows, where PyTorch's fp32 loses digits.

Triton path, backward: programs (p, j) over P groups of R consecutive rows
and the column blocks j. Each writes dx for its rows and block, and sums its
rows' dy xhat and dy in registers, storing them once into row p of (P, D) fp32
partial buffers; dw and db are those buffers summed over p by torch. No
atomics, so the result is deterministic. A row of up to
``norm_triton.MAX_BLOCK_D`` columns is one block; wider rows loop over blocks.
Empty inputs launch nothing.

PyTorch path (``use_triton`` false, or a dtype the fp32 kernels would lose
precision on, such as fp64): ``F.layer_norm``, and the rms_norm formula above
in fp32 torch ops (fp64 in fp64), both differentiated by autograd.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .dispatch import launch, triton_module, use_triton

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm(x, (D,), weight, bias, eps)``: x (..., D), weight and bias (D,) or None -> (..., D), x.dtype."""
    _check_shapes(x, weight=weight, bias=bias)
    if not _triton_for(x):
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return _TritonNorm.apply(x, weight, bias, eps, False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` in fp32: x (..., D), weight (D,) or None -> (..., D), x.dtype."""
    _check_shapes(x, weight=weight)
    if not _triton_for(x):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32, or fp64 kept as is
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (y if weight is None else y * weight.to(xf.dtype)).to(x.dtype)
    return _TritonNorm.apply(x, weight, None, eps, True)


def _check_shapes(x: torch.Tensor, **params: torch.Tensor | None) -> None:
    for name, p in params.items():
        if p is not None and p.shape != x.shape[-1:]:
            raise ValueError(f"{name} has shape {tuple(p.shape)}; it must be ({x.shape[-1]},), the last dimension of x")


def _triton_for(x: torch.Tensor) -> bool:
    """The dispatch rule, for the dtypes the fp32-math kernels are exact enough for."""
    return use_triton(x) and x.dtype in _KERNEL_DTYPES


class _TritonNorm(torch.autograd.Function):
    """layer_norm (rms False) or rms_norm (rms True, bias None) through the Triton kernels."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        d = x.shape[-1]
        x2d = x.contiguous().view(math.prod(x.shape[:-1]), d)
        y, mean, rstd = _forward(x2d, weight, bias, eps, rms)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.rms = rms
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(x.shape)

    @staticmethod
    @once_differentiable  # the backward is a kernel, not torch ops: a double backward must fail loudly
    def backward(ctx, dy):
        x2d, weight, mean, rstd = ctx.saved_tensors
        # contiguous also materialises the stride-0 gradient that y.sum().backward() sends
        dx, dw, db = _backward(dy.contiguous().view(x2d.shape), x2d, weight, ctx.bias_dtype, mean, rstd, ctx.rms)
        return dx.view(dy.shape), dw, db, None, None


def _forward(x2d, weight, bias, eps, rms):
    """y (rows, D) in x's dtype, and the fp32 per-row mean (empty for rms) and rstd (rows,)."""
    n_rows, d = x2d.shape
    y = torch.empty_like(x2d)
    mean = torch.empty(0 if rms else n_rows, dtype=torch.float32, device=x2d.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    if n_rows == 0:
        return y, mean, rstd
    tk = triton_module("norm_triton")
    block_d = tk.block_for(d)
    config = dict(HAS_W=weight is not None, BLOCK_D=block_d, num_warps=tk.warps_for(block_d))
    w = _or_placeholder(weight, x2d)
    if rms:
        launch(tk.rms_norm_fwd_kernel, (n_rows,), x2d, w, y, rstd, d, eps, **config)
    else:
        launch(tk.layer_norm_fwd_kernel, (n_rows,), x2d, w, _or_placeholder(bias, x2d), y, mean, rstd, d, eps,
               HAS_B=bias is not None, **config)
    return y, mean, rstd


def _backward(dy2d, x2d, weight, bias_dtype, mean, rstd, rms):
    """dx (rows, D) in x's dtype; dw, db (D,) in weight's and bias's dtypes, None where that input is absent."""
    n_rows, d = x2d.shape
    dx = torch.empty_like(x2d)
    has_w, has_b = weight is not None, bias_dtype is not None
    if n_rows == 0:
        dw = torch.zeros_like(weight) if has_w else None
        return dx, dw, torch.zeros(d, dtype=bias_dtype, device=x2d.device) if has_b else None
    tk = triton_module("norm_triton")
    block_d = tk.block_for(d)
    rows_per_program = -(-n_rows // _row_groups(x2d.device))
    n_programs = -(-n_rows // rows_per_program)  # every program gets at least one row
    grid = (n_programs, -(-d // block_d))
    dw_part = torch.empty(n_programs, d, dtype=torch.float32, device=x2d.device) if has_w else x2d
    db_part = torch.empty(n_programs, d, dtype=torch.float32, device=x2d.device) if has_b else x2d
    config = dict(HAS_W=has_w, BLOCK_D=block_d, num_warps=tk.warps_for(block_d))
    w = _or_placeholder(weight, x2d)
    if rms:
        launch(tk.rms_norm_bwd_kernel, grid, x2d, w, dy2d, rstd, dx, dw_part,
               n_rows, d, rows_per_program, **config)
    else:
        launch(tk.layer_norm_bwd_kernel, grid, x2d, w, dy2d, mean, rstd, dx, dw_part, db_part,
               n_rows, d, rows_per_program, HAS_B=has_b, **config)
    dw = dw_part.sum(0).to(weight.dtype) if has_w else None
    db = db_part.sum(0).to(bias_dtype) if has_b else None
    return dx, dw, db


def _or_placeholder(t: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """``t`` made contiguous, or, when absent, a tensor for a pointer argument that its HAS_ flag keeps unread."""
    return placeholder if t is None else t.contiguous()


def _row_groups(device: torch.device) -> int:
    """How many programs share the backward's rows: a few per SM fill the GPU; the partials are (this, D)."""
    if device.type != "cuda":
        return 4  # the interpreter: few programs, so each loops over several rows, as on a GPU
    return 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
