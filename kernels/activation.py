"""The MLP activations, GELU (tanh approximation) and SwiGLU, forward and backward.

Elementwise, computed in fp32 whatever the storage dtype, rounded once on store:

    gelu(x)          = 0.5 x (1 + tanh(u)),   u = k (x + c x^3),   k = sqrt(2 / pi),  c = 0.044715
                     = x s,                   s = sigmoid(2u)       (since 1 + tanh(u) = 2 sigmoid(2u))
    gelu'(x)         = s + 2 x s (1 - s) u',  u' = k (1 + 3 c x^2)
                       (= 0.5 (1 + t) + 0.5 x (1 - t^2) u' with t = tanh(u), as 1 - t^2 = 4 s (1 - s))

    swiglu(g, v)     = silu(g) v = g sigmoid(g) v
    d/dg             = v s (1 + g (1 - s)),   s = sigmoid(g)
    d/dv             = g s

Writing tanh through the sigmoid avoids the cancellation in ``1 + tanh(u)``
and ``1 - t^2`` for negative x, so the kernel is at least as accurate as
PyTorch's formula. The sigmoid is evaluated through e = exp(-|z|) <= 1 and
r = 1 / (1 + e), which never overflow: s = r for z >= 0 and e r below, and
the backward's s (1 - s) is e r^2 for either sign, with no ``1 - s`` to cancel.

Autograd saves the inputs, not the outputs, and the backward kernel recomputes
s: one extra exp per element instead of keeping another activation-sized
tensor alive. Empty tensors launch nothing; non-contiguous inputs are copied
to contiguous ones first. The kernels cover fp32, bf16 and fp16; any other
dtype (fp64 for gradcheck, integers, which PyTorch rejects) takes the PyTorch
path, so the kernels never compute an fp64 input at fp32 precision.

Each launcher is a ``torch.library`` custom op (``minipar::gelu_fwd``,
``gelu_bwd``, ``swiglu_fwd``, ``swiglu_bwd``, with fake implementations giving
the shapes) that the autograd Functions call, so ``torch.compile`` traces gelu
and swiglu whole (fullgraph) and keeps the kernels. ``activation_triton`` has
the kernels and their launch configuration.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .dispatch import launch, triton_module, use_triton

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """``F.gelu(x, approximate="tanh")``: any shape, same shape and dtype; differentiable in x."""
    if not _triton_for(x):
        return F.gelu(x, approximate="tanh")
    return _Gelu.apply(x)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up``: gate and up of one shape and dtype -> that shape and dtype; differentiable in both."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu needs gate and up of one shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
                         f"and {tuple(up.shape)} {up.dtype}; broadcast or cast them first")
    if not _triton_for(gate):
        return F.silu(gate) * up
    return _SwiGLU.apply(gate, up)


def _triton_for(x: torch.Tensor) -> bool:
    """The dispatch rule, for the dtypes the fp32-math kernels are exact enough for."""
    return use_triton(x) and x.dtype in _KERNEL_DTYPES


class _Gelu(torch.autograd.Function):
    """y = gelu(x) (forward), dx = gelu'(x) dy (backward): the two custom ops below."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return gelu_fwd(x)

    @staticmethod
    @once_differentiable  # the backward is a kernel, not torch ops: a double backward must fail loudly
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        return gelu_bwd(x, grad_y)


class _SwiGLU(torch.autograd.Function):
    """y = silu(g) v (forward), (dg, dv) = (v silu'(g) dy, silu(g) dy) (backward), in one kernel each."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_fwd(gate, up)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        gate, up = ctx.saved_tensors
        # One pass writes both gradients: each needs sigmoid(gate), and reading
        # gate, up and grad_y once is the whole cost of this memory-bound kernel.
        grad_gate, grad_up = swiglu_bwd(gate, up, grad_y)
        return (grad_gate if ctx.needs_input_grad[0] else None,
                grad_up if ctx.needs_input_grad[1] else None)


# ----------------------------------------------------------------------------- the launchers, as custom ops

@torch.library.custom_op("minipar::gelu_fwd", mutates_args=())
def gelu_fwd(x: torch.Tensor) -> torch.Tensor:
    """gelu(x): any shape -> x's shape and dtype (contiguous)."""
    return _elementwise("gelu_fwd_kernel", x)


@torch.library.custom_op("minipar::gelu_bwd", mutates_args=())
def gelu_bwd(x: torch.Tensor, grad_y: torch.Tensor) -> torch.Tensor:
    """gelu'(x) grad_y: x and grad_y of one shape -> that shape, x's dtype."""
    return _elementwise("gelu_bwd_kernel", x, grad_y)


@torch.library.custom_op("minipar::swiglu_fwd", mutates_args=())
def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) up: one shape and dtype -> that shape and dtype."""
    return _elementwise("swiglu_fwd_kernel", gate, up)


@torch.library.custom_op("minipar::swiglu_bwd", mutates_args=())
def swiglu_bwd(gate: torch.Tensor, up: torch.Tensor, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_gate, grad_up), each of gate's shape and dtype."""
    return _elementwise("swiglu_bwd_kernel", gate, up, grad_y, n_out=2)


@gelu_fwd.register_fake
def _(x):
    return _outputs(x, 1)[0]


@gelu_bwd.register_fake
def _(x, grad_y):
    return _outputs(x, 1)[0]


@swiglu_fwd.register_fake
def _(gate, up):
    return _outputs(gate, 1)[0]


@swiglu_bwd.register_fake
def _(gate, up, grad_y):
    return _outputs(gate, 2)


def _outputs(first: torch.Tensor, n_out: int) -> tuple[torch.Tensor, ...]:
    """New contiguous tensors of ``first``'s shape and dtype (a gradient takes its input's dtype, as autograd
    requires)."""
    return tuple(torch.empty(first.shape, dtype=first.dtype, device=first.device) for _ in range(n_out))


def _elementwise(name: str, *inputs: torch.Tensor, n_out: int = 1):
    """Launch kernel ``name`` over the flattened inputs: ``kernel(*inputs, *outputs, n, **config(n))``.

    ``contiguous`` is free for contiguous inputs and materialises the rest, such as
    the stride-0 gradient that ``y.sum().backward()`` sends.
    """
    flat = [t.contiguous() for t in inputs]
    outs = _outputs(inputs[0], n_out)
    n = inputs[0].numel()
    if n:
        tk = triton_module("activation_triton")
        config = tk.config(n)
        launch(getattr(tk, name), (-(-n // config["BLOCK"]),), *flat, *outs, n, **config)
    return outs[0] if n_out == 1 else outs
