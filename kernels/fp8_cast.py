"""Quantise an FP8 matmul operand by rows or 1 x 128 tiles: amax, scale and cast in one pass.

For x (rows, K) contiguous, fp32 or bf16, and groups of ``width`` columns along
K (``width=K``: one group per row, the rowwise recipe; ``width=128``: the
blockwise recipe's activation tiles, a last partial tile taking what it has):

    amax[r, g]  = max |x[r, g*width : (g+1)*width]|            (at least 1e-12)
    scale       = fp8_max / amax      (rounded down to a power of two with pow2)
    q[r, c]     = cast_fp8(clamp(x[r, c] * scale[r, c // width], -fp8_max, fp8_max))
    inv_scale   = 1 / scale           (rows, ceil(K / width)), fp32

``minipar.fp8.quantize.quantise`` computes the same with torch ops (the
reference, and the path for tensorwise scales, 128 x 128 weight blocks, and any
amax that must first be agreed over tensor-parallel ranks: those need the
whole tensor's, or other ranks', amax before the cast). The Triton kernel
(``fp8_cast_triton``) equals it bit for bit. The launcher is a ``torch.library``
custom op (``minipar::fp8_cast``) writing into outputs it is given.
"""

from __future__ import annotations

import torch

from .dispatch import launch, triton_module, use_triton

MAX_WIDTH = 16384  # a wider row group takes the PyTorch path (its row would not fit one program's registers)


def fp8_cast(x: torch.Tensor, dtype: torch.dtype, width: int, pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, K) -> (q (rows, K) in ``dtype``, inv_scale (rows, ceil(K / width)) fp32); see the module doc."""
    _check(x, dtype, width)
    rows, k = x.shape
    groups = -(-k // width)
    if not use_triton(x) or width > MAX_WIDTH:
        return _fp8_cast_torch(x, dtype, width, pow2)
    q = torch.empty(rows, k, dtype=dtype, device=x.device)
    inv_scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    _fp8_cast(x, q, inv_scale, width, pow2)
    return q, inv_scale


def _fp8_cast_torch(x: torch.Tensor, dtype: torch.dtype, width: int, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, with torch ops (``minipar.fp8.quantize``'s arithmetic)."""
    fp8_max = torch.finfo(dtype).max
    rows, k = x.shape
    pad = -k % width
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(rows, -1, width)
    amax = xf.abs().amax(dim=2, keepdim=True).clamp(min=1e-12)
    scale = torch.full_like(amax, fp8_max) / amax  # correctly rounded (fp8_max / amax is max * (1 / amax))
    if pow2:
        scale = torch.ldexp(torch.ones_like(scale), torch.frexp(scale)[1] - 1)
    q = (xf * scale).clamp(-fp8_max, fp8_max).to(dtype).view(rows, -1)[:, :k]
    return q.contiguous(), scale.reciprocal().view(rows, -1)


@torch.library.custom_op("minipar::fp8_cast", mutates_args=("q", "inv_scale"))
def _fp8_cast(x: torch.Tensor, q: torch.Tensor, inv_scale: torch.Tensor, width: int, pow2: bool) -> None:
    """The Triton launcher: a grid of (row blocks, groups per row)."""
    rows, k = x.shape
    if rows == 0 or k == 0:
        return
    tk = triton_module("fp8_cast_triton")
    config = tk.config(k, width)
    info = torch.finfo(q.dtype)
    grid = (-(-rows // config["ROWS"]), inv_scale.shape[1])
    launch(tk.fp8_cast_kernel, grid, x, q, inv_scale, rows, k, width, inv_scale.shape[1], float(info.max),
           POW2=pow2, MANTISSA=_MANTISSA[q.dtype],
           MIN_NORMAL=float(info.smallest_normal), **config)


_MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


@_fp8_cast.register_fake
def _(x, q, inv_scale, width, pow2):
    return None


def _check(x: torch.Tensor, dtype: torch.dtype, width: int) -> None:
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"fp8_cast takes a contiguous 2-d (rows, K) operand, got shape {tuple(x.shape)}"
                         f"{'' if x.is_contiguous() else ', not contiguous'}: reshape(-1, K) and .contiguous() it")
    if dtype not in _MANTISSA:
        raise ValueError(f"fp8_cast casts to torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"fp8_cast width={width!r} must be a positive int (128 for tiles, K for rows)")
    if not x.is_floating_point():
        raise ValueError(f"fp8_cast quantises a floating tensor, got {x.dtype}")
