"""Triton kernel for ``minipar.kernels.adamw`` (imported at first use; see ``dispatch``)."""

import triton
import triton.language as tl

from .common_triton import round_to

# Elements per program. The step is memory-bound (about 30 bytes moved per element, a few flops), so one
# fixed size that gives each of 4 warps' threads eight fp32 elements (two 16-byte vectors) is enough. No
# autotuning: it would also rerun an in-place update while benchmarking the candidates.
BLOCK = 1024


@triton.jit
def adamw_step_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, n,
                      decay, weight_decay, lerp_weight, beta2, one_minus_beta2, neg_step_size,
                      bias_correction2_sqrt, eps,
                      L2: tl.constexpr, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program i: the Adam/AdamW update of elements [i*BLOCK, (i+1)*BLOCK), in fp32, in torch's order.

    Scalars arrive as fp32, rounded from the host's doubles exactly as torch
    rounds a Python scalar for an fp32 tensor. ``decay`` is 1 - lr*wd
    (1 when the decay is not decoupled); ``L2`` adds ``weight_decay * param``
    to the gradient instead.
    """
    block = tl.program_id(0).to(tl.int64)  # int64: offsets of a large shard pass 2**31
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(param_ptr + offs, mask=mask, other=0.0)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # bf16/fp16 grads upcast on load
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)

    if L2:
        g = g + weight_decay * p
    p = p * decay
    # torch's lerp_: from the nearer end, which keeps it exact at weight 0 and 1. The test is made on the fp32
    # weight, as torch makes it, so a beta1 that rounds to 0.5 picks the same formula.
    m = tl.where(lerp_weight < 0.5, m + lerp_weight * (g - m), g - (g - m) * (1.0 - lerp_weight))
    v = v * beta2 + one_minus_beta2 * g * g
    # IEEE sqrt and division, as torch's kernels use: plain tl.sqrt and `/` may be approximate on a GPU.
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)  # addcdiv's order: (value * exp_avg) / denom

    tl.store(param_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offs, round_to(p, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)
