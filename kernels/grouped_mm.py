"""Grouped matrix product: every group's rows times its own matrix, in one call, no padding.

With x (M, K) whose rows are sorted by group, w (G, K, N) and counts (G,) the
rows of each group (any of them 0, their sum M), rows_g = [o_g, o_g + counts[g])
where o_g = counts[0] + ... + counts[g-1]:

    forward     y[rows_g]  = x[rows_g] @ w[g]                  (M, N)
    backward    dx[rows_g] = dy[rows_g] @ w[g]^T               (M, K)   the same product, w transposed
                dw[g]      = x[rows_g]^T @ dy[rows_g]          (G, K, N) zero for a group without rows

This is a dropless mixture of experts' expert computation: the rows are the
tokens sorted by expert, w stacks the experts' weights, and no expert is padded
to a capacity (``minipar.moe.experts``). An empty group still gets its (zero)
gradient, never None, so every rank's expert gradients have the same shape.

Paths (``dispatch.use_triton`` picks):

* PyTorch: ``torch._grouped_mm`` (one call, offsets read on the device, no
  host sync) where this torch has it and it applies: fp32/bf16/fp16, every
  operand's strides and data pointer 16-byte aligned (its rule, on CPU as on a
  GPU), and a one-time probe on the device and dtype succeeded (on a GPU it
  may need sm_90 and bf16: probed, not assumed). Otherwise a loop of
  ``torch.mm`` over the groups (``counts`` read on the host; on CPU the two
  give bitwise the same result, ``tests/test_kernels_grouped_mm.py``).
* Triton (``grouped_mm_triton``): one launch over (row tiles of every group,
  N tiles) for y and dx, one over (groups, K tiles, N tiles) for dw. The
  tile -> group table is computed on the device from ``counts`` (a cumulative
  sum and a binary search: no count is read back); the grid is sized by the
  bound ceil(M / BM) + G on the tiles, so programs past the last tile exit.

Bias is not part of the product: the experts add it per row by a gather of
their bias rows (``minipar.moe.experts``), whose backward, a segment sum, is
autograd's; one concept here, and the same bias arithmetic on both paths.

``sum(counts) == M`` is the caller's promise; it is checked on the CPU's PyTorch path only
(elsewhere a check would read the counts back, the host sync the device paths avoid).
"""

from __future__ import annotations

import functools

import torch

from .dispatch import launch, sm_count, triton_module, use_triton

__all__ = ["grouped_mm"]


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x (M, K) rows sorted by group, w (G, K, N), counts (G,) int rows per group -> y (M, N), x's dtype;
    differentiable in x and w (see the module doc for the math)."""
    _check(x, w, counts)
    if not x.is_cuda and not use_triton(x) and int(counts.sum()) != x.shape[0]:  # reads counts: CPU, PyTorch only
        raise ValueError(f"grouped_mm counts sum to {int(counts.sum())} but x has {x.shape[0]} rows: every row "
                         "belongs to one group (sort the rows by group and count them)")
    return _GroupedMM.apply(x, w, counts)


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts):
        ctx.save_for_backward(x, w, counts)
        return rows_times_group(x, w, counts)

    @staticmethod
    def backward(ctx, dy):
        x, w, counts = ctx.saved_tensors
        dy = dy.contiguous()
        dx = rows_times_group(dy, w.transpose(1, 2), counts) if ctx.needs_input_grad[0] else None
        dw = group_outer(x, dy, counts) if ctx.needs_input_grad[1] else None
        return dx, dw, None


# ----------------------------------------------------------------------------- the two primitives

def rows_times_group(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """a (M, K), b (G, K, N) (any strides: the backward passes w transposed) -> out[rows_g] = a[rows_g] @ b[g]."""
    if use_triton(a):
        return grouped_mm_op(a, b, counts)
    if _torch_grouped_applies(a, b):
        return torch._grouped_mm(a, b, offs=counts.cumsum(0, dtype=torch.int32))
    return torch.cat([rows @ b[g] for g, rows in enumerate(a.split(counts.tolist()))]) if len(counts) else \
        a.new_empty(a.shape[0], b.shape[2])


def group_outer(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """a (M, K), b (M, N) -> out (G, K, N), out[g] = a[rows_g]^T @ b[rows_g] (zero for an empty group)."""
    if use_triton(a):
        return grouped_mm_weight_grad_op(a, b, counts)
    if _torch_grouped_applies(a.t(), b):
        return torch._grouped_mm(a.t(), b, offs=counts.cumsum(0, dtype=torch.int32))
    rows = counts.tolist()
    return torch.stack([ag.t() @ bg for ag, bg in zip(a.split(rows), b.split(rows))]) if rows else \
        a.new_zeros(0, a.shape[1], b.shape[1])


def _torch_grouped_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch._grouped_mm takes these operands: its dtypes, 16-byte aligned strides and pointers (its rule),
    int32 offsets, and it ran correctly on this device and dtype when first probed."""
    if not hasattr(torch, "_grouped_mm") or a.dtype not in _GROUPED_DTYPES or a.dtype != b.dtype:
        return False
    if a.shape[0] >= 2**31 or not all(_aligned(t) for t in (a, b)):
        return False
    return _probe(a.device.type, a.device.index, a.dtype)


