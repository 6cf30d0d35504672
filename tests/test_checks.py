"""What minipar checks for you (issue 19): a model, option or batch that differs between ranks or
is out of range raises on every rank (never a gloo abort, a hang, or a silently mixed model);
ranks seeded differently still train one model; options are checked when they are built; the
tensor-parallel dropout streams differ between data-parallel replicas."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from minipar import Mesh, MixedPrecision, ShardedModule
from minipar.models import GPT, GPTConfig, MoEGPTConfig, MoEGPT
from minipar.models.gpt import Block

CFG = dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.0)


def _healthy(mesh: Mesh) -> bool:
    """The process group still works after the error (one all-reduce over the world)."""
    t = torch.ones(1, device=mesh.device)
    mesh.comm.all_reduce(t, mesh.world)
    return t.item() == mesh.world_size


# -- one model, whatever each rank was given ----------------------------------------------------

def _seeded_per_rank(ctx, layout: dict, strategy: str):
    mesh = Mesh(**layout)
    model = ShardedModule(GPT(GPTConfig(**CFG, seed=100 + ctx.rank)), mesh=mesh, strategy=strategy)
    state = {k: v.float().cpu() for k, v in model.full_state_dict().items()}
    mesh.destroy()
    return state


@pytest.mark.parametrize("layout, strategy", [(dict(tp=2, pp=2), "ddp"), (dict(dp=2, tp=2), "zero3")])
def test_ranks_seeded_differently_train_world_rank_0s_model(pools, layout, strategy):
    """Each rank builds its model from another seed: every tensor-parallel shard is cut from rank
    0's full tensor, every replica (dp, tp, the last stage's tied copy) starts from it."""
    reference = GPT(GPTConfig(**CFG, seed=100)).state_dict()
    for rank, state in enumerate(pools.run(4, _seeded_per_rank, layout, strategy)):
        assert state.keys() == reference.keys()
        for k, v in reference.items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=0, msg=lambda s: f"rank {rank} {k}: {s}")


def _different_model(ctx):
    mesh = Mesh(tp=2)
    model = GPT(GPTConfig(**{**CFG, "n_embd": 8 if ctx.rank == 0 else 16}))
    with pytest.raises(ValueError) as info:
        ShardedModule(model, mesh=mesh)
    ok = _healthy(mesh)
    mesh.destroy()
    return str(info.value), ok


def test_a_different_model_on_a_tensor_parallel_rank_names_the_ranks_and_the_first_difference(pools):
    for message, healthy in pools.run(2, _different_model, timeout=60):
        assert healthy
        assert "differs between ranks of the 'world' group" in message
        assert "rank 0 (pp 0, dp 0, tp 0) and rank 1 (pp 0, dp 0, tp 1)" in message
        assert "['model'][0]: 'wte.weight (16, 8) torch.float32' vs 'wte.weight (16, 16) torch.float32'" in message


def _different_precision(ctx):
    mesh = Mesh()
    policy = MixedPrecision(torch.bfloat16 if ctx.rank == 0 else torch.float16)
    with pytest.raises(ValueError) as info:
        ShardedModule(GPT(GPTConfig(**CFG)), mesh=mesh, strategy="zero2", mixed_precision=policy)
    mesh.destroy()
    return str(info.value)


def test_an_option_that_differs_only_in_a_dtype_is_found(pools):
    """Options are described by value (a dtype as torch.bfloat16), not by type alone."""
    for message in pools.run(2, _different_precision, timeout=60):
        assert "['param_dtype']: 'torch.bfloat16' vs 'torch.float16'" in message, message


def _rank_dependent_options(ctx):
    mesh = Mesh()
    policy = MixedPrecision(torch.bfloat16 if ctx.rank < 2 else torch.float16)
    cfg = {**CFG, "n_layer": 2 if ctx.rank < 2 else 3}
    with pytest.raises(ValueError) as info:
        ShardedModule(GPT(GPTConfig(**cfg)), mesh=mesh, strategy="zero2", mixed_precision=policy,
                      bucket_cap_mb=1.0 + (ctx.rank == 2), dropout_seed=7)
    ok = _healthy(mesh)
    mesh.destroy()
    return str(info.value), ok


def test_rank_dependent_options_are_named_with_both_ranks_values(pools):
    """Issue 31: rank 2 computes its options and model from its rank. Every rank's error lists each
    option that differs, by its config's field, with rank 0's and rank 2's values, and each tensor
    that differs or is missing; options given alike (dropout_seed) are not listed."""
    for message, healthy in pools.run(3, _rank_dependent_options, timeout=60):
        assert healthy
        assert "rank 2 differ(s) from rank 0" in message, message
        assert "what differs between rank 0 and rank 2:" in message, message
        assert "option strategy.bucket_cap_mb: 1.0 on rank 0, 2.0 on rank 2" in message, message
        assert ("option strategy.mixed_precision.param_dtype: 'torch.bfloat16' on rank 0, "
                "'torch.float16' on rank 2") in message, message
        assert "model tensor layers.2.attn.q_proj.weight: absent on rank 0, (8, 8) torch.float32 on rank 2" in message
        assert "dropout_seed" not in message, message


def _callable_policy(ctx):
    mesh = Mesh()
    model = ShardedModule(GPT(GPTConfig(**CFG)), mesh=mesh, strategy="zero3",
                          wrap_policy=lambda m: isinstance(m, Block))
    units = [u.name for u in model.strategy.units]
    mesh.destroy()
    return units


def test_a_callable_wrap_policy_is_accepted_at_world_size_2(pools):
    """The cross-rank check describes a function by its qualified name, never by its address."""
    units = pools.run(2, _callable_policy)
    assert units[0] == units[1] and len(units[0]) == 3  # two blocks and the root


# -- options, checked when they are built -------------------------------------------------------

@pytest.mark.parametrize("build, match", [
    (lambda: ShardedModule(nn.Linear(2, 2), bucket_cap_mb=math.inf), "bucket_cap_mb=inf must be a finite number"),
    (lambda: ShardedModule(nn.Linear(2, 2), bucket_cap_mb=math.nan), "bucket_cap_mb=nan must be a finite number"),
    (lambda: ShardedModule(nn.Linear(2, 2), strategy="zero3", reshard_after_forward="yes"),
     "reshard_after_forward='yes' must be True, False or None"),
    (lambda: MixedPrecision(torch.float16, init_scale=0.0), "init_scale=0.0 must be a finite number > 0"),
    (lambda: MixedPrecision(torch.float16, init_scale=math.inf), "init_scale=inf must be a finite number > 0"),
    (lambda: MixedPrecision(torch.float16, growth_interval=0), "growth_interval=0 must be an integer >= 1"),
    (lambda: MoEGPT(MoEGPTConfig(**CFG, n_experts=2, capacity_factor=math.inf)),
     "capacity_factor=inf must be a finite number > 0"),
    (lambda: ShardedModule(nn.Linear(2, 2), dropout_seed=1.5), "dropout_seed=1.5 must be an integer"),
])
def test_non_finite_and_wrong_typed_options_raise_when_built(build, match):
    assert not dist.is_initialized()  # no process group here: reaching a collective would fail otherwise
    with pytest.raises(ValueError, match=match):
        build()


def _plan_error(ctx, plan):
    mesh = Mesh(tp=2)
    with mesh.comm.counting() as stats:
        with pytest.raises(ValueError) as info:
            ShardedModule(GPT(GPTConfig(**CFG)), mesh=mesh, tp_plan=plan)
    mesh.destroy()
    return str(info.value), len(stats.records)


@pytest.mark.parametrize("plan, match", [
    ({"nothing.here": "colwise"}, "matches no module"),
    ({"wte": "vocab"}, "'lm_head' shares a weight with 'wte', which the plan shards"),
    ({"layers.0.mlp.fc": "colwise_in_region"}, "no module above it is 'enter_region'"),
    ({"layers.0.ln_1": "colwise"}, "plan style 'colwise' needs an nn.Linear"),
])
def test_tensor_parallel_plan_errors_come_before_any_collective(pools, plan, match):
    for message, collectives in pools.run(2, _plan_error, plan, timeout=60):
        assert re.search(match, message), message
        assert collectives == 0, f"{collectives} collectives ran before the plan error"


# -- batches ----------------------------------------------------------------------------------

def _batch(mesh: Mesh, rows: int = 4, seq: int = 8):
    g = torch.Generator().manual_seed(mesh.dp_rank)  # tp and pp peers share their replica's batch
    x = torch.randint(0, 16, (rows, seq + 1), generator=g)
    return x[:, :-1].clone(), x[:, 1:].clone()


def _bad_batch(ctx, layout: dict, case: str):
    mesh = Mesh(**layout)
    model = ShardedModule(GPT(GPTConfig(**CFG)), mesh=mesh, microbatches=2 if mesh.pp > 1 else 1)
    x, y = _batch(mesh, seq=10 if case == "long" else 8)
    last = ctx.rank == ctx.world_size - 1
    if case == "id" and last:
        x[0, 3] = 16
    elif case == "target" and last:
        y[1, 2] = -7
    elif case == "ignored":
        y[:, 0] = -100
    elif case == "shape" and last:
        x, y = x[:2], y[:2]
    try:
        loss = model.train_step(x, y, model.cross_entropy)
        out = f"trained: {math.isfinite(loss.item())}"
    except ValueError as e:
        out = str(e)
    ok = _healthy(mesh)
    mesh.destroy()
    return out, ok


@pytest.mark.parametrize("layout", [dict(dp=2, tp=2), dict(tp=2, pp=2)])
@pytest.mark.parametrize("case, expect", [
    ("id", "rank 3 ({}): token ids outside [0, 16)"),
    ("target", "rank 3 ({}): targets outside [0, 16) other than ignore_index=-100"),
    ("long", "a sequence longer than the block size 8"),
    ("shape", "were given batches of different shapes"),
    ("ignored", "trained: True"),
])
def test_a_bad_batch_raises_on_every_rank(pools, layout, case, expect):
    """One rank's bad batch (an id or target outside the vocabulary, a sequence over the block size,
    a shape its tensor-/pipeline-parallel peers do not share) raises on all of them, before any
    compute; targets equal to ignore_index are fine."""
    where = "pp 0, dp 1, tp 1" if layout.get("dp") == 2 else "pp 1, dp 0, tp 1"
    for rank, (out, healthy) in enumerate(pools.run(4, _bad_batch, layout, case, timeout=90)):
        assert healthy, rank
        assert expect.format(where) in out, f"rank {rank}: {out}"


def _uneven_dp(ctx):
    mesh = Mesh()
    model = ShardedModule(GPT(GPTConfig(**CFG)), mesh=mesh)
    x, y = _batch(mesh, rows=4 if ctx.rank == 0 else 2)
    loss = model.train_step(x, y, model.cross_entropy).item()
    mesh.destroy()
    return loss


def test_data_parallel_ranks_may_hold_different_batch_sizes(pools):
    losses = pools.run(2, _uneven_dp)
    assert losses[0] == losses[1] and math.isfinite(losses[0])


# -- dropout streams ----------------------------------------------------------------------------

def _streams(ctx, seed: int):
    mesh = Mesh(dp=2, tp=2)
    model = ShardedModule(GPT(GPTConfig(**{**CFG, "dropout": 0.3})), mesh=mesh, dropout_seed=seed)
    draws = {}
    for region in ("replicated", "sharded"):
        with model.module.tp_random.fork(region):
            draws[region] = tuple(torch.rand(6).tolist())
    mesh.destroy()
    return mesh.dp_rank, mesh.tp_rank, draws


def test_tensor_parallel_dropout_streams_differ_between_data_parallel_replicas(pools):
    """The replicated stream is one per replica (equal over tp, so replicated activations stay
    equal), the sharded one per rank; both derive from the user's seed."""
    out = pools.run(4, _streams, 5)
    replicated = {(dp, tp): d["replicated"] for dp, tp, d in out}
    sharded = [d["sharded"] for _, _, d in out]
    assert replicated[0, 0] == replicated[0, 1] and replicated[1, 0] == replicated[1, 1]
    assert replicated[0, 0] != replicated[1, 0]
    assert len(set(sharded) | set(replicated.values())) == 6  # no stream shared by accident
    again = pools.run(4, _streams, 5)
    assert [d for *_, d in again] == [d for *_, d in out]  # a function of the seed alone
    other = pools.run(4, _streams, 6)
    assert all(a[2]["replicated"] != b[2]["replicated"] for a, b in zip(out, other))


