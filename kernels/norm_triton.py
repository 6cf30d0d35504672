"""Triton kernels for ``minipar.kernels.norm`` (imported at first use; see ``dispatch``).

LayerNorm and RMSNorm share one body per direction: RMSNorm is LayerNorm with
mu = 0 and no bias, selected by the constexpr ``IS_RMS``. The four named
kernels are thin entry points, so a profile (and ``dispatch.launches``) tells
the two norms apart.

Every loop walks a row in column blocks of ``BLOCK_D``; a row of up to
``MAX_BLOCK_D`` columns is one block, so the loop runs once. Loads upcast to
fp32 (bf16 arithmetic is wrong under the interpreter, and the sums want fp32
anyway); low-precision stores go through ``round_to``.
"""

import triton
import triton.language as tl

from .common_triton import round_to

MAX_BLOCK_D = 8192  # the widest row held in one block; wider rows loop over column blocks


def block_for(d: int) -> int:
    """Columns per block: the whole row up to ``MAX_BLOCK_D``."""
    return min(MAX_BLOCK_D, triton.next_power_of_2(d))


def warps_for(block_d: int) -> int:
    """Warps per program: at most 16 fp32 values per thread for each live block-sized array."""
    return min(16, max(4, block_d // 256))


# ----------------------------------------------------------------------------- forward

@triton.jit
def layer_norm_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, D, eps,
                          HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program r: y[r] = (x[r] - mu) * rstd * w + b, and mean[r] = mu (fp32-rounded), rstd[r] = rstd."""
    _norm_fwd_row(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, D, eps, HAS_W, HAS_B, False, BLOCK_D, INTERPRETED)


@triton.jit
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, D, eps, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program r: y[r] = x[r] * rstd * w, and rstd[r] = rstd."""
    # b_ptr and mean_ptr are never touched when IS_RMS: any pointer fills their places
    _norm_fwd_row(x_ptr, w_ptr, x_ptr, y_ptr, rstd_ptr, rstd_ptr, D, eps, HAS_W, False, True, BLOCK_D, INTERPRETED)


@triton.jit
def _norm_fwd_row(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, D, eps,
                  HAS_W: tl.constexpr, HAS_B: tl.constexpr, IS_RMS: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: row * D can pass 2**31 on large inputs
    x_row = x_ptr + row * D
    y_row = y_ptr + row * D

    mu = 0.0
    if not IS_RMS:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for start in range(0, D, BLOCK_D):
            cols = start + tl.arange(0, BLOCK_D)
            acc += tl.load(x_row + cols, mask=cols < D, other=0.0).to(tl.float32)
        mu = tl.sum(acc, axis=0) / D
        tl.store(mean_ptr + row, mu)

    # The variance from a second pass over xc = x - mu, never mean(x^2) - mu^2,
    # which cancels when |mu| is large against the spread. And corrected: mu is
    # the mean rounded to fp32, so every xc is off by the same rounding, which
    # rstd amplifies; c = mean(xc) measures it, and xc - c are the deviations
    # to fp32 accuracy (the corrected two-pass algorithm). RMSNorm: c = 0.
    # Sums accumulate elementwise and are reduced once after the loop: one
    # cross-thread reduction per row, however many blocks.
    acc_sq = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_c = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = cols < D
        xc = tl.where(mask, tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) - mu, 0.0)
        acc_sq += xc * xc
        if not IS_RMS:
            acc_c += xc
    c = 0.0
    if not IS_RMS:
        c = tl.sum(acc_c, axis=0) / D
    rstd = tl.rsqrt(tl.sum(acc_sq, axis=0) / D - c * c + eps)  # mean((xc - c)^2) = mean(xc^2) - c^2
    tl.store(rstd_ptr + row, rstd)

    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = cols < D
        y = (tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) - mu - c) * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, round_to(y, y_ptr.dtype.element_ty, INTERPRETED), mask=mask)


# ----------------------------------------------------------------------------- backward

@triton.jit
def layer_norm_bwd_kernel(x_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
                          n_rows, D, rows_per_program,
                          HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program (p, j): dx of rows [p R, p R + R) in column block j; their dw, db sums into row p of the partials."""
    _norm_bwd_rows(x_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
                   n_rows, D, rows_per_program, HAS_W, HAS_B, False, BLOCK_D, INTERPRETED)


@triton.jit
def rms_norm_bwd_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, D, rows_per_program,
                        HAS_W: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program (p, j): dx of rows [p R, p R + R) in column block j; their dw sums into row p of the partials."""
    _norm_bwd_rows(x_ptr, w_ptr, dy_ptr, rstd_ptr, rstd_ptr, dx_ptr, dw_part_ptr, dw_part_ptr,
                   n_rows, D, rows_per_program, HAS_W, False, True, BLOCK_D, INTERPRETED)


@triton.jit
def _norm_bwd_rows(x_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
                   n_rows, D, rows_per_program,
                   HAS_W: tl.constexpr, HAS_B: tl.constexpr, IS_RMS: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr):
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    # This program's share of dw and db stays in registers across its rows and
    # is written once to its own row of the partials: no atomics, no races,
    # and the caller's sum over programs is deterministic.
    dw_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_D], dtype=tl.float32)

    row_start = p.to(tl.int64) * rows_per_program  # int64, so is row: row * D can pass 2**31
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        x_row = x_ptr + row * D
        dy_row = dy_ptr + row * D
        mu = 0.0
        if not IS_RMS:
            mu = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)

        # mean(g xhat) and mean(g) are over the whole row, which may span several
        # column blocks; every program of the row computes them (the row is
        # read again from cache when it is one block, the usual case). With
        # xc = x - mu and the forward's correction c = mean(xc) (see there):
        # mean(g xhat) = (mean(g xc) - c mean(g)) rstd. Each block is reduced as
        # it is read: block-sized accumulators here, next to dw_acc and db_acc,
        # would spill registers at BLOCK_D = 8192.
        sum_gx = 0.0
        sum_g = 0.0
        sum_c = 0.0
        for start in range(0, D, BLOCK_D):
            k = start + tl.arange(0, BLOCK_D)
            k_mask = k < D
            xc = tl.where(k_mask, tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32) - mu, 0.0)
            g = tl.load(dy_row + k, mask=k_mask, other=0.0).to(tl.float32)
            if HAS_W:
                g = g * tl.load(w_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
            sum_gx += tl.sum(g * xc, axis=0)
            if not IS_RMS:
                sum_g += tl.sum(g, axis=0)
                sum_c += tl.sum(xc, axis=0)
        c = sum_c / D  # both 0 for RMSNorm: no mean was subtracted, so no mean(g) term
        mean_g = sum_g / D
        mean_gx = (sum_gx / D - c * mean_g) * rstd

        xhat = (tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) - mu - c) * rstd
        dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        g = dy
        if HAS_W:  # reloaded per row (from cache): held across rows, w would spill registers at BLOCK_D = 8192
            g = dy * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dx = (g - xhat * mean_gx - mean_g) * rstd
        tl.store(dx_ptr + row * D + cols, round_to(dx, dx_ptr.dtype.element_ty, INTERPRETED), mask=mask)
        if HAS_W:
            dw_acc += dy * xhat
        if HAS_B:
            db_acc += dy

    if HAS_W:
        tl.store(dw_part_ptr + p * D + cols, dw_acc, mask=mask)
    if HAS_B:
        tl.store(db_part_ptr + p * D + cols, db_acc, mask=mask)
