"""When the ZeRO stages communicate, and what they hold while doing it.

* zero1 and zero2 reduce-scatter gradient buckets *during* backward, as DDP all-reduces them:
  the first reduce-scatter is issued before the first block's backward runs.
* zero2 and zero3 never hold the whole gradient: the full-size staging buffers alive at any
  moment of backward stay within the in-flight window plus the groups still filling.
* zero3 prefetches: from the second step on, the next unit's all-gather is already in flight
  when a unit starts its forward, and the previous unit's when a unit starts its backward.
* zero1's accumulation: any mix of no_sync and synchronising backwards before a step gives the
  gradient of their sum (a step after only no_sync backwards reduces then); its persistent
  buckets, reduce-scattered in place, forget everything at zero_grad.
"""

from __future__ import annotations

import pytest
import torch

from minipar import Mesh, ShardedModule
from minipar.models import GPT, GPTConfig, gpt_loss

CFG = dict(vocab_size=50, block_size=8, n_layer=3, n_head=2, n_embd=16)


def _reduce_scatters_during_backward(ctx, strategy):
    mesh = Mesh()
    model = GPT(GPTConfig(**CFG))
    sharded = ShardedModule(model, mesh=mesh, strategy=strategy, bucket_cap_mb=1e-6)  # a bucket per parameter
    before_first_block = []
    # The first block's backward runs near the very end: only its own and the embeddings' gradients follow.
    model.layers[0].register_full_backward_pre_hook(
        lambda mod, grad_out: before_first_block.append(stats.calls(op="reduce_scatter", tag="grad")))
    x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device)
    with mesh.comm.counting() as stats:
        gpt_loss(sharded(x[:, :-1]), x[:, 1:]).backward()
    mesh.destroy()
    return before_first_block, stats.calls(op="reduce_scatter", tag="grad")


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_reduce_scatter_overlaps_backward(pools, strategy):
    for before, total in pools.run(2, _reduce_scatters_during_backward, strategy):
        assert len(before) == 1
        assert 0 < before[0] < total, (before, total)


def _staged_bytes(ctx, strategy):
    """The largest number of staged gradient elements alive at any post-accumulate-grad hook."""
    mesh = Mesh()
    model = GPT(GPTConfig(**{**CFG, "n_layer": 6}, tie_weights=False))
    sharded = ShardedModule(model, mesh=mesh, strategy=strategy, bucket_cap_mb=1e-6)
    state = sharded.strategy
    stagings = state.buckets if strategy == "zero2" else [part.grads for u in state.units for part in u.parts]
    # What may be alive at once: the two in flight and the one filling; for zero3 also the root
    # unit, whose parameters (head, final norm, embeddings) get gradients first and last.
    root = [part.grads for u in state.units if u.is_root for part in u.parts] if strategy == "zero3" else []
    sizes = sorted(s.group.layout.padded for s in stagings if s not in root)
    bound = sum(sizes[-3:]) + sum(s.group.layout.padded for s in root)
    peak = [0]

    def record(p):
        alive = sum(s._flat.numel() for s in stagings if s._flat is not None)
        peak[0] = max(peak[0], alive)
    # Registered after the strategy's own hooks, so each sees the state right after the strategy acted.
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(record)
    x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device)
    gpt_loss(sharded(x[:, :-1]), x[:, 1:]).backward()
    total = sum(g.layout.padded for g in state.groups)
    alive_after = sum(s._flat.numel() for s in stagings if s._flat is not None)
    mesh.destroy()
    return peak[0], total, bound, alive_after


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_the_full_gradient_is_never_held(pools, strategy):
    """With a bucket per parameter (zero2) or a unit per block (zero3) of a 6-layer GPT, the staged
    gradient never exceeds the in-flight window of 2 groups plus the one filling (plus, for zero3,
    the root unit), well below the whole gradient; nothing is staged once backward has returned."""
    for peak, total, bound, alive_after in pools.run(2, _staged_bytes, strategy):
        assert alive_after == 0
        assert 0 < peak <= bound, (peak, bound)
        assert peak < 0.6 * total, (peak, total)


