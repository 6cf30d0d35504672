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
from minipar.core.syncs import count_host_syncs

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
@given(n=st.integers(1, 12), m=st.integers(1, 24), d=st.integers(1, 40), bf16=st.booleans(), seed=st.integers(0, 99),
       int64=st.booleans())
def test_permute_unpermute_small_tiles(n, m, d, bf16, seed, int64):
    """With tiles of 4 rows by 16 columns: rows split over column blocks (a ragged tail included), row tiles
    with a ragged tail, destination rows of a tile with different numbers of sources (0 included), and the
    int64-offset variant (an operand of 2**31 elements gets it): still the reference, forward and backward."""
    tk = kernels.dispatch.triton_module("permute_triton")
    small = dict(ROWS=4, BLOCK_D=16, EVEN_D=d % 16 == 0, INT64=int64)
    with mock.patch.object(tk, "config", lambda d, size, numel: small):
        _check_permute_unpermute(n, m, d, torch.bfloat16 if bf16 else torch.float32, seed)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d, n_blocks", [(4096, 1), (4097, 2), (8193, 3)])
def test_permute_unpermute_wide_rows(d, n_blocks, dtype):
    """With the real tiles (at most 4096 columns): D = 4096 is one column block, D = 4097 two, the second
    holding one column, D = 8193 three."""
    tk = kernels.dispatch.triton_module("permute_triton")
    assert -(-d // tk.config(d, dtype.itemsize, 5 * d)["BLOCK_D"]) == n_blocks
    _check_permute_unpermute(3, 5, d, dtype, seed=d)


@interpreted
def test_unpermute_many_sources_per_row():
    """Destination rows with 0 to 40 sources side by side in one tile: each sums its own, in index order (bitwise
    index_add_ in fp32)."""
    g = torch.Generator().manual_seed(11)
    n, d = 24, 37
    index = torch.cat([torch.full((k,), (7 * k) % n) for k in range(41)])  # row (7k mod n) gets k sources
    index = index[torch.randperm(index.numel(), generator=g)]
    y = torch.randn(index.numel(), d, generator=g)
    with launched("segment_sum_rows_kernel"):
        out = unpermute(y, index, n)
    assert torch.equal(out, torch.zeros(n, d).index_add_(0, index, y))


@interpreted
def test_permute_unpermute_in_torch_compile():
    """Inside torch.compile (fullgraph, aot_eager) permute and unpermute trace as their custom ops: forward and
    backward launch the kernels and equal eager bit for bit."""
    g = torch.Generator().manual_seed(12)
    index = torch.randint(0, 9, (14,), generator=g)

    def fn(x):
        return unpermute(permute(x, index) * 2, index, 9)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    x = torch.randn(9, 33, generator=g).bfloat16()
    grad = torch.randn(9, 33, generator=g).bfloat16()
    results = []
    for f in (compiled, fn):
        leaf = x.clone().requires_grad_()
        with launched("gather_rows_kernel"), launched("segment_sum_rows_kernel"):
            out = f(leaf)
            out.backward(grad)
        results.append((out.detach(), leaf.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@interpreted
def test_permute_unpermute_make_no_host_sync():
    """permute and unpermute, forward and backward: nothing would make the host wait for a GPU (no bincount,
    no count read back; ``minipar.core.syncs``)."""
    index = torch.tensor([3, 0, 3, 5, 1, 3])
    x = torch.randn(6, 20, requires_grad=True)
    with count_host_syncs() as syncs, launched("gather_rows_kernel"), launched("segment_sum_rows_kernel"):
        unpermute(permute(x, index), index, 6).sum().backward()
    assert not syncs.calls, syncs.report()


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
