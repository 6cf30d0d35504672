"""minipar.kernels.norm: layer_norm and rms_norm, forward and backward, against PyTorch.

The Triton tests run in a child pytest under ``TRITON_INTERPRET=1`` (see
``kernel_testing``); each asserts that its kernels launched.

The reference is PyTorch's math run in fp64 by autograd (``F.layer_norm``, the
rms formula) on the same inputs, rounded to fp32. PyTorch's own fp32 is no
reference for ill-conditioned rows: at D = 1 its layer_norm dweight is ~1e-4
where the exact value is 0, and for rows whose mean is large against their
spread it is off in the third digit (see ``test_rows_with_a_large_mean``).

fp32 results are held to ``assert_close``'s default fp32 tolerances, dx in
units of its row's rstd (``_assert_fp32``). bf16 results are judged by
``lowp_ok`` against the same fp32 truth, with PyTorch's own bf16 result as the
yardstick.
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from minipar import kernels
from minipar.kernels.norm import layer_norm, rms_norm

from kernel_testing import interpreted, launched, lowp_ok, run_interpreted


def test_triton_kernels_under_interpreter():
    """This module's interpreted tests, in a TRITON_INTERPRET=1 child: all pass, none skip."""
    run_interpreted(__file__)


def test_pytorch_path_is_f_layer_norm_and_launches_nothing(monkeypatch):
    """On CPU without the interpreter: layer_norm is exactly F.layer_norm, rms_norm is F.rms_norm; no kernel runs."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = sum(kernels.launches.values())
    x, w, b, dy = (torch.randn(2, 3, 37), torch.randn(37), torch.randn(37), torch.randn(2, 3, 37))
    got = _run(lambda x, w, b: layer_norm(x, w, b, eps=1e-4), (x, w, b), dy)
    want = _run(lambda x, w, b: F.layer_norm(x, (37,), w, b, eps=1e-4), (x, w, b), dy)
    assert all(torch.equal(g, r) for g, r in zip(got, want))
    got = _run(lambda x, w: rms_norm(x, w), (x, w), dy)
    want = _run(lambda x, w: F.rms_norm(x, (37,), w, eps=1e-6), (x, w), dy)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)
    assert sum(kernels.launches.values()) == before


def test_parameter_shapes_are_checked():
    """A weight or bias that is not (D,) is refused on either path, not broadcast."""
    with pytest.raises(ValueError, match=r"must be \(4,\)"):
        rms_norm(torch.randn(2, 4), torch.ones(1))
    with pytest.raises(ValueError, match="bias has shape"):
        layer_norm(torch.randn(2, 4), torch.ones(4), torch.ones(2, 4))


# ----------------------------------------------------------------------------- helpers

def _run(fn, inputs, dy):
    """[y, grad of each input that is not None]: ``fn(*inputs)`` on fresh leaves, backward with ``dy``."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    y.backward(dy)
    return [y] + [t.grad for t in leaves if t is not None]


def _rms_formula(x, w, eps=1e-6):
    """The definition of rms_norm, in x's dtype."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def _layer_norm_ref(x, w, b):
    return F.layer_norm(x, x.shape[-1:], w, b)


def _fp64(fn, inputs, dy):
    """The reference: ``_run`` in fp64, rounded to fp32."""
    return [t.float() for t in _run(fn, [None if t is None else t.double() for t in inputs], dy.double())]


def _rstd(x, center: bool, eps: float) -> torch.Tensor:
    """Each row's rstd (..., 1), in fp64: layer_norm's (center) or rms_norm's."""
    x = x.double()
    if center:
        x = x - x.mean(-1, keepdim=True)
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _assert_fp32(got, want, rstd):
    """Every result within assert_close's default fp32 tolerances of the fp64 truth; dx in units of rstd.

    dx is rstd times a projection of g = dy w (see norm.py); fp32 resolves that
    projection to about fp32 accuracy of g, so dx's error grows with rstd, which
    reaches eps**-0.5 for rows of tiny spread (layer_norm) or norm (rms_norm),
    D = 1 included. Divided by rstd, dx is held to the default tolerances.
    """
    for i, (g, r) in enumerate(zip(got, want)):
        if i == 1:
            g, r = g.double() / rstd, r.double() / rstd
        torch.testing.assert_close(g, r, rtol=1.3e-6, atol=1e-5)  # the defaults for fp32


