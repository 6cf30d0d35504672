"""minipar.kernels.linear_cross_entropy: the LM head's loss in row chunks, against the unchunked math in fp64.

The reference is ``F.cross_entropy(hidden @ weight.T, ...)`` computed in fp64 from the same (exactly
upcast) inputs, forward and backward. fp32 is held to fp32 tolerances stated at the check. In bf16 the
loss is fp32 math on logits rounded to bf16 (as nn.Linear's are), so it is compared with the fp64 loss
of those rounded logits; the gradients are judged like every low-precision kernel (``lowp_ok``'s rule:
no worse than PyTorch's own bf16 composition, ``F.cross_entropy(F.linear(h, w))``, or one bf16 rounding
of the exact result), plus the roundings this algorithm makes where PyTorch's does not, each bounded
at the check. Cases: ignored targets, every target ignored, label smoothing, N not a multiple of the
chunk, a chunk per row, hidden (B, T, D), a weight that needs no gradient, and a tied weight also used
as an embedding (its gradient is the sum of both uses). The memory test measures, with a
TorchDispatchMode, the bytes alive at each moment inside forward and backward: never a tensor larger
than one chunk's logits, never as much as the (N, V) logits in all.
"""

from __future__ import annotations

import contextlib
import importlib
import weakref
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from minipar import kernels
from minipar.kernels import linear_cross_entropy
from minipar.kernels.linear_cross_entropy import default_chunk_rows
from minipar.core.syncs import count_host_syncs

from kernel_testing import INTERPRETING, interpreted, launched, max_err, pytorch_path, run_interpreted

if INTERPRETING:
    # triton's own @jit functions (tl.zeros, ...) are bound to the interpreter or the compiler when first
    # imported; a dispatch mode inside pytorch_path() (TRITON_INTERPRET=0) may import triton first
    import triton.language  # noqa: F401

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def test_triton_kernels_under_interpreter():
    """This module's interpreted tests, in a TRITON_INTERPRET=1 child: all pass, none skip."""
    run_interpreted(__file__)


