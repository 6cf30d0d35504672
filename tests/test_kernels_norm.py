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
yardstick (``_layer_norm_lowp``: with fp32 parameters, PyTorch's fp32 result
rounded once, since CUDA's F.layer_norm refuses a bf16 input with an fp32 weight).

The fused residual add (``add_layer_norm``, ``add_rms_norm``) is held to the
composition it replaces: h bitwise equal to ``x + delta`` (one fp32 add, one
rounding, on any device), y and the gradients against the fp64 composition on
that h. The custom ops' fake implementations are checked by ``opcheck``, and
the four public functions under ``torch.compile(fullgraph=True)`` give the
eager results through the kernels.
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
from minipar.kernels import norm
from minipar.kernels.add_norm import add_layer_norm, add_rms_norm
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


def _layer_norm_lowp(x, w, b):
    """PyTorch's layer_norm of a bf16/fp16 x, the yardstick: in x's dtype when the parameters are in it
    (or absent); with fp32 parameters, computed in fp32 and rounded once to x's dtype (what a
    mixed-precision kernel does; CUDA's F.layer_norm refuses a bf16 input with an fp32 weight)."""
    if all(p is None or p.dtype == x.dtype for p in (w, b)):
        return F.layer_norm(x, x.shape[-1:], w, b)
    return F.layer_norm(x.float(), x.shape[-1:], w, b).to(x.dtype)


def _rms_lowp(x, w):
    """The rms formula on a bf16/fp16 x, the yardstick as `_layer_norm_lowp`: in x's dtype, or with an fp32
    weight in fp32 rounded once to x's dtype."""
    if w is None or w.dtype == x.dtype:
        return _rms_formula(x, w)
    return _rms_formula(x.float(), w).to(x.dtype)


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
    torch_bf16 = _run(_layer_norm_lowp, (x, w, b), dy)
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
    x, w, b, dy = _inputs(torch.Generator().manual_seed(seed), (n_rows,), d, torch.float32, True, not rms,
                          torch.float32, False)
    fn, ref = ((lambda x, w, b: rms_norm(x, w), lambda x, w, b: _rms_formula(x, w)) if rms else
               (layer_norm, _layer_norm_ref))
    with mock.patch.object(norm, "MAX_BLOCK_D", 16), _launched_both("rms_norm" if rms else "layer_norm", n_rows):
        assert norm.block_for(d) <= 16
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
@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_programs_loop_over_several_tiles(fn):
    """37 rows of 1000 columns: 19 tiles of 2 rows (the last one short) for the backward's 4 programs, so each
    program prefetches and carries its dw, db sums across several tiles; all results equal the reference."""
    assert norm.backward_config(1000, 37 * 1000, 4)["ROWS"] == 2
    g = torch.Generator().manual_seed(11)
    rms = "rms" in fn
    x, w, b, dy = _inputs(g, (37,), 1000, torch.float32, True, not rms, torch.float32, False)
    rstd_of = lambda h: _rstd(h, not rms, 1e-6 if rms else 1e-5)  # noqa: E731
    if fn.startswith("add_"):
        delta, dh = torch.randn(37, 1000, generator=g), torch.randn(37, 1000, generator=g)
        with _launched_both(fn, 37):
            got = _run_pair(_add_norm(rms), (x, delta, w, b), (dh, dy))
        want = _add_norm_fp64(rms, x, delta, w, b, dh, dy)
        got, want, rstd = got[1:], want[1:], rstd_of(want[0])
        del got[2], want[2]  # d delta is d x
    else:
        with _launched_both(fn, 37):
            got = _run(lambda x, w, b: rms_norm(x, w) if rms else layer_norm(x, w, b), (x, w, b), dy)
        want = _fp64(lambda x, w, b: _rms_formula(x, w) if rms else _layer_norm_ref(x, w, b), (x, w, b), dy)
        rstd = rstd_of(x)
    _assert_fp32(got, want, rstd)


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


# ----------------------------------------------------------------------------- the fused residual add

def _add_norm(rms: bool):
    """The public function under test, as fn(x, delta, w, b) -> (h, y)."""
    return (lambda x, d, w, b: add_rms_norm(x, d, w)) if rms else add_layer_norm


def _run_pair(fn, inputs, grads):
    """[h, y, grad of each input that is not None]: ``fn(*inputs)`` on fresh leaves, backward with (dh, dy)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    torch.autograd.backward(outs, grads)
    return list(outs) + [t.grad for t in leaves if t is not None]


def _add_norm_fp64(rms, x, delta, w, b, dh, dy):
    """The reference: h = x + delta in x's dtype (the composition's one rounding), then the norm of
    that h and its gradients in fp64 by autograd; d x = d delta = dh + dnorm, summed in fp64.
    Returns [h, y, dx, ddelta, dw, db] (the last two where w, b exist), rounded to fp32 but h."""
    h = x + delta
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in (h, w, b)]
    y = _rms_formula(leaves[0], leaves[1]) if rms else _layer_norm_ref(*leaves)
    y.backward(dy.double())
    dx = (leaves[0].grad + dh.double()).float()
    return [h, y.float(), dx, dx] + [t.grad.float() for t in leaves[1:] if t is not None]


def test_add_norm_pytorch_path_is_the_composition(monkeypatch):
    """On CPU without the interpreter: add_layer_norm / add_rms_norm are h = x + delta and the norm of h,
    exactly, forward and backward; no kernel runs. Mismatched x and delta are refused."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = sum(kernels.launches.values())
    x, d, w, b = torch.randn(2, 3, 37), torch.randn(2, 3, 37), torch.randn(37), torch.randn(37)
    grads = (torch.randn(2, 3, 37), torch.randn(2, 3, 37))

    def composed(norm):
        def fn(x, d, *params):
            h = x + d
            return h, norm(h, *params)
        return fn

    got = _run_pair(add_layer_norm, (x, d, w, b), grads)
    want = _run_pair(composed(lambda h, w, b: F.layer_norm(h, (37,), w, b)), (x, d, w, b), grads)
    assert all(torch.equal(g, r) for g, r in zip(got, want))
    got = _run_pair(lambda x, d, w: add_rms_norm(x, d, w, eps=1e-5), (x, d, w), grads)
    want = _run_pair(composed(lambda h, w: rms_norm(h, w, eps=1e-5)), (x, d, w), grads)
    assert all(torch.equal(g, r) for g, r in zip(got, want))
    assert sum(kernels.launches.values()) == before
    with pytest.raises(ValueError, match="one shape and dtype"):
        add_layer_norm(x, d.to(torch.bfloat16))
    with pytest.raises(ValueError, match="one shape and dtype"):
        add_rms_norm(x, d[:1])


