"""Triton helpers shared by the kernel modules (imported at first use, like them; see ``dispatch``)."""

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 ``x`` converted to ``dtype``, rounded to nearest even.

    A GPU's conversion to bf16 already rounds to nearest even: compiled, this is
    a plain ``x.to(dtype)`` (``INTERPRETED`` is a constexpr that `dispatch.launch`
    sets, so the branch below is not even in the GPU's code). Triton's
    interpreter truncates instead, which would make every bf16 result up to one
    ulp off on the CPU; there the fp32 bits are rounded first (add 0x7FFF plus
    the lowest kept bit, clear the low 16 bits), NaN passed through unchanged.
    """
    if INTERPRETED:
        if dtype == tl.bfloat16:
            bits = x.to(tl.int32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            rounded = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
            x = tl.where(x != x, x, rounded)
    return x.to(dtype)
