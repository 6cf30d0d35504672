"""ZeRO-1, ZeRO-2 and ZeRO-3 under faults that touch one rank or one reused buffer.

* An inf in one gradient element, on one rank, in an element another rank's shard owns: only that
  other rank's reduced shard holds it, yet every rank skips the step and halves its loss scale.
* Reused gradient buffers (the staging pool's, ZeRO-1's persistent buckets) filled with NaN before
  a backward: the padding of every gradient shard is still exactly zero after it, no step is
  skipped, and the gradients and parameters equal those of a run without the NaN.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from minipar import Mesh, MixedPrecision, ShardedModule

STRATEGIES = ["zero1", "zero2", "zero3"]
WORLD = 3
FP16 = MixedPrecision(param_dtype=torch.float16, init_scale=1024.0)


def _model() -> nn.Module:
    """Parameters of 4, 4, 20, 5 and 5 elements, layers of 8, 25 and 5, 38 in all: at world 3 no
    bucket (one per parameter, or one for all) and no unit (one per layer) divides evenly."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1, bias=False))


def _sharded(strategy: str, mesh: Mesh, bucket_cap_mb: float) -> ShardedModule:
    return ShardedModule(_model(), mesh=mesh, strategy=strategy, bucket_cap_mb=bucket_cap_mb, mixed_precision=FP16,
                         wrap_policy=(nn.Linear,) if strategy == "zero3" else None)


def _loss(out: torch.Tensor, _) -> torch.Tensor:
    return out.float().pow(2).mean()


# -- one inf, on one rank, in another rank's shard --------------------------------------


def _one_inf(ctx, strategy):
    mesh = Mesh()
    sharded = _sharded(strategy, mesh, bucket_cap_mb=1.0)  # zero1/2: one bucket of all 38 elements
    opt = sharded.build_optimizer(torch.optim.SGD, lr=0.1)
    state = sharded.strategy
    # The first element of rank 1's shard of the largest group, as a (parameter, element) pair.
    group = max(state.groups, key=lambda g: g.layout.numel)
    target = group.layout.shard_size
    param, index = next((p, target - a) for p in group.layout.params
                        for a, b in [group.layout.span(p)] if a <= target < b)
    poison = [False]

    def plant(grad: torch.Tensor) -> torch.Tensor:  # before the strategy's hooks see the gradient
        if not poison[0]:
            return grad
        grad = grad.clone()
        grad.view(-1)[index] = float("inf")
        return grad

    if ctx.rank == 0:  # only rank 0's gradient gets the inf; rank 1 owns the element
        param.register_hook(plant)
    x = torch.randn(4, 1, generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device)
    log = []
    for step in range(3):
        poison[0] = step == 1
        sharded.train_step(x, None, _loss)
        local_inf = not all(torch.isfinite(g.grad_shard).all() for g in state.groups)  # before any agreement
        found = state.unscale_()
        # Compared before the step: ranks that disagree would issue different collectives in it and
        # hang; this way a missing agreement fails at once, with every rank's answer.
        flags = [None] * ctx.world_size
        dist.all_gather_object(flags, found)
        if len(set(flags)) > 1:
            return log, flags
        masters = [g.master.detach().clone() for g in state.groups]
        before = sharded.full_state_dict()
        stepped = opt.step()
        after = sharded.full_state_dict()
        opt.zero_grad()
        log.append(dict(local_inf=local_inf, found=found, stepped=stepped, scale=state.scaler.scale,
                        masters_kept=all(torch.equal(m, g.master) for m, g in zip(masters, state.groups)),
                        params_kept=all(torch.equal(before[k], after[k]) for k in before)))
    mesh.destroy()
    return log, None


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_inf_in_another_ranks_shard_skips_the_step_everywhere(pools, strategy):
    """fp16, 3 ranks: in step 1 rank 0's gradient gets one inf, in an element of rank 1's shard, so
    after the reduce-scatter only rank 1's shard holds a non-finite value. Every rank must still
    find the overflow, skip the step (fp32 masters and full parameters unchanged) and halve its
    loss scale; the steps before and after are taken everywhere with the same scale."""
    results = pools.run(WORLD, _one_inf, strategy)
    for rank, (log, disagreement) in enumerate(results):
        assert disagreement is None, f"ranks disagree on the overflow (rank: found inf): {disagreement}"
        assert [e["local_inf"] for e in log] == [False, rank == 1, False], (rank, log)
        assert [(e["found"], e["stepped"], e["scale"]) for e in log] == \
            [(False, True, 1024.0), (True, False, 512.0), (False, True, 512.0)], (rank, log)
        assert [(e["masters_kept"], e["params_kept"]) for e in log] == \
            [(False, False), (True, True), (False, False)], (rank, log)