@interpreted
@settings(max_examples=8)
@given(**shapes, rms=st.booleans(), dtype=st.sampled_from(["fp32", "bf16"]))
def test_add_norm(lead, d, has_w, has_b, strided, seed, rms, dtype):
    """For any shape, strides, parameters and dtype: h is x + delta bitwise; y, d x = d delta, dw, db equal
    the fp64 composition on that h (fp32: at fp32 tolerance, dx in units of rstd; bf16: ``lowp_ok``,
    PyTorch's own bf16 composition the yardstick)."""
    lowp = dtype == "bf16"
    g = torch.Generator().manual_seed(seed)
    x, w, b, dy = _inputs(g, lead, d, torch.bfloat16 if lowp else torch.float32, has_w, has_b and not rms,
                          torch.float32, strided)
    delta, dh = (0.5 * torch.randn(*lead, d, generator=g)).to(x.dtype), torch.randn(*lead, d, generator=g).to(x.dtype)
    name = "add_rms_norm" if rms else "add_layer_norm"
    with _launched_both(name, math.prod(lead)):
        got = _run_pair(_add_norm(rms), (x, delta, w, b), (dh, dy))
    want = _add_norm_fp64(rms, x, delta, w, b, dh, dy)
    assert torch.equal(got[0], want[0]) and got[0].dtype == x.dtype
    assert [t.dtype for t in got] == [t.dtype for t in (x, x, x, x, w, b) if t is not None]
    h = want[0]
    rstd = _rstd(h, not rms, 1e-6 if rms else 1e-5)
    if not lowp:
        # dx = dh + rstd (projection of g): in units of rstd, as _assert_fp32 explains
        for i, (gt, r) in enumerate(zip(got[1:], want[1:])):
            if i in (1, 2):
                gt, r = gt.double() / rstd, r.double() / rstd
            torch.testing.assert_close(gt, r, rtol=1.3e-6, atol=1e-5)
        return
    lowp_norm = (lambda h, w, b: _rms_lowp(h, w)) if rms else _layer_norm_lowp

    def composed(x, d, w, b):
        h = x + d
        return h, lowp_norm(h, w, b)

    torch_lowp = _run_pair(composed, (x, delta, w, b), (dh, dy))
    dx_scale = _dx_scale(h, w, dy, rstd) + dh.float().abs().max().item() if h.numel() else 0.0
    scales = [None, dx_scale, dx_scale, None, None]
    for gt, t, r, scale in zip(got[1:], torch_lowp[1:], want[1:], scales):
        assert lowp_ok(gt, t, r, atol=_slack(r, scale))


