"""minipar.kernels.activation: gelu (tanh) and swiglu kernels against PyTorch, forward and backward.

fp32 results must equal PyTorch's at the default fp32 tolerances; bf16 and
fp16 results are judged against an fp32 reference of the same inputs
(``lowp_ok``). The Triton tests run in a TRITON_INTERPRET=1 child pytest (see
``kernel_testing``) and each asserts that its kernels launched.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from minipar import kernels
from minipar.kernels.activation import gelu, swiglu
from minipar.core.syncs import count_host_syncs

from kernel_testing import interpreted, launched, lowp_ok, pytorch_path, run_interpreted

# Element counts: anything up to 9000, the block edges (2048 per program below 4096 elements, 4096 from
# there) with 1-element tails, and matrices (any count up to 4900) so a transposed layout is really
# non-contiguous.
SIZES = st.one_of(st.integers(0, 9000), st.sampled_from([0, 1, 2047, 2049, 4095, 4096, 4097, 8193]))
SHAPES = st.one_of(SIZES.map(lambda n: (n,)), st.tuples(st.integers(0, 70), st.integers(0, 70)))
LAYOUTS = st.sampled_from(["contiguous", "strided", "transposed"])
LOWP = [torch.bfloat16, torch.float16]


def test_triton_kernels_under_interpreter():
    """This module's interpreted tests, in a TRITON_INTERPRET=1 child: all pass, none skip."""
    run_interpreted(__file__)


def make(shape: tuple, layout: str, amp: float, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Values of scale amp in ``shape``: contiguous, every other element of a buffer, or transposed.

    The dtype is applied before the view is taken: ``.to`` and ``.clone`` make a strided view contiguous.
    """
    if layout == "strided":
        return (torch.randn(*shape, 2, generator=g) * amp).to(dtype)[..., 0]
    if layout == "transposed":  # the same shape, its memory in the reversed dimension order
        return (torch.randn(*reversed(shape), generator=g) * amp).to(dtype).permute(*reversed(range(len(shape))))
    return (torch.randn(*shape, generator=g) * amp).to(dtype)


def forward_backward(fn, inputs: list[torch.Tensor], grad_y: torch.Tensor):
    """fn's output and the gradients of its inputs for the upstream gradient grad_y (on leaf copies)."""
    leaves = [t.detach().requires_grad_() for t in inputs]  # detach keeps the layout (clone may not)
    y = fn(*leaves)
    y.backward(grad_y)
    return y.detach(), [t.grad for t in leaves]


def check(got: torch.Tensor, same_dtype: torch.Tensor, fp32_ref: torch.Tensor) -> None:
    """fp32: PyTorch's result at the default tolerances; bf16/fp16: ``lowp_ok`` against the fp32 reference."""
    assert got.dtype == same_dtype.dtype and got.shape == fp32_ref.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, same_dtype)
    else:
        assert lowp_ok(got, same_dtype, fp32_ref)


def gelu_ref(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


# ----------------------------------------------------------------------------- the Triton kernels

@interpreted
@pytest.mark.parametrize("dtype", [torch.float32] + LOWP)
@settings(max_examples=8)
@given(shape=SHAPES, layout=LAYOUTS, amp=st.sampled_from([1.0, 4.0, 30.0]), seed=st.integers(0, 99))
def test_gelu(dtype, shape, layout, amp, seed):
    """For any size and layout: gelu = F.gelu(approximate="tanh"), and so is its input gradient."""
    g = torch.Generator().manual_seed(seed)
    x = make(shape, layout, amp, g, dtype)
    grad_y = torch.randn(shape, generator=g).to(dtype)
    with launched("gelu_fwd_kernel") if x.numel() else contextlib.nullcontext():
        with launched("gelu_bwd_kernel") if x.numel() else contextlib.nullcontext():
            y, (dx,) = forward_backward(gelu, [x], grad_y)
    want_y, (want_dx,) = forward_backward(gelu_ref, [x.float()], grad_y.float())
    torch_y, (torch_dx,) = forward_backward(gelu_ref, [x], grad_y)
    check(y, torch_y, want_y)
    check(dx, torch_dx, want_dx)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32] + LOWP)
@settings(max_examples=8)
@given(shape=SHAPES, gate_layout=LAYOUTS, up_layout=LAYOUTS, amp=st.sampled_from([1.0, 4.0, 30.0]),
       seed=st.integers(0, 99))
def test_swiglu(dtype, shape, gate_layout, up_layout, amp, seed):
    """For any size and layouts: swiglu = F.silu(gate) * up, and so are both input gradients."""
    g = torch.Generator().manual_seed(seed)
    gate = make(shape, gate_layout, amp, g, dtype)
    up = make(shape, up_layout, 1.0, g, dtype)
    grad_y = torch.randn(shape, generator=g).to(dtype)
    with launched("swiglu_fwd_kernel") if gate.numel() else contextlib.nullcontext():
        with launched("swiglu_bwd_kernel") if gate.numel() else contextlib.nullcontext():
            y, (dg, du) = forward_backward(swiglu, [gate, up], grad_y)
    want_y, (want_dg, want_du) = forward_backward(swiglu_ref, [gate.float(), up.float()], grad_y.float())
    torch_y, (torch_dg, torch_du) = forward_backward(swiglu_ref, [gate, up], grad_y)
    check(y, torch_y, want_y)
    check(dg, torch_dg, want_dg)
    check(du, torch_du, want_du)


