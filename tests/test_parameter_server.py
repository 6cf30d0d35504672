"""Parameter server: the sync mode equals the single-process run; the async mode keeps its
staleness bound and still trains; bad configurations fail before any message.

The sync reference is the same GPT built from the same seed, trained in this (the pytest)
process on the concatenation of every worker's batch, with the same AdamW, weight decay and
gradient clipping (a max_norm small enough to fire). Servers are ranks 0 .. S-1, workers the
rest; worker j (j = rank - S) owns rows j*local_bs:(j+1)*local_bs of each global batch.
"""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, strategies as st

from minipar import Mesh
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.data_parallel.parameter_server import ParameterServer, partition_by_size

from helpers import EPS, LR, WD

ADAMW = dict(lr=LR, weight_decay=WD, eps=EPS)


def _cfg(seed: int, vocab: int = 31, seq: int = 5, n_layer: int = 1, n_head: int = 2, bias: bool = True,
         tie: bool = True) -> dict:
    return dict(vocab_size=vocab, block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=4 * n_head, bias=bias,
                tie_weights=tie, seed=seed)


# -- sync: equal to the single-process run ------------------------------------------------------------------


def _train_sync(ctx, cfg: dict, data: torch.Tensor, servers: int, local_bs: int, max_norm: float):
    mesh = Mesh()
    # Workers start from other weights: the first pull must hand them the servers' values.
    model = GPT(GPTConfig(**{**cfg, "seed": cfg["seed"] + (ctx.rank >= servers) * (ctx.rank + 1)}))
    ps = ParameterServer(model, mesh, torch.optim.AdamW, servers=servers, mode="sync", max_norm=max_norm, **ADAMW)
    if ps.is_server:
        ps.serve()
        owned = {n for i, (n, _) in enumerate(model.named_parameters()) if i in ps.shard}
        return "server", [], [], {n: p.detach().clone() for n, p in model.named_parameters() if n in owned}
    j = ctx.rank - servers
    losses, norms = [], []
    for s in range(data.shape[0]):
        x = data[s, j * local_bs:(j + 1) * local_bs]
        losses.append(ps.train_step(x[:, :-1], x[:, 1:], gpt_loss).item())
        norms.append(ps.last_grad_norm)
    ps.finish()
    return "worker", losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _reference(cfg: dict, data: torch.Tensor, max_norm: float):
    model = GPT(GPTConfig(**cfg))
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, norms = [], []
    for s in range(data.shape[0]):
        loss = gpt_loss(model(data[s][:, :-1]), data[s][:, 1:])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, dict(model.named_parameters())


@st.composite
def sync_cases(draw):
    world = draw(st.integers(2, 4))
    return dict(world=world, servers=draw(st.integers(1, world - 1)), local_bs=draw(st.integers(1, 3)),
                seq=draw(st.integers(2, 6)), n_head=draw(st.integers(1, 2)), tie=draw(st.booleans()),
                vocab=draw(st.integers(7, 40)), seed=draw(st.integers(0, 2**16)))


@given(sync_cases())
def test_sync_equals_single_process(pools, case):
    """For any world size, number of servers and GPT shape, 3 sync steps (AdamW with weight decay,
    global-norm clipping that fires) give the reference's losses, norms and weights on every rank."""
    cfg = _cfg(case["seed"], case["vocab"], case["seq"], n_head=case["n_head"], tie=case["tie"])
    workers = case["world"] - case["servers"]
    data = torch.randint(0, cfg["vocab_size"], (3, workers * case["local_bs"], case["seq"] + 1),
                         generator=torch.Generator().manual_seed(case["seed"]))
    ref_losses, ref_norms, ref_params = _reference(cfg, data, max_norm=0.5)
    assert max(ref_norms) > 0.5, "the clipping under test must fire"
    results = pools.run(case["world"], _train_sync, cfg, data, case["servers"], case["local_bs"], 0.5)
    owned = set()
    for role, losses, norms, params in results:
        if role == "worker":
            assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
            assert norms == pytest.approx(ref_norms, rel=1e-5, abs=1e-6)
        else:
            assert not owned & params.keys(), "a tensor is owned by two servers"
            owned |= params.keys()
        for n, p in params.items():
            torch.testing.assert_close(p, ref_params[n].detach(), msg=lambda m: f"{role} {n}: {m}")
    assert owned == ref_params.keys(), "every parameter lives on exactly one server"


def _mismatched_steps(ctx):
    ps = ParameterServer(GPT(GPTConfig(**_cfg(0))), Mesh(), torch.optim.SGD, servers=1, lr=0.1)
    try:
        if ps.is_server:
            ps.serve()
        else:
            x = torch.randint(0, 31, (1, 6))
            for _ in range(1 + ctx.rank):  # the workers disagree on the step count
                ps.train_step(x[:, :-1], x[:, 1:], gpt_loss)
            ps.finish()
    except RuntimeError as e:
        return str(e)
    return None


