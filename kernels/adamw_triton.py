"""Triton kernel for ``minipar.kernels.adamw`` (imported at first use; see ``dispatch``).

Program p updates elements [p * BLOCK, (p + 1) * BLOCK). The step is memory
bound (about 30 bytes per element against a few dozen instructions), so
`config` gives each thread 8 elements: two 16-byte vectors of each fp32
stream, loaded before any math. Every access is marked 4 elements wide (the
16 bytes of an fp32 store): the fp32 streams and a 16-bit grad or copy then
share one register layout, so a bf16 tensor moves in 8-byte vectors and no
value goes through shared memory (a layout of 8 per thread for it would cost a
shared-memory round trip and barriers for every fp32 value stored beside it).

The kernel is compiled without floating-point contraction: every operation
is rounded to fp32 as written, so each specialisation (fp32, bf16 or fp16
grad; any copy dtype) and the interpreter compute bit for bit the same
values. Offsets are int32 unless the launcher sets ``INT64``.
"""

import triton
import triton.language as tl

from .common_triton import round_to

ELEMENTS_PER_THREAD = 8
VEC = tl.constexpr(4)  # fp32 elements in a 16-byte store


def config(n: int) -> dict:
    """BLOCK and num_warps for n elements (8 per thread), INT64 near 2**31, and no fp contraction."""
    num_warps = 8 if n >= 8 * 32 * ELEMENTS_PER_THREAD else 4
    block = num_warps * 32 * ELEMENTS_PER_THREAD
    return dict(BLOCK=block, INT64=n > 2**31 - 1 - block, num_warps=num_warps, enable_fp_fusion=False)


@triton.jit
def adamw_step_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, n,
                      decay, weight_decay, lerp_weight, beta2, one_minus_beta2, neg_step_size,
                      bias_correction2_sqrt, eps,
                      L2: tl.constexpr, LERP_FROM_G: tl.constexpr, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr,
                      INT64: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program i: the Adam/AdamW update of elements [i*BLOCK, (i+1)*BLOCK), in fp32, in torch's order.

    Scalars arrive rounded from the host's doubles exactly as torch rounds a
    Python scalar for an fp32 tensor (and are cast to fp32 here, should a
    compiler pass them as fp64). ``decay`` is 1 - lr*wd (1 when the decay is
    not decoupled); ``L2`` adds ``weight_decay * param`` to the gradient instead.
    ``LERP_FROM_G``: the fp32 lerp weight is at least 0.5 (decided on the host).
    """
    decay = tl.cast(decay, tl.float32)
    weight_decay = tl.cast(weight_decay, tl.float32)
    lerp_weight = tl.cast(lerp_weight, tl.float32)
    beta2 = tl.cast(beta2, tl.float32)
    one_minus_beta2 = tl.cast(one_minus_beta2, tl.float32)
    neg_step_size = tl.cast(neg_step_size, tl.float32)
    bias_correction2_sqrt = tl.cast(bias_correction2_sqrt, tl.float32)
    eps = tl.cast(eps, tl.float32)

    start = tl.program_id(0)
    if INT64:
        start = start.to(tl.int64)
    offs = tl.max_contiguous(tl.multiple_of(start * BLOCK + tl.arange(0, BLOCK), VEC), VEC)
    mask = offs < n
    p = tl.load(param_ptr + offs, mask=mask, other=0.0)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # bf16/fp16 grads upcast (exactly) on load
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)

    if L2:
        g = g + weight_decay * p
    p = p * decay
    # torch's lerp_: from the nearer end, which keeps it exact at weight 0 and 1.
    if LERP_FROM_G:
        m = g - (g - m) * (1.0 - lerp_weight)
    else:
        m = m + lerp_weight * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    # IEEE sqrt and division, as torch's kernels use: plain tl.sqrt and `/` may be approximate on a GPU.
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)  # addcdiv's order on the CPU: (value * exp_avg) / denom

    tl.store(param_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offs, round_to(p, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)