@interpreted
@pytest.mark.parametrize("rms", [False, True])
def test_add_norm_unused_outputs_and_wide_rows(rms):
    """Rows wider than a block (16 columns here) loop; with only h used, x and delta get dh alone and the
    parameters nothing; with only y used, x and delta get the norm's gradient; the backward is deterministic."""
    g = torch.Generator().manual_seed(7)
    x, w, b, dy = _inputs(g, (5,), 37, torch.float32, True, not rms, torch.float32, False)
    delta, dh = torch.randn(5, 37, generator=g), torch.randn(5, 37, generator=g)
    with mock.patch.object(norm, "MAX_BLOCK_D", 16), _launched_both(f"add_{'rms' if rms else 'layer'}_norm", 5):
        got = _run_pair(_add_norm(rms), (x, delta, w, b), (dh, dy))
        again = _run_pair(_add_norm(rms), (x, delta, w, b), (dh, dy))
    assert all(torch.equal(a, c) for a, c in zip(got, again))  # the same code: bitwise the same, no atomics
    want = _add_norm_fp64(rms, x, delta, w, b, dh, dy)
    rstd = _rstd(want[0], not rms, 1e-6 if rms else 1e-5)
    for i, (gt, r) in enumerate(zip(got, want)):
        if i in (2, 3):
            gt, r = gt.double() / rstd, r.double() / rstd
        torch.testing.assert_close(gt, r, rtol=1.3e-6, atol=1e-5)

    leaves = [t.clone().requires_grad_() for t in (x, delta, w)]
    h, _ = _add_norm(rms)(*leaves, None)
    h.backward(dh)
    assert torch.equal(leaves[0].grad, dh) and torch.equal(leaves[1].grad, dh) and leaves[2].grad is None
    leaves = [t.clone().requires_grad_() for t in (x, delta, w)]
    _, y = _add_norm(rms)(*leaves, None)
    y.backward(dy)
    alone = _add_norm_fp64(rms, x, delta, w, None, torch.zeros_like(dh), dy)
    torch.testing.assert_close(leaves[0].grad.double() / rstd, alone[2].double() / rstd, rtol=1.3e-6, atol=1e-5)
    assert torch.equal(leaves[0].grad, leaves[1].grad)


# ----------------------------------------------------------------------------- custom ops, torch.compile, launch shapes

@interpreted
def test_custom_ops_fake_implementations_match():
    """``opcheck``: each op's schema holds and its fake implementation gives the real outputs' shapes,
    strides and dtypes (bf16 data with fp32 parameters included: dw and db take the parameters' dtypes)."""
    g = torch.Generator().manual_seed(0)
    x, w, b, dy = _inputs(g, (6,), 40, torch.bfloat16, True, True, torch.float32, False)
    delta = torch.randn(6, 40, generator=g).to(torch.bfloat16)
    ops = torch.ops.minipar
    checks = ("test_schema", "test_faketensor")
    for rms in (False, True):
        y, mean, rstd = ops.norm_fwd(x, w, None if rms else b, 1e-5, rms)
        cases = [(ops.norm_fwd, (x, w, b, 1e-5, rms)), (ops.norm_fwd, (x, None, None, 1e-5, rms)),
                 (ops.add_norm_fwd, (x, delta, w, b, 1e-5, rms)),
                 (ops.norm_bwd, (dy, None, x, w, None if rms else torch.float32, mean, rstd, rms)),
                 (ops.norm_bwd, (dy, delta, x, None, None, mean, rstd, rms))]
        for op, args in cases:
            result = torch.library.opcheck(op, args, test_utils=checks)
            assert all(v == "SUCCESS" for v in result.values()), (op, result)