@st.composite
def lce_cases(draw):
    lead = draw(st.sampled_from([(), (2,), (2, 3)]))  # () -> (N, D); (B,) -> (B, T, D) with T drawn
    t_len = draw(st.integers(0, 13))
    n = t_len * (lead[0] if lead else 1)
    return dict(shape=(*lead[:1], t_len), d=draw(st.integers(1, 24)), v=draw(st.integers(1, 120)),
                dtype=draw(st.sampled_from(list(DTYPES))), eps=draw(st.sampled_from([0.0, 0.1])),
                ignored=draw(st.sampled_from([0.0, 0.3, 1.0])), ignore_index=draw(st.sampled_from([-100, 0])),
                # at most about 5 chunks (the interpreter pays per launch); chunk=1 is an explicit example
                chunk=draw(st.one_of(st.none(), st.integers(max(1, n // 5), max(n, 1)))),
                weight_grad=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))


def make_case(case):
    g = torch.Generator().manual_seed(case["seed"])
    shape, d, v, dtype = case["shape"], case["d"], case["v"], DTYPES[case["dtype"]]
    hidden = torch.randn(*shape, d, generator=g).to(dtype)
    weight = (torch.randn(v, d, generator=g) / d**0.5 * 3).to(dtype)  # logits of a few units
    targets = torch.randint(0, v, shape, generator=g)
    targets[torch.rand(shape, generator=g) < case["ignored"]] = case["ignore_index"]
    return hidden, weight, targets


def reference(hidden, weight, targets, case, dtype=torch.float64, upstream=1.0):
    """Loss, d hidden, d weight and d logits (N, V) of the unchunked composition in ``dtype``, the mean
    over valid rows (0 when there are none, where F.cross_entropy's mean would be NaN)."""
    h = hidden.detach().to(dtype).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    count = (targets != case["ignore_index"]).sum().clamp(min=1)
    logits = F.linear(h, w).flatten(0, -2)
    logits.retain_grad()
    loss = F.cross_entropy(logits, targets.flatten(), ignore_index=case["ignore_index"],
                           label_smoothing=case["eps"], reduction="sum") / count.to(dtype)
    loss.backward(torch.tensor(upstream, dtype=dtype))
    return loss.detach(), h.grad, w.grad, logits.grad


def check_lce(case) -> None:
    hidden, weight, targets = make_case(case)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_(case["weight_grad"])
    upstream = -1.5  # the saved gradients are scaled by the incoming one, sign included
    loss = linear_cross_entropy(h, w, targets, ignore_index=case["ignore_index"], label_smoothing=case["eps"],
                                chunk_rows=case["chunk"])
    assert loss.dtype == torch.float32 and loss.shape == ()
    loss.backward(torch.tensor(upstream))
    assert h.grad.dtype == hidden.dtype and h.grad.shape == hidden.shape
    assert (w.grad is not None) == case["weight_grad"]
    if not (targets != case["ignore_index"]).any():  # every row ignored: 0 and zero gradients
        assert loss.item() == 0.0 and not h.grad.any() and (w.grad is None or not w.grad.any())
        return
    ref_loss, ref_h, ref_w, ref_z = reference(hidden, weight, targets, case, upstream=upstream)
    if hidden.dtype == torch.float32:
        # fp32 GEMMs over D (forward) and N or V (backward) terms against exact fp64: a few ulps of the
        # sums' magnitudes (values here are O(1)), hence atol 1e-5, rtol 1e-5
        torch.testing.assert_close(loss, ref_loss.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h.grad, ref_h.float(), rtol=1e-5, atol=1e-5)
        if w.grad is not None:
            torch.testing.assert_close(w.grad, ref_w.float(), rtol=1e-5, atol=1e-5)
        return
    # bf16. The loss is fp32 math on logits rounded to bf16 (as nn.Linear's would be): the fp64 loss of
    # those logits, to fp32 accuracy.
    rounded_logits = F.linear(hidden, weight).double()
    want = F.cross_entropy(rounded_logits.flatten(0, -2), targets.flatten(), ignore_index=case["ignore_index"],
                           label_smoothing=case["eps"])
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
    # The gradients: judged against the exact ones like every bf16 kernel (lowp_ok: PyTorch's own bf16
    # error, or one rounding), plus the roundings this chain makes where PyTorch's makes them elsewhere:
    # G = dL/dlogits rounded to bf16 before its GEMMs, the GEMM's bf16 output, the scaling by the incoming
    # gradient after it (PyTorch scales first), each at most 2^-8 of the magnitudes summed: 3 x 2^-8
    # max(|G| @ |W|) for dL/dh. For dL/dW: G's rounding, one rounding of each chunk's G_c^T h_c (the
    # GEMM's bf16 output) before the fp32 sum (at most 2^-8 |G|^T |h| over all chunks), and the final
    # cast: 3 x 2^-8 max(|G|^T |h|). 1% for the gap between the exact G and the bf16 one.
    _, low_h, low_w, _ = reference(hidden, weight, targets, case, dtype=hidden.dtype, upstream=upstream)
    g_abs, h_abs = ref_z.abs() * 1.01, hidden.double().flatten(0, -2).abs()
    bound_h = max_err(low_h, ref_h) + max_err(ref_h.to(torch.bfloat16), ref_h) \
        + 3 * 2.0**-8 * (g_abs @ weight.double().abs()).max().item() + 1e-6
    assert max_err(h.grad, ref_h) <= bound_h, (max_err(h.grad, ref_h), bound_h)
    if w.grad is not None:
        bound_w = max_err(low_w, ref_w) + max_err(ref_w.to(torch.bfloat16), ref_w) \
            + 3 * 2.0**-8 * (g_abs.t() @ h_abs).max().item() + 1e-6
        assert max_err(w.grad, ref_w) <= bound_w, (max_err(w.grad, ref_w), bound_w)


EXAMPLES = [
    dict(shape=(7,), d=8, v=50, dtype="fp32", eps=0.1, ignored=1.0, ignore_index=-100, chunk=3, weight_grad=True,
         seed=1),  # every row ignored
    dict(shape=(2, 9), d=5, v=97, dtype="bf16", eps=0.1, ignored=0.3, ignore_index=0, chunk=4, weight_grad=True,
         seed=2),  # (B, T, D), 18 rows in chunks of 4: the last chunk is 2 rows
    dict(shape=(3, 5), d=16, v=33, dtype="fp32", eps=0.0, ignored=0.3, ignore_index=-100, chunk=None,
         weight_grad=False, seed=3),  # the default chunk; a frozen head
    dict(shape=(0,), d=4, v=9, dtype="bf16", eps=0.0, ignored=0.0, ignore_index=-100, chunk=None, weight_grad=True,
         seed=4),  # no rows at all
    dict(shape=(5,), d=1, v=1, dtype="fp32", eps=0.1, ignored=0.3, ignore_index=-100, chunk=1, weight_grad=True,
         seed=5),  # a chunk per row; D = 1 and V = 1 (the loss is exactly 0)
]


def _examples(test):
    for case in EXAMPLES:
        test = example(case=case)(test)
    return test


@interpreted
@settings(max_examples=8, deadline=None)
@given(case=lce_cases())
@_examples
def test_linear_cross_entropy_triton(case):
    """For any shapes, dtype, smoothing, ignored rows and chunk size: the chunked kernels equal the
    unchunked fp64 composition, forward and backward."""
    n = len(torch.empty(case["shape"]).flatten())
    with launched("xent_loss_grad_kernel") if n else contextlib.nullcontext():
        check_lce(case)


@settings(max_examples=8, deadline=None)
@given(case=lce_cases())
@_examples
def test_linear_cross_entropy_pytorch_path(case):
    """The PyTorch path (the same chunks in torch ops) launches nothing and equals the same reference."""
    with pytorch_path():
        check_lce(case)


def _tied_case():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 40, (2, 6), generator=g)
    weight = torch.randn(40, 8, generator=g)
    proj = torch.randn(8, 8, generator=g) / 8**0.5
    targets = torch.randint(0, 40, (2, 6), generator=g)
    targets[0, 2] = -100
    return ids, weight, proj, targets


def check_tied_weight() -> None:
    """The head's weight is also the embedding: its gradient is the sum over both uses, as with F.linear."""
    ids, weight, proj, targets = _tied_case()

    def run(w, loss_fn):
        hidden = torch.tanh(F.embedding(ids, w) @ proj)
        return loss_fn(hidden, w) + 0.25 * F.embedding(ids, w).square().sum()

    w = weight.clone().requires_grad_()
    run(w, lambda h, w: linear_cross_entropy(h, w, targets, chunk_rows=5)).backward()
    w64 = weight.double().requires_grad_()
    proj = proj.double()
    ref = run(w64, lambda h, w: F.cross_entropy(F.linear(h, w).flatten(0, -2), targets.flatten()))
    ref.backward()
    torch.testing.assert_close(w.grad, w64.grad.float(), rtol=1e-5, atol=1e-5)  # fp32 against fp64


@interpreted
def test_tied_weight_gets_the_sum_of_its_gradients_triton():
    with launched("xent_loss_grad_kernel"):
        check_tied_weight()


def test_tied_weight_gets_the_sum_of_its_gradients_pytorch_path():
    with pytorch_path():
        check_tied_weight()


# ----------------------------------------------------------------------------- memory

class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created inside the block and still alive, at every op: ``peak`` and
    ``largest`` (the biggest single storage). A storage is new when an op's output does not alias an
    input (its schema says so); it is alive while any tensor the block saw on it (views included) is.
    A minipar custom op is opaque to a dispatch mode, so its body is run under the mode instead."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors alive on it]
        self.now = self.peak = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        body = OPDEFS.get(func._schema.name) if func.namespace == "minipar" else None
        if body is not None:  # a kernel launcher: run its Python body under the mode, to see what it allocates
            with self:
                out = body._init_fn(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        returns = func._schema.returns
        for i, t in enumerate(tree_leaves(out)):
            if not isinstance(t, torch.Tensor) or not t.untyped_storage().nbytes():
                continue
            aliases = i < len(returns) and returns[i].alias_info is not None
            key = t.untyped_storage().data_ptr()
            if key in self.live:
                self.live[key][1] += 1
            elif aliases:
                continue  # a view of, or an in-place write to, memory the block did not allocate
            else:
                size = t.untyped_storage().nbytes()
                self.live[key] = [size, 1]
                self.now += size
                self.peak, self.largest = max(self.peak, self.now), max(self.largest, size)
            weakref.finalize(t, self._release, key)
        return out

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]


N_MEM, D_MEM, V_MEM = 256, 16, 1024


def check_memory(loss_fn) -> LiveBytes:
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(N_MEM, D_MEM, generator=g, requires_grad=True)
    weight = torch.randn(V_MEM, D_MEM, generator=g, requires_grad=True)
    targets = torch.randint(0, V_MEM, (N_MEM,), generator=g)
    with LiveBytes() as mem:
        loss_fn(hidden, weight, targets).backward()
    return mem


def test_the_measure_sees_the_unchunked_logits():
    """The instrument works: the plain composition holds (N, V) fp32 logits (and more)."""
    with pytorch_path():
        mem = check_memory(lambda h, w, t: F.cross_entropy(F.linear(h, w), t))
    assert mem.largest >= N_MEM * V_MEM * 4 and mem.peak >= 2 * N_MEM * V_MEM * 4, (mem.largest, mem.peak)


def assert_chunked_memory(mem: LiveBytes) -> None:
    rows = default_chunk_rows(V_MEM, D_MEM, 4)  # 8 D / 4 bytes = 32 rows: 8 chunks
    chunk = rows * V_MEM * 4  # a chunk's fp32 logits: by design twice the fp32 dL/dW (8 V D bytes)
    saved = N_MEM * D_MEM * 4 + V_MEM * D_MEM * 4  # dL/dh and dL/dW, made in forward, scaled in backward
    # no tensor larger than a chunk's logits (or dL/dW, the same size); alive at once: the saved
    # gradients and the backward's scaled copies of them, the chunk's logits buffer and, on the PyTorch
    # path, its fp32 temporaries (the upcast logits, exp, the gradient): a few chunks, an eighth of the
    # (N, V) logits each, and no single tensor bigger than one chunk
    assert mem.largest <= chunk, (mem.largest, chunk)
    assert mem.peak <= 2 * saved + 4 * chunk, (mem.peak, saved, chunk)
    assert mem.peak < N_MEM * V_MEM * 4, "more than the fp32 logits alone (the composition: twice that)"


def test_never_holds_the_logits_pytorch_path():
    with pytorch_path():
        assert_chunked_memory(check_memory(linear_cross_entropy))


@interpreted
def test_never_holds_the_logits_triton():
    with launched("xent_loss_grad_kernel"):
        assert_chunked_memory(check_memory(linear_cross_entropy))


# ----------------------------------------------------------------------------- launches, syncs, compile

@interpreted
def test_launches_and_no_host_syncs_triton():
    """One launch per chunk plus two (the count, the mean), and nothing read on the host."""
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(10, 6, generator=g, requires_grad=True)
    weight = torch.randn(30, 6, generator=g, requires_grad=True)
    targets = torch.randint(0, 30, (10,), generator=g)
    before = dict(kernels.launches)
    with count_host_syncs() as syncs:
        linear_cross_entropy(hidden, weight, targets, chunk_rows=4).backward()
    assert not syncs.calls, syncs.report()
    used = {k: n - before.get(k, 0) for k, n in kernels.launches.items() if n > before.get(k, 0)}
    assert used == {"xent_loss_grad_kernel": 3, "xent_mean_kernel": 2}, used


@interpreted
def test_compiles_whole_triton():
    """Under torch.compile (aot_eager, fullgraph): the eager loss and gradients, through the kernels."""
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(2, 5, 8, generator=g)
    weight = torch.randn(33, 8, generator=g)
    targets = torch.randint(0, 33, (2, 5), generator=g)
    targets[1, 0] = -100

    def step(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(h, w, targets)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    fn = lambda h, w, t: linear_cross_entropy(h, w, t, label_smoothing=0.1, chunk_rows=4)  # noqa: E731
    with launched("xent_loss_grad_kernel"):
        got = step(torch.compile(fn, backend="aot_eager", fullgraph=True))
    for a, b in zip(got, step(fn)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same kernels on the same inputs


@interpreted
def test_int64_offsets_triton():
    """The chunk kernel's int64-offset variant (for chunks of 2**31 elements or more) computes the same."""
    lce_module = importlib.import_module("minipar.kernels.linear_cross_entropy")  # not the function so named
    with mock.patch.object(lce_module, "needs_int64", lambda *tensors: True), launched("xent_loss_grad_kernel"):
        check_lce(EXAMPLES[1])


def test_pytorch_path_compiles_whole():
    """The PyTorch path's chunk loop under torch.compile (aot_eager, fullgraph) gives the eager results."""
    g = torch.Generator().manual_seed(9)
    hidden, weight = torch.randn(2, 5, 8, generator=g), torch.randn(33, 8, generator=g)
    targets = torch.randint(0, 33, (2, 5), generator=g)
    fn = lambda h, w, t: linear_cross_entropy(h, w, t, chunk_rows=4)  # noqa: E731
    results = []
    with pytorch_path():
        for run in (torch.compile(fn, backend="aot_eager", fullgraph=True), fn):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            loss = run(h, w, targets)
            loss.backward()
            results.append((loss.detach(), h.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_rejects_mismatched_inputs():
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(h, torch.randn(10, 7), t)
    with pytest.raises(ValueError, match="targets must have shape"):
        linear_cross_entropy(h, w, t[:3])
    with pytest.raises(ValueError, match="compute dtype"):
        linear_cross_entropy(h, w.bfloat16(), t)
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy(h, w, t, chunk_rows=0)
    with pytorch_path(), pytest.raises(IndexError, match="out of bounds"):
        linear_cross_entropy(h, w, torch.tensor([0, 1, 10, 2]))