# -- NaN in reused gradient buffers -------------------------------------------------------


def _fill_with_nan(sharded: ShardedModule, fresh: bool) -> list[torch.Tensor]:
    """Put NaN where a backward may find stale contents: ZeRO-1's persistent buckets (undefined
    after zero_grad, ``fresh``), and for every stage the staging pool's free buffers (always
    undefined: the pool is handed ``keep`` NaN buffers as large as the largest group, which
    push out whatever it held). Returns the NaN buffers handed to the pool."""
    state = sharded.strategy
    if state.stage == 1:
        if fresh:
            for b in state.buckets:
                b.flat.fill_(float("nan"))
        return []
    pool = state.order.pool
    largest = max(g.layout.padded for g in state.groups)
    given = [torch.full((largest,), float("nan"), dtype=state.policy.grad_dtype, device=state.groups[0].shard.device)
             for _ in range(pool.keep)]
    for buffer in given:
        pool.give(buffer)
    return given


def _nan_buffers(ctx, strategy, poison):
    mesh = Mesh()
    sharded = _sharded(strategy, mesh, bucket_cap_mb=1e-6)  # zero1/2: a bucket per parameter
    opt = sharded.build_optimizer(torch.optim.SGD, lr=0.1)
    state = sharded.strategy
    padded = all(g.layout.padded > g.layout.numel for g in state.groups)
    gen = torch.Generator().manual_seed(ctx.rank)
    log, grads, used = [], [], []
    for step in range(3):
        for micro in range(2):  # two synchronising backwards: the second takes buffers the first gave back
            given = _fill_with_nan(sharded, fresh=micro == 0) if poison else []
            x = torch.randn(4, 1, generator=gen).to(ctx.device)
            sharded.train_step(x, None, lambda out, y: _loss(out, y) / 2)
            used.append(any(not torch.isnan(b).all() for b in given))
        pad_zero = all(bool((g.grad_shard[g.layout.real_len:] == 0).all()) for g in state.groups)
        full = state.full_grads()
        grads.append({n: full[id(p)].cpu() for n, p in sharded.module.named_parameters()})
        log.append((pad_zero, opt.step()))
        opt.zero_grad()
    params = {k: v.cpu() for k, v in sharded.full_state_dict().items()}
    mesh.destroy()
    return padded, used, log, grads, params


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nan_in_reused_gradient_buffers_never_reaches_the_shards(pools, strategy):
    """fp16, 3 ranks, every bucket and unit padded: with NaN in the staging pool's free buffers
    (and ZeRO-1's buckets after zero_grad) before each of two synchronising backwards per step,
    the padding of every gradient shard is exactly zero, no step is skipped (the fp16 overflow
    check reads the whole shard, padding included), and three steps give bitwise the gradients
    and parameters of the same run without the NaN."""
    clean = pools.run(WORLD, _nan_buffers, strategy, False)
    dirty = pools.run(WORLD, _nan_buffers, strategy, True)
    assert all(padded for padded, *_ in clean), "every group must have padding for this test to mean anything"
    if strategy != "zero1":
        assert all(any(used) for _, used, *_ in dirty), "the staging buffers must come from the pool"
    # Per rank, per step: (the padding of every gradient shard is zero, the step was taken).
    assert [log for _, _, log, *_ in dirty] == [[(True, True)] * 3] * WORLD
    assert [log for _, _, log, *_ in clean] == [[(True, True)] * 3] * WORLD
    for rank, ((*_, grads0, params0), (*_, grads, params)) in enumerate(zip(clean, dirty)):
        for step, (g0, g) in enumerate(zip(grads0, grads)):
            for n in g0:
                assert torch.equal(g[n], g0[n]), f"rank {rank} step {step} grad {n}: {g[n]} vs {g0[n]}"
        for k in params0:
            assert torch.equal(params[k], params0[k]), f"rank {rank} {k}"
