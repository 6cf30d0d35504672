"""Triton kernel for ``minipar.kernels.fp8_cast`` (imported at first use; see ``dispatch``).

Program (r, g) takes ROWS rows of the (rows, K) operand and, in each, the
elements of scale group g: columns [g * WIDTH, (g + 1) * WIDTH) (WIDTH = 128
for 1 x 128 tiles, K for a whole row). The block is loaded once, into
registers; the group's amax, its scale and the cast all come from that copy,
so x is read once and q written once (the PyTorch path reads x three times:
abs, amax, scale-and-cast).

``scale = fp8_max / amax`` is a correctly rounded division (``div_rn``: a GPU's
default fp32 division is approximate), and its power of two is taken from its
bits (exponent kept, mantissa cleared), exactly as ``torch.frexp`` gives it;
so the kernel's scales and bytes equal the PyTorch path's bit for bit.
"""

import triton
import triton.language as tl

ELEMENTS_PER_PROGRAM = 2048
EXPONENT_BITS = tl.constexpr(0x7F800000)


def config(k: int, width: int) -> dict:
    """BLOCK (the group's width as a power of two) and ROWS per program (about 2048 elements), num_warps."""
    block = triton.next_power_of_2(width)
    return dict(BLOCK=block, ROWS=max(1, ELEMENTS_PER_PROGRAM // block), num_warps=8 if block >= 4096 else 4)


@triton.jit
def _round_fp8(y, MANTISSA: tl.constexpr, MIN_NORMAL: tl.constexpr, INTERPRETED: tl.constexpr):
    """y (fp32, |y| <= fp8 max) rounded to the fp8 grid, nearest even, when interpreted (the interpreter's
    cast does not round so); compiled, the hardware's cast rounds and y passes as it is."""
    if INTERPRETED:
        shift: tl.constexpr = 23 - MANTISSA
        bits = y.to(tl.int32, bitcast=True)
        bits = bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)
        normal = ((bits >> shift) << shift).to(tl.float32, bitcast=True)
        # below the smallest normal the grid is uniform, MIN_NORMAL * 2**-MANTISSA apart: adding and taking
        # away 1.5 * 2**23 of that spacing rounds to it, nearest even, in fp32 itself
        magic: tl.constexpr = 1.5 * 2.0**23 * MIN_NORMAL * 2.0**-MANTISSA
        subnormal = (tl.abs(y) + magic) - magic
        subnormal = tl.where(y < 0, -subnormal, subnormal)  # keeps the sign of a value that rounds to zero
        y = tl.where(tl.abs(y) < MIN_NORMAL, subnormal, normal)
    return y


@triton.jit
def fp8_cast_kernel(x_ptr, q_ptr, inv_ptr, rows, k, width, groups, fp8_max, BLOCK: tl.constexpr,
                    ROWS: tl.constexpr, POW2: tl.constexpr, MANTISSA: tl.constexpr, MIN_NORMAL: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    """q[r, c] = cast(clamp(x[r, c] * scale)), inv[r, g] = 1 / scale, scale = fp8_max / amax of the group."""
    fp8_max = tl.cast(fp8_max, tl.float32)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    c = g * width + tl.arange(0, BLOCK)
    mask = (r[:, None] < rows) & (c[None, :] < k) & (c[None, :] < (g + 1) * width)
    offs = r[:, None].to(tl.int64) * k + c[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)
    scale = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32) * fp8_max, amax)
    if POW2:  # the power of two at or below: exponent bits kept, mantissa cleared
        scale = (scale.to(tl.int32, bitcast=True) & EXPONENT_BITS).to(tl.float32, bitcast=True)
    y = tl.minimum(tl.maximum(x * scale[:, None], -fp8_max), fp8_max)
    y = _round_fp8(y, MANTISSA, MIN_NORMAL, INTERPRETED)
    tl.store(q_ptr + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
    inv = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), scale)
    tl.store(inv_ptr + r.to(tl.int64) * groups + g, inv, mask=r < rows)
