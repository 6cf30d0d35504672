"""minipar.kernels.cross_entropy: the loss and its gradient against F.cross_entropy, in Triton and PyTorch.

Every check compares with ``F.cross_entropy`` on the same logits in fp32 (low
precision logits: judged with ``lowp_ok`` against that fp32 reference). The
vocab-parallel check splits the logits into tp slices and combines the
per-slice ``row_stats`` by hand, as ``minipar.tensor_parallel.cross_entropy``
does across ranks, without processes. The Triton tests run in a child pytest
under ``TRITON_INTERPRET=1`` (see ``kernel_testing``); each asserts that its
kernels launched. The same checks run on the PyTorch path, asserting that it
launches nothing. Beyond the values: the single cross-lane reduction the GPU
runs (which the interpreter otherwise replaces by a max and a sum) on small
tiles; the Triton path is its three launches and no torch op between them, with
no host sync; the int64-offset variant; NaN logits; torch.compile (fullgraph).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st

import importlib
from collections import Counter
from unittest import mock

from torch.utils._python_dispatch import TorchDispatchMode

from minipar import kernels
from minipar.kernels.cross_entropy import cross_entropy, needs_int64, row_stats, token_losses, xent_grad
from minipar.core.syncs import count_host_syncs

from kernel_testing import INTERPRETING, interpreted, launched, lowp_ok, max_err, pytorch_path, run_interpreted

if INTERPRETING:
    # triton's own @jit functions are bound to the interpreter or the compiler when first imported, and a
    # pytorch_path() block (TRITON_INTERPRET=0) must not be the first to import them
    import triton
    import triton.language as tl

    from minipar.kernels.cross_entropy_triton import _lane_stats, _reduce_lanes

    @triton.jit
    def one_reduction_kernel(z_ptr, out_ptr, V, ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
        """The lanes' statistics, then the GPU's single tl.reduce (INTERPRETED False): lse and sum z per row."""
        rows = tl.arange(0, ROWS)
        m, s, sz = _lane_stats(z_ptr, rows, V, V, True, ROWS, BLOCK_V, True)
        m, s, sz = _reduce_lanes(m, s, sz, True, ROWS, False)
        tl.store(out_ptr + rows, m + tl.log(s))
        tl.store(out_ptr + ROWS + rows, sz)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def test_triton_kernels_under_interpreter():
    """This module's interpreted tests, in a TRITON_INTERPRET=1 child: all pass, none skip."""
    run_interpreted(__file__)


def triton_path():
    """Both kernels launched by the block (forward and backward of a non-empty batch)."""
    stack = contextlib.ExitStack()
    stack.enter_context(launched("row_stats_kernel"))
    stack.enter_context(launched("xent_grad_kernel"))
    return stack


@st.composite
def ce_cases(draw, max_n: int = 40, max_v: int = 300):
    return dict(n=draw(st.integers(0, max_n)), v=draw(st.integers(1, max_v)), lead=draw(st.sampled_from([1, 2])),
                scale=draw(st.sampled_from([1.0, 10.0, 0.01])), eps=draw(st.sampled_from([0.0, 0.1])),
                ignored=draw(st.sampled_from([0.0, 0.3, 1.0])), ignore_index=draw(st.sampled_from([-100, 0])),
                dtype=draw(st.sampled_from(list(DTYPES))), strided=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))


def make_case(case):
    """Logits (lead, n, v) in the case's dtype (a column slice of wider rows if strided), int64 targets."""
    g = torch.Generator().manual_seed(case["seed"])
    lead, n, v = case["lead"], case["n"], case["v"]
    wide = torch.randn(lead, n, v + 3 * case["strided"], generator=g) * case["scale"]
    logits = wide.to(DTYPES[case["dtype"]])[..., :v]
    targets = torch.randint(0, v, (lead, n), generator=g)
    targets[torch.rand(lead, n, generator=g) < case["ignored"]] = case["ignore_index"]
    return logits, targets