@interpreted
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # -inf * 0 = nan, as in PyTorch
def test_extreme_inputs_match_pytorch():
    """Far tails, infinities and nan: the same values as PyTorch (the sigmoid never overflows)."""
    edge = torch.tensor([-float("inf"), -1e4, -100.0, -20.0, -5.0, -1e-3, 0.0, 1e-3, 5.0, 20.0, 100.0, 1e4,
                         float("inf"), float("nan")])
    with launched("gelu_fwd_kernel"), launched("gelu_bwd_kernel"):
        y, (dx,) = forward_backward(gelu, [edge], torch.ones_like(edge))
    want_y, (want_dx,) = forward_backward(gelu_ref, [edge], torch.ones_like(edge))
    torch.testing.assert_close(y, want_y, equal_nan=True)
    torch.testing.assert_close(dx, want_dx, equal_nan=True)
    up = torch.linspace(-2, 2, edge.numel())
    with launched("swiglu_fwd_kernel"), launched("swiglu_bwd_kernel"):
        y, grads = forward_backward(swiglu, [edge, up], torch.ones_like(edge))
    want_y, want_grads = forward_backward(swiglu_ref, [edge, up], torch.ones_like(edge))
    torch.testing.assert_close(y, want_y, equal_nan=True)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, equal_nan=True)


@interpreted
def test_gradient_of_one_input_only():
    """swiglu with only ``up`` requiring grad: gate gets none, up gets silu(gate) * grad_y."""
    gate, up = torch.randn(300), torch.randn(300, requires_grad=True)
    with launched("swiglu_bwd_kernel"):
        swiglu(gate, up).sum().backward()
    assert gate.grad is None
    torch.testing.assert_close(up.grad, F.silu(gate))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int64_offsets(dtype):
    """The int64-offset variant (what a tensor near 2**31 elements gets) computes what the int32 one does:
    forced here, with blocks of 256, on a size with a ragged last block."""
    tk = kernels.dispatch.triton_module("activation_triton")
    g = torch.Generator().manual_seed(5)
    gate, up, grad_y = (make((1000,), "contiguous", 4.0, g, dtype) for _ in range(3))
    want = [forward_backward(gelu, [gate], grad_y), forward_backward(swiglu, [gate, up], grad_y)]
    with mock.patch.object(tk, "config", lambda n: dict(BLOCK=256, INT64=True, num_warps=4)):
        with launched("gelu_fwd_kernel"), launched("swiglu_bwd_kernel"):
            got = [forward_backward(gelu, [gate], grad_y), forward_backward(swiglu, [gate, up], grad_y)]
    for (y, grads), (want_y, want_grads) in zip(got, want):
        assert torch.equal(y, want_y)
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_equals_eager(dtype):
    """Inside torch.compile (fullgraph, aot_eager) gelu and swiglu trace as their custom ops: the compiled
    forward and backward launch the kernels and equal eager bit for bit (the same kernels run)."""
    g = torch.Generator().manual_seed(7)
    gate, up, grad_y = (make((33, 70), "contiguous", 4.0, g, dtype) for _ in range(3))
    for fn, inputs, names in ((gelu, [gate], ("gelu_fwd_kernel", "gelu_bwd_kernel")),
                              (swiglu, [gate, up], ("swiglu_fwd_kernel", "swiglu_bwd_kernel"))):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        with launched(names[0]), launched(names[1]):
            y, grads = forward_backward(compiled, inputs, grad_y)
        want_y, want_grads = forward_backward(fn, inputs, grad_y)
        assert torch.equal(y, want_y)
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))


@interpreted
def test_launchers_make_no_host_sync():
    """gelu and swiglu, forward and backward, with a non-contiguous input: nothing would make the host wait
    for a GPU (``minipar.core.syncs``; the interpreter's own reads are not counted)."""
    g = torch.Generator().manual_seed(3)
    gate, up = make((40, 30), "transposed", 2.0, g, torch.bfloat16), make((40, 30), "strided", 1.0, g, torch.bfloat16)
    with count_host_syncs() as syncs, launched("gelu_bwd_kernel"), launched("swiglu_bwd_kernel"):
        forward_backward(gelu, [gate], torch.ones_like(gate))
        forward_backward(swiglu, [gate, up], torch.ones_like(gate))
    assert not syncs.calls, syncs.report()


@interpreted
def test_fp64_takes_the_pytorch_path():
    """The kernels compute in fp32, so fp64 (gradcheck) stays on PyTorch: exact, and nothing launched."""
    x = torch.randn(40, dtype=torch.float64, requires_grad=True)
    before = sum(kernels.launches.values())
    assert torch.autograd.gradcheck(gelu, (x,))
    assert torch.autograd.gradcheck(swiglu, (x, torch.randn(40, dtype=torch.float64, requires_grad=True)))
    assert sum(kernels.launches.values()) == before


# ----------------------------------------------------------------------------- the PyTorch path

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pytorch_path_is_pytorch_and_launches_nothing(dtype):
    """Without CUDA or the interpreter, gelu and swiglu are F.gelu(tanh) and F.silu(gate) * up, bit for bit."""
    g = torch.Generator().manual_seed(0)
    gate, up, grad_y = (make((37, 21), "transposed", 3.0, g, dtype) for _ in range(3))
    with pytorch_path():
        y, (dx,) = forward_backward(gelu, [gate], grad_y)
        z, (dg, du) = forward_backward(swiglu, [gate, up], grad_y)
    want_y, (want_dx,) = forward_backward(gelu_ref, [gate], grad_y)
    want_z, (want_dg, want_du) = forward_backward(swiglu_ref, [gate, up], grad_y)
    for got, want in [(y, want_y), (dx, want_dx), (z, want_z), (dg, want_dg), (du, want_du)]:
        assert torch.equal(got, want)


def test_swiglu_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="one shape and dtype"):
        swiglu(torch.zeros(3, 4), torch.zeros(4))
    with pytest.raises(ValueError, match="one shape and dtype"):
        swiglu(torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16))
