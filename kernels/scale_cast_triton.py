"""Triton kernel for ``minipar.kernels.scale_cast`` (imported at first use; see ``dispatch``)."""

import triton
import triton.language as tl

from .common_triton import round_to

# Elements per program: fixed, not autotuned; a memory-bound stream, and one
# config keeps the interpreter runs short. 4096 elements over the default 4
# warps is 32 per thread, and a 1e8-element bucket is ~25k programs, each doing
# at most one atomic. (Not yet timed on a GPU.)
BLOCK = 4096

FLT_MAX = tl.constexpr(3.4028234663852886e38)  # the largest finite fp32


@triton.jit
def scale_cast_kernel(src_ptr, dst_ptr, found_ptr, n, scale, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program p, block b: dst[b] = round(fp32(src[b]) * scale); found[0] = max(found[0], 1) if any is inf/nan."""
    # int64 offsets: a bucket can pass 2**31 elements, and p * BLOCK would wrap in int32.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = round_to(x * scale, dst_ptr.dtype.element_ty, INTERPRETED)
    tl.store(dst_ptr + offs, y, mask=mask)
    # Judge the value as stored: a cast to fp16 can overflow a finite fp32 product.
    # nan is the one value unequal to itself; inf the one above FLT_MAX. Masked lanes loaded 0: clean.
    y32 = y.to(tl.float32)
    bad = tl.max(((y32 != y32) | (tl.abs(y32) > FLT_MAX)).to(tl.int32), axis=0)
    # Only a program that saw an inf/nan touches the flag; max never lowers it.
    tl.atomic_max(found_ptr, 1.0, mask=bad > 0)
