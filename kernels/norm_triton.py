"""Triton kernels for ``minipar.kernels.norm`` and ``add_norm`` (imported at first use; see ``dispatch``).

LayerNorm and RMSNorm share one body per direction: RMSNorm is LayerNorm with
mu = 0 and no bias (constexpr ``IS_RMS``), and the residual add in front of
either is ``HAS_DELTA`` (forward) / ``HAS_DH`` (backward). The ``*_kernel``
functions are thin entry points, so a profile (and ``dispatch.launches``)
tells the variants apart. The launchers in ``norm`` choose every launch shape.

Tiles are 2-D, [ROWS, BLOCK_D]: a program normalises ROWS whole rows (several
when rows are narrow). A row that fits one block (``SINGLE``, up to
``norm.MAX_BLOCK_D`` columns) is loaded once into registers, and its mean,
variance and output all come from that copy; the two sums of one pass share
one two-operand ``tl.reduce`` (``_sum2``). Wider rows loop over column blocks
(three passes forward, two backward).

The backward is persistent: G programs (a small multiple of the SM count)
loop over row tiles pid, pid + G, ...; the next tile's loads are issued
before the current tile's math, so its memory traffic overlaps the current
reductions. Each program keeps its share of dw and db in fp32 registers and
writes it once, to its own row of a (G, D) partial buffer (wide rows:
accumulated in that row in memory, which only this program touches);
`norm_grad_sum_kernel` sums the G partials per column in a fixed order and
writes dw/db in the parameters' dtypes. No float atomics: deterministic.

Offsets are 32-bit unless a tensor has 2**31 elements or more (``LONG``).
Loads upcast to fp32 (bf16 arithmetic is wrong under the interpreter, and the
sums want fp32 anyway); low-precision stores go through ``round_to``. Scalars
are cast to fp32 on entry: a caller passing fp64 (Inductor) adds no fp64 math.
"""

import triton
import triton.language as tl

from .common_triton import round_to

# ----------------------------------------------------------------------------- shared pieces


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _sum2(a, b, axis: tl.constexpr, INTERPRETED: tl.constexpr):
    """(sum of a, sum of b) along ``axis``: compiled, one two-operand reduction, so the two share their
    shuffles' rounds and one pass through shared memory. The interpreter runs a tuple reduction's
    combine function in Python per element; there, two sums."""
    if INTERPRETED:
        return tl.sum(a, axis=axis), tl.sum(b, axis=axis)
    return tl.reduce((a, b), axis, _add2)


@triton.jit
def _rows(first_row, n_rows, ROWS: tl.constexpr, LONG: tl.constexpr):
    """Row indices first_row.. (ROWS,), int64 if LONG, and which of them exist."""
    rows = first_row + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    if LONG:
        rows = rows.to(tl.int64)
    return rows, row_mask


@triton.jit
def _load_input(x_ptr, delta_ptr, h_ptr, offs, mask, HAS_DELTA: tl.constexpr, STORE_H: tl.constexpr,
                INTERPRETED: tl.constexpr):
    """The rows to normalise, in fp32: x, or h = x + delta rounded once to h's dtype (stored if STORE_H)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        h = round_to(x + tl.load(delta_ptr + offs, mask=mask, other=0.0).to(tl.float32),
                     h_ptr.dtype.element_ty, INTERPRETED)
        if STORE_H:
            tl.store(h_ptr + offs, h, mask=mask)
        x = h.to(tl.float32)
    return x


# ----------------------------------------------------------------------------- forward

@triton.jit
def layer_norm_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_rows, D, eps,
                          HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                          SINGLE: tl.constexpr, LONG: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program i, rows r of [i ROWS, i ROWS + ROWS): y[r] = (x[r] - mu) rstd w + b; mean[:, r] = (mu, c), rstd[r]."""
    _norm_fwd(x_ptr, x_ptr, x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_rows, D, eps,
              False, HAS_W, HAS_B, False, ROWS, BLOCK_D, SINGLE, LONG, INTERPRETED)


