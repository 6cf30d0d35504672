"""Single-process DataParallel: for any batch size and number of CPU "devices" (threads), the wrapped
model equals the model alone on the same batch -- outputs, loss, gradients, and the parameters after
AdamW steps with weight decay and gradient clipping that fires.

The reference in each test is a deep copy of the model taken before wrapping, run in this thread on
the whole batch with the same optimizer. Gradients agree up to summation order (the replicas' sums
are added on the first device), so float64 models are compared to 1e-12 and the GPT (fp32) to 1e-5.
Batch sizes are drawn to include ones not divisible by the device count and ones smaller than it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, strategies as st

from minipar.data_parallel.single_process import DataParallel, ReplicaError
from minipar.models import GPT, GPTConfig, gpt_loss

LR, WD, MAX_NORM = 1e-2, 0.1, 1e-3  # a norm this small is always exceeded: clipping fires every step


class Net(nn.Module):
    """Two layers, a tensor keyword argument and a float one, and a parameter forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 7), nn.Linear(7, 3)
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, scale: float) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)) * mask) * scale


def _adamw_steps(model: nn.Module, steps: int, run) -> list[dict]:
    """``steps`` steps of AdamW (LR, WD) with clipping at MAX_NORM; per step the output, loss, norm
    before clipping, gradients (None where unset) and parameters after the step."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    record = []
    for s in range(steps):
        out, loss = run(s)
        loss.backward()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
        opt.step()
        opt.zero_grad()
        record.append(dict(out=out.detach(), loss=loss.item(), norm=norm, grads=grads,
                           params={n: p.detach().clone() for n, p in model.named_parameters()}))
    return record


def _assert_same(got: list[dict], want: list[dict], tol: float) -> None:
    for s, (g, w) in enumerate(zip(got, want, strict=True)):
        assert w["norm"] > MAX_NORM  # clipping fired
        torch.testing.assert_close(g["out"], w["out"], rtol=tol, atol=tol, msg=f"step {s} output")
        assert g["loss"] == pytest.approx(w["loss"], rel=tol, abs=tol), s
        assert g["norm"] == pytest.approx(w["norm"], rel=tol, abs=tol), s
        for name in w["grads"]:
            if w["grads"][name] is None:  # a parameter the forward never uses gets no gradient in either
                assert g["grads"][name] is None, (s, name)
            else:
                torch.testing.assert_close(g["grads"][name], w["grads"][name], rtol=tol, atol=tol,
                                           msg=f"step {s} gradient of {name}")
            torch.testing.assert_close(g["params"][name], w["params"][name], rtol=tol, atol=tol,
                                       msg=f"step {s} parameter {name}")


@given(k=st.integers(1, 4), batch=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_equals_the_single_process_module(k, batch, seed):
    """Net (float64, unused parameter, tensor and float keyword arguments) wrapped over k CPU
    devices equals Net alone on the same batches, for three AdamW steps with clipping."""
    torch.manual_seed(seed)
    model = Net().double()
    reference = copy.deepcopy(model)
    data = [(torch.randn(batch, 5, dtype=torch.float64), (torch.rand(batch, 7) > 0.3).double(),
             torch.randn(batch, 3, dtype=torch.float64)) for _ in range(3)]

    def run(m):
        def step(s):
            x, mask, y = data[s]
            out = m(x, mask=mask, scale=0.5)
            return out, (out - y).square().mean()
        return step

    dp = DataParallel(model, devices=["cpu"] * k)
    _assert_same(_adamw_steps(model, 3, run(dp)), _adamw_steps(reference, 3, run(reference)), tol=1e-12)


@given(k=st.integers(1, 4), batch=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_gpt_equals_the_single_process_gpt(k, batch, seed):
    """minipar's GPT (tied embedding and LM head) wrapped over k CPU devices equals the GPT alone:
    logits, gpt_loss, gradients and parameters over two AdamW steps with clipping (fp32)."""
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, seed=seed)
    model = GPT(cfg)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(cfg.vocab_size, (batch, cfg.block_size + 1), generator=gen) for _ in range(2)]

    def run(m):
        def step(s):
            logits = m(tokens[s][:, :-1])
            return logits, gpt_loss(logits, tokens[s][:, 1:])
        return step

    dp = DataParallel(model, devices=["cpu"] * k)
    assert model.lm_head.weight is model.wte.weight
    _assert_same(_adamw_steps(model, 2, run(dp)), _adamw_steps(reference, 2, run(reference)), tol=1e-5)


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).double()


@given(k=st.integers(2, 4), extra=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_batchnorm_in_train_mode_normalises_per_slice_and_keeps_replica_0s_running_stats(k, extra, seed):
    """Train mode: replica i's output rows are the model applied to slice i alone (batch statistics
    per slice, not per batch), and the running statistics afterwards are those of slice 0 alone
    (replica 0 updates the module's own buffers; the others' copies are dropped). Every slice has
    at least two rows, as BatchNorm needs in train mode."""
    torch.manual_seed(seed)
    model = _bn_net()
    batch = 2 * k + extra
    x = torch.randn(batch, 4, dtype=torch.float64)
    sizes = [batch // k + (1 if i < batch % k else 0) for i in range(k)]
    per_slice = []
    for i, rows in enumerate(x.split(sizes)):
        alone = copy.deepcopy(model)
        per_slice.append((alone(rows), alone[1]))
    out = DataParallel(model, devices=["cpu"] * k)(x)
    torch.testing.assert_close(out, torch.cat([o for o, _ in per_slice]), rtol=1e-12, atol=1e-12)
    bn, bn_slice0 = model[1], per_slice[0][1]
    torch.testing.assert_close(bn.running_mean, bn_slice0.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(bn.running_var, bn_slice0.running_var, rtol=0, atol=0)
    assert bn.num_batches_tracked.item() == 1
    # which is not the single-process output: that normalises with the whole batch's statistics
    assert not torch.allclose(out, _bn_net()(x), rtol=1e-6, atol=1e-6)


@given(k=st.integers(1, 4), batch=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_batchnorm_in_eval_mode_equals_the_single_process_module(k, batch, seed):
    """Eval mode: BatchNorm reads its running statistics, so outputs and gradients equal the
    single-process run's and the buffers are left as they were."""
    torch.manual_seed(seed)
    model = _bn_net()
    model[1].running_mean.normal_()
    model[1].running_var.uniform_(0.5, 2.0)
    model.eval()
    reference = copy.deepcopy(model)
    x = torch.randn(batch, 4, dtype=torch.float64)
    out, want = DataParallel(model, devices=["cpu"] * k)(x), reference(x)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)
    for b, c in zip(model.buffers(), reference.buffers()):
        assert torch.equal(b, c)