def _inputs(g, lead, d, dtype, has_w, has_b, w_dtype, strided):
    """x (*lead, d) in dtype (non-contiguous if strided), w and b (d,) or None in w_dtype, dy like x."""
    x = torch.randn(d, *lead, generator=g).movedim(0, -1) if strided else torch.randn(*lead, d, generator=g)
    w = (1 + 0.5 * torch.randn(d, generator=g)).to(w_dtype) if has_w else None
    b = torch.randn(d, generator=g).to(w_dtype) if has_b else None
    return x.to(dtype), w, b, torch.randn(*lead, d, generator=g).to(dtype)


def _launched_both(name: str, n_rows: int):
    """Asserts the forward and backward kernels of ``name`` both launched (empty inputs launch nothing)."""
    if n_rows == 0:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(launched(f"{name}_fwd_kernel"))
    stack.enter_context(launched(f"{name}_bwd_kernel"))
    return stack


def _slack(want: torch.Tensor, scale: float | None = None) -> float:
    """The absolute term of ``lowp_ok``: four fp32 roundings of ``scale`` (default: want's largest entry), >= 1e-6.

    The kernel's fp32 result differs from the exact one by a few fp32
    roundings of the terms it is made of (for dweight and dbias, a sum over up
    to 40 rows in another order than the reference's); where the exact value
    lies that close to a bf16 rounding tie, the kernel may round the other way,
    and its error then passes the one-rounding bound by that much. dx is a
    difference of terms as large as rstd |g| (see ``_assert_fp32``): its scale
    is theirs, ``_dx_scale``.
    """
    if scale is None:
        scale = want.abs().max().item() if want.numel() else 0.0
    return max(1e-6, 4 * 2.0 ** -24 * scale)


def _dx_scale(x, w, dy, rstd) -> float:
    """The largest rstd |dy w| over x's rows: the size of the terms dx is computed from."""
    g = dy.double() * (1 if w is None else w.double())
    return (rstd * g.abs()).max().item() if g.numel() else 0.0


shapes = dict(lead=st.sampled_from([(0,), (1,), (3,), (17,), (40,), (0, 3), (2, 3), (4, 5), (8, 5)]),
              d=st.sampled_from([1, 2, 3, 7, 16, 33, 64, 100, 255, 256, 300]) | st.integers(1, 300),
              has_w=st.booleans(), has_b=st.booleans(), strided=st.booleans(), seed=st.integers(0, 2**16))


# ----------------------------------------------------------------------------- fp32

@interpreted
@settings(max_examples=8)
@given(**shapes)
def test_layer_norm_fp32(lead, d, has_w, has_b, strided, seed):
    """For any shape, strides and weight/bias presence: y, dx, dw, db equal F.layer_norm's (fp64) at fp32 tolerance."""
    x, w, b, dy = _inputs(torch.Generator().manual_seed(seed), lead, d, torch.float32, has_w, has_b,
                          torch.float32, strided)
    with _launched_both("layer_norm", math.prod(lead)):
        got = _run(lambda x, w, b: layer_norm(x, w, b), (x, w, b), dy)
    assert got[0].dtype == torch.float32 and got[1].shape == x.shape
    _assert_fp32(got, _fp64(_layer_norm_ref, (x, w, b), dy), _rstd(x, True, 1e-5))


