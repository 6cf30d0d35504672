"""minipar.kernels.adamw: the fused Adam/AdamW step against torch.optim.Adam/AdamW(foreach=False).

The PyTorch path issues torch's own single-tensor calls, so it must equal
torch.optim bitwise. The Triton kernel (in this module's TRITON_INTERPRET=1
child, see ``kernel_testing``, or compiled on a GPU) must equal it to fp32
rounding, and its low-precision copy must be exactly the updated fp32 param
rounded to nearest. The kernel is compiled without multiply-add contraction,
so its variants for different grad dtypes run the same fp32 operations: a
bf16 grad must give bitwise what its fp32 upcast gives.
Both must keep the optimizer's state interchangeable with torch's: the same
state_dict, and plain ``optimizer.step()`` calls mixed in anywhere.
"""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minipar import kernels
from minipar.kernels.adamw import adamw_step_, fused_step, supports
from minipar.core.syncs import count_host_syncs

from kernel_testing import interpreted, launched, pytorch_path, run_interpreted

KERNEL = "adamw_step_kernel"
# Sizes around the kernel's blocks (1024 elements below 2048, 2048 from there; one-element tails) and
# arbitrary ones, up to three blocks.
sizes = st.one_of(st.integers(1, 6200), st.sampled_from([1, 1023, 1025, 2047, 2048, 2049, 4097]))
lrs = st.sampled_from([1e-3, 3e-4, 1e-2, 0.1])
beta1s = st.sampled_from([0.9, 0.8, 0.5, 0.0])  # 0.5 and 0: torch's lerp from the gradient's end
beta2s = st.sampled_from([0.999, 0.99, 0.95, 0.5])
decays = st.sampled_from([0.01, 0.1, 0.5])
epss = st.sampled_from([1e-8, 1e-6, 1e-3])
# Kernel against torch: tighter than assert_close's fp32 default (rtol 1.3e-6, atol 1e-5). The two differ by
# an ulp here and there where one fuses a multiply-add (torch's CPU lerp/add) and the other does not.
CLOSE = dict(rtol=1e-6, atol=1e-6)


def test_triton_kernels_under_interpreter():
    """This module's interpreted tests, in a TRITON_INTERPRET=1 child: all pass, none skip."""
    run_interpreted(__file__)


# ----------------------------------------------------------------------------- fused_step against torch.optim

def make_optimizer(kind: str, params: list[torch.nn.Parameter], lr: float, betas: tuple[float, float],
                   eps: float, wd: float) -> torch.optim.Optimizer:
    """Two param groups with different lr/betas; ``kind``: adamw, adam (L2 decay) or adam_decoupled."""
    groups = [{"params": params[:1]},
              {"params": params[1:], "lr": lr * 3, "betas": (betas[1] * betas[0], betas[1]), "weight_decay": wd / 2}]
    kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    if kind == "adamw":
        return torch.optim.AdamW(groups, **kw)
    return torch.optim.Adam(groups, **kw, decoupled_weight_decay=kind == "adam_decoupled")


def assert_same_state(got: dict, want: dict, exact: bool) -> None:
    """Two optimizer state_dicts: equal structure, hyperparameters, and tensors (dtype, device, values)."""
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for i, state in want["state"].items():
        assert got["state"][i].keys() == state.keys()
        for key, t in state.items():
            g = got["state"][i][key]
            assert (g.dtype, g.device, g.shape) == (t.dtype, t.device, t.shape), key
            if exact or key == "step":
                assert torch.equal(g, t), key
            else:
                torch.testing.assert_close(g, t, **CLOSE)