def check_cross_entropy(case) -> None:
    """Loss and gradient of cross_entropy equal F.cross_entropy's on the same logits."""
    logits, targets = make_case(case)
    kw = dict(ignore_index=case["ignore_index"], label_smoothing=case["eps"])
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, targets, **kw)
    assert loss.dtype == torch.float32 and loss.shape == ()
    upstream = torch.tensor(-2.5)
    loss.backward(upstream)
    assert x.grad.dtype == logits.dtype and x.grad.shape == logits.shape
    assert torch.equal(x.detach(), logits), "the logits were written"

    ref_x = logits.float().requires_grad_()  # the fp32 reference, exact on low-precision inputs
    ref = F.cross_entropy(ref_x.flatten(0, -2), targets.flatten(), reduction="sum", **kw)
    count = (targets != case["ignore_index"]).sum()
    if count == 0:  # all ignored: 0 and zero gradients, where F.cross_entropy's mean would be NaN
        assert loss.item() == 0.0 and not x.grad.any()
        return
    ref = ref / count
    ref.backward(upstream)
    torch.testing.assert_close(loss, ref.detach())  # fp32 math whatever the dtype: fp32 tolerances
    if logits.dtype == torch.float32:
        torch.testing.assert_close(x.grad, ref_x.grad)
    else:
        low_x = logits.clone().requires_grad_()
        F.cross_entropy(low_x.flatten(0, -2), targets.flatten(), **kw).backward(upstream.to(logits.dtype))
        assert lowp_ok(x.grad, low_x.grad, ref_x.grad), (max_err(x.grad, ref_x.grad), max_err(low_x.grad, ref_x.grad))


@interpreted
@settings(max_examples=8, deadline=None)
@given(case=ce_cases())
@example(case=dict(n=7, v=33, lead=2, scale=10.0, eps=0.1, ignored=1.0, ignore_index=-100, dtype="fp32",
                   strided=False, seed=1))  # every row ignored
@example(case=dict(n=37, v=257, lead=1, scale=10.0, eps=0.1, ignored=0.3, ignore_index=0, dtype="bf16",
                   strided=True, seed=2))
def test_cross_entropy_triton(case):
    """For any shape, dtype, scale, smoothing and ignored rows: Triton equals F.cross_entropy, fwd and bwd."""
    with triton_path() if case["n"] else contextlib.nullcontext():
        check_cross_entropy(case)


@settings(max_examples=8, deadline=None)
@given(case=ce_cases())
@example(case=dict(n=5, v=11, lead=2, scale=1.0, eps=0.0, ignored=1.0, ignore_index=-100, dtype="fp32",
                   strided=False, seed=3))
def test_cross_entropy_pytorch_path(case):
    """The PyTorch path launches nothing and equals F.cross_entropy, fwd and bwd."""
    with pytorch_path():
        check_cross_entropy(case)


@interpreted
@pytest.mark.parametrize("v", [4097, 9000])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_long_rows_and_minus_inf_triton(v, dtype):
    """Rows longer than one block (several loop steps), with -inf logits filling whole leading blocks."""
    g = torch.Generator().manual_seed(v)
    logits = (torch.randn(3, v, generator=g) * 10).to(DTYPES[dtype])
    logits[0, :4096] = float("-inf")  # the whole first block: the running max stays -inf through it
    logits[1, ::7] = float("-inf")
    targets = torch.tensor([v - 1, 3, -100])
    x = logits.clone().requires_grad_()
    with triton_path():
        loss = cross_entropy(x, targets)
        loss.backward()
    ref_x = logits.float().requires_grad_()
    ref = F.cross_entropy(ref_x, targets)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    assert torch.isfinite(x.grad).all()
    if dtype == "fp32":
        torch.testing.assert_close(x.grad, ref_x.grad)
    else:
        low_x = logits.clone().requires_grad_()
        F.cross_entropy(low_x, targets).backward()
        assert lowp_ok(x.grad, low_x.grad, ref_x.grad)


