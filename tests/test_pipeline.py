"""Pipeline parallelism: for pp in {2, 4}, any micro-batch count, both schedules and the layouts of
4 processes over dp, tp and pp (pp=4; pp=2 x dp=2; pp=2 x tp=2), training equals the single-process
run on the global batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, strategies as st

from minipar import Mesh, ShardedModule
from minipar.models import GPT, GPTConfig, gpt_loss

from helpers import EPS, LR, WD
from test_zero import PRECISIONS, _train_reference


def _train_pp(ctx, layout: dict, cfg: dict, data: torch.Tensor, schedule: str, m: int, max_norm: float):
    mesh = Mesh(**layout)
    model = ShardedModule(GPT(GPTConfig(**cfg)), mesh=mesh, schedule=schedule, microbatches=m, bucket_cap_mb=1e-3)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    local = data.shape[1] // mesh.dp
    losses, norms, peaks = [], [], []
    for s in range(data.shape[0]):
        x = data[s, mesh.dp_rank * local:(mesh.dp_rank + 1) * local].to(ctx.device)
        losses.append(model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy).item())  # vocab-parallel if tp
        norms.append(model.clip_grad_norm_(max_norm).item())
        opt.step()
        opt.zero_grad()
        peaks.append(model.peak_live_activations)
    state = model.full_state_dict()
    mesh.destroy()
    return losses, norms, state, peaks, mesh.pp_rank


def _reference(cfg, data, max_norm):
    model = GPT(GPTConfig(**cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses, norms = [], []
    for s in range(data.shape[0]):
        x = data[s]
        loss = gpt_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, model.state_dict()


LAYOUTS = [(2, dict(pp=2)), (4, dict(pp=4)), (4, dict(pp=2, dp=2)), (4, dict(pp=2, tp=2))]


@example(layout=LAYOUTS[3], schedule="1f1b", m=3, n_layer=4, tie=True, seed=1)
@example(layout=LAYOUTS[1], schedule="gpipe", m=5, n_layer=5, tie=True, seed=2)
@given(layout=st.sampled_from(LAYOUTS), schedule=st.sampled_from(["gpipe", "1f1b"]), m=st.integers(1, 8),
       n_layer=st.integers(4, 5), tie=st.booleans(), seed=st.integers(0, 2**16))
def test_pipeline_equals_single_process(pools, layout, schedule, m, n_layer, tie, seed):
    """Losses (reported on every rank), the gradient norm (one norm over all stages, the tied
    weight counted once; independent of m) and parameters after three AdamW steps equal the
    reference; 1F1B never holds more than pp - stage micro-batches' activations, GPipe all m."""
    world, mesh_sizes = layout
    dp = mesh_sizes.get("dp", 1)
    cfg = dict(vocab_size=24, block_size=5, n_layer=n_layer, n_head=2, n_embd=8, tie_weights=tie, seed=seed)
    data = torch.randint(0, 24, (3, dp * m, 6), generator=torch.Generator().manual_seed(seed + 1))
    ref_losses, ref_norms, ref_state = _reference(cfg, data, 0.05)
    assert max(ref_norms) > 0.05
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    pp = mesh_sizes["pp"]
    for rank, (losses, norms, state, peaks, stage) in enumerate(
            pools.run(world, _train_pp, mesh_sizes, cfg, data, schedule, m, 0.05)):
        torch.testing.assert_close(f32(losses), f32(ref_losses), msg=lambda s: f"rank {rank} losses: {s}")
        torch.testing.assert_close(f32(norms), f32(ref_norms), msg=lambda s: f"rank {rank} norms: {s}")
        assert state.keys() == ref_state.keys()
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, msg=lambda s: f"rank {rank} {k}: {s}")
        bound = min(pp - stage, m) if schedule == "1f1b" else m
        assert max(peaks) == bound, (schedule, stage, peaks)


def _bad(ctx, kwargs, layout):
    mesh = Mesh(**layout)
    with pytest.raises(ValueError) as info:
        model = ShardedModule(GPT(GPTConfig(vocab_size=10, block_size=4, n_layer=2, n_head=1, n_embd=4)),
                              mesh=mesh, **kwargs)
        x = torch.randint(0, 10, (3, 5))
        model.train_step(x[:, :-1], x[:, 1:], gpt_loss)
    mesh.destroy()
    return str(info.value)


@pytest.mark.parametrize("kwargs, layout, match", [
    ({}, dict(pp=4), "4 pipeline stages but only 2 layers"),
    ({"schedule": "zigzag"}, dict(pp=2), "unknown schedule 'zigzag'; choose one of gpipe, 1f1b"),
    ({"microbatches": 2}, dict(pp=2), "a batch of 3 does not split into microbatches=2"),
])
def test_bad_pipeline_configurations_raise(pools, kwargs, layout, match):
    world = 4 if layout["pp"] == 4 else 2
    for msg in pools.run(world, _bad, kwargs, layout):
        assert match in msg