def check_against_torch_optim(kind, n_sizes, lr, betas, eps, wd, seed, exact):
    """Fused steps, then fused and plain steps mixed with a state_dict round trip, against torch.optim."""
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(n, generator=g) for n in n_sizes]
    mine = [torch.nn.Parameter(t.clone()) for t in full]
    ref = [torch.nn.Parameter(t.clone()) for t in full]
    opt = make_optimizer(kind, mine, lr, betas, eps, wd)
    ref_opt = make_optimizer(kind, ref, lr, betas, eps, wd)
    assert supports(opt)
    # the low-precision copies, bf16 and fp16 in turn; a param without a gradient keeps its copy as it was
    outs = {id(p): torch.empty(p.numel(), dtype=(torch.bfloat16, torch.float16)[i % 2]) for i, p in enumerate(mine)}
    plan = ["fused"] * 6 + ["plain", "fused", "reload", "fused", "plain", "fused"]
    for step, how in enumerate(plan):
        for i, (p, r) in enumerate(zip(mine, ref)):
            if i == 1 and step % 3 == 1:  # a param without a gradient this step: skipped, its count lags
                p.grad = r.grad = None
                continue
            grad = torch.randn(p.shape, generator=g)
            p.grad, r.grad = grad.clone(), grad.clone()
        if how == "reload":  # fresh state tensors: the step count must be read again
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        if how == "plain":
            opt.step()
        else:
            context = launched(KERNEL) if not exact else contextlib.nullcontext()
            with context:
                fused_step(opt, outs)
            for p in mine:
                if p.grad is not None:  # the copy is exactly the new fp32 param rounded to nearest
                    assert torch.equal(outs[id(p)], p.detach().to(outs[id(p)].dtype))
        ref_opt.step()
        for p, r in zip(mine, ref):
            if exact:
                assert torch.equal(p, r)
            else:
                torch.testing.assert_close(p, r, **CLOSE)
        assert_same_state(opt.state_dict(), ref_opt.state_dict(), exact)


optimizer_cases = dict(kind=st.sampled_from(["adamw", "adam", "adam_decoupled"]),
                       n_sizes=st.lists(sizes, min_size=1, max_size=3), lr=lrs,
                       betas=st.tuples(beta1s, beta2s), eps=epss, wd=decays, seed=st.integers(0, 99))


@settings(max_examples=8)
@given(**optimizer_cases)
def test_torch_path_equals_torch_optim(kind, n_sizes, lr, betas, eps, wd, seed):
    """On CPU without the interpreter: fused_step launches nothing and equals torch.optim bitwise."""
    before = sum(kernels.launches.values())
    with pytorch_path():
        check_against_torch_optim(kind, n_sizes, lr, betas, eps, wd, seed, exact=True)
    assert sum(kernels.launches.values()) == before


@interpreted
@settings(max_examples=8)
@given(**optimizer_cases)
def test_kernel_matches_torch_optim(kind, n_sizes, lr, betas, eps, wd, seed):
    """The Triton kernel under fused_step equals torch.optim to fp32 rounding; its copies are exact."""
    check_against_torch_optim(kind, n_sizes, lr, betas, eps, wd, seed, exact=False)


# ----------------------------------------------------------------------------- adamw_step_ itself

@interpreted
@settings(max_examples=8)
@given(n=sizes, grad_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       out_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32, None]),
       decoupled=st.booleans(), wd=st.sampled_from([0, 0.1, 0.5]), step=st.integers(1, 50), lr=lrs,
       beta1=beta1s, beta2=beta2s, eps=epss, seed=st.integers(0, 99))