def test_out_of_range_target_raises_on_the_pytorch_path():
    """Where PyTorch computes the loss (CPU tensors), as F.cross_entropy; not where the Triton kernel
    runs (the check would make the host wait for a GPU; train_step checks targets before any compute)."""
    with pytorch_path():
        with pytest.raises(IndexError, match="out of bounds"):
            cross_entropy(torch.randn(2, 5), torch.tensor([1, 5]))
        cross_entropy(torch.randn(2, 5), torch.tensor([1, -100]))  # ignore_index is not a class


# ----------------------------------------------------------------------------- vocab-parallel math, no processes

def check_vocab_parallel(case, tp: int) -> None:
    """Split the logits into tp vocab slices; combine each slice's row_stats as the TP code does
    (max, rescale the sum to the global max, sum), then xent_grad per slice: equal to F.cross_entropy
    and its gradient on the full logits."""
    logits, targets = make_case(case)
    logits, targets = logits.flatten(0, -2), targets.flatten()
    v, eps, ignore = case["v"], case["eps"], case["ignore_index"]
    v_local = v // tp
    slices = logits.split(v_local, dim=-1)  # views: a row stride of v, as a rank's slice of wider logits
    stats = [row_stats(z, targets, r * v_local) for r, z in enumerate(slices)]
    m_local, s_local, z_t, sum_z = (torch.stack(col) for col in zip(*stats))  # (tp, N) each
    m = m_local.amax(dim=0)  # the max all-reduce
    sum_exp = (s_local * torch.exp(m_local - m)).sum(dim=0)  # rescaled, then the sum all-reduce
    lse = sum_exp.log() + m
    valid = targets != ignore
    count = valid.sum().clamp(min=1)
    loss = torch.where(valid, token_losses(lse, z_t.sum(dim=0), sum_z.sum(dim=0), eps, v), 0.0).sum() / count
    upstream = 0.5
    coef = torch.where(valid, upstream / count, 0.0)
    grads = [xent_grad(z, lse, targets, r * v_local, coef, eps, v) for r, z in enumerate(slices)]
    grad = torch.cat(grads, dim=-1)
    assert grad.dtype == logits.dtype

    ref_x = logits.float().requires_grad_()
    ref = F.cross_entropy(ref_x, targets, ignore_index=ignore, label_smoothing=eps, reduction="sum") / count
    ref.backward(torch.tensor(upstream))
    torch.testing.assert_close(loss, ref.detach())
    if logits.dtype == torch.float32:
        torch.testing.assert_close(grad, ref_x.grad)
    else:
        low_x = logits.clone().requires_grad_()
        low = F.cross_entropy(low_x, targets, ignore_index=ignore, label_smoothing=eps, reduction="sum")
        (low / count.to(low.dtype)).backward(torch.tensor(upstream, dtype=logits.dtype))
        assert lowp_ok(grad, low_x.grad, ref_x.grad), (max_err(grad, ref_x.grad), max_err(low_x.grad, ref_x.grad))


@st.composite
def tp_cases(draw):
    tp = draw(st.sampled_from([2, 3, 4]))
    case = draw(ce_cases(max_v=75))
    case["v"] = tp * min(case["v"], 75)  # divisible by tp, up to 300
    return tp, case


@interpreted
@settings(max_examples=8, deadline=None)
@given(tp_case=tp_cases())
@example(tp_case=(3, dict(n=9, v=3 * 41, lead=1, scale=10.0, eps=0.1, ignored=0.3, ignore_index=-100,
                          dtype="bf16", strided=False, seed=4)))
def test_vocab_parallel_math_triton(tp_case):
    """Per-slice Triton row_stats + xent_grad, combined by hand, equal F.cross_entropy on the full logits."""
    tp, case = tp_case
    with triton_path() if case["n"] else contextlib.nullcontext():
        check_vocab_parallel(case, tp)


@settings(max_examples=8, deadline=None)
@given(tp_case=tp_cases())
def test_vocab_parallel_math_pytorch_path(tp_case):
    tp, case = tp_case
    with pytorch_path():
        check_vocab_parallel(case, tp)


# ----------------------------------------------------------------------------- the GPU's structure, interpreted

