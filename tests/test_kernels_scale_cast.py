"""minipar.kernels.scale_cast: scale_cast_ against its definition, on both paths.

The definition: ``dst = (src.float() * scale).to(dst.dtype)``, bit for bit, and
``found_inf`` raised to 1 exactly when a stored value is inf or nan, never
lowered. The Triton tests run in a TRITON_INTERPRET=1 child pytest (see
``kernel_testing``) and each asserts that the kernel launched; the PyTorch
path is held to the same definition.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minipar import kernels
from minipar.kernels.scale_cast import scale_cast_

from kernel_testing import interpreted, launched, pytorch_path, run_interpreted

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# name: (src dtype, dst dtype, in place)
CASTS = {"fp32->bf16": (F32, BF16, False), "bf16->fp32": (BF16, F32, False), "fp32->fp32 in place": (F32, F32, True),
         "fp32->fp16": (F32, F16, False), "bf16->bf16 in place": (BF16, BF16, True)}
# Element counts: anything up to 5000, and the block edges (4096 per program) with 1-element tails.
SIZES = st.one_of(st.integers(0, 5000), st.sampled_from([0, 1, 4095, 4096, 4097]))
# Loss-scale inverses, and 1/3 and 1e-3, which fp32 cannot hold: the scale is rounded to fp32 on both paths.
SCALES = st.sampled_from([1.0, 0.5, 2.0**-16, 1 / 3, 1e-3, 1 / 65536 * 3])


def test_triton_kernels_under_interpreter():
    """This module's interpreted tests, in a TRITON_INTERPRET=1 child: all pass, none skip."""
    run_interpreted(__file__)


@contextlib.contextmanager
def launches_nothing():
    before = sum(kernels.launches.values())
    yield
    assert sum(kernels.launches.values()) == before


def path(n: int, triton: bool):
    """The Triton kernel, asserted to launch (an empty bucket launches nothing), or the PyTorch path."""
    if not triton:
        return pytorch_path()
    return launched("scale_cast_kernel") if n else launches_nothing()


def bucket(n: int, cast: str, seed: int, amp: float = 100.0):
    """src (n,) and dst (n,), each the front of a buffer whose element n is a nan sentinel.

    The sentinel after src must not raise the flag (masked loads) and the one
    after dst must survive (masked stores). In place, dst is src.
    """
    src_dtype, dst_dtype, in_place = CASTS[cast]
    g = torch.Generator().manual_seed(seed)
    src_buf = torch.cat([torch.randn(n, generator=g) * amp, torch.tensor([float("nan")])]).to(src_dtype)
    dst_buf = src_buf if in_place else torch.full((n + 1,), float("nan"), dtype=dst_dtype)
    return src_buf[:n], dst_buf[:n], dst_buf


def check_scale_cast(n: int, cast: str, scale: float, flag_set: bool, seed: int, triton: bool) -> None:
    src, dst, dst_buf = bucket(n, cast, seed)
    want = (src.float() * scale).to(dst.dtype)
    found_inf = torch.full((1,), 1.0 if flag_set else 0.0)
    with path(n, triton):
        scale_cast_(src, dst, scale, found_inf)
    assert torch.equal(dst, want), (dst.float() - want.float()).abs().max()
    assert torch.isnan(dst_buf[n])
    assert found_inf.item() == (1.0 if flag_set else 0.0)  # clean data: the flag is left as it was


INJECTIONS = {  # name: (cast, value put into src, scale)
    "nan in src": ("fp32->bf16", float("nan"), 0.5),
    "-inf in src": ("bf16->fp32", -float("inf"), 0.5),
    "fp32 product overflows": ("fp32->fp32 in place", 3e38, 4.0),
    "fp16 cast overflows": ("fp32->fp16", 7e4, 1.0),
    "bf16 product overflows": ("bf16->bf16 in place", -3e38, 2.0),
}