def test_sync_workers_with_different_step_counts_fail_on_every_rank_not_hang(pools):
    messages = pools.run(3, _mismatched_steps, timeout=120)
    # Worker 1 (two steps) finishes cleanly; the server and worker 2, which pushed a third step, both fail.
    server, short, long = messages
    assert short is None and "same number of steps" in server and "same number of steps" in long, messages


# -- async: the staleness bound, and convergence ----------------------------------------------------------


def _train_async(ctx, servers: int, staleness, steps: int, slow_s: float):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**_cfg(1, vocab=16, seq=8, n_layer=1)))
    ps = ParameterServer(model, Mesh(), torch.optim.AdamW, servers=servers, mode="async", staleness=staleness,
                         max_norm=1.0, lr=3e-3)
    if ps.is_server:
        ps.serve()
        return "server", ps.applied, []
    # Every worker learns the same fixed sequences (a task the model can fit): the loss must fall.
    x = torch.arange(9).repeat(4, 1) * (torch.arange(4)[:, None] + 1) % 16
    losses = []
    for _ in range(steps):
        if ctx.rank == servers:  # the first worker is slow: the others run ahead of it
            time.sleep(slow_s)
        losses.append(ps.train_step(x[:, :-1], x[:, 1:], gpt_loss).item())
    ps.finish()
    return "worker", ps.versions_used, losses


def _worst_lag(results) -> int:
    return max(step - clock for role, versions, _ in results if role == "worker" for step, clock in versions)


@pytest.mark.parametrize("world,servers,staleness", [(3, 1, 0), (4, 1, 1), (4, 2, 2)])
def test_async_respects_staleness_bound_and_converges(pools, world, servers, staleness):
    """With one worker slowed down, no worker ever computes step c on parameters missing any
    worker's step < c - staleness; the GPT's loss still falls on every worker."""
    results = pools.run(world, _train_async, servers, staleness, 40, 0.01)
    assert _worst_lag(results) <= staleness
    for role, versions, losses in results:
        if role == "worker":
            assert [s for s, _ in versions] == list(range(41))  # the first pull, then one per step
            assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
        else:  # each gradient was applied once, in each worker's step order
            for w in range(world - servers):
                assert [c for i, c, _ in versions if i == w] == list(range(40))


def test_async_without_bound_runs_ahead(pools):
    """The control for the test above: with no bound the fast workers get more than 2 steps ahead
    of the slow one, so the bound is what holds them back there."""
    results = pools.run(3, _train_async, 1, None, 20, 0.1)
    assert _worst_lag(results) > 2


def _uneven_async(ctx, staleness):
    ps = ParameterServer(GPT(GPTConfig(**_cfg(0))), Mesh(), torch.optim.SGD, servers=2, mode="async",
                         staleness=staleness, lr=0.1)
    if ps.is_server:
        ps.serve()
        return len(ps.applied)
    x = torch.randint(0, 31, (1, 6))
    for _ in range(2 + 3 * ctx.rank):  # workers 2 and 3 take 8 and 11 steps
        ps.train_step(x[:, :-1], x[:, 1:], gpt_loss)
    ps.finish()
    return ps.steps


@pytest.mark.parametrize("staleness", [0, 2, None])
def test_async_workers_with_different_step_counts_all_finish(pools, staleness):
    """A worker that finishes early stops holding the others back: every rank returns (no hang),
    and each server applied every push."""
    assert pools.run(4, _uneven_async, staleness, timeout=120) == [19, 19, 8, 11]


# -- configuration ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(servers=3), "servers=3 must be"),
    (dict(servers=0), "servers=0 must be"),
    (dict(servers=1, mode="stale"), "mode='stale'"),
    (dict(servers=1, staleness=1), "sync mode is never stale"),
    (dict(servers=1, mode="async", staleness=-1), "staleness=-1"),
    (dict(servers=1, max_norm=0.0), "max_norm=0.0"),
])
def test_bad_configuration_raises_before_any_message(pools, kwargs, match):
    for msg, calls in pools.run(3, _bad_config, kwargs):
        assert match in msg and calls == 0, (msg, calls)


def _bad_config(ctx, kwargs):
    mesh = Mesh()
    with mesh.comm.counting() as stats:
        try:
            ParameterServer(GPT(GPTConfig(**_cfg(0))), mesh, torch.optim.SGD, lr=0.1, **kwargs)
        except ValueError as e:
            return str(e), stats.calls()
    return "no error", stats.calls()


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=30), st.integers(1, 8))
def test_partition_covers_every_tensor_once_and_balances(numels, parts):
    """Each tensor index lands in exactly one part; the heaviest part is within one tensor of the mean."""
    out = partition_by_size(numels, parts)
    assert sorted(i for p in out for i in p) == list(range(len(numels)))
    loads = [sum(numels[i] for i in p) for p in out]
    assert max(loads) <= sum(numels) / parts + max(numels)
