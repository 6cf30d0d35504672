"""Triton kernels for ``minipar.kernels.cross_entropy`` (imported at first use; see ``dispatch``).

One program per row of logits, looping over the vocabulary in blocks of
BLOCK_V columns, so a row of any length streams through registers and the
probabilities are never written anywhere.
"""

import triton
import triton.language as tl

from .common_triton import round_to

MAX_BLOCK_V = 4096  # columns per loop step: one step for most vocab slices, ~13 for a 50k vocabulary


def block_for(v: int) -> int:
    """Columns per loop step: the whole row up to MAX_BLOCK_V (at least 16, a comfortable minimum tile)."""
    return min(MAX_BLOCK_V, max(16, triton.next_power_of_2(v)))


def warps_for(block_v: int) -> int:
    """More warps for wide blocks, so each thread holds a handful of columns (ignored by the interpreter)."""
    return 8 if block_v >= 2048 else 4


@triton.jit
def row_stats_kernel(z_ptr, t_ptr, m_ptr, s_ptr, zt_ptr, sz_ptr, V, stride_row, vocab_start,
                     BLOCK_V: tl.constexpr):
    """Program i, one pass over row i: m = max_j z, s = sum_j exp(z - m), z_t (0 if t is not here), sum_j z."""
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride can pass 2**31 on large inputs
    z_row = z_ptr + row * stride_row
    m = -float("inf")  # running max of the blocks seen so far
    s = 0.0            # sum of exp(z - m) over those blocks, relative to the running max
    sz = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        # upcast on load: fp32 math (and bf16 arithmetic is wrong under the interpreter)
        z = tl.load(z_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # A block (or a whole prefix) of -inf logits leaves m_new = -inf; shifting by 0 instead keeps
        # exp(-inf - -inf) = NaN out of the sum: those terms are exp(-inf) = 0 as they should be.
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
        sz += tl.sum(tl.where(mask, z, 0.0), axis=0)
        m = m_new
    # The target's logit: one scalar load, on the rank whose slice holds it.
    local_t = tl.load(t_ptr + row) - vocab_start
    here = (local_t >= 0) & (local_t < V)
    z_t = tl.load(z_row + local_t, mask=here, other=0.0).to(tl.float32)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(zt_ptr + row, z_t)
    tl.store(sz_ptr + row, sz)


@triton.jit
def xent_grad_kernel(z_ptr, lse_ptr, t_ptr, coef_ptr, g_ptr, V, stride_row, vocab_start, smooth, hit,
                     BLOCK_V: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program i: g[i, j] = coef_i * (exp(z_ij - lse_i) - smooth - hit [j = t_i - vocab_start]).

    smooth = eps / V_global, hit = 1 - eps. g is contiguous (N, V).
    """
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_row
    g_row = g_ptr + row * V
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row)
    local_t = tl.load(t_ptr + row) - vocab_start  # outside [0, V) on the ranks that do not hold t
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(z - lse) - smooth  # the softmax, recomputed from the saved log-sum-exp
        g = tl.where(cols == local_t, g - hit, g)
        tl.store(g_row + cols, round_to(coef * g, g_ptr.dtype.element_ty, INTERPRETED), mask=mask)
