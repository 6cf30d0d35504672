"""minipar.kernels.grouped_mm: y[rows_g] = x[rows_g] @ w[g] and its backward, every path against a loop over
the groups computed in float64.

For any group counts (zeros among them, every row in one group, no rows at all) and any K, N (odd ones
included): the PyTorch path's forward, dx and dw equal the float64 loop to fp32 rounding (assert_close's
fp32 tolerance, rtol 1.3e-6 and atol 1e-5: the products are sums of at most 40 terms of size ~1); its
two forms, ``torch._grouped_mm`` (aligned operands) and the loop of ``torch.mm``, are equal bit for bit on
the CPU; an empty group's weight gradient is zero, never None. The Triton kernels run in a
TRITON_INTERPRET=1 child pytest (``kernel_testing``) on tiny shapes; each asserts it launched. In fp32 they
equal the reference to fp32 rounding (the interpreter sums K in another order than BLAS); in bf16 they
are judged by ``lowp_ok`` against the fp32 result (no worse than PyTorch's own bf16 product).
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from minipar.kernels.grouped_mm import grouped_mm

from kernel_testing import interpreted, launched, lowp_ok, pytorch_path, run_interpreted

# the module itself: `minipar.kernels.grouped_mm` as an attribute is the function the package exports
gm = importlib.import_module("minipar.kernels.grouped_mm")


def test_triton_kernels_under_interpreter():
    """This module's interpreted tests, in a TRITON_INTERPRET=1 child: all pass, none skip."""
    run_interpreted(__file__)


def operands(counts: list[int], k: int, n: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    m = sum(counts)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(len(counts), k, n, generator=g).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    return x, w, torch.tensor(counts, dtype=torch.long), dy


def reference(x, w, counts, dy):
    """The definition, group by group, in float64: (y, dx, dw)."""
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    rows = counts.tolist()
    y = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    dx = torch.zeros_like(x64)
    dw = torch.zeros_like(w64)
    start = 0
    for g, c in enumerate(rows):
        sl = slice(start, start + c)
        y[sl] = x64[sl] @ w64[g]
        dx[sl] = dy64[sl] @ w64[g].T
        dw[g] = x64[sl].T @ dy64[sl]
        start += c
    return y, dx, dw


def run(x, w, counts, dy):
    """grouped_mm's (y, dx, dw) on leaves made from x and w."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_mm(x, w, counts)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def assert_fp32_close(got, want):
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert a is not None, f"{name} is None"
        torch.testing.assert_close(a, b.float(), msg=lambda m: f"{name}: {m}")


def counts_strategy(max_groups: int = 5, max_rows: int = 12):
    """Group counts with zeros likely: each group empty or up to max_rows rows."""
    return st.lists(st.one_of(st.just(0), st.integers(1, max_rows)), min_size=1, max_size=max_groups)


@settings(max_examples=20)
@example(counts=[0, 0, 9], k=7, n=5, seed=0)  # every row in the last group
@example(counts=[0, 0], k=3, n=4, seed=1)  # no rows at all
@example(counts=[4, 0, 8, 0], k=8, n=16, seed=2)  # aligned: torch._grouped_mm
@given(counts=counts_strategy(), k=st.integers(1, 40), n=st.integers(1, 40), seed=st.integers(0, 99))
def test_pytorch_path_equals_the_loop(counts, k, n, seed):
    """For any counts, K and N: forward, dx and dw equal the float64 loop to fp32 rounding; an empty group's
    dw is exactly zero."""
    x, w, c, dy = operands(counts, k, n, seed)
    with pytorch_path():
        got = run(x, w, c, dy)
    assert_fp32_close(got, reference(x, w, c, dy))
    for g, rows in enumerate(counts):
        if rows == 0:
            assert torch.equal(got[2][g], torch.zeros(k, n)), g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_grouped_mm_where_it_applies_equals_the_loop_bitwise(monkeypatch, dtype):
    """Aligned operands take ``torch._grouped_mm`` (counted), K = 7 (28-byte rows) takes the loop; the two
    forms give the same bits on the CPU, forward and backward."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm: the loop is the only PyTorch form")
    gm._probe("cpu", None, dtype)  # its one-time probe runs now, before the calls are counted
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, w, c, dy = operands([5, 0, 11, 16], 16, 24, seed=3, dtype=dtype)
    with pytorch_path():
        grouped = run(x, w, c, dy)
        assert len(calls) == 3, calls  # y, dx and dw
        monkeypatch.setattr(gm, "_torch_grouped_applies", lambda a, b: False)
        loop = run(x, w, c, dy)
    for a, b in zip(grouped, loop):
        assert torch.equal(a, b)
    monkeypatch.undo()
    calls.clear()
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with pytorch_path():
        run(*operands([3, 4], 7, 24, seed=4, dtype=dtype))
    assert len(calls) == 1, calls  # K = 7: x's 7-element rows unaligned (y, dw loop); dy and w^T aligned (dx grouped)