def test_kernel_matches_torch_path(n, grad_dtype, out_dtype, decoupled, wd, step, lr, beta1, beta2, eps, seed):
    """From any state: kernel = PyTorch path to fp32 rounding; a low-precision grad is upcast exactly."""
    g = torch.Generator().manual_seed(seed)
    param, m = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
    v = torch.rand(n, generator=g) * 0.01
    grad = torch.randn(n, generator=g).to(grad_dtype)
    hp = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd, decoupled=decoupled)

    def run(grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state = [param.clone(), m.clone(), v.clone()]
        out = None if out_dtype is None else torch.full((n,), float("nan"), dtype=out_dtype)
        adamw_step_(state[0], grad, state[1], state[2], **hp, out=out)
        return (*state, out)

    with launched(KERNEL):
        p, m1, v1, out = run(grad)
    with pytorch_path():
        want = run(grad.float())  # the fp32 reference fed the same gradient, upcast
    for got, ref in zip((p, m1, v1), want):
        torch.testing.assert_close(got, ref, **CLOSE)
    if out is not None:
        assert torch.equal(out, p.to(out_dtype))
    if grad_dtype != torch.float32:
        # Upcasting in the kernel is exact, and the kernel contracts no multiply-add in any variant
        # (enable_fp_fusion off), so the bf16/fp16-grad variant runs the fp32 variant's operations on the
        # same values: bitwise equal, on a GPU too (with contraction on, ptxas fused differently per variant).
        with launched(KERNEL):
            upcast = run(grad.float())
        for got, ref in zip((p, m1, v1), upcast):
            assert torch.equal(got, ref)


@interpreted
def test_kernel_is_compiled_without_contraction():
    """What the bitwise claims above rest on: the launch asks Triton for no fp contraction."""
    with kernels.dispatch.recording() as recorded:
        p = torch.zeros(3000)
        adamw_step_(p, torch.zeros(3000, dtype=torch.bfloat16), p.clone(), p.clone(), step=1, lr=1e-3, beta1=0.9,
                    beta2=0.99, eps=1e-8, weight_decay=0.1, out=torch.empty(3000, dtype=torch.bfloat16))
    assert [r.kernel.__name__ for r in recorded] == [KERNEL]
    assert recorded[0].kwargs["enable_fp_fusion"] is False


@interpreted
def test_int64_offsets():
    """The int64-offset variant (a shard near 2**31 elements gets it), forced with blocks of 256: bitwise
    what the int32 variant computes."""
    tk = kernels.dispatch.triton_module("adamw_triton")
    g = torch.Generator().manual_seed(9)
    param, grad, m = (torch.randn(1000, generator=g) for _ in range(3))
    v = torch.rand(1000, generator=g)

    def run():
        state, out = [param.clone(), m.clone(), v.clone()], torch.empty(1000, dtype=torch.bfloat16)
        with launched(KERNEL):
            adamw_step_(state[0], grad.bfloat16(), state[1], state[2], step=4, lr=1e-2, beta1=0.9, beta2=0.95,
                        eps=1e-8, weight_decay=0.1, out=out)
        return (*state, out)

    want = run()
    real = tk.config
    with mock.patch.object(tk, "config", lambda n: {**real(n), "BLOCK": 256, "INT64": True, "num_warps": 2}):
        got = run()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@interpreted
def test_adamw_step_in_torch_compile():
    """The kernel is a mutating custom op: called inside a compiled function (fullgraph, aot_eager), with and
    without a copy, it updates param, state and copy exactly as eager does."""
    def step(p, grad, m, v, out):
        adamw_step_(p, grad, m, v, step=2, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, out=out)
        adamw_step_(p, grad, m, v, step=3, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
        return p * 1

    g = torch.Generator().manual_seed(10)
    tensors = [torch.randn(3000, generator=g), torch.randn(3000, generator=g).bfloat16(),
               torch.randn(3000, generator=g), torch.rand(3000, generator=g), torch.empty(3000, dtype=torch.bfloat16)]
    got, want = [t.clone() for t in tensors], [t.clone() for t in tensors]
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    with launched(KERNEL):
        compiled(*got)
    step(*want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@interpreted
def test_adamw_step_makes_no_host_sync():
    """adamw_step_ and fused_step (a non-fused optimizer: its step counts live on the host by design, and
    after the first step fused_step does not even read them): nothing would make the host wait for a GPU."""
    p = torch.nn.Parameter(torch.randn(3000))
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=False)
    p.grad = torch.randn(3000)
    fused_step(opt)  # creates the state
    with count_host_syncs() as syncs, launched(KERNEL):
        adamw_step_(p.detach(), torch.randn(3000).half(), torch.zeros(3000), torch.zeros(3000), step=1, lr=1e-3,
                    beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, out=torch.empty(3000, dtype=torch.bfloat16))
        fused_step(opt, {id(p): torch.empty(3000, dtype=torch.bfloat16)})
    assert not syncs.calls, syncs.report()


def test_torch_path_upcasts_and_copies():
    """PyTorch path: a bf16/fp16 grad acts as its fp32 upcast; ``out`` is param.to(dtype); nothing launches."""
    g = torch.Generator().manual_seed(0)
    before = sum(kernels.launches.values())
    for grad_dtype, out_dtype in [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)]:
        param, grad = torch.randn(1025, generator=g), torch.randn(1025, generator=g).to(grad_dtype)
        runs = []
        for gr in (grad, grad.float()):
            p, m, v = param.clone(), torch.zeros(1025), torch.zeros(1025)
            out = torch.empty(1025, dtype=out_dtype)
            with pytorch_path():
                adamw_step_(p, gr, m, v, step=3, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
                            out=out)
            assert torch.equal(out, p.to(out_dtype))
            runs.append((p, m, v))
        for a, b in zip(*runs):
            assert torch.equal(a, b)
    assert sum(kernels.launches.values()) == before


# ----------------------------------------------------------------------------- the step count and the state

def test_step_count_follows_the_tensor():
    """A count changed behind fused_step's back is read again, and an fp32 count saturates where torch's does."""
    torch.manual_seed(0)
    mine, ref = [torch.nn.Parameter(torch.randn(7))], [torch.nn.Parameter(torch.randn(7))]
    ref[0].data.copy_(mine[0].data)
    opt, ref_opt = (torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 1 - 1e-7), foreach=False) for ps in (mine, ref))
    reads, real_item = [], torch.Tensor.item

    def counted_item(t: torch.Tensor):
        reads.append(t)
        return real_item(t)

    with pytorch_path():
        for step in range(8):
            if step == 3:  # jump to just below 2**24, where the fp32 count stops increasing
                for o in (opt, ref_opt):
                    o.state[o.param_groups[0]["params"][0]]["step"].fill_(2.0 ** 24 - 2)
            grad = torch.randn(7)
            mine[0].grad, ref[0].grad = grad.clone(), grad.clone()
            reads.clear()
            with (mock.patch.object(torch.Tensor, "item", counted_item),
                  mock.patch("minipar.kernels.adamw.adamw_step_", wraps=adamw_step_) as spy):
                fused_step(opt)
            # the count is read from the tensor on the first step and after fill_ only (on a GPU: a sync) ...
            assert len(reads) == (1 if step in (0, 3) else 0), (step, len(reads))
            # ... and the one the update used is always the tensor's
            assert spy.call_args.kwargs["step"] == opt.state[mine[0]]["step"].item()
            ref_opt.step()
            assert torch.equal(mine[0], ref[0])
            assert_same_state(opt.state_dict(), ref_opt.state_dict(), exact=True)
    assert opt.state[mine[0]]["step"].item() == 2.0 ** 24


