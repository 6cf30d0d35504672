"""Triton kernels for ``minipar.kernels.cross_entropy`` and ``linear_cross_entropy`` (imported at first use;
see ``dispatch``).

Layout. A program takes ROWS consecutive rows and walks them in tiles of (ROWS, BLOCK_V): BLOCK_V is the
whole row up to MAX_BLOCK_V columns, and narrow rows go several to a program so that a tile holds about
TILE elements (`tile_for`). Warps follow the tile (`warps_for`): 4 below 4096 elements, 8 at 4096, so a
thread of a wide row holds 16 columns per step, two 16-byte vectors of bf16. The full tiles of a row are
loaded without a mask (no per-element predicate, no fill value); only the last, partial tile is masked. A
program's rows past N are clamped to row N - 1 for loading (a harmless re-read) and masked at the stores.

The online softmax is held elementwise. Every lane (an element position of the tile) keeps its own running
max m and sum s = sum exp(z - m) over the columns it has seen, and a new z updates them with ONE
exponential, e = exp(-|z - m|): if z > m the new max is z and s becomes s e + 1, else s becomes s + e
(`_lane_update`). No cross-lane work happens inside the loop: the lanes of a row are combined once, at
the end, by one `tl.reduce` whose combine function merges two (max, sum) pairs the same way (`_merge`),
so a row costs one reduction however wide it is. (The interpreter runs such a reduce in Python, element
by element; under it, and only there, the lanes are combined as a max, then a rescaled sum: see
`_reduce_lanes`.) The running max starts at -FLT_MAX, not -inf, so z - m is never -inf + inf = NaN (a
lane that saw only -inf keeps s = 0, the right sum); a NaN logit reaches the sum and the max, and so the
loss, as in PyTorch.

The gradient is streamed once, g = coef (exp(z - lse) - eps/V - (1 - eps)[j = t]) (`_write_grad`); the
target column is found by comparing int32 column indices within the tile with the target's, and a row
whose coefficient is 0 (ignored) gets lse = +inf, so exp(z - lse) = 0 and g = 0 exactly, with no
per-element select.

Per-element exponentials are exp(x) = 2^(x log2 e) with the GPU's flush-to-zero ex2 (`_exp`): a term
below 2^-126 becomes 0 instead of a denormal (an absolute change below 2^-126, next to sums of at least
1 and gradients rounded far coarser), which spares the three instructions per element of the non-ftz
form. The interpreter uses tl.exp.

Kernels (the launchers are in ``cross_entropy.py`` and ``linear_cross_entropy.py``):

    row_stats_kernel       one read of the logits. STATS: m, s, z_t, sum z per row of a vocab slice (the
                           tensor-parallel primitive). LOSS: lse and the row's loss (0 if ignored).
    xent_mean_kernel       one program: counts the valid targets and/or writes mean = sum(loss) / count,
                           summing in a fixed order (no atomics: deterministic).
    xent_grad_kernel       one read of the logits, one write of the gradient: coef_i (softmax - eps/V -
                           (1 - eps)[j = t]), coef per row (ROW_COEF) or grad_loss / count for valid rows.
    xent_loss_grad_kernel  a row's loss, then its gradient written over the logits in place (the chunks
                           of ``linear_cross_entropy``): two reads and one write of the row.

Offsets are 32-bit unless a tensor spans 2**31 elements or more (the launcher sets OFF64). Float scalars
are cast to fp32 at entry (``tl.cast``, which the interpreter also accepts for a Python float): a compiler
may pass them typed fp64, and no fp64 arithmetic may follow.
"""

import triton
import triton.language as tl

from .common_triton import round_to

MAX_BLOCK_V = 4096  # columns per loop step: one step for most vocab slices, 8 for a 32k vocabulary
TILE = 4096  # elements a program holds per step; narrow rows are stacked up to it
NEG_MAX = tl.constexpr(-3.4028234663852886e38)  # -FLT_MAX: the running max before any column (see above)
LOG2E = tl.constexpr(1.4426950408889634)


def block_for(v: int) -> int:
    """Columns per loop step: the whole row up to MAX_BLOCK_V (at least 16, a comfortable minimum tile)."""
    return min(MAX_BLOCK_V, max(16, triton.next_power_of_2(v)))


