"""Triton kernels for ``minipar.kernels.permute`` (imported at first use; see ``dispatch``).

Both kernels work on tiles of ROWS rows by BLOCK_D columns (`config`: about
16 KB of data per program, the whole row when it fits, many rows when rows
are narrow), over a grid of (row tiles, column blocks). A program loads its
ROWS indices as one vector, then every row's columns at once: 16-byte vectors,
several per thread, all in flight together, instead of one small program per
row waiting on its own index load.

``gather_rows_kernel``: out[m] = x[index[m]], one load and one store per element.

``segment_sum_rows_kernel``: out[n] = the sum of y[order[k]] for k in
[bounds[n], bounds[n+1]), in that order, in fp32; ``order`` is the stable
argsort of the index and ``bounds`` where each destination row's sources start
in it. A program owns its destination rows, so nothing is atomic, every row
(a zero row too) is written once, and the sum is deterministic. Each step of
its loop adds every row's next two sources (both rows' loads in flight
together, the adds in order), all ROWS rows at once; the loop runs to the
largest count among them, rows with fewer masked off.

Offsets are int32 unless the launcher sets ``INT64`` (an operand of 2**31
elements or more).
"""

import triton
import triton.language as tl

from .common_triton import round_to

TILE_BYTES = 16384  # data per program: 8 KB rows of bf16 at D = 4096, two to a program
MAX_BLOCK_D = 4096  # columns per program at most; wider rows take several column blocks
# Warps: the gather's 4 give each thread eight 16-byte vectors to load and store; the segment sum's 8 halve
# that, as it holds two sources' vectors and an fp32 accumulator (4 warps would need 128 registers a thread).
GATHER_WARPS, SEGMENT_SUM_WARPS = 4, 8


def config(d: int, element_size: int, numel: int) -> dict:
    """The tile for rows of d elements of element_size bytes; EVEN_D when the column blocks cover d exactly
    (no column mask); INT64 when an operand of ``numel`` elements (the largest) could overflow int32 offsets."""
    tile = TILE_BYTES // element_size
    block_d = min(triton.next_power_of_2(d), MAX_BLOCK_D)
    return dict(ROWS=max(1, tile // block_d), BLOCK_D=block_d, EVEN_D=d % block_d == 0, INT64=numel >= 2**31)


@triton.jit
def _tile(n_rows, D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, INT64: tl.constexpr):
    """This program's rows (ROWS,), their mask, its columns (BLOCK_D,), and the mask of its columns in range
    (1, BLOCK_D): a constant, which the compiler folds away, when the blocks divide D."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    if INT64:
        rows = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    if EVEN_D:
        col_ok = tl.full([1, BLOCK_D], 1, tl.int1)
    else:
        col_ok = (cols < D)[None, :]
    return rows, rows < n_rows, cols, col_ok


@triton.jit
def gather_rows_kernel(x_ptr, index_ptr, out_ptr, M, D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                       EVEN_D: tl.constexpr, INT64: tl.constexpr):
    """Program (i, j): out[rows of tile i, cols of block j] = x[index[those rows], same cols]."""
    rows, row_ok, cols, col_ok = _tile(M, D, ROWS, BLOCK_D, EVEN_D, INT64)
    src = tl.load(index_ptr + rows, mask=row_ok)  # a masked row's index is never used
    if not INT64:
        src = src.to(tl.int32)
    mask = row_ok[:, None] & col_ok
    vals = tl.load(x_ptr + (src * D)[:, None] + cols[None, :], mask=mask)
    tl.store(out_ptr + (rows * D)[:, None] + cols[None, :], vals, mask=mask)


@triton.jit
def segment_sum_rows_kernel(y_ptr, order_ptr, bounds_ptr, out_ptr, N, D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                            EVEN_D: tl.constexpr, INT64: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program (i, j): out[n, cols of block j] = sum over k in [bounds[n], bounds[n+1]) of y[order[k], same cols],
    in fp32, for the rows n of tile i."""
    rows, row_ok, cols, col_ok = _tile(N, D, ROWS, BLOCK_D, EVEN_D, INT64)
    first = tl.load(bounds_ptr + rows, mask=row_ok, other=0)
    count = tl.load(bounds_ptr + rows + 1, mask=row_ok, other=0) - first
    if not INT64:
        first, count = first.to(tl.int32), count.to(tl.int32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    sources = order_ptr + first  # each row's next source's position in order
    # Two sources per step, both loads issued before either add (the adds stay in order): a top-2 MoE
    # gives each token two, so one step's loads cover them, with one dependent index load before.
    for _ in range(0, (tl.max(count, axis=0) + 1) // 2):
        src0 = tl.load(sources, mask=count > 0, other=0)
        src1 = tl.load(sources + 1, mask=count > 1, other=0)
        if not INT64:
            src0, src1 = src0.to(tl.int32), src1.to(tl.int32)
        # upcast on load: sums in fp32 (and bf16 arithmetic is wrong under the interpreter)
        y0 = tl.load(y_ptr + (src0 * D)[:, None] + cols[None, :], mask=(count > 0)[:, None] & col_ok, other=0.0)
        y1 = tl.load(y_ptr + (src1 * D)[:, None] + cols[None, :], mask=(count > 1)[:, None] & col_ok, other=0.0)
        acc += y0.to(tl.float32)
        acc += y1.to(tl.float32)
        sources += 2
        count -= 2
    tl.store(out_ptr + (rows * D)[:, None] + cols[None, :], round_to(acc, out_ptr.dtype.element_ty, INTERPRETED),
             mask=row_ok[:, None] & col_ok)
