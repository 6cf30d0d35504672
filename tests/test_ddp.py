"""DDP: for any GPT shape, world size, bucket size and accumulation count, the
distributed run equals the single-process run on the global batch.

Each test states what it compares. The reference is the same model built from
the same seed, trained in this (the pytest) process on the concatenation of
every rank's data, with the same AdamW, weight decay and gradient clipping.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, strategies as st

from minipar import Mesh, ShardedModule
from minipar.models import GPT, GPTConfig, gpt_loss

from helpers import EPS, LR, WD, accumulated_step, batches


# -- the equivalence property ----------------------------------------------------


def _train_ddp(ctx, cfg: dict, data: torch.Tensor, local_bs: int, bucket_cap_mb: float, max_norm: float,
               set_to_none: bool):
    # Ranks other than 0 start from different weights: wrapping must broadcast rank 0's.
    model = GPT(GPTConfig(**{**cfg, "seed": cfg["seed"] + ctx.rank}))
    mesh = Mesh()
    ddp = ShardedModule(model, mesh=mesh, strategy="ddp", bucket_cap_mb=bucket_cap_mb)
    opt = ddp.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    steps = data.shape[0]
    rows = slice(ctx.rank * local_bs, (ctx.rank + 1) * local_bs)
    losses, norms = [], []
    for s in range(steps):
        step_loss = accumulated_step(ddp, data[s], rows, ctx.device)
        grads = {n: None if p.grad is None else p.grad.to("cpu", copy=True) for n, p in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        losses.append(step_loss)
    return losses, norms, grads, {k: v.cpu() for k, v in ddp.full_state_dict().items()}


def _train_reference(cfg: dict, data: torch.Tensor, max_norm: float):
    model = GPT(GPTConfig(**cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses, norms = [], []
    for s in range(data.shape[0]):
        x = data[s].flatten(0, 1)  # every micro-batch of every rank: the global batch
        loss = gpt_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, grads, model.state_dict()


@st.composite
def ddp_cases(draw):
    n_head = draw(st.integers(1, 3))
    seq = draw(st.integers(1, 7))
    cfg = dict(vocab_size=draw(st.integers(5, 67)), block_size=seq, n_layer=draw(st.integers(1, 2)),
               # head_dim >= 4: a LayerNorm over 2 features maps every input to +-1 and its gradient is
               # so ill-conditioned that summation order alone moves results past fp32 tolerance.
               n_head=n_head, n_embd=n_head * draw(st.sampled_from([4, 8])), bias=draw(st.booleans()),
               tie_weights=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))
    return dict(
        cfg=cfg,
        world=draw(st.integers(1, 4)),
        local_bs=draw(st.integers(1, 3)),
        accum=draw(st.integers(1, 3)),
        seq=seq,
        # 1e-6 MiB is one byte: smaller than any parameter, so every parameter gets a bucket of its own.
        bucket_cap_mb=draw(st.sampled_from([1e-6, 1e-3, 4e-3, 25.0])),
        set_to_none=draw(st.booleans()),
        data_seed=draw(st.integers(0, 2**16)),
    )


@given(case=ddp_cases())
def test_ddp_equals_single_process(pools, case):
    """Several AdamW steps (weight decay, clipping that fires) with DDP on per-rank data equal the
    single-process run on the global batch: losses, gradient norms, gradients and parameters; and
    every rank holds bitwise identical parameters."""
    cfg, world = case["cfg"], case["world"]
    data = batches(case["data_seed"], 3, case["accum"], world, case["local_bs"], case["seq"], cfg["vocab_size"])
    max_norm = 0.05
    ref_losses, ref_norms, ref_grads, ref_params = _train_reference(cfg, data, max_norm)
    assert max(ref_norms) > max_norm, "clipping must fire for this test to mean anything"

    results = pools.run(world, _train_ddp, cfg, data, case["local_bs"], case["bucket_cap_mb"], max_norm,
                        case["set_to_none"])
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731 -- fp32 values, fp32 tolerance
    for rank, (losses, norms, grads, params) in enumerate(results):
        torch.testing.assert_close(f32(losses), f32(ref_losses), msg=lambda m: f"rank {rank} losses: {m}")
        torch.testing.assert_close(f32(norms), f32(ref_norms), msg=lambda m: f"rank {rank} grad norms: {m}")
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], msg=lambda m: f"rank {rank} grad {name}: {m}")
        assert params.keys() == ref_params.keys()
        for name in ref_params:
            torch.testing.assert_close(params[name], ref_params[name], msg=lambda m: f"rank {rank} {name}: {m}")
        for name in params:
            assert torch.equal(params[name], results[0][3][name]), f"rank {rank} differs from rank 0 in {name}"


# -- unused and rank-dependent parameters -----------------------------------------


class Branchy(nn.Module):
    """A trunk, a branch some ranks use, a branch no rank uses, a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.trunk = nn.Linear(5, 6)
        self.sometimes = nn.Linear(6, 3)
        self.never = nn.Linear(6, 3)
        self.head = nn.Linear(6, 3)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.trunk(x)))
        out = self.head(h)
        if use_branch:
            out = out + self.sometimes(h)
        return out