def test_the_module_stays_at_dot_module_and_is_what_trains():
    """.module is the wrapped model itself; the wrapper's parameters are its parameters (so an
    optimizer built on either steps the same tensors) and its state dict prefixes 'module.'."""
    model = Net()
    dp = DataParallel(model, devices=["cpu", "cpu"])
    assert dp.module is model
    assert [id(p) for p in dp.parameters()] == [id(p) for p in model.parameters()]
    assert list(dp.state_dict()) == [f"module.{k}" for k in model.state_dict()]


def test_no_grad_forward_builds_no_graph_and_equals_the_module():
    model = Net()
    x, mask = torch.randn(5, 5), torch.ones(5, 7)
    with torch.no_grad():
        out = DataParallel(model, devices=["cpu"] * 3)(x, mask=mask, scale=2.0)
    assert out.grad_fn is None and not out.requires_grad
    torch.testing.assert_close(out, model(x, mask=mask, scale=2.0).detach())


def test_outputs_in_tuples_and_dicts_are_gathered_along_dim_0():
    class Two(nn.Module):
        def forward(self, x):
            return {"double": 2 * x, "pair": (x, x.sum(1))}

    x = torch.arange(10.0).reshape(5, 2)
    out = DataParallel(Two(), devices=["cpu"] * 2)(x)
    assert torch.equal(out["double"], 2 * x) and torch.equal(out["pair"][0], x)
    assert torch.equal(out["pair"][1], x.sum(1))


def test_an_empty_device_list_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="at least one device"):
        DataParallel(Net(), devices=[])


def test_a_module_not_on_the_first_device_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"must live on the first device cpu: call module.to\('cpu'\)"):
        DataParallel(Net().to("meta"), devices=["cpu"])


def test_mismatched_batch_sizes_are_refused():
    with pytest.raises(ValueError, match=r"sizes differ: \[4, 3\]"):
        DataParallel(Net(), devices=["cpu"] * 2)(torch.randn(4, 5), mask=torch.ones(3, 7), scale=1.0)


@given(k=st.integers(2, 4), failing=st.integers(0, 3))
def test_an_exception_in_one_replica_names_it(k, failing):
    """A replica that raises is named (index, device) in the caller with its own message and
    traceback, and the original exception is the cause; the other replicas finish first."""
    failing = failing % k

    class Picky(nn.Module):
        def forward(self, x):
            if (x == -1).any():
                raise KeyError("saw the marker row")
            return x * 2

    x = torch.zeros(2 * k, 3)
    x[2 * failing] = -1  # slices of two rows each: the marker lands in replica `failing`
    with pytest.raises(ReplicaError, match=rf"replica {failing} of {k} \(on cpu\) raised KeyError: "
                                            r"'saw the marker row'") as info:
        DataParallel(Picky(), devices=["cpu"] * k)(x)
    assert isinstance(info.value.__cause__, KeyError)
    assert "in forward" in str(info.value)  # the replica's traceback


def test_batchnorm_with_a_one_row_slice_fails_naming_the_replica():
    """Batch 3 over 2 devices: slices of 2 and 1 rows; BatchNorm cannot train on one row."""
    with pytest.raises(ReplicaError, match=r"replica 1 of 2 \(on cpu\) raised ValueError: Expected more than 1 value"):
        DataParallel(_bn_net(), devices=["cpu"] * 2)(torch.randn(3, 4, dtype=torch.float64))
