"""Activation checkpointing (``ShardedModule(activation_checkpointing=...)``, `minipar.recompute`).

For every strategy and layout, recomputing the transformer blocks in backward changes nothing but
memory: with dropout on, three clipped AdamW steps give bit-for-bit the losses, gradient norms and
parameters of the same run without it (the dropout masks are replayed, the strategies' gradient
hooks fire once). A negative control shows that the comparison notices masks that are *not*
replayed. The activations autograd keeps are measured: recomputation keeps fewer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from minipar import Mesh, ShardedModule, recompute
from minipar.models import GPT, MLP, GPTConfig, MoEGPT, MoEGPTConfig, gpt_loss
from minipar.recompute import ActivationMemory

from helpers import EPS, LR, WD, train_rows

MAX_NORM = 0.05  # below every gradient norm here: clipping fires


def _cfg(moe: bool = False, **kw) -> dict:
    cfg = dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.2, seed=5)
    if moe:
        cfg.update(n_experts=4, top_k=2, capacity_factor=1.0)
    return {**cfg, **kw}


def _run(ctx, layout: dict, strategy: str, cfg: dict, data: torch.Tensor, ckpt, sp: bool, moe: bool):
    """Three steps on this rank's rows; (losses, gradient norms, full state dict)."""
    torch.manual_seed(100 + ctx.rank)  # each rank's dropout stream, the same with and without ckpt
    mesh = Mesh(**layout)
    net = MoEGPT(MoEGPTConfig(**cfg)) if moe else GPT(GPTConfig(**cfg))
    extra = dict(microbatches=2) if mesh.pp > 1 else {}
    model = ShardedModule(net, mesh=mesh, strategy=strategy, bucket_cap_mb=1e-3, sequence_parallel=sp,
                          activation_checkpointing=ckpt, **extra)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    losses, norms = train_rows(model, opt, data, MAX_NORM)
    state = {k: v.cpu() for k, v in model.full_state_dict().items()}
    checkpointed = model.checkpointed
    mesh.destroy()
    return losses, norms, state, checkpointed


def _both(ctx, layout, strategy, cfg, data, sp, moe):
    return [_run(ctx, layout, strategy, cfg, data, ckpt, sp, moe) for ckpt in (False, True)]


LAYOUTS = [
    (1, {}, "ddp", False, False), (2, {}, "ddp", False, False), (2, {}, "zero1", False, False),
    (2, {}, "zero2", False, False), (2, {}, "zero3", False, False), (2, {"tp": 2}, "ddp", True, False),
    (4, {"tp": 2}, "zero3", False, False), (2, {"pp": 2}, "ddp", False, False),
    (4, {"dp": 2, "pp": 2}, "zero1", False, False), (4, {"dp": 2, "tp": 2, "pp": 1}, "zero2", True, False),
    (2, {"ep": 2}, "ddp", False, True),
]


@pytest.mark.parametrize("world, layout, strategy, sp, moe", LAYOUTS,
                         ids=[f"{s}-w{w}-{'x'.join(f'{k}{v}' for k, v in l.items()) or 'dp'}"
                              f"{'-sp' if sp else ''}{'-moe' if m else ''}" for w, l, s, sp, m in LAYOUTS])
def test_recompute_changes_nothing_but_memory(pools, world, layout, strategy, sp, moe):
    """With dropout, the checkpointed run equals the plain one bit for bit on every rank: losses,
    gradient norms (clipping fires) and parameters after three AdamW steps."""
    cfg = _cfg(moe)
    dp = world // (layout.get("tp", 1) * layout.get("pp", 1))
    data = torch.randint(0, 16, (3, dp * 4, 9), generator=torch.Generator().manual_seed(6))
    for rank, ((losses, norms, state, none), (c_losses, c_norms, c_state, chosen)) in \
            enumerate(pools.run(world, _both, layout, strategy, cfg, data, sp, moe)):
        assert none == [] and chosen, (rank, chosen)  # the blocks this rank holds were checkpointed
        assert min(norms) > MAX_NORM
        assert c_losses == losses, (rank, c_losses, losses)
        assert c_norms == norms, (rank, c_norms, norms)
        for k, v in state.items():
            assert torch.equal(c_state[k], v), f"rank {rank}: {k} differs with activation checkpointing"


def test_a_recompute_without_replayed_masks_would_be_caught(monkeypatch):
    """Negative control: if the recompute drew fresh dropout masks, the gradients would differ from
    the plain run's, so the comparison above can fail."""
    cfg, x = GPTConfig(**_cfg()), torch.randint(0, 16, (4, 9), generator=torch.Generator().manual_seed(1))

    def grads(replay: bool):
        torch.manual_seed(0)
        model = GPT(cfg)
        recompute.checkpoint_modules(model, True, torch.device("cpu"))
        if not replay:
            monkeypatch.setattr(recompute.RNGStreams, "replay", lambda self, snap: torch.enable_grad())
        gpt_loss(model(x[:, :-1]), x[:, 1:]).backward()
        monkeypatch.undo()
        return [p.grad.clone() for p in model.parameters()]

    torch.manual_seed(0)
    plain = GPT(cfg)
    gpt_loss(plain(x[:, :-1]), x[:, 1:]).backward()
    want = [p.grad for p in plain.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads(replay=True), want))
    assert not all(torch.equal(a, b) for a, b in zip(grads(replay=False), want))


def _peak(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    with ActivationMemory(model.parameters()) as mem:
        loss = gpt_loss(model(x[:, :-1]), x[:, 1:])
        mem.mark_forward_done()
        loss.backward()
    return mem.after_forward_bytes, mem.peak_bytes


def test_recompute_keeps_fewer_activations():
    """Measured with the saved-tensor meter on an 8-layer GPT: after forward a checkpointed model
    holds little more than each block's input, and its peak over backward (which includes one
    block's recomputed activations) is far below the plain model's."""
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=8, n_head=4, n_embd=64, dropout=0.1)
    x = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(2))
    plain_fwd, plain_peak = _peak(GPT(cfg), x)
    model = GPT(cfg)
    assert len(recompute.checkpoint_modules(model, True, torch.device("cpu"))) == cfg.n_layer
    ckpt_fwd, ckpt_peak = _peak(model, x)
    block_input = 4 * 32 * 64 * 4  # batch x seq x n_embd fp32 bytes
    print(f"activation bytes after forward {plain_fwd:,} -> {ckpt_fwd:,}; peak {plain_peak:,} -> {ckpt_peak:,}")
    assert ckpt_fwd < plain_fwd / 3
    assert ckpt_peak < plain_peak / 2
    # What a checkpointed model keeps: the blocks' inputs plus the embeddings, final norm and head.
    assert ckpt_fwd >= cfg.n_layer * block_input


def _bad(ctx, kwargs):
    with pytest.raises(ValueError) as info:
        ShardedModule(GPT(GPTConfig(**_cfg())), mesh=Mesh(), **kwargs)
    return str(info.value)


@pytest.mark.parametrize("kwargs, match", [
    (dict(activation_checkpointing="blocks"), "is not understood"),
    (dict(activation_checkpointing=(nn.GRU,)), "activation_checkpointing (module classes ['GRU']) matches no"),
    (dict(strategy="zero3", wrap_policy=(MLP,), activation_checkpointing=True), "lie inside the checkpointed module"),
])
def test_bad_checkpointing_policies_raise_on_every_rank(pools, kwargs, match):
    for msg in pools.run(2, _bad, kwargs):
        assert match in msg, msg