def _branch_data(world: int, steps: int):
    g = torch.Generator().manual_seed(11)
    return torch.randn(steps, world, 4, 5, generator=g), torch.randn(steps, world, 4, 3, generator=g)


def _uses_branch(rank: int, step: int, mode: str) -> bool:
    return {"all": True, "none": False, "even_ranks": rank % 2 == 0, "rank0_step1": rank == 0 and step == 1}[mode]


def _branchy_vs_torch_ddp(ctx, mode: str, bucket_cap_mb: float, steps: int):
    """Run minipar DDP and torch DDP(find_unused_parameters=True) side by side on this rank."""
    from torch.nn.parallel import DistributedDataParallel

    mesh = Mesh()
    ours_model, theirs_model = Branchy().to(ctx.device), Branchy().to(ctx.device)
    ours = ShardedModule(ours_model, mesh=mesh, bucket_cap_mb=bucket_cap_mb)
    theirs = DistributedDataParallel(theirs_model, find_unused_parameters=True, bucket_cap_mb=bucket_cap_mb,
                                     device_ids=None if ctx.device == "cpu" else [ctx.device])
    opts = [torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=WD, eps=EPS) for m in (ours_model, theirs_model)]
    xs, ys = (t.to(ctx.device) for t in _branch_data(ctx.world_size, steps))
    trace = []
    for s in range(steps):
        use = _uses_branch(ctx.rank, s, mode)
        for wrapped in (ours, theirs):
            loss = ((wrapped(xs[s, ctx.rank], use_branch=use) - ys[s, ctx.rank]) ** 2).mean()
            loss.backward()
        trace.append({n: (None if p.grad is None else p.grad.to("cpu", copy=True),
                          None if q.grad is None else q.grad.to("cpu", copy=True))
                      for (n, p), (_, q) in zip(ours_model.named_parameters(), theirs_model.named_parameters())})
        for o in opts:
            o.step()
            o.zero_grad()
    params = {n: (p.detach().cpu(), q.detach().cpu())
              for (n, p), (_, q) in zip(ours_model.named_parameters(), theirs_model.named_parameters())}
    return trace, params


@pytest.mark.parametrize("mode", ["all", "none", "even_ranks", "rank0_step1"])
@pytest.mark.parametrize("bucket_cap_mb", [1e-6, 25.0])
def test_unused_and_rank_dependent_branches_match_torch_ddp(pools, mode, bucket_cap_mb):
    """Branches used by all, some or no ranks: no hang, and gradients (None-ness included) and
    parameters equal PyTorch DDP with find_unused_parameters=True; a parameter no rank used keeps
    grad=None and is never changed by the optimizer."""
    world = 3
    results = pools.run(world, _branchy_vs_torch_ddp, mode, bucket_cap_mb, 3)
    initial = dict(Branchy().named_parameters())
    for rank, (trace, params) in enumerate(results):
        for s, grads in enumerate(trace):
            for name, (ours, theirs) in grads.items():
                assert (ours is None) == (theirs is None), f"rank {rank} step {s} {name}: {ours} vs {theirs}"
                if ours is not None:
                    torch.testing.assert_close(ours, theirs, msg=lambda m: f"rank {rank} step {s} {name}: {m}")
            assert grads["never.weight"][0] is None
            any_rank_used = any(_uses_branch(r, s, mode) for r in range(world))
            assert (grads["sometimes.weight"][0] is not None) == any_rank_used
        for name, (ours, theirs) in params.items():
            torch.testing.assert_close(ours, theirs, msg=lambda m: f"rank {rank} {name}: {m}")
        assert torch.equal(params["never.weight"][0], initial["never.weight"].detach())


