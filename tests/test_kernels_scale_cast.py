"""minipar.kernels.scale_cast: scale_cast_ against its definition, on both paths.

The definition: ``dst = (src.float() * scale).to(dst.dtype)``, bit for bit, and
``found_inf`` raised to 1 exactly when a stored value is inf or nan, never
lowered. The Triton tests run in a TRITON_INTERPRET=1 child pytest (see
``kernel_testing``) and each asserts that the kernel launched; the PyTorch
path is held to the same definition.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minipar import kernels
from minipar.kernels.scale_cast import scale_cast_
from minipar.core.syncs import count_host_syncs

from kernel_testing import interpreted, launched, pytorch_path, run_interpreted

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# name: (src dtype, dst dtype, in place)
CASTS = {"fp32->bf16": (F32, BF16, False), "bf16->fp32": (BF16, F32, False), "fp32->fp32 in place": (F32, F32, True),
         "fp32->fp16": (F32, F16, False), "bf16->bf16 in place": (BF16, BF16, True)}
# Element counts: anything up to 9000, and the block edges (2048 per program below 4096 elements, 4096
# from there) with 1-element tails.
SIZES = st.one_of(st.integers(0, 9000), st.sampled_from([0, 1, 2047, 2049, 4095, 4096, 4097, 8193]))
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


def _below(x: float) -> float:
    """The largest fp32 below the fp32 value x."""
    return torch.nextafter(torch.tensor(x), torch.tensor(0.0)).item()


# fp32 values a cast sends to inf (the overflow threshold, halfway past the largest finite value, a tie that
# rounds to the even neighbour, inf) and the largest ones it keeps finite, per cast.
THRESHOLDS = {"fp32->fp16": 65520.0, "fp32->bf16": (2 - 2**-8) * 2.0**127}


def check_threshold(cast: str, sign: float, triton: bool) -> None:
    """Just below the threshold the stored value is finite and the flag stays down; at it, inf and raised."""
    for value, overflows in ((_below(THRESHOLDS[cast]), False), (THRESHOLDS[cast], True)):
        src, dst, _ = bucket(3000, cast, seed=4)
        src[1234] = sign * value
        want = (src.float() * 1.0).to(dst.dtype)
        assert torch.isinf(want[1234]) == overflows
        found_inf = torch.zeros(1)
        with path(3000, triton):
            scale_cast_(src, dst, 1.0, found_inf)
        assert torch.equal(dst, want)
        assert found_inf.item() == float(overflows), (cast, sign, value)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, on the overflow tested
@interpreted
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("cast", sorted(THRESHOLDS))
def test_scale_cast_triton_overflow_threshold(cast, sign):
    check_threshold(cast, sign, triton=True)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, on the overflow tested
@interpreted
def test_scale_cast_int64_offsets():
    """The int64-offset variant (a bucket near 2**31 elements gets it), forced with blocks of 256: the same
    result and flag."""
    tk = kernels.dispatch.triton_module("scale_cast_triton")
    real = tk.config
    with mock.patch.object(tk, "config", lambda n, size: {**real(n, size), "BLOCK": 256, "INT64": True,
                                                          "num_warps": 2}):
        check_scale_cast(1000, "fp32->bf16", 1 / 3, False, seed=6, triton=True)
        check_overflow(1000, "fp16 cast overflows", 0.9, False, seed=6, triton=True)


@interpreted
def test_scale_cast_in_torch_compile():
    """The kernel is a mutating custom op: called inside a compiled function (fullgraph, aot_eager), in
    place and out of place, it writes dst and raises the flag as eager does."""
    def step(src, dst, flag):
        scale_cast_(src, dst, 0.5, flag)
        scale_cast_(src, src, 2.0, flag)  # in place
        return flag * 1

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for poison in (False, True):
        src = torch.randn(3000, generator=torch.Generator().manual_seed(8))
        if poison:
            src[17] = float("inf")
        got = (src.clone(), torch.empty(3000, dtype=torch.bfloat16), torch.zeros(1))
        want = (src.clone(), torch.empty(3000, dtype=torch.bfloat16), torch.zeros(1))
        with launched("scale_cast_kernel"):
            got_flag = compiled(*got)
        step(*want)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert got_flag.item() == float(poison)


@interpreted
def test_scale_cast_makes_no_host_sync():
    """The launcher, in place and out of place: nothing would make the host wait for a GPU."""
    src, dst, flag = torch.randn(5000), torch.empty(5000, dtype=torch.float16), torch.zeros(1)
    with count_host_syncs() as syncs, launched("scale_cast_kernel"):
        scale_cast_(src, dst, 0.25, flag)
        scale_cast_(src, src, 0.25, flag)
    assert not syncs.calls, syncs.report()


# ----------------------------------------------------------------------------- the PyTorch path

@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("cast", sorted(THRESHOLDS))
def test_scale_cast_pytorch_overflow_threshold(cast, sign):
    check_threshold(cast, sign, triton=False)


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