# -- a collective that waits too long -------------------------------------------------------------

def _lonely_collective(ctx):
    import time
    from datetime import timedelta

    from minipar import AxisGroup, CollectiveError  # noqa: F401
    mesh = Mesh()
    pg = dist.new_group([0, 1], timeout=timedelta(seconds=2))  # as minipar.init(timeout=2) gives every group
    group = AxisGroup("probe", (0, 1), ctx.rank, pg)
    out = []
    if ctx.rank == 0:  # rank 1 never joins
        for async_op in (False, True):
            start = time.monotonic()
            try:
                work = mesh.comm.all_reduce(torch.zeros(3, 2), group, async_op=async_op, tag=f"lonely_{async_op}")
                if async_op:
                    work.wait()
                out.append(("completed", 0.0))
            except CollectiveError as e:
                out.append((str(e), time.monotonic() - start))
    else:
        time.sleep(5)
    dist.barrier()  # the world's group is unaffected
    dist.destroy_process_group(pg)
    mesh.destroy()
    return out


def test_a_collective_past_its_timeout_names_itself(pools):
    """Instead of a silent wait: an error on the waiting rank that says which collective (op, axis,
    ranks, tag, shape), raised at the call or at wait() of an async handle."""
    out, _ = pools.run(2, _lonely_collective, timeout=60)
    assert len(out) == 2
    for (message, waited), async_op in zip(out, (False, True)):
        assert f"all_reduce over 'probe' (ranks [0, 1]), tag 'lonely_{async_op}', shape (3, 2)" in message, message
        assert "minipar.init(timeout=...)" in message
        assert waited < 20


def test_init_refuses_a_timeout_that_is_not_a_positive_number():
    import minipar
    for bad in (0, -1.0, math.inf, "10"):
        with pytest.raises(ValueError, match="must be a finite number of seconds > 0"):
            minipar.init(timeout=bad)