@triton.jit
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, D, eps,
                        HAS_W: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                        SINGLE: tl.constexpr, LONG: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program i, rows r of [i ROWS, i ROWS + ROWS): y[r] = x[r] rstd w; rstd[r]."""
    # pointers a constexpr flag keeps unread (delta, h, b, mean) are filled with any pointer
    _norm_fwd(x_ptr, x_ptr, x_ptr, w_ptr, x_ptr, y_ptr, rstd_ptr, rstd_ptr, n_rows, D, eps,
              False, HAS_W, False, True, ROWS, BLOCK_D, SINGLE, LONG, INTERPRETED)


@triton.jit
def add_layer_norm_fwd_kernel(x_ptr, delta_ptr, h_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_rows, D, eps,
                              HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                              SINGLE: tl.constexpr, LONG: tl.constexpr, INTERPRETED: tl.constexpr):
    """As layer_norm_fwd_kernel of h = x + delta, and h stored."""
    _norm_fwd(x_ptr, delta_ptr, h_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_rows, D, eps,
              True, HAS_W, HAS_B, False, ROWS, BLOCK_D, SINGLE, LONG, INTERPRETED)


@triton.jit
def add_rms_norm_fwd_kernel(x_ptr, delta_ptr, h_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, D, eps,
                            HAS_W: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                            SINGLE: tl.constexpr, LONG: tl.constexpr, INTERPRETED: tl.constexpr):
    """As rms_norm_fwd_kernel of h = x + delta, and h stored."""
    _norm_fwd(x_ptr, delta_ptr, h_ptr, w_ptr, x_ptr, y_ptr, rstd_ptr, rstd_ptr, n_rows, D, eps,
              True, HAS_W, False, True, ROWS, BLOCK_D, SINGLE, LONG, INTERPRETED)


@triton.jit
def _norm_fwd(x_ptr, delta_ptr, h_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_rows, D, eps,
              HAS_DELTA: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, IS_RMS: tl.constexpr,
              ROWS: tl.constexpr, BLOCK_D: tl.constexpr, SINGLE: tl.constexpr, LONG: tl.constexpr,
              INTERPRETED: tl.constexpr):
    # The variance is never mean(x^2) - mu^2, which cancels when |mu| is large
    # against the spread, but mean(xc^2) over xc = x - mu. And corrected: mu is
    # the mean rounded to fp32, so every xc is off by the same rounding, which
    # rstd amplifies; c = mean(xc) measures it, xc - c are the deviations to
    # fp32 accuracy, and mean((xc - c)^2) = mean(xc^2) - c^2 (the corrected
    # two-pass algorithm). The mean is saved as the unevaluated sum mu + c
    # (mean[0], mean[1]): mu + c rounded to fp32 would be mu again.
    # RMSNorm: mu = c = 0.
    eps = tl.cast(eps, tl.float32)  # Inductor may pass an fp64 scalar: no fp64 arithmetic follows
    first_row = tl.program_id(0) * ROWS
    y_ty = y_ptr.dtype.element_ty
    rows, row_mask = _rows(first_row, n_rows, ROWS, LONG)
    row_offs = rows[:, None] * D  # [ROWS, 1]
    if SINGLE:
        cols = tl.arange(0, BLOCK_D)[None, :]
        offs = row_offs + cols
        mask = row_mask[:, None] & (cols < D)
        x = _load_input(x_ptr, delta_ptr, h_ptr, offs, mask, HAS_DELTA, True, INTERPRETED)
        if IS_RMS:
            xc = x
            var = tl.sum(x * x, axis=1) / D
        else:
            mu = tl.sum(x, axis=1) / D
            xc = tl.where(mask, x - mu[:, None], 0.0)
            sum_c, sum_sq = _sum2(xc, xc * xc, 1, INTERPRETED)
            c = sum_c / D
            var = sum_sq / D - c * c
            xc = xc - c[:, None]
        rstd = tl.rsqrt(var + eps)
        y = xc * rstd[:, None]
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, round_to(y, y_ty, INTERPRETED), mask=mask)
    else:
        # Wide rows: the same sums, accumulated elementwise over column blocks
        # and reduced once after each loop.
        mu = tl.zeros([ROWS], dtype=tl.float32)
        if not IS_RMS:
            acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
            for start in range(0, D, BLOCK_D):
                cols = start + tl.arange(0, BLOCK_D)[None, :]
                offs = row_offs + cols
                mask = row_mask[:, None] & (cols < D)
                acc += _load_input(x_ptr, delta_ptr, h_ptr, offs, mask, HAS_DELTA, False, INTERPRETED)
            mu = tl.sum(acc, axis=1) / D
        acc_c = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        acc_sq = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        for start in range(0, D, BLOCK_D):
            cols = start + tl.arange(0, BLOCK_D)[None, :]
            offs = row_offs + cols
            mask = row_mask[:, None] & (cols < D)
            xc = tl.where(mask, _load_input(x_ptr, delta_ptr, h_ptr, offs, mask, HAS_DELTA, False, INTERPRETED)
                          - mu[:, None], 0.0)
            acc_c += xc
            acc_sq += xc * xc
        c = tl.zeros([ROWS], dtype=tl.float32)
        if IS_RMS:
            sum_sq = tl.sum(acc_sq, axis=1)
        else:
            sum_c, sum_sq = _sum2(acc_c, acc_sq, 1, INTERPRETED)
            c = sum_c / D
        rstd = tl.rsqrt(sum_sq / D - c * c + eps)
        for start in range(0, D, BLOCK_D):
            cols = start + tl.arange(0, BLOCK_D)[None, :]
            offs = row_offs + cols
            mask = row_mask[:, None] & (cols < D)
            x = _load_input(x_ptr, delta_ptr, h_ptr, offs, mask, HAS_DELTA, True, INTERPRETED)
            y = (x - mu[:, None] - c[:, None]) * rstd[:, None]
            if HAS_W:
                y = y * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
            if HAS_B:
                y = y + tl.load(b_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
            tl.store(y_ptr + offs, round_to(y, y_ty, INTERPRETED), mask=mask)
    if not IS_RMS:
        tl.store(mean_ptr + rows, mu, mask=row_mask)
        tl.store(mean_ptr + n_rows + rows, c, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


# ----------------------------------------------------------------------------- backward

@triton.jit
def layer_norm_bwd_kernel(x_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr, n_rows, D,
                          HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                          SINGLE: tl.constexpr, LONG: tl.constexpr, INTERPRETED: tl.constexpr):
    """Persistent program p: dx of its row tiles; their dy xhat and dy sums into row p of the partials."""
    _norm_bwd(x_ptr, w_ptr, dy_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr, n_rows, D,
              False, HAS_W, HAS_B, False, ROWS, BLOCK_D, SINGLE, LONG, INTERPRETED)


@triton.jit
def rms_norm_bwd_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, D,
                        HAS_W: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                        SINGLE: tl.constexpr, LONG: tl.constexpr, INTERPRETED: tl.constexpr):
    """Persistent program p: dx of its row tiles; their dy xhat sums into row p of the partials."""
    _norm_bwd(x_ptr, w_ptr, dy_ptr, dy_ptr, rstd_ptr, rstd_ptr, dx_ptr, dw_part_ptr, dw_part_ptr, n_rows, D,
              False, HAS_W, False, True, ROWS, BLOCK_D, SINGLE, LONG, INTERPRETED)


@triton.jit
def add_layer_norm_bwd_kernel(x_ptr, w_ptr, dy_ptr, dh_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
                              n_rows, D, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROWS: tl.constexpr,
                              BLOCK_D: tl.constexpr, SINGLE: tl.constexpr, LONG: tl.constexpr,
                              INTERPRETED: tl.constexpr):
    """As layer_norm_bwd_kernel, with dh (the gradient of h = x + delta) added to dx before the one rounding."""
    _norm_bwd(x_ptr, w_ptr, dy_ptr, dh_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr, n_rows, D,
              True, HAS_W, HAS_B, False, ROWS, BLOCK_D, SINGLE, LONG, INTERPRETED)


@triton.jit
def add_rms_norm_bwd_kernel(x_ptr, w_ptr, dy_ptr, dh_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, D,
                            HAS_W: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                            SINGLE: tl.constexpr, LONG: tl.constexpr, INTERPRETED: tl.constexpr):
    """As rms_norm_bwd_kernel, with dh added to dx before the one rounding."""
    _norm_bwd(x_ptr, w_ptr, dy_ptr, dh_ptr, rstd_ptr, rstd_ptr, dx_ptr, dw_part_ptr, dw_part_ptr, n_rows, D,
              True, HAS_W, False, True, ROWS, BLOCK_D, SINGLE, LONG, INTERPRETED)


@triton.jit
def _row_stats(mean_ptr, rstd_ptr, rows, row_mask, n_rows, IS_RMS: tl.constexpr):
    """What the forward saved for these rows: mu, c (0 for RMSNorm) and rstd, each (ROWS,) fp32."""
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    if IS_RMS:
        mu = tl.zeros_like(rstd)
        c = tl.zeros_like(rstd)
    else:
        mu = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        c = tl.load(mean_ptr + n_rows + rows, mask=row_mask, other=0.0)
    return mu, c, rstd


@triton.jit
def _norm_bwd(x_ptr, w_ptr, dy_ptr, dh_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr, n_rows, D,
              HAS_DH: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, IS_RMS: tl.constexpr,
              ROWS: tl.constexpr, BLOCK_D: tl.constexpr, SINGLE: tl.constexpr, LONG: tl.constexpr,
              INTERPRETED: tl.constexpr):
    # With xhat = (x - mu - c) rstd and g = dy w (see norm.py):
    #   dx = rstd (g - xhat mean(g xhat) - mean(g)) [+ dh],  dw += dy xhat,  db += dy.
    # Zero-filled columns and rows past the end have dy = 0, so g, dy xhat and
    # dy add nothing; the stores are masked.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, ROWS)
    dx_ty = dx_ptr.dtype.element_ty
    if LONG:
        part_row = pid.to(tl.int64) * D
    else:
        part_row = pid * D
    if SINGLE:
        cols = tl.arange(0, BLOCK_D)
        col_mask = cols < D
        w = tl.full([BLOCK_D], 1.0, tl.float32)
        if HAS_W:  # loaded once, held across every row of this program
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        db_acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        # Software pipelining by hand: tile t + G is loaded (in its storage
        # dtype) before tile t's reductions, so its latency hides behind them.
        # Its rows and offsets are this tile's moved on by G tiles.
        rows, row_mask = _rows(pid * ROWS, n_rows, ROWS, LONG)
        offs = rows[:, None] * D + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0)
        mu, c, rstd = _row_stats(mean_ptr, rstd_ptr, rows, row_mask, n_rows, IS_RMS)
        step = n_programs * ROWS
        if LONG:
            step = step.to(tl.int64)  # step * D passes 2**31 when the tensor does
        for tile in range(pid, n_tiles, n_programs):
            n_rows_idx = rows + step
            n_row_mask = n_rows_idx < n_rows
            n_offs = offs + step * D
            n_mask = n_row_mask[:, None] & col_mask[None, :]
            n_x = tl.load(x_ptr + n_offs, mask=n_mask, other=0.0)
            n_dy = tl.load(dy_ptr + n_offs, mask=n_mask, other=0.0)
            n_mu, n_c, n_rstd = _row_stats(mean_ptr, rstd_ptr, n_rows_idx, n_row_mask, n_rows, IS_RMS)

            xhat = (x.to(tl.float32) - mu[:, None] - c[:, None]) * rstd[:, None]
            dyf = dy.to(tl.float32)
            g = dyf * w[None, :]
            if IS_RMS:
                mean_gx = tl.sum(g * xhat, axis=1) / D
                dx = (g - xhat * mean_gx[:, None]) * rstd[:, None]
            else:
                sum_gx, sum_g = _sum2(g * xhat, g, 1, INTERPRETED)
                dx = (g - xhat * (sum_gx / D)[:, None] - (sum_g / D)[:, None]) * rstd[:, None]
            if HAS_DH:
                dx += tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + offs, round_to(dx, dx_ty, INTERPRETED), mask=mask)
            dw_acc += dyf * xhat
            db_acc += dyf

            rows, offs, mask, x, dy, mu, c, rstd = n_rows_idx, n_offs, n_mask, n_x, n_dy, n_mu, n_c, n_rstd
        # this program's share of dw and db, written once to its own row of the partials
        if HAS_W:
            tl.store(dw_part_ptr + part_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
        if HAS_B:
            tl.store(db_part_ptr + part_row + cols, tl.sum(db_acc, axis=0), mask=col_mask)
    else:
        # Wide rows: a pass for the two row sums, a pass for dx; the partials
        # accumulate in this program's own row of the buffers (set on its first
        # tile, read back and added to after), so still no other program's
        # writes are involved.
        for tile in range(pid, n_tiles, n_programs):
            rows, row_mask = _rows(tile * ROWS, n_rows, ROWS, LONG)
            row_offs = rows[:, None] * D
            mu, c, rstd = _row_stats(mean_ptr, rstd_ptr, rows, row_mask, n_rows, IS_RMS)
            acc_gx = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
            acc_g = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
            for start in range(0, D, BLOCK_D):
                cols = start + tl.arange(0, BLOCK_D)
                offs = row_offs + cols[None, :]
                mask = row_mask[:, None] & (cols < D)[None, :]
                xhat = (tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                        - mu[:, None] - c[:, None]) * rstd[:, None]
                g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                if HAS_W:
                    g = g * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
                acc_gx += g * xhat
                acc_g += g
            sum_gx, sum_g = _sum2(acc_gx, acc_g, 1, INTERPRETED)
            mean_gx = sum_gx / D
            mean_g = tl.zeros_like(mean_gx)
            if not IS_RMS:
                mean_g = sum_g / D
            for start in range(0, D, BLOCK_D):
                cols = start + tl.arange(0, BLOCK_D)
                col_mask = cols < D
                offs = row_offs + cols[None, :]
                mask = row_mask[:, None] & col_mask[None, :]
                xhat = (tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                        - mu[:, None] - c[:, None]) * rstd[:, None]
                dyf = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                g = dyf
                if HAS_W:
                    g = dyf * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                dx = (g - xhat * mean_gx[:, None] - mean_g[:, None]) * rstd[:, None]
                if HAS_DH:
                    dx += tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(dx_ptr + offs, round_to(dx, dx_ty, INTERPRETED), mask=mask)
                later = col_mask & (cols * 0 + tile > pid)  # an i1 tensor: the interpreter refuses a scalar mask
                if HAS_W:
                    part = tl.load(dw_part_ptr + part_row + cols, mask=later, other=0.0)
                    tl.store(dw_part_ptr + part_row + cols, part + tl.sum(dyf * xhat, axis=0), mask=col_mask)
                if HAS_B:
                    part = tl.load(db_part_ptr + part_row + cols, mask=later, other=0.0)
                    tl.store(db_part_ptr + part_row + cols, part + tl.sum(dyf, axis=0), mask=col_mask)


@triton.jit
def norm_grad_sum_kernel(dw_part_ptr, db_part_ptr, dw_ptr, db_ptr, n_parts, D,
                         HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                         LONG: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program j: dw[cols] = sum over p of dw_part[p, cols] (and db), cols the j-th block of BLOCK_C columns,
    summed in fp32 in a fixed order and rounded once to dw's (db's) dtype."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < D
    acc_w = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for start in range(0, n_parts, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts < n_parts)[:, None] & col_mask[None, :]
        if LONG:
            parts = parts.to(tl.int64)
        offs = parts[:, None] * D + cols[None, :]
        if HAS_W:
            acc_w += tl.load(dw_part_ptr + offs, mask=mask, other=0.0)
        if HAS_B:
            acc_b += tl.load(db_part_ptr + offs, mask=mask, other=0.0)
    if HAS_W:
        tl.store(dw_ptr + cols, round_to(tl.sum(acc_w, axis=0), dw_ptr.dtype.element_ty, INTERPRETED), mask=col_mask)
    if HAS_B:
        tl.store(db_ptr + cols, round_to(tl.sum(acc_b, axis=0), db_ptr.dtype.element_ty, INTERPRETED), mask=col_mask)