_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _aligned(t: torch.Tensor) -> bool:
    """Its matrices row- or column-major (exactly one of the last two strides 1) and every other stride, and
    the data pointer, a multiple of 16 bytes (a size-1 dimension's stride counts: torch checks it)."""
    unit = [s == 1 for s in t.stride()[-2:]]
    return (t.data_ptr() % 16 == 0 and sum(unit) == 1
            and all(s * t.element_size() % 16 == 0 for s in t.stride() if s != 1))


@functools.lru_cache(maxsize=None)
def _probe(device_type: str, index: int | None, dtype: torch.dtype) -> bool:
    """One tiny grouped product (an empty group included) against the loop, on this device and dtype:
    False where torch._grouped_mm raises (a GPU older than it supports, a dtype it lacks) or disagrees."""
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(24, 16, generator=gen).to(device, dtype)
    b = torch.randn(3, 16, 16, generator=gen).to(device, dtype)
    counts = [8, 0, 16]
    try:
        got = torch._grouped_mm(a, b, offs=torch.tensor(counts, device=device).cumsum(0, dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    want = torch.cat([a[:8] @ b[0], a[8:] @ b[2]])
    # This asks "does it compute the grouped product at all" (a group read at the wrong offset is O(1) off),
    # not "does it round as the loop does": 1e-2 covers bf16/fp16 rounding of 16-term sums (~4e-3); the
    # tests compare the chosen path with the loop bit for bit where they must agree.
    return bool(torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))


# ----------------------------------------------------------------------------- the launchers, as custom ops

@torch.library.custom_op("minipar::grouped_mm", mutates_args=())
def grouped_mm_op(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """a (M, K), b (G, K, N) with row-major matrices or their transposes (the backward's w^T), counts (G,) ->
    (M, N) in a's dtype: the Triton grouped product."""
    a = a.contiguous()
    transposed = b.stride(1) == 1 and b.stride(2) != 1  # b[g] is the transpose of a row-major (N, K) matrix
    if not transposed:
        b = b.contiguous()
    (m, k), (g, _, n) = a.shape, b.shape
    out = a.new_empty(m, n)
    if m == 0 or n == 0 or g == 0:
        return out
    tk = triton_module("grouped_mm_triton")
    config = tk.config(k, n, a.dtype, sm_count(a.device) is None)
    bm = config["BM"]
    bounds = _bounds(counts)
    # The tile -> group table, on the device: group g has ceil(counts[g] / BM) row tiles; tile t belongs to
    # the group whose cumulative tile count first exceeds t (G, past the last tile: that program exits).
    tiles = (counts + bm - 1) // bm
    tile_ends = tiles.cumsum(0)
    n_tiles = -(-m // bm) + g  # a bound on sum ceil(counts / BM), known from the shapes alone
    t = torch.arange(n_tiles, device=a.device, dtype=tile_ends.dtype)
    tile_group = torch.searchsorted(tile_ends, t, right=True)
    clamped = tile_group.clamp(max=g - 1)
    tile_row = bounds[clamped] + (t - (tile_ends - tiles)[clamped]) * bm
    launch(tk.grouped_mm_kernel, (n_tiles, -(-n // config["BN"])), a, b, out, tile_group.to(torch.int32),
           tile_row.to(torch.int32), bounds, g, n, k, b.stride(0), b.stride(2 if transposed else 1),
           B_TRANSPOSED=transposed, **config)
    return out


@torch.library.custom_op("minipar::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad_op(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """a (M, K), b (M, N), counts (G,) -> (G, K, N) fp32-accumulated, in a's dtype: dw[g] = a_g^T b_g."""
    a, b = a.contiguous(), b.contiguous()
    (m, k), n, g = a.shape, b.shape[1], counts.shape[0]
    out = a.new_empty(g, k, n)
    if out.numel() == 0:
        return out
    tk = triton_module("grouped_mm_triton")
    config = tk.weight_grad_config(k, n, a.dtype, sm_count(a.device) is None)
    grid = (g, -(-k // config["BK"]), -(-n // config["BN"]))
    launch(tk.grouped_mm_weight_grad_kernel, grid, a, b, out, _bounds(counts), k, n, **config)
    return out


def _bounds(counts: torch.Tensor) -> torch.Tensor:
    """(G + 1,) int32: group g's rows are [bounds[g], bounds[g + 1])."""
    return torch.nn.functional.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))


@grouped_mm_op.register_fake
def _(a, b, counts):
    return a.new_empty(a.shape[0], b.shape[2])


@grouped_mm_weight_grad_op.register_fake
def _(a, b, counts):
    return a.new_empty(counts.shape[0], a.shape[1], b.shape[1])


def _check(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_mm takes x (M, K) and w (G, K, N), got {tuple(x.shape)} and {tuple(w.shape)}: "
                         "one matrix per group, stacked on w's first axis")
    if counts.shape != (w.shape[0],) or counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grouped_mm counts must be ({w.shape[0]},) int32/int64 (rows per group), got "
                         f"{tuple(counts.shape)} {counts.dtype}")
    if x.dtype != w.dtype or not x.is_floating_point():
        raise ValueError(f"grouped_mm multiplies floating x and w of one dtype, got {x.dtype} and {w.dtype}")