@interpreted
def test_norms_inside_torch_compile():
    """The four public functions under torch.compile(fullgraph=True): the eager loss and gradients, and the
    Triton kernels ran (the custom ops are opaque to the compiler; it traces through them)."""
    def fn(x, d, w, b):
        h, y = add_layer_norm(x, d, w, b)
        z = layer_norm(2 * y, w, b) + rms_norm(h, w)
        h2, y2 = add_rms_norm(h, z, w)
        return (y2 * h2).sum() + z.square().sum()

    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(3, 5, 40, generator=g), torch.randn(3, 5, 40, generator=g), 1 + torch.randn(40, generator=g),
              torch.randn(40, generator=g)]
    want = _run(fn, inputs, torch.tensor(1.0))
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    names = [f"{n}_{p}_kernel" for n in ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
             for p in ("fwd", "bwd")] + ["norm_grad_sum_kernel"]
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(launched(name))
        got = _run(compiled, inputs, torch.tensor(1.0))
    # The same kernels on the same inputs; the torch ops between them may be decomposed or reordered by
    # AOT autograd, so the loss and gradients are held to fp32 tolerance, not bitwise.
    for gt, r in zip(got, want):
        torch.testing.assert_close(gt, r)


def test_launch_shapes_follow_the_width():
    """Warps by width (4 below 2K columns, 8 at 4K, 16 from 8K; the backward by bytes, so fp32 gets twice
    bf16's), narrow rows several to a program, one block up to 8192 columns, 64-bit offsets only from
    2**31 elements, and the backward's registers capped so that its programs per SM fit."""
    n = 16384
    for d, warps, rows, block in [(1, 4, 64, 1), (100, 4, 16, 128), (768, 4, 2, 1024), (2048, 4, 1, 2048),
                                  (4096, 8, 1, 4096), (8192, 16, 1, 8192), (8193, 16, 1, 8192)]:
        cfg = norm.launch_config(d, n * d)
        assert (cfg["num_warps"], cfg["ROWS"], cfg["BLOCK_D"], cfg["SINGLE"], cfg["LONG"]) == \
            (warps, rows, block, d <= 8192, False), d
        assert norm.backward_config(d, n * d, 2)["num_warps"] == warps
    assert norm.launch_config(4096, 2**31)["LONG"] and not norm.launch_config(4096, 2**31 - 1)["LONG"]
    assert [norm.backward_config(d, n * d, 4)["num_warps"] for d in (1024, 2048, 4096, 8192)] == [8, 8, 16, 16]
    for warps in (4, 8, 16):
        cfg = dict(norm.backward_config(4096, n * 4096, 2), num_warps=warps)
        assert norm.programs_per_sm(warps) * warps * 32 * cfg["maxnreg"] <= 65536  # an H100/H200 SM's registers
    assert norm.grad_sum_config(4096, 132)["BLOCK_C"] == 32  # 128 programs for 132 SMs


def test_benchmark_shape_launches():
    """At the benchmark shape (16384 x 4096 bf16) layer_norm's forward is one program per row with 8 warps,
    its backward a persistent grid, then one norm_grad_sum_kernel (off a GPU: 4 programs each, as for 4 SMs);
    recorded, not run."""
    x = torch.empty(16384, 4096, dtype=torch.bfloat16, requires_grad=True)
    w, b = (torch.empty(4096, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    with kernels.dispatch.recording() as recorded:
        layer_norm(x, w, b).backward(torch.empty(16384, 4096, dtype=torch.bfloat16))
    assert [(r.kernel.__name__, r.grid, r.kwargs["num_warps"]) for r in recorded] == [
        ("layer_norm_fwd_kernel", (16384,), 8), ("layer_norm_bwd_kernel", (4,), 8), ("norm_grad_sum_kernel", (4,), 4)]
    assert recorded[0].kwargs["BLOCK_D"] == 4096 and recorded[0].kwargs["SINGLE"] and not recorded[0].kwargs["LONG"]