@interpreted
@settings(max_examples=8)
@given(**shapes)
def test_rms_norm_fp32(lead, d, has_w, has_b, strided, seed):
    """For any shape and strides, with or without weight: y, dx, dw equal the rms formula's (fp64) at fp32 tolerance."""
    x, w, _, dy = _inputs(torch.Generator().manual_seed(seed), lead, d, torch.float32, has_w, False,
                          torch.float32, strided)
    with _launched_both("rms_norm", math.prod(lead)):
        got = _run(lambda x, w: rms_norm(x, w), (x, w), dy)
    _assert_fp32(got, _fp64(_rms_formula, (x, w), dy), _rstd(x, False, 1e-6))


# ----------------------------------------------------------------------------- bf16

@interpreted
@settings(max_examples=8)
@given(**shapes, fp32_weights=st.booleans())
def test_layer_norm_bf16(lead, d, has_w, has_b, strided, seed, fp32_weights):
    """bf16 x (weights bf16 or fp32): every result in its input's dtype, no worse than PyTorch's bf16 layer_norm."""
    w_dtype = torch.float32 if fp32_weights else torch.bfloat16
    x, w, b, dy = _inputs(torch.Generator().manual_seed(seed), lead, d, torch.bfloat16, has_w, has_b, w_dtype, strided)
    with _launched_both("layer_norm", math.prod(lead)):
        got = _run(lambda x, w, b: layer_norm(x, w, b), (x, w, b), dy)
    # PyTorch's CPU backward fails for a bias without a weight in another dtype than x;
    # a weight of ones is the same math.
    torch_w = torch.ones(d, dtype=w_dtype) if w is None and b is not None else w
    torch_bf16 = _run(lambda x, w, b: F.layer_norm(x, (d,), w, b), (x, torch_w, b), dy)
    if w is None and b is not None:
        del torch_bf16[2]  # the stand-in weight's gradient
    want = _fp64(_layer_norm_ref, (x, w, b), dy)
    assert [t.dtype for t in got] == [t.dtype for t in (x, x, w, b) if t is not None]
    scales = [None, _dx_scale(x, w, dy, _rstd(x, True, 1e-5)), None, None]
    for g, t, r, scale in zip(got, torch_bf16, want, scales):
        assert lowp_ok(g, t, r, atol=_slack(r, scale))


@interpreted
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # F.rms_norm, fp32 weights
@settings(max_examples=8)
@given(**shapes, fp32_weights=st.booleans())
def test_rms_norm_bf16(lead, d, has_w, has_b, strided, seed, fp32_weights):
    """bf16 x (weight bf16 or fp32): y and dx in bf16, dw in weight's dtype, no worse than PyTorch's bf16 rms_norm."""
    w_dtype = torch.float32 if fp32_weights else torch.bfloat16
    x, w, _, dy = _inputs(torch.Generator().manual_seed(seed), lead, d, torch.bfloat16, has_w, False, w_dtype, strided)
    with _launched_both("rms_norm", math.prod(lead)):
        got = _run(lambda x, w: rms_norm(x, w), (x, w), dy)
    torch_bf16 = _run(lambda x, w: F.rms_norm(x, (d,), w, eps=1e-6), (x, w), dy)
    want = _fp64(_rms_formula, (x, w), dy)
    assert [t.dtype for t in got] == [t.dtype for t in (x, x, w) if t is not None]
    scales = [None, _dx_scale(x, w, dy, _rstd(x, False, 1e-6)), None]
    for g, t, r, scale in zip(got, torch_bf16, want, scales):
        assert lowp_ok(g, t, r, atol=_slack(r, scale))


# ----------------------------------------------------------------------------- wide rows, empty inputs, dtypes