def check_overflow(n: int, injection: str, where: float, flag_set: bool, seed: int, triton: bool) -> None:
    cast, value, scale = INJECTIONS[injection]
    src, dst, dst_buf = bucket(n, cast, seed)
    pos = min(int(where * n), n - 1)
    src[pos] = value
    want = (src.float() * scale).to(dst.dtype)
    assert not torch.isfinite(want[pos])
    found_inf = torch.full((1,), 1.0 if flag_set else 0.0)
    with path(n, triton):
        scale_cast_(src, dst, scale, found_inf)
    torch.testing.assert_close(dst, want, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(dst_buf[n])
    assert found_inf.item() == 1.0


# ----------------------------------------------------------------------------- the Triton kernel

@interpreted
@settings(max_examples=8)
@given(n=SIZES, cast=st.sampled_from(sorted(CASTS)), scale=SCALES, flag_set=st.booleans(), seed=st.integers(0, 99))
def test_scale_cast_triton(n, cast, scale, flag_set, seed):
    """For any size, cast and scale: dst = (src.float() * scale).to(dst.dtype) exactly; clean data leaves the flag."""
    check_scale_cast(n, cast, scale, flag_set, seed, triton=True)


@interpreted
@pytest.mark.parametrize("cast", sorted(CASTS))
def test_scale_cast_triton_each_cast(cast):
    """Every cast once at a fixed size spanning two programs with a tail, flag clear and flag already set."""
    for flag_set in (False, True):
        check_scale_cast(4096 + 37, cast, 1 / 3, flag_set, seed=1, triton=True)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, on the overflow tested
@interpreted
@settings(max_examples=8)
@given(n=st.integers(1, 5000), injection=st.sampled_from(sorted(INJECTIONS)), where=st.floats(0, 1),
       flag_set=st.booleans(), seed=st.integers(0, 99))
def test_scale_cast_triton_flags_inf_and_nan(n, injection, where, flag_set, seed):
    """One inf or nan anywhere (in src, from the product, or from the cast) sets the flag to 1."""
    check_overflow(n, injection, where, flag_set, seed, triton=True)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, on the overflow tested
@interpreted
@pytest.mark.parametrize("injection", sorted(INJECTIONS))
def test_scale_cast_triton_each_injection(injection):
    """Every kind of overflow, placed in the tail of the last program."""
    check_overflow(2 * 4096 + 5, injection, 1.0, False, seed=2, triton=True)


# ----------------------------------------------------------------------------- the PyTorch path

@settings(max_examples=8)
@given(n=SIZES, cast=st.sampled_from(sorted(CASTS)), scale=SCALES, flag_set=st.booleans(), seed=st.integers(0, 99))
def test_scale_cast_pytorch(n, cast, scale, flag_set, seed):
    """The PyTorch path: the same definition, nothing launched."""
    check_scale_cast(n, cast, scale, flag_set, seed, triton=False)


@pytest.mark.parametrize("injection", sorted(INJECTIONS))
@pytest.mark.parametrize("flag_set", [False, True])
def test_scale_cast_pytorch_flags_inf_and_nan(injection, flag_set):
    check_overflow(1000, injection, 0.5, flag_set, seed=3, triton=False)


def test_scale_cast_rejects_bad_arguments():
    src, flag = torch.zeros(8), torch.zeros(1)
    with pytest.raises(ValueError, match="equal numel"):
        scale_cast_(src, torch.zeros(7), 1.0, flag)
    with pytest.raises(ValueError, match="contiguous"):
        scale_cast_(src, torch.zeros(16)[::2], 1.0, flag)
    with pytest.raises(ValueError, match="1-element fp32"):
        scale_cast_(src, src, 1.0, torch.zeros(1, dtype=torch.bool))
    with pytest.raises(ValueError, match="floating"):
        scale_cast_(src, torch.zeros(8, dtype=torch.int32), 1.0, flag)
