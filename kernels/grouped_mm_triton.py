"""Triton kernels for ``minipar.kernels.grouped_mm`` (imported at first use; see ``dispatch``).

``grouped_mm_kernel``: out[rows_g] = a[rows_g] @ b[g]. Program (t, j) computes
row tile t (BM rows, all of one group) by column tile j (BN columns). Which
group and which first row tile t has are read from two small tables the
launcher builds on the device (``tile_group``, ``tile_row``); a program whose
tile lies past the last group's (``tile_group == G``) exits, so the grid can be
sized from the shapes, never from the counts. The K loop accumulates
BM x BK by BK x BN products in fp32 (``tl.dot``; fp32 operands as IEEE fp32,
not TF32, as torch's matmul), rounded once to the output dtype. ``b`` is read
through its strides, so the backward's dx = dy @ w^T passes w transposed
without a copy.

``grouped_mm_weight_grad_kernel``: out[g] = a[rows_g]^T @ b[rows_g]. Program
(g, i, j) owns the BK x BN tile (i, j) of group g's K x N result and loops over
the group's rows BM at a time; a group without rows stores zeros, so every
expert's gradient exists.

Under the interpreter the operands are widened to fp32 before the product
(its bf16 arithmetic is not the hardware's) and the blocks are small (its
programs run one after another).
"""

import triton
import triton.language as tl

from .common_triton import round_to


def config(k: int, n: int, dtype, interpreted: bool) -> dict:
    """Tile sizes of the grouped product: 64 rows by up to 128 columns, K in steps of 64 (32 in fp32)."""
    if interpreted:
        return _even(dict(BM=16, BN=_fit(n, 32), BK=_fit(k, 32), num_warps=4), k, n)
    return _even(dict(BM=64, BN=_fit(n, 128), BK=_fit(k, 32 if dtype.itemsize == 4 else 64), num_warps=4), k, n)


def weight_grad_config(k: int, n: int, dtype, interpreted: bool) -> dict:
    """Tile sizes of the weight gradient: a 64 x 64 (K, N) tile, rows in steps of 64 (32 in fp32)."""
    if interpreted:
        return _even(dict(BM=16, BK=_fit(k, 32), BN=_fit(n, 32), num_warps=4), k, n)
    return _even(dict(BM=32 if dtype.itemsize == 4 else 64, BK=_fit(k, 64), BN=_fit(n, 64), num_warps=4), k, n)


def _even(config: dict, k: int, n: int) -> dict:
    """EVEN_K / EVEN_N: the blocks divide K / N, so those masks are constants (only the rows are masked)."""
    return dict(config, EVEN_K=k % config["BK"] == 0, EVEN_N=n % config["BN"] == 0)


def _fit(size: int, most: int) -> int:
    """A block for a dimension of ``size``: a power of two, at least 16 (``tl.dot``'s least), at most ``most``."""
    return max(16, min(most, triton.next_power_of_2(size)))


@triton.jit
def _dot(a, b, acc, INTERPRETED: tl.constexpr):
    """acc + a @ b in fp32: IEEE fp32 for fp32 operands (no TF32), the tensor cores' bf16/fp16 otherwise."""
    if INTERPRETED:
        a, b = a.to(tl.float32), b.to(tl.float32)
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def grouped_mm_kernel(a_ptr, b_ptr, out_ptr, tile_group_ptr, tile_row_ptr, bounds_ptr, G, N, K, stride_bg, stride_b,
                      B_TRANSPOSED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program (t, j): out[rows of tile t, cols of tile j] = a[those rows] @ b[g, :, those cols], g = tile t's group.
    b[g] is (K, N) row-major (element (k, n) at k * stride_b + n), or with B_TRANSPOSED the transpose of a
    row-major (N, K) matrix (at n * stride_b + k): a constexpr, so the unit stride is known and loads vectorise."""
    g = tl.load(tile_group_ptr + tl.program_id(0))
    if g >= G:
        return
    first = tl.load(tile_row_ptr + tl.program_id(0))
    end = tl.load(bounds_ptr + g + 1)
    rows = first + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < end
    col_ok = _in_range(cols, N, EVEN_N)
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * K
    b_group = b_ptr + g.to(tl.int64) * stride_bg
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = _in_range(ks, K, EVEN_K)
        a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if B_TRANSPOSED:
            b_at = b_group + ks[:, None] + cols[None, :] * stride_b
        else:
            b_at = b_group + ks[:, None] * stride_b + cols[None, :]
        b = tl.load(b_at, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _dot(a, b, acc, INTERPRETED)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
             round_to(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _in_range(idx, size, EVEN: tl.constexpr):
    """idx < size, or a constant true the compiler folds away when the blocks divide size (EVEN)."""
    if EVEN:
        return tl.full(idx.shape, 1, tl.int1)
    return idx < size


@triton.jit
def grouped_mm_weight_grad_kernel(a_ptr, b_ptr, out_ptr, bounds_ptr, K, N, BM: tl.constexpr, BK: tl.constexpr,
                                  BN: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                                  INTERPRETED: tl.constexpr):
    """Program (g, i, j): out[g, K tile i, N tile j] = sum over group g's rows r of a[r, tile i]^T b[r, tile j]."""
    g = tl.program_id(0)
    start = tl.load(bounds_ptr + g)
    end = tl.load(bounds_ptr + g + 1)
    ks = tl.program_id(1) * BK + tl.arange(0, BK)
    cols = tl.program_id(2) * BN + tl.arange(0, BN)
    k_ok, col_ok = _in_range(ks, K, EVEN_K), _in_range(cols, N, EVEN_N)
    acc = tl.zeros([BK, BN], dtype=tl.float32)
    for r0 in range(start, end, BM):
        rows = r0 + tl.arange(0, BM)
        row_ok = rows < end
        a = tl.load(a_ptr + rows.to(tl.int64)[None, :] * K + ks[:, None], mask=k_ok[:, None] & row_ok[None, :],
                    other=0.0)  # (BK, BM): a's tile read transposed
        b = tl.load(b_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0)
        acc = _dot(a, b, acc, INTERPRETED)
    out = out_ptr + g.to(tl.int64) * K * N
    tl.store(out + ks[:, None] * N + cols[None, :], round_to(acc, out_ptr.dtype.element_ty, INTERPRETED),
             mask=k_ok[:, None] & col_ok[None, :])