def test_state_format_matches_torch():
    """Lazily created state: as torch creates it, for a plain and a fused optimizer, and Adam's int decay 0."""
    for make in (lambda ps: torch.optim.Adam(ps),  # weight_decay=0, an int
                 lambda ps: torch.optim.AdamW(ps, fused=True)):
        mine, ref = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(5))
        ref.data.copy_(mine.data)
        opt, ref_opt = make([mine]), make([ref])
        assert supports(opt)
        for _ in range(3):
            grad = torch.randn(5)
            mine.grad, ref.grad = grad.clone(), grad.clone()
            with pytorch_path():
                fused_step(opt)
            ref_opt.step()
        torch.testing.assert_close(mine, ref)  # torch's fused kernel rounds its own way
        assert_same_state(opt.state_dict(), ref_opt.state_dict(), exact=False)


def test_supports():
    """Only plain Adam/AdamW with Python-number hyperparameters over fp32 params."""
    def params(dtype=torch.float32):
        return [torch.nn.Parameter(torch.zeros(3, dtype=dtype))]

    class MyAdamW(torch.optim.AdamW):
        pass

    assert supports(torch.optim.AdamW(params(), weight_decay=0.1))
    assert supports(torch.optim.Adam(params(), weight_decay=0.1, decoupled_weight_decay=True))
    rejected = [torch.optim.AdamW(params(), amsgrad=True), torch.optim.Adam(params(), maximize=True),
                torch.optim.AdamW(params(), differentiable=True), torch.optim.Adam(params(), capturable=True),
                torch.optim.AdamW(params(), lr=torch.tensor(1e-3)), torch.optim.SGD(params(), lr=0.1),
                MyAdamW(params()), torch.optim.AdamW(params(torch.bfloat16)),
                torch.optim.AdamW(params(torch.complex64))]
    for opt in rejected:
        assert not supports(opt), opt
    opt = rejected[0]
    opt.param_groups[0]["params"][0].grad = torch.zeros(3)
    with pytest.raises(ValueError, match="supports"):
        fused_step(opt)


def test_bad_arguments():
    z = torch.zeros(4)
    hp = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="numel"):
        adamw_step_(z, torch.zeros(5), z.clone(), z.clone(), **hp)
    with pytest.raises(ValueError, match="float32"):
        adamw_step_(z.bfloat16(), z, z.clone(), z.clone(), **hp)
    with pytest.raises(ValueError, match="contiguous"):
        adamw_step_(z, torch.zeros(8)[::2], z.clone(), z.clone(), **hp)
    with pytest.raises(ValueError, match="step"):
        adamw_step_(z, z.clone(), z.clone(), z.clone(), **{**hp, "step": 0})