@interpreted
@pytest.mark.parametrize("v", [5, 16, 40])
def test_one_reduction_merges_lanes(v):
    """Lanes of 16 columns (one partial tile, one whole tile, several tiles with a partial last one)
    folded one element at a time, then merged by the one cross-lane reduction the GPU runs: the
    log-sum-exp and the sum of each row, for rows of -inf, ties, a NaN, and spreads of 1e4."""
    g = torch.Generator().manual_seed(v)
    z = torch.randn(8, v, generator=g) * 10
    z[1] = float("-inf")                     # nothing but -inf: lse -inf, the sum -inf
    z[2, : v // 2 + 1] = float("-inf")       # a leading run of -inf, then values
    z[3, v // 2] = float("nan")              # NaN reaches the loss, as in PyTorch
    z[4] = 2.5                               # ties everywhere: every merge of equal maxima
    z[5] = torch.randn(v, generator=g) * 1e4  # exp underflows to 0 for all but the top
    z[6, -1] = 80.0                          # the max in the last (partial) tile
    out = torch.empty(16)
    one_reduction_kernel[(1,)](z, out, v, ROWS=8, BLOCK_V=16)
    want = torch.logsumexp(z.double(), dim=1).float()
    torch.testing.assert_close(out[:8], want, equal_nan=True)
    torch.testing.assert_close(out[8:], z.double().sum(1).float(), equal_nan=True, rtol=1e-5, atol=1e-3)


class AtenOps(TorchDispatchMode):
    """The ops dispatched inside the block, by name (a custom op counts as one op)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


@interpreted
def test_triton_path_is_three_launches_and_no_torch_op():
    """Forward: row_stats_kernel (the rows' lse and loss) and xent_mean_kernel (count and mean); backward:
    xent_grad_kernel. Around them only views, the autograd engine's ones and detach; no host sync."""
    logits, targets = make_case(dict(n=9, v=70, lead=2, scale=1.0, eps=0.1, ignored=0.3, ignore_index=-100,
                                     dtype="bf16", strided=True, seed=9))
    x = logits.requires_grad_()
    before = dict(kernels.launches)
    with count_host_syncs() as syncs, AtenOps() as mode:
        cross_entropy(x, targets, label_smoothing=0.1).backward()
    assert not syncs.calls, syncs.report()
    used = {k: n - before.get(k, 0) for k, n in kernels.launches.items() if n > before.get(k, 0)}
    assert used == {"row_stats_kernel": 1, "xent_mean_kernel": 1, "xent_grad_kernel": 1}, used
    compute = {op for op in mode.ops if op not in {"aten::view", "aten::ones_like", "aten::detach"}}
    assert compute == {"minipar::cross_entropy_fwd", "minipar::cross_entropy_bwd"}, mode.ops


def test_pytorch_path_primitives_make_no_host_sync():
    """The torch primitives on a GPU would not wait either (the gradient's target term is a scatter)."""
    logits, targets = make_case(dict(n=6, v=20, lead=1, scale=1.0, eps=0.1, ignored=0.3, ignore_index=-100,
                                     dtype="fp32", strided=False, seed=10))
    logits, targets = logits[0], targets[0]
    with pytorch_path(), count_host_syncs() as syncs:
        m, s, z_t, sum_z = row_stats(logits[:, :10], targets, 10)
        lse = m + s.log()
        token_losses(lse, z_t, sum_z, 0.1, 20)
        xent_grad(logits[:, :10], lse, targets, 10, torch.ones(6), 0.1, 20)
    assert not syncs.calls, syncs.report()


@interpreted
def test_int64_offsets_triton():
    """The kernels' int64-offset variant (taken for tensors of 2**31 elements or more) computes the same."""
    case = dict(n=13, v=45, lead=2, scale=10.0, eps=0.1, ignored=0.3, ignore_index=-100, dtype="bf16",
                strided=True, seed=11)
    ce_module = importlib.import_module("minipar.kernels.cross_entropy")  # the package exports a function so named
    with mock.patch.object(ce_module, "needs_int64", lambda *tensors: True), triton_path():
        check_cross_entropy(case)
        check_vocab_parallel(case, 3)


def test_int64_offsets_only_past_2_31_elements():
    assert needs_int64(torch.empty(2**16, 2**15, device="meta"))
    assert not needs_int64(torch.empty(2**16 - 2, 2**15, device="meta"))
    assert needs_int64(torch.empty(2**16, 2**15 + 2, device="meta")[:, :2**15 - 1])  # a slice of wider rows


def check_nan_logit() -> None:
    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    loss = cross_entropy(logits, torch.tensor([1, 2, 3]))
    assert loss.isnan(), loss


@interpreted
def test_nan_logit_gives_nan_loss_triton():
    with launched("row_stats_kernel"):
        check_nan_logit()


def test_nan_logit_gives_nan_loss_pytorch_path():
    with pytorch_path():
        check_nan_logit()


@interpreted
def test_loss_is_deterministic_triton():
    """The same launch twice gives the same bits: every sum is in a fixed order, no atomics."""
    logits, targets = make_case(dict(n=40, v=300, lead=2, scale=10.0, eps=0.1, ignored=0.3, ignore_index=-100,
                                     dtype="bf16", strided=False, seed=12))
    first, second = (cross_entropy(logits, targets, label_smoothing=0.1) for _ in range(2))
    assert torch.equal(first, second)


@interpreted
def test_compiles_whole_triton():
    """Under torch.compile (aot_eager, fullgraph): cross_entropy and the vocab-parallel primitives give
    the eager results, forward and backward, through the kernels (launched inside the custom ops)."""
    logits, targets = make_case(dict(n=6, v=40, lead=2, scale=1.0, eps=0.1, ignored=0.3, ignore_index=-100,
                                     dtype="fp32", strided=False, seed=13))

    def loss_and_grad(fn):
        x = logits.clone().requires_grad_()
        loss = fn(x, targets)
        loss.backward()
        return loss.detach(), x.grad

    def slices(z, t):  # two vocab slices of 20, combined as the tensor-parallel code does
        z, t = z.flatten(0, -2), t.flatten()
        (m0, s0, zt0, sz0), (m1, s1, zt1, sz1) = row_stats(z[:, :20], t, 0), row_stats(z[:, 20:], t, 20)
        m = torch.maximum(m0, m1)
        lse = (s0 * torch.exp(m0 - m) + s1 * torch.exp(m1 - m)).log() + m
        coef = torch.full_like(lse, 0.5)
        grads = [xent_grad(z[:, :20], lse, t, 0, coef, 0.1, 40), xent_grad(z[:, 20:], lse, t, 20, coef, 0.1, 40)]
        return token_losses(lse, zt0 + zt1, sz0 + sz1, 0.1, 40), torch.cat(grads, -1)

    fn = lambda x, t: cross_entropy(x, t, label_smoothing=0.1)  # noqa: E731
    with triton_path():
        got = loss_and_grad(torch.compile(fn, backend="aot_eager", fullgraph=True))
        got_slices = torch.compile(slices, backend="aot_eager", fullgraph=True)(logits, targets)
    for a, b in zip((*got, *got_slices), (*loss_and_grad(fn), *slices(logits, targets))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same kernels on the same inputs


def test_pytorch_path_compiles_whole():
    """The PyTorch path under torch.compile (aot_eager, fullgraph): the CPU-only target check steps aside
    while tracing (it reads a value), and the loss and gradient are the eager ones."""
    logits, targets = make_case(dict(n=6, v=40, lead=2, scale=1.0, eps=0.1, ignored=0.3, ignore_index=-100,
                                     dtype="fp32", strided=False, seed=14))
    fn = lambda x, t: cross_entropy(x, t, label_smoothing=0.1)  # noqa: E731
    results = []
    with pytorch_path():
        for run in (torch.compile(fn, backend="aot_eager", fullgraph=True), fn):
            x = logits.clone().requires_grad_()
            loss = run(x, targets)
            loss.backward()
            results.append((loss.detach(), x.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
