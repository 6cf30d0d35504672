"""minipar.kernels: the dispatch rule, and the permute kernels against their PyTorch reference.

The Triton tests run in a child pytest under ``TRITON_INTERPRET=1`` (see
``kernel_testing``); each asserts that its kernel launched.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minipar import kernels
from minipar.kernels import permute, unpermute

from kernel_testing import interpreted, launched, lowp_ok, run_interpreted


def test_triton_kernels_under_interpreter():
    """This module's interpreted tests, in a TRITON_INTERPRET=1 child: all pass, none skip."""
    run_interpreted(__file__)


def test_dispatch_rule(monkeypatch):
    """Triton under the interpreter (any device), PyTorch on CPU otherwise; read at every call."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.use_triton(torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not kernels.use_triton(torch.zeros(1))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not kernels.use_triton(torch.zeros(1))


def test_cpu_path_launches_nothing(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = sum(kernels.launches.values())
    x = torch.randn(5, 3, requires_grad=True)
    unpermute(permute(x, torch.tensor([4, 0, 4])), torch.tensor([1, 1, 0]), 2).sum().backward()
    assert sum(kernels.launches.values()) == before


# ----------------------------------------------------------------------------- permute / unpermute

@interpreted
@settings(max_examples=8)
@given(n=st.integers(0, 9), m=st.integers(0, 12), d=st.integers(1, 70), bf16=st.booleans(), seed=st.integers(0, 99))
def test_permute_unpermute(n, m, d, bf16, seed):
    """For any sizes (empty included): permute = x[index], unpermute = index_add_ into zeros; backward likewise."""
    _check_permute_unpermute(n, m, d, torch.bfloat16 if bf16 else torch.float32, seed)


@interpreted
@settings(max_examples=8)
@given(n=st.integers(1, 6), m=st.integers(1, 8), d=st.integers(1, 70), bf16=st.booleans(), seed=st.integers(0, 99))
def test_permute_unpermute_rows_wider_than_a_block(n, m, d, bf16, seed):
    """With blocks of 16 columns, rows of any width loop over column blocks (a ragged tail included) and
    still equal the reference, forward and backward."""
    tk = kernels.dispatch.triton_module("permute_triton")
    with mock.patch.object(tk, "block_for", lambda d: 16):
        _check_permute_unpermute(n, m, d, torch.bfloat16 if bf16 else torch.float32, seed)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d, n_blocks", [(1024, 1), (1025, 2), (2049, 3)])
def test_permute_unpermute_wide_rows(d, n_blocks, dtype):
    """With the real block size (at most 1024 columns): D = 1024 is one block, D = 1025 two, the second holding
    one column, D = 2049 three."""
    tk = kernels.dispatch.triton_module("permute_triton")
    assert -(-d // tk.block_for(d)) == n_blocks
    _check_permute_unpermute(3, 5, d, dtype, seed=d)


def _check_permute_unpermute(n, m, d, dtype, seed):
    """permute and unpermute (forward and backward) of random (n, d) rows by a random index of m rows."""
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, n, (m,), generator=g) if n else torch.zeros(0, dtype=torch.long)
    m = index.shape[0]
    x = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    grad_y = torch.randn(m, d, generator=g).to(dtype)
    with launched("gather_rows_kernel") if m else contextlib.nullcontext():
        y = permute(x, index)
    assert y.dtype == dtype and torch.equal(y, x.detach()[index])  # a copy: exact
    with launched("segment_sum_rows_kernel") if n else contextlib.nullcontext():
        y.backward(grad_y)
    want = torch.zeros(n, d).index_add_(0, index, grad_y.float())  # fp32 reference
    torch_sum = torch.zeros(n, d, dtype=dtype).index_add_(0, index, grad_y)
    assert lowp_ok(x.grad, torch_sum, want)

    y2 = grad_y.clone().requires_grad_()
    with launched("segment_sum_rows_kernel") if n else contextlib.nullcontext():
        out = unpermute(y2, index, n)
    assert out.dtype == dtype and out.shape == (n, d)
    assert lowp_ok(out, torch_sum, want)
    grad_out = torch.randn(n, d, generator=g).to(dtype)
    with launched("gather_rows_kernel") if m else contextlib.nullcontext():
        out.backward(grad_out)
    assert torch.equal(y2.grad, grad_out[index])
