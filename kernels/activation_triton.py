"""Triton kernels for ``minipar.kernels.activation`` (imported at first use; see ``dispatch``).

Every kernel is elementwise over the flattened tensors: program p owns
elements [p * BLOCK, (p + 1) * BLOCK), the tail masked. Offsets are int64 so a
tensor past 2**31 elements addresses correctly. Loads are upcast to fp32 (the
math is fp32, and bf16 arithmetic is wrong under the interpreter) and every
store goes through ``round_to``.
"""

import triton
import triton.language as tl

from .common_triton import round_to

# Elements per program. A fixed size, not autotuned: these kernels are memory
# bound, 1024 elements over the default 4 warps gives each thread 8 to stream,
# and one config keeps the interpreter runs short. (Not yet timed on a GPU.)
BLOCK = 1024

# k and c in u = k (x + c x^3); constexpr, as jit code may read only constexpr globals.
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_C = tl.constexpr(0.044715)


@triton.jit
def _offsets(n, BLOCK: tl.constexpr):
    """This program's element offsets (int64) and the mask of those below n."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return offs, offs < n


@triton.jit
def _sigmoid(z):
    """1 / (1 + exp(-z)) in fp32, through e = exp(-|z|) <= 1 so nothing overflows for any |z|."""
    e = tl.exp(-tl.abs(z))
    r = 1.0 / (1.0 + e)
    return tl.where(z >= 0, r, e * r)


@triton.jit
def _gelu_s_and_du(x):
    """For fp32 x: s = sigmoid(2u) and u' = du/dx, with u = k (x + c x^3)."""
    x2 = x * x
    u = SQRT_2_OVER_PI * (x + GELU_C * x2 * x)
    du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x2)
    return _sigmoid(2.0 * u), du


@triton.jit
def gelu_fwd_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    """y = x s, s = sigmoid(2u): gelu with the tanh approximation."""
    offs, mask = _offsets(n, BLOCK)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s, _ = _gelu_s_and_du(x)
    tl.store(y_ptr + offs, round_to(x * s, y_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def gelu_bwd_kernel(x_ptr, dy_ptr, dx_ptr, n, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    """dx = dy (s + 2 x s (1 - s) u'), s recomputed from the saved x."""
    offs, mask = _offsets(n, BLOCK)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s, du = _gelu_s_and_du(x)
    dx = dy * (s + 2.0 * x * s * (1.0 - s) * du)
    tl.store(dx_ptr + offs, round_to(dx, dx_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def swiglu_fwd_kernel(g_ptr, v_ptr, y_ptr, n, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    """y = g sigmoid(g) v, rounded once (PyTorch rounds silu(g) and then the product)."""
    offs, mask = _offsets(n, BLOCK)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * _sigmoid(g) * v
    tl.store(y_ptr + offs, round_to(y, y_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def swiglu_bwd_kernel(g_ptr, v_ptr, dy_ptr, dg_ptr, dv_ptr, n, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    """dg = dy v s (1 + g (1 - s)), dv = dy g s, s = sigmoid(g) recomputed from the saved gate."""
    offs, mask = _offsets(n, BLOCK)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = _sigmoid(g)
    dg = dy * v * s * (1.0 + g * (1.0 - s))
    dv = dy * g * s
    tl.store(dg_ptr + offs, round_to(dg, dg_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    tl.store(dv_ptr + offs, round_to(dv, dv_ptr.dtype.element_ty, INTERPRETED), mask=mask)