def tile_for(n: int, v: int) -> tuple[int, int]:
    """(ROWS, BLOCK_V): narrow rows stacked so a tile holds about TILE elements, never more rows than n."""
    block_v = block_for(v)
    return max(1, min(TILE // block_v, triton.next_power_of_2(max(n, 1)))), block_v


def warps_for(elements: int) -> int:
    """Warps by tile size: 16 elements per thread at a full tile (ignored by the interpreter)."""
    return 8 if elements >= 4096 else 4


@triton.jit
def _exp(x, INTERPRETED: tl.constexpr):
    """exp(x) in fp32: the GPU's ex2 with denormal results flushed to 0 (see the module docstring)."""
    if INTERPRETED:
        return tl.exp(x)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * LOG2E], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _lane_update(m, s, z, INTERPRETED: tl.constexpr):
    """Fold z into each lane's (max m, sum s of exp(. - m)) with one exponential, e = exp(-|z - m|) (|.|
    and - are free operand modifiers on a GPU). z > m: the new max is z, the old sum is rescaled by
    exp(m - z) and z adds exp(0) = 1; else z adds exp(z - m). A NaN z makes e, and so s, NaN."""
    e = _exp(-tl.abs(z - m), INTERPRETED)
    return tl.maximum(m, z, propagate_nan=tl.PropagateNan.ALL), tl.where(z > m, s * e + 1.0, s + e)


@triton.jit
def _merge(m1, s1, m2, s2):
    """Two (max, sum) pairs of disjoint column sets as one: the smaller max's sum rescaled to the larger.
    (tl.exp: a few per row, not per element, so the interpreter can run this exact code too.)"""
    e = tl.exp(-tl.abs(m1 - m2))
    return tl.maximum(m1, m2, propagate_nan=tl.PropagateNan.ALL), tl.where(m1 >= m2, s1 + s2 * e, s2 + s1 * e)


@triton.jit
def _merge_with_sum(m1, s1, z1, m2, s2, z2):
    m, s = _merge(m1, s1, m2, s2)
    return m, s, z1 + z2


@triton.jit
def _rows(ROWS: tl.constexpr, N, OFF64: tl.constexpr):
    """This program's rows (ROWS,): the indices to load from (past N clamped to N - 1), and the store mask."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    if OFF64:
        rows = rows.to(tl.int64)
    return tl.minimum(rows, N - 1), rows < N


@triton.jit
def _lane_stats(z_ptr, rows, V, stride_row, WITH_SUM: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
                INTERPRETED: tl.constexpr):
    """One read of the rows: per lane (ROWS, BLOCK_V), the running max m (-FLT_MAX if the lane saw only
    -inf or nothing), sum s of exp(z - m) over the lane's columns, and their sum of z if WITH_SUM."""
    base = z_ptr + rows[:, None] * stride_row
    m = tl.full((ROWS, BLOCK_V), NEG_MAX, tl.float32)
    s = tl.zeros((ROWS, BLOCK_V), tl.float32)
    sz = tl.zeros((ROWS, BLOCK_V), tl.float32)
    v_full = V - V % BLOCK_V
    for start in range(0, v_full, BLOCK_V):  # whole tiles: no mask
        # upcast on load: fp32 math (and bf16 arithmetic is wrong under the interpreter)
        z = tl.load(base + (start + tl.arange(0, BLOCK_V))[None, :]).to(tl.float32)
        m, s = _lane_update(m, s, z, INTERPRETED)
        if WITH_SUM:
            sz += z
    if v_full < V:  # the partial last tile: masked columns read as -inf, which leaves (m, s) as they were
        cols = v_full + tl.arange(0, BLOCK_V)
        z = tl.load(base + cols[None, :], mask=(cols < V)[None, :], other=-float("inf")).to(tl.float32)
        m, s = _lane_update(m, s, z, INTERPRETED)
        if WITH_SUM:
            sz += tl.where((cols < V)[None, :], z, 0.0)
    return m, s, sz


@triton.jit
def _reduce_lanes(m, s, sz, WITH_SUM: tl.constexpr, ROWS: tl.constexpr, INTERPRETED: tl.constexpr):
    """The lanes of each row as one (max, sum of exp(z - max), sum of z) per row: one cross-lane reduction
    (sum of z 0 unless WITH_SUM). A row of -inf has sum 0 and max -FLT_MAX."""
    if INTERPRETED:
        # The interpreter runs a tl.reduce with a combine function in Python, element by element (about
        # 1000x slower than its numpy max and sum): there the same pairs are merged as max, then the sum
        # rescaled to it. The same numbers up to the order of the sum; the GPU's single reduction below is
        # run under the interpreter on small tiles by test_one_reduction_merges_lanes.
        m_row = tl.max(m, axis=1)
        s_row = tl.sum(s * tl.exp(m - m_row[:, None]), axis=1)  # m >= -FLT_MAX: never exp(NaN)
        sz_row = tl.sum(sz, axis=1)
    elif WITH_SUM:
        m_row, s_row, sz_row = tl.reduce((m, s, sz), 1, _merge_with_sum)
    else:
        m_row, s_row = tl.reduce((m, s), 1, _merge)
        sz_row = tl.zeros((ROWS,), tl.float32)
    return m_row, s_row, sz_row


@triton.jit
def _row_stats(z_ptr, rows, V, stride_row, WITH_SUM: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
               INTERPRETED: tl.constexpr):
    """Per row (ROWS,): max m, sum of exp(z - m), and the sum of z if WITH_SUM (else 0)."""
    m, s, sz = _lane_stats(z_ptr, rows, V, stride_row, WITH_SUM, ROWS, BLOCK_V, INTERPRETED)
    return _reduce_lanes(m, s, sz, WITH_SUM, ROWS, INTERPRETED)


@triton.jit
def _local_target(t, vocab_start, V):
    """The target's column in this slice as int32, -1 where the slice does not hold it (also an ignored
    target): compared with int32 column indices, one instruction per element, not a 64-bit compare."""
    local_t = t - vocab_start
    return tl.where((local_t >= 0) & (local_t < V), local_t, -1).to(tl.int32)


@triton.jit
def _target_logit(z_ptr, rows, stride_row, local_t):
    """z[row, local_t] in fp32 where local_t >= 0, else 0: one load per row."""
    return tl.load(z_ptr + rows * stride_row + local_t, mask=local_t >= 0, other=0.0).to(tl.float32)


@triton.jit
def _row_loss(lse, z_t, sz, valid, smoothing, inv_v, SMOOTH: tl.constexpr):
    """(lse - z_t) + eps (z_t - sum z / V) where the target counts, else 0 (where, not a product: an
    ignored row's loss may be inf or NaN). The smoothing term only when eps != 0 (0 * inf = NaN)."""
    loss = lse - z_t
    if SMOOTH:
        loss += smoothing * (z_t - sz * inv_v)
    return tl.where(valid, loss, 0.0)


@triton.jit
def _grad_tile(z, tile_t, lse, coef, smooth, hit, SMOOTH: tl.constexpr, BLOCK_V: tl.constexpr,
               INTERPRETED: tl.constexpr):
    """coef (exp(z - lse) - smooth - hit [col = tile_t]) for a tile, rows broadcast from (ROWS,); tile_t is
    the target's column relative to the tile's first (so the compare is with constants, no per-element add)."""
    g = _exp(z - lse[:, None], INTERPRETED)  # the softmax, recomputed from the log-sum-exp
    if SMOOTH:
        g -= smooth
    g = tl.where(tl.arange(0, BLOCK_V)[None, :] == tile_t[:, None], g - hit, g)
    return coef[:, None] * g


@triton.jit
def _write_grad(z_ptr, stride_row, g_ptr, g_stride, rows, row_mask, V, lse, local_t, coef, smooth, hit,
                SMOOTH: tl.constexpr, BLOCK_V: tl.constexpr, INTERPRETED: tl.constexpr):
    """Stream the rows once: g = coef (softmax - smooth - hit [j = local_t]) in g's dtype. A row with coef
    0 gets exact zeros whatever its lse (a row of -inf logits would give 0 * NaN): its lse is replaced by
    +inf, so exp(z - lse) = 0 there (a per-row select instead of a per-element one)."""
    lse = tl.where(coef != 0.0, lse, float("inf"))
    z_base = z_ptr + rows[:, None] * stride_row
    g_base = g_ptr + rows[:, None] * g_stride
    out_ty = g_ptr.dtype.element_ty
    v_full = V - V % BLOCK_V
    for start in range(0, v_full, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(z_base + cols[None, :]).to(tl.float32)
        g = _grad_tile(z, local_t - start, lse, coef, smooth, hit, SMOOTH, BLOCK_V, INTERPRETED)
        tl.store(g_base + cols[None, :], round_to(g, out_ty, INTERPRETED), mask=row_mask[:, None])
    if v_full < V:
        cols = v_full + tl.arange(0, BLOCK_V)
        z = tl.load(z_base + cols[None, :], mask=(cols < V)[None, :], other=0.0).to(tl.float32)
        g = _grad_tile(z, local_t - v_full, lse, coef, smooth, hit, SMOOTH, BLOCK_V, INTERPRETED)
        tl.store(g_base + cols[None, :], round_to(g, out_ty, INTERPRETED),
                 mask=row_mask[:, None] & (cols < V)[None, :])


@triton.jit
def row_stats_kernel(z_ptr, t_ptr, m_ptr, s_ptr, zt_ptr, sz_ptr, N, V, stride_row, vocab_start, ignore_index,
                     smoothing, LOSS: tl.constexpr, SMOOTH: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_V: tl.constexpr, OFF64: tl.constexpr, INTERPRETED: tl.constexpr):
    """Rows [pid*ROWS, pid*ROWS + ROWS) of z (N, V), columns adjacent, rows stride_row apart.

    LOSS false (a vocab slice starting at vocab_start): m_ptr, s_ptr, zt_ptr, sz_ptr get the row's max,
    sum of exp(z - max), target logit (0 if this slice does not hold it) and sum of z.
    LOSS true (the whole vocabulary, vocab_start 0): m_ptr gets lse = max + log(sum) and s_ptr the row's
    loss, 0 where t = ignore_index; zt_ptr and sz_ptr are unused.
    """
    smoothing = tl.cast(smoothing, tl.float32)
    rows, row_mask = _rows(ROWS, N, OFF64)
    t = tl.load(t_ptr + rows)
    z_t = _target_logit(z_ptr, rows, stride_row, _local_target(t, vocab_start, V))
    m, s, sz = _row_stats(z_ptr, rows, V, stride_row, SMOOTH or not LOSS, ROWS, BLOCK_V, INTERPRETED)
    if LOSS:
        lse = m + tl.log(s)  # a row of -inf: -FLT_MAX + log 0 = -inf, as the definition gives
        tl.store(m_ptr + rows, lse, mask=row_mask)
        tl.store(s_ptr + rows, _row_loss(lse, z_t, sz, t != ignore_index, smoothing, 1.0 / V, SMOOTH),
                 mask=row_mask)
    else:
        tl.store(m_ptr + rows, tl.where(s == 0.0, -float("inf"), m), mask=row_mask)  # a row of -inf: max -inf
        tl.store(s_ptr + rows, s, mask=row_mask)
        tl.store(zt_ptr + rows, z_t, mask=row_mask)
        tl.store(sz_ptr + rows, sz, mask=row_mask)


@triton.jit
def xent_mean_kernel(loss_ptr, t_ptr, count_ptr, out_ptr, N, ignore_index, COUNT: tl.constexpr,
                     MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """One program. COUNT: count_ptr[0] = number of t != ignore_index, in fp32 (read from count_ptr
    otherwise). MEAN: out_ptr[0] = sum(loss) / max(count, 1), so 0 when every row is ignored. Per-lane
    partials over the blocks, one reduction at the end: the same order on every run."""
    total = tl.zeros((BLOCK,), tl.float32)
    valid = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, N, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < N
        if COUNT:
            t = tl.load(t_ptr + idx, mask=mask, other=ignore_index)
            valid += (t != ignore_index).to(tl.int32)
        if MEAN:
            total += tl.load(loss_ptr + idx, mask=mask, other=0.0)
    if COUNT:
        count = tl.sum(valid, axis=0).to(tl.float32)
        tl.store(count_ptr, count)
    else:
        count = tl.load(count_ptr)
    if MEAN:
        tl.store(out_ptr, tl.sum(total, axis=0) / tl.maximum(count, 1.0))


@triton.jit
def xent_grad_kernel(z_ptr, lse_ptr, t_ptr, coef_ptr, count_ptr, g_ptr, N, V, stride_row, vocab_start,
                     ignore_index, smooth, hit, ROW_COEF: tl.constexpr, SMOOTH: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_V: tl.constexpr, OFF64: tl.constexpr, INTERPRETED: tl.constexpr):
    """g[i, j] = coef_i (exp(z_ij - lse_i) - smooth - hit [j = t_i - vocab_start]); g contiguous (N, V).

    smooth = eps / V_global (SMOOTH: whether eps != 0), hit = 1 - eps. ROW_COEF: coef_i = coef_ptr[i]
    (the caller zeroes ignored rows). Otherwise coef_i = coef_ptr[0] / max(count_ptr[0], 1) where
    t_i != ignore_index, else 0: the gradient of the mean loss times the incoming gradient coef_ptr[0].
    """
    smooth = tl.cast(smooth, tl.float32)
    hit = tl.cast(hit, tl.float32)
    rows, row_mask = _rows(ROWS, N, OFF64)
    lse = tl.load(lse_ptr + rows)
    t = tl.load(t_ptr + rows)
    if ROW_COEF:
        coef = tl.load(coef_ptr + rows)
    else:
        scale = tl.load(coef_ptr).to(tl.float32) / tl.maximum(tl.load(count_ptr), 1.0)
        coef = tl.where(t != ignore_index, scale, 0.0)
    _write_grad(z_ptr, stride_row, g_ptr, V, rows, row_mask, V, lse, _local_target(t, vocab_start, V), coef,
                smooth, hit, SMOOTH, BLOCK_V, INTERPRETED)


@triton.jit
def xent_loss_grad_kernel(z_ptr, t_ptr, count_ptr, loss_ptr, N, V, ignore_index, smoothing,
                          SMOOTH: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr, OFF64: tl.constexpr,
                          INTERPRETED: tl.constexpr):
    """Rows of z (N, V) contiguous, the whole vocabulary: loss_ptr[i] = row i's loss (0 if ignored), and
    z[i] overwritten with d mean-loss / d z[i] = (softmax - eps/V - (1 - eps)[j = t_i]) / max(count, 1)
    for valid rows, 0 for ignored ones (count_ptr[0]: the valid rows of the whole batch, not the chunk).

    In place is safe: a row is read in full (the target's logit, then the statistics, which end in a
    reduction across the program's threads) by the program that then overwrites it, and each element of
    the second pass is loaded by the thread that then stores to it. Rows clamped to N - 1 only read.
    """
    smoothing = tl.cast(smoothing, tl.float32)
    rows, row_mask = _rows(ROWS, N, OFF64)
    t = tl.load(t_ptr + rows)
    valid = t != ignore_index
    local_t = _local_target(t, 0, V)
    # z_t before the statistics: their cross-lane reduction is the point every thread of the program has
    # passed before any thread stores a gradient, so no thread can read an overwritten logit here
    z_t = _target_logit(z_ptr, rows, V, local_t)
    m, s, sz = _row_stats(z_ptr, rows, V, V, SMOOTH, ROWS, BLOCK_V, INTERPRETED)
    lse = m + tl.log(s)
    inv_v = 1.0 / V
    tl.store(loss_ptr + rows, _row_loss(lse, z_t, sz, valid, smoothing, inv_v, SMOOTH), mask=row_mask)
    coef = tl.where(valid, 1.0 / tl.maximum(tl.load(count_ptr), 1.0), 0.0)
    _write_grad(z_ptr, V, z_ptr, V, rows, row_mask, V, lse, local_t, coef, smoothing * inv_v, 1.0 - smoothing,
                SMOOTH, BLOCK_V, INTERPRETED)