# -- no_sync, communication volume and overlap --------------------------------------


def _count_comm(ctx, cfg: dict, bucket_cap_mb: float, accum: int):
    mesh = Mesh()
    model = GPT(GPTConfig(**cfg))
    ddp = ShardedModule(model, mesh=mesh, bucket_cap_mb=bucket_cap_mb)
    x = torch.randint(0, cfg["vocab_size"], (2, cfg["block_size"] + 1),
                      generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device)
    per_micro = []
    for a in range(accum):
        sync = contextlib.nullcontext() if a == accum - 1 else ddp.no_sync()
        with mesh.comm.counting() as stats, sync:
            gpt_loss(ddp(x[:, :-1]), x[:, 1:]).backward()
        per_micro.append((stats.calls(op="all_reduce", tag="grad"), stats.bytes(op="all_reduce", tag="grad"),
                          stats.calls(tag="unused_map"), stats.calls()))
    bucketed = [p for b in ddp.strategy.buckets for p in b.params]
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return per_micro, len(ddp.strategy.buckets), grad_bytes, len(bucketed), len({id(p) for p in bucketed})


@given(world=st.integers(2, 4), accum=st.integers(1, 3), bucket_cap_mb=st.sampled_from([1e-6, 2e-3, 25.0]),
       tie=st.booleans())
def test_each_gradient_byte_all_reduced_once_per_step(pools, world, accum, bucket_cap_mb, tie):
    """Counted by the collective layer: backward under no_sync communicates nothing; the synchronising
    backward all-reduces every gradient byte exactly once (one call per bucket, buckets partition
    the parameters, a tied weight counted once) plus one small used-parameter map."""
    cfg = dict(vocab_size=37, block_size=5, n_layer=2, n_head=2, n_embd=8, tie_weights=tie)
    for per_micro, n_buckets, grad_bytes, n_bucketed, n_unique in pools.run(world, _count_comm, cfg, bucket_cap_mb, accum):
        assert n_bucketed == n_unique == len(list(GPT(GPTConfig(**cfg)).parameters()))
        for calls, nbytes, map_calls, all_calls in per_micro[:-1]:
            assert (calls, nbytes, map_calls, all_calls) == (0, 0, 0, 0)
        calls, nbytes, map_calls, all_calls = per_micro[-1]
        assert (calls, nbytes, map_calls) == (n_buckets, grad_bytes, 1)
        assert all_calls == n_buckets + 1


def _overlap(ctx):
    mesh = Mesh()
    model = GPT(GPTConfig(vocab_size=50, block_size=8, n_layer=3, n_head=2, n_embd=16))
    ddp = ShardedModule(model, mesh=mesh, bucket_cap_mb=1e-6)  # a bucket per parameter
    launched_before_first_block = []
    # The first block's backward runs near the very end of backward: only its own and the
    # embeddings' gradients come after it.
    model.layers[0].register_full_backward_pre_hook(
        lambda mod, grad_out: launched_before_first_block.append(stats.calls(op="all_reduce", tag="grad")))
    x = torch.randint(0, 50, (2, 9)).to(ctx.device)
    with mesh.comm.counting() as stats:
        gpt_loss(ddp(x[:, :-1]), x[:, 1:]).backward()
    return launched_before_first_block, stats.calls(op="all_reduce", tag="grad")


def test_all_reduce_overlaps_backward(pools):
    """The first buckets' all-reduces are issued while backward is still running, not after it."""
    for launched_before, total in pools.run(2, _overlap):
        assert len(launched_before) == 1
        assert 0 < launched_before[0] < total


# -- what wrapping sets up: buffers from rank 0, gradients in the buckets ---------------


