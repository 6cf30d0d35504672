"""A wrapped model is freed when its last reference goes, under every strategy.

Strategies hook the parameters they hold. A hook lives as long as its parameter, so a hook that
held its strategy strongly would close a cycle through a tensor, which Python's collector does not
break: every ShardedModule built in a process, with its model, its optimizer state and the threads
of its mesh's process groups, would stay for the life of the process (seen as hundreds of gloo
threads per rank in the test pools). Here each layout is built, trained one step and dropped; after
one collection nothing of it may remain. And the model must not be trained without its wrapper: a
gradient reaching a parameter whose strategy is gone raises, instead of silently skipping the sync.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from minipar import Mesh, ShardedModule
from minipar.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig, gpt_loss

CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)

# (world, mesh sizes, ShardedModule options, MoE) -- every strategy alone, and the strategies under
# tensor, pipeline and expert parallelism, where the layers add hooks of their own.
LAYOUTS = {
    "ddp": (2, {}, dict(strategy="ddp"), False),
    "zero1": (2, {}, dict(strategy="zero1"), False),
    "zero2": (2, {}, dict(strategy="zero2"), False),
    "zero3": (2, {}, dict(strategy="zero3"), False),
    "zero3-tp2sp": (4, dict(tp=2), dict(strategy="zero3", sequence_parallel=True), False),
    "zero1-pp2-1f1b": (4, dict(pp=2), dict(strategy="zero1", schedule="1f1b", microbatches=2), False),
    "zero2-moe-ep2": (4, dict(ep=2), dict(strategy="zero2"), True),
}


def _build_train_drop(ctx, sizes: dict, options: dict, moe: bool):
    def build():
        mesh = Mesh(**sizes)
        inner = MoEGPT(MoEGPTConfig(**CFG, n_experts=4)) if moe else GPT(GPTConfig(**CFG))
        model = ShardedModule(inner, mesh=mesh, **options)
        opt = model.build_optimizer(torch.optim.AdamW, lr=1e-3)
        x = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(ctx.rank))
        model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy)  # vocab-parallel under tp
        model.clip_grad_norm_(1.0)
        opt.step()
        mesh.destroy()
        return [weakref.ref(o) for o in (inner, model, opt, mesh)]

    refs = build()
    gc.collect()
    return [r() is not None for r in refs]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_dropped_model_is_freed(pools, layout):
    world, sizes, options, moe = LAYOUTS[layout]
    for rank, alive in enumerate(pools.run(world, _build_train_drop, sizes, options, moe)):
        left = [what for what, a in zip(("the model", "the ShardedModule", "its optimizer", "the mesh"), alive) if a]
        assert not left, f"rank {rank}, {layout}: {', '.join(left)} outlived every reference"


def _train_without_the_wrapper(ctx, strategy: str):
    inner = GPT(GPTConfig(**CFG))
    ShardedModule(inner, mesh=Mesh(), strategy=strategy)  # dropped at once: its hooks stay on the parameters
    gc.collect()
    x = torch.randint(0, 32, (2, 9))
    try:
        gpt_loss(inner(x[:, :-1]), x[:, 1:]).backward()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_training_a_model_whose_wrapper_is_gone_raises(pools, strategy):
    """(zero3 is not listed: its parameters are views of a buffer the strategy owns, empty without it.)"""
    for rank, message in enumerate(pools.run(2, _train_without_the_wrapper, strategy)):
        assert message is not None and "keep the ShardedModule" in message, f"rank {rank}: {message!r}"


def _rewrapped(ctx, first: str, second: str, rewrap: bool):
    inner = GPT(GPTConfig(**CFG))
    if rewrap:
        ShardedModule(inner, mesh=Mesh(), strategy=first)  # dropped: its hooks stay, stale
        gc.collect()
    model = ShardedModule(inner, mesh=Mesh(), strategy=second)
    opt = model.build_optimizer(torch.optim.AdamW, lr=1e-2)
    gen = torch.Generator().manual_seed(ctx.rank)
    losses = []
    for _ in range(2):
        x = torch.randint(0, 32, (2, 9), generator=gen)
        losses.append(model.train_step(x[:, :-1], x[:, 1:], gpt_loss).item())
        model.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.clone() for k, v in model.full_state_dict().items()}


@pytest.mark.parametrize("first, second", [("ddp", "zero1"), ("zero1", "ddp"), ("zero2", "zero3")])
def test_a_model_wrapped_again_trains_as_if_wrapped_once(pools, first, second):
    """The first wrapper's hooks stay on the parameters when it is dropped; once another strategy has
    adopted them they are stale and do nothing: training equals a model wrapped once. (Not after
    zero3, which keeps the values in its shards: see the next test.)"""
    for rank, ((losses, state), (ref_losses, ref_state)) in enumerate(
            zip(pools.run(2, _rewrapped, first, second, True), pools.run(2, _rewrapped, first, second, False))):
        assert losses == ref_losses, (rank, losses, ref_losses)
        for k in ref_state:
            assert torch.equal(state[k], ref_state[k]), (rank, k)


def _wrap_after_zero3(ctx):
    inner = GPT(GPTConfig(**CFG))
    ShardedModule(inner, mesh=Mesh(), strategy="zero3")
    try:
        ShardedModule(inner, mesh=Mesh(), strategy="ddp")
    except ValueError as e:
        return str(e)
    return None


def test_wrapping_a_model_a_zero3_wrapper_sharded_raises_on_every_rank(pools):
    """Its parameters are views of the wrapper's gathered buffer, empty while sharded: broadcasting them
    crashed gloo ("Bad address"); now every rank raises with the fix, before any collective on them."""
    for rank, message in enumerate(pools.run(2, _wrap_after_zero3)):
        assert message is not None and "have no storage" in message and "Wrap a fresh model" in message, \
            f"rank {rank}: {message!r}"
