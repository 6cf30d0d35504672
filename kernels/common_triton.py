"""Triton helpers shared by the kernel modules (imported at first use, like them; see ``dispatch``)."""

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` converted to ``dtype``, rounded to nearest even for bf16.

    A GPU converts fp32 to bf16 rounding to nearest even anyway; Triton's
    interpreter truncates, which would make every bf16 result up to one ulp
    off on CPU. Rounding the fp32 bits first (add 0x7FFF plus the lowest kept
    bit, clear the low 16 bits) makes the conversion exact on both, for a few
    integer operations per element. NaN passes through unchanged.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        rounded = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
        x = tl.where(x != x, x, rounded)
    return x.to(dtype)
