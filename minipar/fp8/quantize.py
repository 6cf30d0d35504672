"""Quantise a matmul operand to FP8 and multiply two of them: the arithmetic of every recipe.

An operand is a 2-D tensor (rows, K) whose last dimension K is the one the
matmul contracts, so ``matmul(a, b) = a @ b^T`` for a (M, K) and b (N, K) (the
"NT" layout ``torch._scaled_mm`` wants on a GPU: a row-major, b^T column-major).
It is quantised in one of four forms, by which elements share a scale:

    "tensor": one scale              amax over the whole operand          scale shape ()
    "row":    one scale per row      amax over K, for each row            (rows, 1)
    "tile":   1 x 128 tiles along K  amax over each tile                  (rows, ceil(K / 128))
    "block":  128 x 128 blocks       amax over each block                 (ceil(rows / 128), ceil(K / 128))

    scale = fp8_max / amax     (rounded down to a power of two with pow2_scales; amax >= 1e-12)
    data  = cast_fp8(clamp(x * scale, -fp8_max, fp8_max))      (round to nearest even)
    x    ~= data * inv_scale,   inv_scale = 1 / scale         (exact for a power of two)

Because every form's groups lie along K or are whole rows, a group never mixes
two output elements' products with different scales: the product of two
"tensor" or two "row" operands is exactly ``(a_data @ b_data^T) * inv_a * inv_b^T``,
which ``torch._scaled_mm`` computes (fp32 accumulation), on the CPU too. Tiles
and blocks change scale along K, inside one dot product, which ``_scaled_mm``
takes on Hopper only through CUTLASS/cuBLAS block-scaled kernels that CPU torch
does not offer: "tile" and "block" are therefore *emulated* here, each operand
dequantised to fp32 (data * inv_scale, exact) and multiplied in fp32. The
numerics are those of the real recipe up to the order of fp32 accumulation.
A last partial tile or block (K or rows not a multiple of 128) takes the amax of
the elements it has.

Rows and tiles whose amax needs no other rank's go through
``minipar.kernels.fp8_cast`` (amax, scale and cast in one pass; a Triton kernel
on a GPU); the rest (tensorwise, 128 x 128 blocks, amaxes agreed over tp) are
quantised here with torch ops, to the same bits.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .. import kernels
from .config import float8_dtype

TILE = 128
AMAX_FLOOR = 1e-12  # an all-zero group gets a finite scale (its data is 0 whatever the scale)


class Quantised(NamedTuple):
    """An operand in FP8: ``data`` (rows, K) float8, ``inv_scale`` fp32 shaped by the form (see module doc)."""
    data: torch.Tensor
    inv_scale: torch.Tensor
    form: str


def amax_of(x: torch.Tensor, form: str) -> torch.Tensor:
    """The largest |x| of each scale group of the (rows, K) operand, in fp32 (shapes in the module doc)."""
    a = x.detach().abs().float()
    if form == "tensor":
        return a.amax()
    if form == "row":
        return a.amax(dim=1, keepdim=True)
    rows, k = a.shape
    a = _pad(a, TILE if form == "block" else 1, TILE)
    if form == "tile":
        return a.view(rows, -1, TILE).amax(dim=2)
    if form == "block":
        return a.view(a.shape[0] // TILE, TILE, -1, TILE).amax(dim=(1, 3))
    raise ValueError(f"unknown quantisation form {form!r}")


def scale_from_amax(amax: torch.Tensor, fmt: str, pow2: bool) -> torch.Tensor:
    """fp8_max / amax, rounded down to a power of two with ``pow2`` (then ``x * scale`` never exceeds fp8_max)."""
    # tensor / tensor: a correctly rounded division (a Python float over a tensor is computed as
    # float * reciprocal(tensor), one more rounding, which the Triton kernel and a GPU's div.rn do not make)
    amax = amax.clamp(min=AMAX_FLOOR)
    scale = torch.full_like(amax, torch.finfo(float8_dtype(fmt)).max) / amax
    if not pow2:
        return scale
    # the power of two at or below: scale = m * 2**e with m in [0.5, 1), exactly (a log2 rounded in fp32
    # could land on the power above for a scale just below it)
    _, exponent = torch.frexp(scale)
    return torch.ldexp(torch.ones_like(scale), exponent - 1)


def quantise(x: torch.Tensor, fmt: str, form: str, pow2: bool, amax: torch.Tensor | None = None,
             reduce_amax: Callable[[torch.Tensor], None] | None = None) -> Quantised:
    """x (rows, K) -> `Quantised`. ``amax``: already computed (a tensorwise amax shared by x and x^T);
    ``reduce_amax``: called on the amax, in place, before the scale is made (the max over the
    tensor-parallel ranks when the groups span their shards)."""
    if amax is None and reduce_amax is None and form in ("row", "tile"):
        # every group is whole on this rank: amax, scale and cast in one pass (a Triton kernel on a GPU)
        data, inv_scale = kernels.fp8_cast(x.contiguous(), float8_dtype(fmt), x.shape[1] if form == "row" else TILE,
                                           pow2)
        return Quantised(data, inv_scale, form)
    if amax is None:
        amax = amax_of(x, form)
        if reduce_amax is not None:
            reduce_amax(amax)
    scale = scale_from_amax(amax, fmt, pow2)
    fp8_max = torch.finfo(float8_dtype(fmt)).max
    data = (x.float() * expand(scale, form, x.shape)).clamp(-fp8_max, fp8_max).to(float8_dtype(fmt))
    return Quantised(data, scale.reciprocal(), form)


def expand(per_group: torch.Tensor, form: str, shape: torch.Size) -> torch.Tensor:
    """A per-group tensor (scale or amax) broadcast to the operand's ``shape``."""
    if form in ("tensor", "row"):
        return per_group
    rows, k = shape
    full = per_group.repeat_interleave(TILE, dim=1)[:, :k]
    return full.repeat_interleave(TILE, dim=0)[:rows] if form == "block" else full


def dequantise(q: Quantised) -> torch.Tensor:
    """data * inv_scale in fp32 (exact when the scales are powers of two)."""
    return q.data.float() * expand(q.inv_scale, q.form, q.data.shape)


def matmul(a: Quantised, b: Quantised) -> torch.Tensor:
    """a (M, K) @ b (N, K)^T in fp32 (M, N): ``torch._scaled_mm`` for tensor/row forms, fp32 emulation for
    tiles and blocks (module doc)."""
    if a.form in ("tensor", "row") and b.form in ("tensor", "row"):
        return torch._scaled_mm(a.data, b.data.t(), scale_a=a.inv_scale, scale_b=b.inv_scale.t().contiguous(),
                                out_dtype=torch.float32)
    return dequantise(a) @ dequantise(b).t()


def _pad(a: torch.Tensor, row_multiple: int, col_multiple: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor up to multiples (zeros never raise an amax)."""
    rows, k = a.shape
    pad_rows, pad_k = -rows % row_multiple, -k % col_multiple
    return torch.nn.functional.pad(a, (0, pad_k, 0, pad_rows)) if pad_rows or pad_k else a