class WithBuffers(nn.Module):
    """A layer plus a float and an integer buffer whose values say which rank built them."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("running_mean", torch.full((4,), float(rank + 1)))
        self.register_buffer("steps_seen", torch.tensor([10 * (rank + 1)], dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.running_mean[:2]


def _buffers_after_wrap(ctx):
    model = WithBuffers(ctx.rank).to(ctx.device)
    before = {n: b.to("cpu", copy=True) for n, b in model.named_buffers()}
    ShardedModule(model, mesh=Mesh(), strategy="ddp")
    return before, {n: b.to("cpu", copy=True) for n, b in model.named_buffers()}


def test_wrapping_broadcasts_buffers_from_rank_0(pools):
    """Buffers (float and integer) that differ between ranks before wrapping equal rank 0's on every
    rank afterwards, as the parameters do: a model built per rank starts from one state."""
    results = pools.run(3, _buffers_after_wrap)
    assert [before["running_mean"][0].item() for before, _ in results] == [1.0, 2.0, 3.0]  # they did differ
    for rank, (_, after) in enumerate(results):
        assert torch.equal(after["running_mean"], torch.full((4,), 1.0)), f"rank {rank}: {after}"
        assert torch.equal(after["steps_seen"], torch.tensor([10])), f"rank {rank}: {after}"
        assert after["steps_seen"].dtype == torch.int64


def _grads_are_bucket_views(ctx, set_to_none: bool):
    cfg = GPTConfig(vocab_size=23, block_size=4, n_layer=2, n_head=2, n_embd=8, tie_weights=True)
    model = GPT(cfg)
    ddp = ShardedModule(model, mesh=Mesh(), bucket_cap_mb=2e-3)  # 2 KiB: several buckets
    opt = ddp.build_optimizer(torch.optim.SGD, lr=0.1)
    name = {id(p): n for n, p in model.named_parameters()}
    x = torch.randint(0, 23, (2, 5), generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device)
    problems, checked = [], 0
    for step in range(2):
        for micro in range(2):  # an accumulating backward under no_sync, then the synchronising one
            with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                gpt_loss(ddp(x[:, :-1]), x[:, 1:]).backward()
            for b in ddp.strategy.buckets:
                for i, p in enumerate(b.params):
                    checked += 1
                    where = f"step {step} micro-batch {micro}: {name[id(p)]}.grad"
                    if p.grad is None:
                        problems.append(f"{where} is None")
                    elif p.grad.untyped_storage().data_ptr() != b.flat.untyped_storage().data_ptr():
                        problems.append(f"{where} is not in bucket {b.index}'s flat buffer")
                    elif p.grad.data_ptr() != b.views[i].data_ptr() or p.grad.shape != p.shape:
                        problems.append(f"{where} is in bucket {b.index} but not at its own slot")
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    n_params = len(list(model.parameters()))
    return problems, checked, n_params, len(ddp.strategy.buckets)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_each_grad_is_a_view_into_its_bucket(pools, set_to_none):
    """After every backward (under no_sync and synchronising; after zero_grad with set_to_none
    either way), each p.grad shares the storage of its bucket's flat buffer, at its own slot: the
    all-reduce needs no copy in or out."""
    for problems, checked, n_params, n_buckets in pools.run(2, _grads_are_bucket_views, set_to_none):
        assert n_buckets > 1 and checked == 2 * 2 * n_params  # every parameter, every backward
        assert problems == []


# -- configuration errors -----------------------------------------------------------


def _mismatched(ctx, what: str):
    mesh = Mesh()
    cfg = GPTConfig(vocab_size=20, block_size=4, n_layer=1, n_head=1, n_embd=8)
    if what == "bucket":
        kwargs, model = {"bucket_cap_mb": 1.0 + ctx.rank}, GPT(cfg)
    else:
        kwargs, model = {}, GPT(GPTConfig(vocab_size=20 + ctx.rank, block_size=4, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(ValueError, match="differs between ranks") as info:
        ShardedModule(model, mesh=mesh, **kwargs)
    dist.barrier()  # the process group is still healthy afterwards
    return str(info.value)


@pytest.mark.parametrize("what", ["bucket", "model"])
def test_configuration_differing_between_ranks_raises_not_hangs(pools, what):
    messages = pools.run(3, _mismatched, what, timeout=60)
    assert all("rank 2" in m for m in messages)


@pytest.mark.parametrize("kwargs, match", [
    ({"bucket_cap_mb": 0}, "bucket_cap_mb=0 must be a finite number > 0"),
    ({"bucket_cap_mb": -3.0}, "bucket_cap_mb=-3.0 must be a finite number > 0"),
    ({"strategy": "zero9"}, "unknown strategy 'zero9'; choose one of ddp"),
])
def test_bad_arguments_raise_before_any_communication(kwargs, match):
    # No process group exists in this process: reaching a collective would fail differently.
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=match):
        ShardedModule(nn.Linear(2, 2), **kwargs)


def test_module_without_parameters_raises():
    with pytest.raises(ValueError, match="ReLU has no parameters"):
        ShardedModule(nn.ReLU())


# -- the wrapper is transparent ------------------------------------------------------


@dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class HFStyle(nn.Module):
    """Keyword arguments in, an output object out, as a Hugging Face model does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        with torch.no_grad():
            self.lin.weight.copy_(torch.arange(12.0).view(3, 4) / 10)
            self.lin.bias.zero_()

    def forward(self, input_ids=None, labels=None):
        logits = self.lin(input_ids)
        return Output(loss=((logits - labels) ** 2).mean(), logits=logits)


