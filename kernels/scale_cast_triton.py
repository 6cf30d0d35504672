"""Triton kernel for ``minipar.kernels.scale_cast`` (imported at first use; see ``dispatch``).

Program p scales and casts elements [p * BLOCK, (p + 1) * BLOCK) and, if one
of them is inf or nan as stored, raises the flag. `config` gives each thread
16 elements; every access is marked VEC-wide (16 bytes of dst: 8 elements for
a 16-bit dst, 4 for fp32), so the loads, the stores and the flag's reduction
share one register layout and nothing goes through shared memory.

The flag costs one instruction per element and no barrier: each thread takes
the NaN-propagating max of |y| over each of its VEC-vectors (the block seen
as (BLOCK / VEC, VEC), the vector dimension halved log2(VEC) times with
``tl.split``: every step stays inside the thread, and the interpreter runs it
as numpy, where ``tl.reduce`` with a combine function of one's own loops in
Python), and a vector whose max is not below the dtype's overflow threshold
issues a relaxed atomic max of 1.0 on the flag (as int32: the bits of
non-negative floats order as integers). On clean data no atomic is issued at all.
"""

import triton
import triton.language as tl

from .common_triton import round_to

ELEMENTS_PER_THREAD = 16
ONE_BITS = tl.constexpr(0x3F800000)  # 1.0f as int32
# The smallest fp32 magnitude a round-to-nearest-even cast sends to inf: halfway between the largest
# finite value and the next power of two (a tie rounds to the even neighbour, inf).
BF16_OVERFLOW = tl.constexpr((2 - 2**-8) * 2.0**127)
FP16_OVERFLOW = tl.constexpr((2 - 2**-11) * 2.0**15)
FP32_OVERFLOW = tl.constexpr(float("inf"))


def config(n: int, dst_element_size: int) -> dict:
    """BLOCK and num_warps for n elements (16 per thread), VEC (16 bytes of dst), INT64 near 2**31."""
    num_warps = 8 if n >= 8 * 32 * ELEMENTS_PER_THREAD else 4
    block = num_warps * 32 * ELEMENTS_PER_THREAD
    vec = 16 // dst_element_size
    return dict(BLOCK=block, VEC=vec, VEC_LOG2=vec.bit_length() - 1, INT64=n > 2**31 - 1 - block, num_warps=num_warps)


@triton.jit
def scale_cast_kernel(src_ptr, dst_ptr, found_ptr, n, scale, BLOCK: tl.constexpr, VEC: tl.constexpr,
                      VEC_LOG2: tl.constexpr, INT64: tl.constexpr, INTERPRETED: tl.constexpr):
    """dst[b] = round(fp32(src[b]) * scale) for this program's block b; found (int32 view of the fp32 flag)
    raised to 1.0 if any of them is inf or nan."""
    scale = tl.cast(scale, tl.float32)  # a compiler may pass it as fp64: no fp64 arithmetic follows
    start = tl.program_id(0)
    if INT64:
        start = start.to(tl.int64)
    offs = tl.max_contiguous(tl.multiple_of(start * BLOCK + tl.arange(0, BLOCK), VEC), VEC)
    mask = offs < n
    y = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
    tl.store(dst_ptr + offs, round_to(y, dst_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    # The stored value is inf or nan exactly when the product is nan or at least the dst's overflow
    # threshold in magnitude (an fp32 product above 65504 is finite, its fp16 cast is not). Masked lanes are 0.
    if dst_ptr.dtype.element_ty == tl.bfloat16:
        limit: tl.constexpr = BF16_OVERFLOW
    elif dst_ptr.dtype.element_ty == tl.float16:
        limit: tl.constexpr = FP16_OVERFLOW
    else:
        limit: tl.constexpr = FP32_OVERFLOW
    vec_max = tl.reshape(tl.abs(y), [BLOCK // VEC, VEC])
    for _ in tl.static_range(VEC_LOG2):  # the max of each vector, by halving its width
        lo, hi = tl.split(tl.reshape(vec_max, [BLOCK // VEC, vec_max.shape[1] // 2, 2]))
        vec_max = tl.maximum(lo, hi, propagate_nan=tl.PropagateNan.ALL)
    bad = ~(tl.reshape(vec_max, [BLOCK // VEC]) < limit)  # true for nan too
    tl.atomic_max(found_ptr + tl.full([BLOCK // VEC], 0, tl.int32), ONE_BITS, mask=bad, sem="relaxed")