@interpreted
@settings(max_examples=8)
@given(n_rows=st.integers(1, 9), d=st.integers(1, 70), rms=st.booleans(), seed=st.integers(0, 2**16))
def test_rows_wider_than_a_block(n_rows, d, rms, seed):
    """With blocks of 16 columns, rows of any width loop over column blocks and still equal the reference."""
    tk = kernels.dispatch.triton_module("norm_triton")
    x, w, b, dy = _inputs(torch.Generator().manual_seed(seed), (n_rows,), d, torch.float32, True, not rms,
                          torch.float32, False)
    fn, ref = ((lambda x, w, b: rms_norm(x, w), lambda x, w, b: _rms_formula(x, w)) if rms else
               (layer_norm, _layer_norm_ref))
    with mock.patch.object(tk, "MAX_BLOCK_D", 16), _launched_both("rms_norm" if rms else "layer_norm", n_rows):
        assert tk.block_for(d) <= 16
        got = _run(fn, (x, w, b), dy)
    _assert_fp32(got, _fp64(ref, (x, w, b), dy), _rstd(x, not rms, 1e-6 if rms else 1e-5))


@interpreted
@pytest.mark.parametrize("d", [8192, 8193])
def test_wide_model_dimensions(d):
    """D = 8192 is one block; D = 8193 is two, the second holding one column."""
    x, w, b, dy = _inputs(torch.Generator().manual_seed(d), (3,), d, torch.float32, True, True, torch.float32, False)
    with _launched_both("layer_norm", 3):
        got = _run(layer_norm, (x, w, b), dy)
    _assert_fp32(got, _fp64(_layer_norm_ref, (x, w, b), dy), _rstd(x, True, 1e-5))
    with _launched_both("rms_norm", 3):
        got = _run(lambda x, w: rms_norm(x, w), (x, w), dy)
    _assert_fp32(got, _fp64(_rms_formula, (x, w), dy), _rstd(x, False, 1e-6))


@interpreted
@pytest.mark.parametrize("d", [2, 3, 64, 300])
def test_rows_with_a_large_mean(d):
    """Rows 1000 + 0.01 z: the fp32 mean is off by an fp32 rounding of 1000, and layer_norm corrects for it.

    Left uncorrected, that error reaches y and dx amplified by rstd ~ 95
    (PyTorch's fp32 CPU layer_norm is off by ~1e-2 in y and ~1 in dx here).
    """
    g = torch.Generator().manual_seed(d)
    x = 1000 + 0.01 * torch.randn(16, d, generator=g)
    _, w, b, dy = _inputs(g, (16,), d, torch.float32, True, True, torch.float32, False)
    with _launched_both("layer_norm", 16):
        got = _run(layer_norm, (x, w, b), dy)
    _assert_fp32(got, _fp64(_layer_norm_ref, (x, w, b), dy), _rstd(x, True, 1e-5))


@interpreted
@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_empty_inputs_launch_nothing(lead):
    """Zero rows: outputs and gradients of the right shapes and dtypes (dw, db zero), and no kernel launched."""
    before = sum(kernels.launches.values())
    x, w, b, dy = _inputs(torch.Generator().manual_seed(0), lead, 5, torch.bfloat16, True, True, torch.float32, False)
    y, dx, dw, db = _run(layer_norm, (x, w, b), dy)
    assert y.shape == dx.shape == x.shape and y.dtype == dx.dtype == torch.bfloat16
    assert dw.dtype == db.dtype == torch.float32 and not dw.any() and not db.any()
    y, dx, dw = _run(lambda x, w: rms_norm(x, w), (x, w), dy)
    assert y.shape == dx.shape == x.shape and not dw.any()
    assert sum(kernels.launches.values()) == before


@interpreted
def test_fp64_takes_the_pytorch_path():
    """fp64 (gradcheck's dtype) is computed by PyTorch at fp64, never by the fp32 kernels."""
    before = sum(kernels.launches.values())
    x, w, b = (torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in ((3, 6), (6,), (6,)))
    assert torch.autograd.gradcheck(lambda x, w, b: layer_norm(x, w, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w), (x, w))
    assert sum(kernels.launches.values()) == before


@interpreted
def test_double_backward_fails_loudly():
    """The backward is a kernel, not differentiable itself: a second derivative raises instead of being wrong."""
    x = torch.randn(2, 4, requires_grad=True)
    with _launched_both("rms_norm", 2):
        (dx,) = torch.autograd.grad(rms_norm(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        dx.sum().backward()