def _hf_style(ctx):
    mesh = Mesh()
    model = ShardedModule(HFStyle(), mesh=mesh)
    g = torch.Generator().manual_seed(3)
    xs, ys = torch.randn(ctx.world_size, 2, 4, generator=g), torch.randn(ctx.world_size, 2, 3, generator=g)
    out = model(input_ids=xs[ctx.rank].to(ctx.device), labels=ys[ctx.rank].to(ctx.device))
    assert type(out) is Output
    out.loss.backward()
    full = model.full_state_dict()
    return model.module.lin.weight.grad.to("cpu", copy=True), sorted(full), xs, ys


def test_keyword_arguments_and_outputs_pass_through(pools):
    results = pools.run(2, _hf_style)
    _, _, xs, ys = results[0]
    ref = HFStyle()
    sum(ref(input_ids=xs[r], labels=ys[r]).loss for r in range(2)).div(2).backward()
    for grad, keys, _, _ in results:
        torch.testing.assert_close(grad, ref.lin.weight.grad)
        assert keys == ["lin.bias", "lin.weight"]  # the original module's names, no wrapper prefix


# -- a strategy of one's own: one registration, no edit elsewhere -----------------------------------

def _own_strategy(ctx, name: str):
    """Register a strategy named ``name`` (DDP with every gradient in one bucket, built by its own
    function) in this rank's process, and train three steps with it: the losses and parameters."""
    from minipar.data_parallel.ddp import DDP
    from minipar.data_parallel.strategy import register_strategy
    register_strategy("one_bucket", lambda module, mesh, config, reshard: DDP(module, mesh, bucket_cap_mb=1e9))
    mesh = Mesh()
    options = {"bucket_cap_mb": 1e-3} if name == "ddp" else {}  # several buckets for the built-in one
    model = ShardedModule(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)), mesh=mesh,
                          strategy=name, **options)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    data = batches(5, 3, 1, ctx.world_size, 2, 8, 32)
    losses = []
    for s in range(3):
        x = data[s, 0, 2 * ctx.rank: 2 * ctx.rank + 2]
        losses.append(model.train_step(x[:, :-1], x[:, 1:], gpt_loss).item())
        opt.step()
        opt.zero_grad()
    state = {k: v.clone() for k, v in model.full_state_dict().items()}
    buckets = len(model.strategy.buckets)
    mesh.destroy()
    return losses, state, buckets


def test_a_registered_strategy_is_built_by_the_front_door(pools):
    """`register_strategy` is all a new data-parallel strategy needs: ``ShardedModule(strategy=name)``
    builds it through the registry (here DDP in one bucket, against the built-in DDP's several), it
    trains equal to DDP, and a name nobody registered is refused listing the ones that are."""
    mine, builtin = (pools.run(2, _own_strategy, name) for name in ("one_bucket", "ddp"))
    for (losses, state, buckets), (ref_losses, ref_state, ref_buckets) in zip(mine, builtin):
        assert buckets == 1 < ref_buckets
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k])
    with pytest.raises(ValueError, match="unknown strategy 'one_bucket'; choose one of ddp"):
        ShardedModule(nn.Linear(2, 2), strategy="one_bucket")  # registered in the ranks' processes only
