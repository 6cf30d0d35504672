"""Host syncs (`minipar.core.syncs`): the counter sees every kind of call that would make the host wait for a
GPU, and a training step on one device makes none.

The step runs under Triton's interpreter (this module's TRITON_INTERPRET=1 child pytest), so every
kernel takes the branch it takes on a GPU: the counter then sees the GPU path's calls, on a CPU.
"""

from __future__ import annotations

import pytest
import torch

import minipar
from minipar import MixedPrecision, ShardedModule
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.core.syncs import by_span, count_host_syncs, read_on_host, to_device

from kernel_testing import interpreted, run_interpreted


def test_triton_kernels_under_interpreter():
    """This module's interpreted tests, in a TRITON_INTERPRET=1 child: all pass, none skip."""
    run_interpreted(__file__)


def test_the_counter_sees_every_kind_of_sync_and_says_where():
    t = torch.tensor([3.0, -1.0, 2.0])
    reps = torch.tensor([1, 2, 0])
    with count_host_syncs() as syncs:
        t.item() if t.numel() == 1 else t[0].item()
        t.tolist()
        bool(t[0] > 0)
        int(t[0])
        float(t[1])
        t.nonzero()
        t[t > 0]
        torch.repeat_interleave(t, reps)
        torch.unique(t)
        torch.equal(t, t)
    kinds = {what for what, _ in syncs.calls}
    assert kinds == {"item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "indexing with a boolean mask",
                     "repeat_interleave without output_size", "unique", "equal"}, kinds
    assert syncs.total == 10
    assert all("test_syncs.py" in where for _, where in syncs.calls), syncs.report()


def test_the_counter_ignores_what_never_waits():
    t = torch.randn(4, 3)
    steps = torch.tensor(5.0)  # e.g. a torch optimizer's step count: on the host in every run
    with count_host_syncs(host_tensors=[steps]) as syncs:
        y = (t * 2).sum(0).any()             # stays a tensor: nothing read
        torch.where(t > 0, t, 0.0).masked_fill_(t < -5, 0.0)
        t.repeat_interleave(2, dim=0)        # a Python count: the shape is known
        torch.repeat_interleave(t, torch.tensor([1, 2, 1, 0]), dim=0, output_size=4)
        steps.item()
        read_on_host(torch.stack([y, y]))
    assert syncs.total == 0, syncs.report()


def test_read_on_host_refuses_a_device_tensor_and_to_device_moves_every_tensor():
    with pytest.raises(ValueError, match="waits for the device"):
        read_on_host(torch.empty(2, device="meta"))
    batch = {"ids": torch.ones(2, 3, dtype=torch.long), "mask": [torch.zeros(2)], "n": 3}
    moved = to_device(batch, torch.device("meta"))
    assert moved["ids"].device.type == "meta" and moved["mask"][0].device.type == "meta" and moved["n"] == 3


def test_views_of_one_batch_travel_as_one_contiguous_copy():
    """What ``to_device`` does for a GPU (`by_span`, with a recording ``copy`` standing for the pinned
    transfer): the inputs and shifted targets of one batch, not contiguous, are one copy of the batch's
    span, rebuilt as equal views of it; a small slice of a large tensor is copied alone; every tensor
    handed to ``copy`` is contiguous (a non-contiguous host tensor is staged in pageable memory, which
    waits for the device); other leaves pass through."""
    copies = []

    def copy(t):
        assert t.is_contiguous()
        copies.append(t.numel())
        return t.clone()

    batch = torch.arange(2 * 9).view(2, 9)
    big = torch.arange(10_000)
    inputs, targets, small, sparse, scalar, other = by_span(
        [batch[:, :-1], batch[:, 1:], big[100:104:2], big[::1000], 3, torch.ones(5)], copy)
    assert torch.equal(inputs, batch[:, :-1]) and torch.equal(targets, batch[:, 1:])
    assert inputs.untyped_storage().data_ptr() == targets.untyped_storage().data_ptr() != batch.data_ptr()
    assert torch.equal(small, big[100:104:2]) and torch.equal(sparse, big[::1000])
    assert scalar == 3 and torch.equal(other, torch.ones(5))
    # the batch once (18); big's two slices span 9,901 elements for 12: each alone, made contiguous (2 and
    # 10); the other tensor (5)
    assert sorted(copies) == [2, 5, 10, 18], copies


CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _steps(strategy: str, options: dict, loss_fn=gpt_loss, model_cfg: dict | None = None, mesh=None,
           seed: int = 0):
    """Three training steps (train_step, clip, AdamW, zero_grad) of a GPT with host batches (on a
    world of one unless ``mesh``); the host syncs of the last two (the first may read one-time state)."""
    mesh = mesh or minipar.Mesh()
    model = ShardedModule(GPT(GPTConfig(**CFG, **(model_cfg or {}))), mesh=mesh, strategy=strategy, **options)
    opt = model.build_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    total = None
    for step in range(3):
        x = torch.randint(0, CFG["vocab_size"], (2, 9), generator=gen)
        inner = getattr(opt, "optimizer", opt)
        steps = [s["step"] for s in inner.state.values() if "step" in s]
        with count_host_syncs(host_tensors=steps) as syncs:
            model.train_step(x[:, :-1], x[:, 1:], loss_fn)
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        if step == 1:
            total = syncs
        elif step > 1:
            total.calls.update(syncs.calls)
    return total


@interpreted
@pytest.mark.parametrize("strategy, options, model_cfg", [
    ("ddp", {}, None),
    ("zero1", dict(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)), None),
    ("zero2", {}, dict(norm="rmsnorm", mlp="swiglu", pos="rope", tie_weights=False)),
    ("zero3", dict(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)), None),
    ("zero3", dict(activation_checkpointing=True), None),
])
def test_a_training_step_on_one_device_waits_for_nothing(world_of_one, strategy, options, model_cfg):
    """The batch given on the host is checked there and copied to the device; the loss, backward,
    gradient sync, clipping (a global norm that stays a tensor) and the fused AdamW step read nothing
    back. (fp16's overflow check must read one flag per step: it is not on this path.)"""
    syncs = _steps(strategy, options, model_cfg=model_cfg)
    assert syncs.total == 0, syncs.report()


@interpreted
def test_a_step_that_reads_a_value_is_caught_where_it_reads(world_of_one):
    """The counter can fail the test above: a loss function that logs its value with .item() is one
    sync per step, reported at its line."""
    def logged_loss(logits, targets):
        loss = gpt_loss(logits, targets)
        print(f"loss {loss.item():.3f}")
        return loss

    syncs = _steps("ddp", {}, loss_fn=logged_loss)
    assert syncs.total == 2 and all("logged_loss" in where for _, where in syncs.calls), syncs.report()


def test_in_a_gpu_run_reads_of_cpu_tensors_are_not_counted():
    """device_only (what benchmarks/gpt_1gpu.py sets on a GPU): a CPU tensor is host memory there."""
    t = torch.tensor([1.0, 2.0])
    with count_host_syncs(device_only=True) as syncs:
        t.tolist()
        t[0].item()
        t[t > 1]
    assert syncs.total == 0, syncs.report()


def _steps_on_ranks(ctx, strategy: str, sizes: dict, options: dict):
    mesh = minipar.Mesh(**sizes)
    syncs = _steps(strategy, options, mesh=mesh, seed=ctx.rank)
    mesh.destroy()
    return syncs.report() if syncs.total else ""


@interpreted
@pytest.mark.parametrize("strategy, sizes, options", [
    ("ddp", {}, {}),
    ("zero3", {}, dict(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))),
    ("zero1", dict(pp=2), dict(schedule="1f1b", microbatches=2)),
])
def test_a_training_step_on_several_ranks_waits_for_nothing(pools, strategy, sizes, options):
    """Host batches on 2 ranks: the batch check agrees its verdict on the host (Mesh.host_world), the
    gradient sync, the loss and the norm stay tensors on the device, so no rank waits for it."""
    for rank, report in enumerate(pools.run(2, _steps_on_ranks, strategy, sizes, options)):
        assert report == "", f"rank {rank}: {report}"