def _prefetch(ctx):
    mesh = Mesh()
    model = GPT(GPTConfig(**CFG))
    sharded = ShardedModule(model, mesh=mesh, strategy="zero3")
    units = {u.module: u for u in sharded.strategy.units}
    blocks = list(model.layers)
    seen = []
    for i, block in enumerate(blocks):
        nxt = units[blocks[i + 1]] if i + 1 < len(blocks) else None
        prev = units[blocks[i - 1]] if i > 0 else None
        # forward hooks run after the strategy's pre-forward (registered first): it has launched the prefetch
        block.register_forward_hook(lambda m, a, o, n=nxt: seen.append(("fwd", n.state.value if n else None)))
        block.register_full_backward_hook(lambda m, gi, go, p=prev: seen.append(("bwd", p.state.value if p else None)))
    for step in range(2):
        seen.clear()
        x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(step)).to(ctx.device)
        gpt_loss(sharded(x[:, :-1]), x[:, 1:]).backward()
    mesh.destroy()
    return seen


def test_zero3_prefetches_the_next_unit(pools):
    """Second step: when block i finishes its forward, block i+1 is already being gathered (or
    gathered); when block i finishes its backward, block i-1 is too (its gather was launched at
    block i's pre-backward)."""
    for seen in pools.run(2, _prefetch):
        fwd = [s for kind, s in seen if kind == "fwd" and s is not None]
        bwd = [s for kind, s in seen if kind == "bwd" and s is not None]
        assert len(fwd) == 2 and len(bwd) == 2, seen
        assert all(s in ("gathering", "full") for s in fwd + bwd), seen


def _zero1_accumulation(ctx, pattern):
    """Gradient shards (gathered full) after the backwards of ``pattern`` ("n": no_sync, "s": sync)."""
    mesh = Mesh()
    model = GPT(GPTConfig(**CFG))
    sharded = ShardedModule(model, mesh=mesh, strategy="zero1", bucket_cap_mb=1e-3)
    gen = torch.Generator().manual_seed(10 + ctx.rank)
    for kind in pattern:
        x = torch.randint(0, 50, (2, 9), generator=gen).to(ctx.device)
        if kind == "n":
            with sharded.no_sync():
                gpt_loss(sharded(x[:, :-1]), x[:, 1:]).backward()
        else:
            gpt_loss(sharded(x[:, :-1]), x[:, 1:]).backward()
    grads = sharded.strategy.full_grads()
    out = {n: grads[id(p)].cpu() for n, p in model.named_parameters()}
    mesh.destroy()
    return out


def _reference_grads(pattern, world):
    model = GPT(GPTConfig(**CFG))
    gens = [torch.Generator().manual_seed(10 + r) for r in range(world)]
    for _ in pattern:
        for r in range(world):
            x = torch.randint(0, 50, (2, 9), generator=gens[r])
            (gpt_loss(model(x[:, :-1]), x[:, 1:]) / world).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("pattern", ["s", "ns", "nns", "sn", "ss", "nn", "sns"])
def test_zero1_accumulates_any_mix_of_no_sync_and_sync(pools, pattern):
    """Whatever the sequence of no_sync ("n") and synchronising ("s") backwards, the reduced
    gradient before the step is the mean over ranks of the sum of all of them."""
    want = _reference_grads(pattern, 2)
    for rank, got in enumerate(pools.run(2, _zero1_accumulation, pattern)):
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, msg=lambda m: f"rank {rank} {k} after {pattern!r}: {m}")


