"""Triton kernels for ``minipar.kernels.activation`` (imported at first use; see ``dispatch``).

Every kernel is elementwise over the flattened tensors: program p owns
elements [p * BLOCK, (p + 1) * BLOCK), the tail masked. `config` picks BLOCK
and the warps so that each thread streams 16 elements per tensor: two 16-byte
vectors of bf16/fp16, four of fp32, all loads issued before any math. Offsets
are int32 unless the launcher sets ``INT64`` (a tensor near 2**31 elements),
which keeps the address arithmetic to one 32-bit add per vector.

The math is fp32 on upcast loads, and each sigmoid costs two special-function
instructions: with e = 2**t, t = -|z| log2(e) <= 0, so e = exp(-|z|) <= 1
never overflows, and r = 1 / (1 + e) with 1 + e in [1, 2]:

    sigmoid(z) = r      (z >= 0),      e r      (z < 0)
    sigmoid(z) (1 - sigmoid(z)) = e r^2      (for either sign: no 1 - s cancellation)

On a GPU, `_exp2` is ``ex2.approx.ftz`` and `_reciprocal` ``rcp.approx.ftz``,
one special-function instruction each (within 2 ulp and 1 ulp of the fp32
result; 1 + e in [1, 2] is far from the approximations' range limits). `/`
would compile to the full-range division, four more instructions per element;
``tl.exp`` adds a multiply and denormal handling. Under the interpreter
(``INTERPRETED``, set by ``dispatch.launch``) both are the exact numpy
operations. Stores go through ``round_to``, the hardware conversion on a GPU.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .common_triton import round_to

ELEMENTS_PER_THREAD = 16  # two 16-byte vectors of a 16-bit tensor per thread, four of fp32

# The constants of u = k (x + c x^3), k = sqrt(2 / pi), c = 0.044715, folded for the kernels:
# z = 2u = x (A + B x^2), and the exp2 argument -|z| log2(e) = |x| (A2 + B2 x^2) (A + B x^2 > 0, so |z| = |x| (...)).
# gelu'(x) needs 2 u' = A + 3 B x^2. Constexpr, as jit code may read only constexpr globals.
_K, _C, _LOG2E = 0.7978845608028654, 0.044715, 1.4426950408889634
GELU_A = tl.constexpr(2 * _K)
GELU_B = tl.constexpr(2 * _K * _C)
GELU_3B = tl.constexpr(6 * _K * _C)
GELU_A2 = tl.constexpr(-2 * _K * _LOG2E)
GELU_B2 = tl.constexpr(-2 * _K * _C * _LOG2E)
NEG_LOG2E = tl.constexpr(-_LOG2E)


def config(n: int) -> dict:
    """Launch parameters for n elements: BLOCK and num_warps (16 elements per thread), INT64 for offsets
    that could pass 2**31 - 1 (the last program's block ends at most BLOCK - 1 past n)."""
    num_warps = 8 if n >= 8 * 32 * ELEMENTS_PER_THREAD else 4
    block = num_warps * 32 * ELEMENTS_PER_THREAD
    return dict(BLOCK=block, INT64=n > 2**31 - 1 - block, num_warps=num_warps)


@triton.jit
def _offsets(n, BLOCK: tl.constexpr, INT64: tl.constexpr):
    """This program's element offsets and the mask of those below n."""
    start = tl.program_id(0)
    if INT64:
        start = start.to(tl.int64)
    offs = start * BLOCK + tl.arange(0, BLOCK)
    return offs, offs < n


@triton.jit
def _exp2(t, INTERPRETED: tl.constexpr):
    """2**t in fp32; t <= 0 here."""
    if INTERPRETED:
        return tl.exp2(t)
    else:
        return libdevice.exp2(t)  # ex2.approx.ftz: one instruction


@triton.jit
def _reciprocal(d, INTERPRETED: tl.constexpr):
    """1 / d for d in [1, 2]."""
    if INTERPRETED:
        return 1.0 / d
    else:
        # one MUFU.RCP (libdevice's fast division adds a flush-to-zero FADD, `/` the full-range scaling)
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [d], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _gelu_e_r(x, x2, INTERPRETED: tl.constexpr):
    """e = exp(-|z|) and r = 1 / (1 + e) for z = 2u = x (A + B x^2)."""
    e = _exp2(tl.abs(x) * (GELU_A2 + GELU_B2 * x2), INTERPRETED)
    return e, _reciprocal(1.0 + e, INTERPRETED)


@triton.jit
def gelu_fwd_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, INT64: tl.constexpr, INTERPRETED: tl.constexpr):
    """y = x sigmoid(2u): x r for x >= 0, x r e below."""
    offs, mask = _offsets(n, BLOCK, INT64)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    e, r = _gelu_e_r(x, x * x, INTERPRETED)
    xr = x * r
    y = tl.where(x >= 0, xr, xr * e)
    tl.store(y_ptr + offs, round_to(y, y_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def gelu_bwd_kernel(x_ptr, dy_ptr, dx_ptr, n, BLOCK: tl.constexpr, INT64: tl.constexpr, INTERPRETED: tl.constexpr):
    """dx = dy (s + e r^2 x 2u'), s = sigmoid(2u) recomputed from the saved x (s (1 - s) = e r^2)."""
    offs, mask = _offsets(n, BLOCK, INT64)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = x * x
    e, r = _gelu_e_r(x, x2, INTERPRETED)
    er = e * r
    s = tl.where(x >= 0, r, er)
    # e r first: it is 0 where x is far out, so x (A + 3B x^2) (finite up to |x| ~ 1e12) never meets an inf
    dx = dy * (s + (er * r) * (x * (GELU_A + GELU_3B * x2)))
    tl.store(dx_ptr + offs, round_to(dx, dx_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def _sigmoid_e_r(g, INTERPRETED: tl.constexpr):
    """e = exp(-|g|) and r = 1 / (1 + e)."""
    e = _exp2(tl.abs(g) * NEG_LOG2E, INTERPRETED)
    return e, _reciprocal(1.0 + e, INTERPRETED)


@triton.jit
def swiglu_fwd_kernel(g_ptr, v_ptr, y_ptr, n, BLOCK: tl.constexpr, INT64: tl.constexpr, INTERPRETED: tl.constexpr):
    """y = g sigmoid(g) v, rounded once (PyTorch rounds silu(g) and then the product)."""
    offs, mask = _offsets(n, BLOCK, INT64)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    e, r = _sigmoid_e_r(g, INTERPRETED)
    gr = g * r
    y = tl.where(g >= 0, gr, gr * e) * v
    tl.store(y_ptr + offs, round_to(y, y_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def swiglu_bwd_kernel(g_ptr, v_ptr, dy_ptr, dg_ptr, dv_ptr, n, BLOCK: tl.constexpr, INT64: tl.constexpr,
                      INTERPRETED: tl.constexpr):
    """dg = dy v (s + g e r^2), dv = dy g s, s = sigmoid(g) recomputed from the saved gate
    (s + g s (1 - s) = s (1 + g (1 - s)), with s (1 - s) = e r^2)."""
    offs, mask = _offsets(n, BLOCK, INT64)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    e, r = _sigmoid_e_r(g, INTERPRETED)
    er = e * r
    s = tl.where(g >= 0, r, er)
    dg = (dy * v) * (s + g * (er * r))
    dv = (dy * g) * s
    tl.store(dg_ptr + offs, round_to(dg, dg_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    tl.store(dv_ptr + offs, round_to(dv, dv_ptr.dtype.element_ty, INTERPRETED), mask=mask)