def test_bad_arguments_raise():
    x, w, c, _ = operands([2, 3], 4, 5, seed=0)
    with pytest.raises(ValueError, match="w \\(G, K, N\\)"):
        grouped_mm(x, w[0], c)
    with pytest.raises(ValueError, match="counts must be \\(2,\\)"):
        grouped_mm(x, w, c[:1])
    with pytest.raises(ValueError, match="counts must be"):
        grouped_mm(x, w, c.float())
    with pytest.raises(ValueError, match="one dtype"):
        grouped_mm(x, w.double(), c)
    with pytorch_path(), pytest.raises(ValueError, match="counts sum to 4 but x has 5 rows"):  # read on CPU only
        grouped_mm(x, w, torch.tensor([1, 3]))


@interpreted
@settings(max_examples=4, deadline=None)
@example(counts=[0, 20, 0], k=5, n=9, seed=0)  # one group spanning two row tiles, empty groups around it
@example(counts=[0, 0], k=3, n=4, seed=1)  # no rows: dw all zeros
@given(counts=counts_strategy(max_groups=4, max_rows=18), k=st.integers(1, 20), n=st.integers(1, 20),
       seed=st.integers(0, 99))
def test_triton_equals_the_loop(counts, k, n, seed):
    """For any counts (tiles of 16 rows: groups of 17 and 18 rows take two), K and N: the Triton forward,
    dx and dw equal the float64 loop to fp32 rounding; an empty group's dw is zero."""
    x, w, c, dy = operands(counts, k, n, seed)
    # No rows: the products launch nothing (their results are empty), the weight gradient's zeros still do.
    with launched("grouped_mm_kernel") if sum(counts) else contextlib.nullcontext():
        with launched("grouped_mm_weight_grad_kernel"):
            got = run(x, w, c, dy)
    assert_fp32_close(got, reference(x, w, c, dy))
    for g, rows in enumerate(counts):
        if rows == 0:
            assert torch.equal(got[2][g], torch.zeros(k, n)), g


@interpreted
def test_triton_bf16_is_no_worse_than_pytorch():
    """bf16 operands, fp32 accumulation, one rounding: within PyTorch's own bf16 error of the fp32 result."""
    x, w, c, dy = operands([7, 0, 19], 24, 40, seed=5, dtype=torch.bfloat16)
    with launched("grouped_mm_kernel"), launched("grouped_mm_weight_grad_kernel"):
        got = run(x, w, c, dy)
    with pytorch_path():
        torch_lowp = run(x, w, c, dy)
    want = reference(x, w, c, dy)
    for name, a, lowp, ref in zip(("y", "dx", "dw"), got, torch_lowp, want):
        assert a.dtype == torch.bfloat16, name
        assert lowp_ok(a, lowp, ref.float(), atol=1e-3), name