class _TwoPaths(torch.nn.Module):
    """Uses ``b`` only when asked: a parameter with a gradient in one backward and none in the next."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b = torch.nn.Linear(5, 7), torch.nn.Linear(7, 7)

    def forward(self, x, use_b: bool):
        h = self.a(x)
        return (self.b(h) if use_b else h).pow(2).sum()


def _zero1_events(ctx, events):
    """Full reduced gradients after ``events``: "S"/"s" synchronising backward with/without ``b``,
    "N"/"n" the same under no_sync, "z" zero_grad. Each rank draws its own inputs."""
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    mesh = Mesh()
    model = _TwoPaths()
    sharded = ShardedModule(model, mesh=mesh, strategy="zero1", bucket_cap_mb=1e-4)
    for e in events:
        if e == "z":
            sharded.strategy.zero_grad()
            continue
        x = torch.randn(3, 5, generator=gen).to(ctx.device)
        if e in "Nn":
            with sharded.no_sync():
                sharded(x, e == "N").backward()
        else:
            sharded(x, e == "S").backward()
    grads = sharded.strategy.full_grads()
    out = {n: grads[id(p)].cpu() for n, p in model.named_parameters()}
    mesh.destroy()
    return out


@pytest.mark.parametrize("events", ["SzS", "Szs", "SsS", "Ss", "NzS", "Nzs", "SNs", "SzN", "sSzn", "SzsS"])
def test_zero1_buckets_forget_at_zero_grad_and_accumulate_otherwise(pools, events):
    """ZeRO-1 keeps the full gradient in persistent buckets that are reduce-scattered in place and
    overwritten after zero_grad: a parameter used before zero_grad and unused after it must show a
    zero gradient, not the stale one; without zero_grad, backwards add up (sync or no_sync)."""
    world = 2
    model = _TwoPaths()
    gens = [torch.Generator().manual_seed(100 + r) for r in range(world)]
    for e in events:
        if e == "z":
            model.zero_grad()
            continue
        for r in range(world):
            (model(torch.randn(3, 5, generator=gens[r]), e in "SN") / world).backward()
    want = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    for rank, got in enumerate(pools.run(world, _zero1_events, events)):
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, msg=lambda m: f"rank {rank} {k} after {events!r}: {m}")


def _nan_then_clean(ctx):
    from minipar import MixedPrecision
    mesh = Mesh()
    torch.manual_seed(0)
    model = ShardedModule(torch.nn.Linear(2, 1), mesh=mesh, strategy="zero1",  # 3 elements: padded to 4
                          mixed_precision=MixedPrecision(param_dtype=torch.float16))
    opt = model.build_optimizer(torch.optim.SGD, lr=0.1)
    scaler, stepped = model.strategy.scaler, []
    for step in range(4):
        loss = model(torch.ones(4, 2, dtype=torch.float16).to(ctx.device)).float().mean() * scaler.scale
        (loss * float("nan") if step == 0 else loss).backward()  # one bad batch, then clean ones
        model.clip_grad_norm_(1.0)  # a nan norm: the coefficient is nan too
        stepped.append(opt.step())
        opt.zero_grad()
    mesh.destroy()
    return stepped


def test_zero1_recovers_from_a_nan_step(pools):
    """fp16: a nan gradient skips that step only. Clipping by a nan norm must not leave nan in the
    buckets' padding, where no later gradient would overwrite it and every step would be skipped."""
    for stepped in pools.run(2, _nan_then_clean):
        assert stepped == [False, True, True, True], stepped


def _module_zero_grad(ctx, strategy):
    mesh = Mesh()
    torch.manual_seed(0)
    model = ShardedModule(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)), mesh=mesh,
                          strategy=strategy)
    gen = torch.Generator().manual_seed(ctx.rank)
    model(torch.randn(2, 3, generator=gen).to(ctx.device)).pow(2).sum().backward()
    model.zero_grad()  # the module's, not the optimizer's
    x = torch.randn(2, 3, generator=gen).to(ctx.device)
    model(x).pow(2).sum().backward()
    grads = model.strategy.full_grads()
    out = {n: grads[id(p)].cpu() for n, p in model.module.named_parameters()}
    mesh.destroy()
    return out


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_the_modules_zero_grad_clears_the_shards_too(pools, strategy):
    """ShardedModule.zero_grad clears what ZeRO keeps outside p.grad (ZeRO-1's buckets, the gradient
    shards), as the optimizer's zero_grad does: the next gradient is the second backward's alone."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    gens = [torch.Generator().manual_seed(r) for r in range(2)]
    for g in gens:
        torch.randn(2, 3, generator=g)  # the first backward's input, forgotten by zero_grad
    for g in gens:
        (ref(torch.randn(2, 3, generator=g)).pow(2).sum() / 2).backward()
    for rank, got in enumerate(pools.run(2, _module_zero_grad, strategy)):
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n], p.grad, msg=lambda m: f"rank {rank} {strategy} {n}: {m}")
