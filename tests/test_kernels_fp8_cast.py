"""minipar.kernels.fp8_cast: the Triton kernel against the PyTorch path, bit for bit, and the PyTorch path
against the recipe's definition (minipar.fp8.quantize).

The Triton tests run in a TRITON_INTERPRET=1 child pytest (see ``kernel_testing``); each asserts that the
kernel launched. q's bytes and inv_scale are equal, with power-of-two scales (the recipes' default) and
without: both paths divide correctly rounded (``fp8_max / amax`` with a Python float would not: torch
computes it as a product with the reciprocal, and a scale one ulp off sends an x * scale that lands on a
tie of the fp8 grid to the other side; seen on 28% of random scales, and as a 1/8 error in one element).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minipar.fp8.quantize import quantise
from minipar.kernels.fp8_cast import fp8_cast

from kernel_testing import interpreted, launched, pytorch_path, run_interpreted

DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def test_triton_kernels_under_interpreter():
    """This module's interpreted tests, in a TRITON_INTERPRET=1 child: all pass, none skip."""
    run_interpreted(__file__)


def operand(rows: int, k: int, seed: int, src: torch.dtype) -> torch.Tensor:
    """Magnitudes spread over 9 decades along K, so each group's small values land in the fp8 subnormals
    (and below them, rounding to a signed zero); a zero row; the dtype the layers quantise from."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-6, 3, k)[torch.randperm(k, generator=g)]
    x[0] = 0.0
    return x.to(src)


def check(rows: int, k: int, width: int | None, fmt: str, pow2: bool, seed: int, src: torch.dtype) -> None:
    x = operand(rows, k, seed, src)
    width = width or k
    with launched("fp8_cast_kernel"):
        q, inv = fp8_cast(x, DTYPES[fmt], width, pow2)
    with pytorch_path():
        q_ref, inv_ref = fp8_cast(x, DTYPES[fmt], width, pow2)
    assert q.dtype == DTYPES[fmt] and q.shape == x.shape and inv.shape == (rows, -(-k // width))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), (q.float() - q_ref.float()).abs().max()
    assert torch.equal(inv, inv_ref)


@interpreted
@settings(max_examples=6)
@given(rows=st.integers(1, 40), k=st.integers(1, 400), tiles=st.booleans(), fmt=st.sampled_from(sorted(DTYPES)),
       pow2=st.booleans(), seed=st.integers(0, 99), src=st.sampled_from([torch.float32, torch.bfloat16]))
def test_fp8_cast_triton_equals_pytorch(rows, k, tiles, fmt, pow2, seed, src):
    """For any operand shape, rows or 1 x 128 tiles (a partial last one), format, scale rounding and source
    dtype: the kernel's bytes and inverse scales are the PyTorch path's."""
    check(rows, k, 128 if tiles else None, fmt, pow2, seed, src)


@interpreted
@pytest.mark.parametrize("fmt", sorted(DTYPES))
def test_fp8_cast_triton_each_form(fmt):
    """Rows of 1000 (one program per row block, a 1024-wide block), tiles with a 44-wide tail, 33 rows."""
    check(33, 1000, None, fmt, True, seed=1, src=torch.float32)
    check(33, 300, 128, fmt, False, seed=2, src=torch.float32)


@pytest.mark.parametrize("form", ["row", "tile"])
@pytest.mark.parametrize("fmt", sorted(DTYPES))
def test_fp8_cast_pytorch_is_the_recipes_quantisation(form, fmt):
    """The PyTorch path equals quantize's generic arithmetic (amax of each group, then scale and cast)."""
    x = operand(20, 300, 3, torch.float32)
    with pytorch_path():
        got = fp8_cast(x, DTYPES[fmt], 300 if form == "row" else 128, True)
    want = quantise(x, fmt, form, True, reduce_amax=lambda a: None)  # a reducer: quantise's generic path
    assert torch.equal(got[0].view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got[1], want.inv_scale)


def test_fp8_cast_rejects_bad_arguments():
    with pytest.raises(ValueError, match="contiguous 2-d"):
        fp8_cast(torch.zeros(4, 4, 4), torch.float8_e4m3fn, 4)
    with pytest.raises(ValueError, match="contiguous"):
        fp8_cast(torch.zeros(8, 8).t(), torch.float8_e4m3fn, 8)
    with pytest.raises(ValueError, match="float8_e4m3fn or torch.float8_e5m2"):
        fp8_cast(torch.zeros(4, 4), torch.bfloat16, 4)
    with pytest.raises(ValueError, match="width"):
        fp8_cast(torch.zeros(4, 4), torch.float8_e4m3fn, 0)