# -- pipeline x ZeRO-1/2, and dp x tp x pp -------------------------------------------------------

def _train_pp_sharded(ctx, layout, strategy, precision, cfg, data, schedule, max_norm):
    mesh = Mesh(**layout)
    m, local = data.shape[1], data.shape[2] // mesh.dp
    model = ShardedModule(GPT(GPTConfig(**cfg)), mesh=mesh, strategy=strategy, schedule=schedule, microbatches=m,
                          mixed_precision=PRECISIONS[precision], bucket_cap_mb=1e-3)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    losses, norms = [], []
    for s in range(data.shape[0]):
        # This rank's micro-batches one after another: the pipeline cuts them back apart in order.
        x = data[s, :, mesh.dp_rank * local:(mesh.dp_rank + 1) * local].flatten(0, 1).to(ctx.device)
        losses.append(model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy).item())
        norms.append(model.clip_grad_norm_(max_norm).item())
        opt.step()
        opt.zero_grad()
    state = model.full_state_dict()
    mesh.destroy()
    return losses, norms, state


def _check_pp_sharded(pools, world, layout, strategy, precision, schedule, m, tie, seed):
    dp = layout.get("dp", 1)
    cfg = dict(vocab_size=12, block_size=4, n_layer=4, n_head=2, n_embd=8, tie_weights=tie, seed=seed)
    data = torch.randint(0, 12, (3, m, dp * 2, 5), generator=torch.Generator().manual_seed(seed + 1))
    # The ZeRO reference replays each data-parallel rank's micro-batches as that strategy runs them
    # (zero1 accumulates in p.grad, zero2 reduces every backward), in fp32 or emulating bf16 exactly.
    ref_losses, ref_norms, _, ref_state = _train_reference(strategy, cfg, data, dp, precision, 0.05, 2.0)
    assert max(ref_norms) > 0.05
    tol = {} if precision == "fp32" else dict(rtol=1.6e-2, atol=1e-5)  # the defaults for fp32 / bf16
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    for rank, (losses, norms, state) in enumerate(
            pools.run(world, _train_pp_sharded, layout, strategy, precision, cfg, data, schedule, 0.05)):
        torch.testing.assert_close(f32(losses), f32(ref_losses), **tol, msg=lambda s: f"rank {rank} losses: {s}")
        torch.testing.assert_close(f32(norms), f32(ref_norms), **tol, msg=lambda s: f"rank {rank} norms: {s}")
        assert state.keys() == ref_state.keys()
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, **tol, msg=lambda s: f"rank {rank} {k}: {s}")


@example(strategy="zero2", layout=dict(pp=2, dp=2), precision="fp32", schedule="1f1b", m=3, tie=True, seed=3)
@example(strategy="zero1", layout=dict(pp=2, dp=2), precision="bf16", schedule="gpipe", m=2, tie=False, seed=4)
@example(strategy="zero1", layout=dict(pp=2, tp=2), precision="fp32", schedule="gpipe", m=2, tie=True, seed=4)
@given(strategy=st.sampled_from(["zero1", "zero2"]),
       layout=st.sampled_from([dict(pp=2, dp=2), dict(pp=2, tp=2), dict(pp=4)]),
       precision=st.sampled_from(["fp32", "bf16"]), schedule=st.sampled_from(["gpipe", "1f1b"]),
       m=st.integers(1, 4), tie=st.booleans(), seed=st.integers(0, 2**16))
def test_pipeline_with_zero_equals_single_process(pools, strategy, layout, precision, schedule, m, tie, seed):
    """ZeRO-1 and ZeRO-2 on the data-parallel axis of a pipeline (with tp or dp beside it), fp32 or
    bf16 compute: losses, the one gradient norm over all stages (tied weight once) and parameters
    after three clipped AdamW steps equal the reference, the tied weight's gradient summed across
    the first and last stage (at the shard level under ZeRO-2).

    bf16 is compared only without tp and with an untied head: the reference emulates the casts
    exactly, but not tensor parallelism's bf16 partial matmuls and their reduction, nor a tied
    weight's two bf16 gradient accumulators (one per stage, summed) where it has one; AdamW
    amplifies those roundings beyond the bf16 tolerance for near-zero gradients."""
    if precision == "bf16" and ("tp" in layout or tie):
        precision = "fp32"
    _check_pp_sharded(pools, 4, layout, strategy, precision, schedule, m, tie, seed)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_dp_tp_pp_all_greater_than_one(pools, strategy):
    """8 processes as dp=2 x tp=2 x pp=2 with a tied head, each data-parallel strategy: the full
    composition equals the reference."""
    _check_pp_sharded(pools, 8, dict(dp=2, tp=2, pp=2), strategy, "fp32", "1f1b", 2, True, 7)
