"""ZeRO-1, ZeRO-2 and ZeRO-3: for every stage and any GPT shape, world size, accumulation count,
clipping norm and precision, the sharded run equals the single-process run on the global batch.

The reference is the same model from the same seed, trained in this process. Under mixed precision
it performs the same casts and roundings the ranks do: each rank's chunk of the batch goes through a
bf16 copy of the fp32 master weights; what a rank reduces (every backward's gradient for zero2/3,
the accumulated p.grad for zero1) is cast to the reduce dtype and divided by the world size; the
ranks' pieces are summed and the sums accumulated in the reduce dtype; clipping scales the reduced
gradient in the reduce dtype; AdamW steps the fp32 master. When every backward of a zero1 step
synchronises, a later one adds each rank's piece onto the slice it owns (which holds the sum so far)
before the reduction; the reference adds in that order, element by element as the ranks own them.

A bf16 reduction rounds after every addition, in an order the backend chooses (gloo's ring, NCCL's
ring or tree, different per chunk), so the reference reproduces it only for one or two ranks: a sum
of two is one rounding whatever the order. bf16 reduction is therefore drawn with worlds of 1 and 2.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import example, given, strategies as st

from minipar import Mesh, MixedPrecision, ShardedModule
from minipar.plan import formulas
from minipar.models import GPT, Block, GPTConfig, gpt_loss

from conftest import ci_examples
from helpers import EPS, LR, WD, accumulated_step, batches

PRECISIONS = {
    "fp32": None,
    "bf16": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16_bf16": MixedPrecision(param_dtype=torch.bfloat16),  # bf16 gradients too, as the ZeRO paper counts
}


def _named(module: nn.Module, full: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: full[id(p)].cpu().clone() for n, p in module.named_parameters()}


def _cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A rank's tensors brought back to the CPU before they are returned (under nccl they live on its GPU)."""
    return {k: v.cpu() for k, v in state.items()}


def _train_sharded(ctx, strategy, cfg, data, local_bs, precision, offload, max_norm, norm_type, wrap, sync_all):
    # Built on the CPU, moved to ctx.device by ShardedModule; accumulated_step moves the inputs.
    model = GPT(GPTConfig(**{**cfg, "seed": cfg["seed"] + ctx.rank}))  # rank 0's weights must win
    mesh = Mesh()
    wrap_policy = {"blocks": None, "block_class": (Block,), "size": 200}[wrap] if strategy == "zero3" else None
    sharded = ShardedModule(model, mesh=mesh, strategy=strategy, bucket_cap_mb=1e-3,
                            mixed_precision=PRECISIONS[precision], cpu_offload=offload, wrap_policy=wrap_policy)
    opt = sharded.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    steps = data.shape[0]
    rows = slice(ctx.rank * local_bs, (ctx.rank + 1) * local_bs)
    losses, norms = [], []
    for s in range(steps):
        step_loss = accumulated_step(sharded, data[s], rows, ctx.device, sync_all)
        if s == steps - 1:  # the last step's reduced gradients, the ones compared (gathering costs collectives)
            grads = _named(model, sharded.strategy.full_grads())
        norms.append(sharded.clip_grad_norm_(max_norm, norm_type).item())
        opt.step()
        opt.zero_grad()
        losses.append(step_loss)
    return losses, norms, grads, _cpu(sharded.full_state_dict()), _owners(model, sharded.strategy)


def _owners(model: nn.Module, state) -> dict[str, torch.Tensor]:
    """{name: the rank whose gradient shard holds each element of that parameter} (shaped like it)."""
    owner = {}
    for g in state.groups:
        for p in g.layout.params:
            a, b = g.layout.span(p)
            owner[id(p)] = (torch.arange(a, b) // g.layout.shard_size).view(p.shape)
    return {n: owner[id(p)] for n, p in model.named_parameters()}


def _train_reference(strategy, cfg, data, world, precision, max_norm, norm_type, sync_all=False, owners=None):
    master = GPT(GPTConfig(**cfg))
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    policy = PRECISIONS[precision]
    losses, norms = [], []
    for s in range(data.shape[0]):
        if policy is None:
            x = data[s].flatten(0, 1)
            loss = gpt_loss(master(x[:, :-1]), x[:, 1:])
            loss.backward()
            losses.append(loss.item())
            grads = {n: p.grad.clone() for n, p in master.named_parameters()}
            norms.append(torch.nn.utils.clip_grad_norm_(master.parameters(), max_norm, norm_type).item())
        else:
            reduced, step_loss = _mixed_precision_gradient(strategy, master, data[s], world, policy, sync_all, owners)
            losses.append(step_loss)
            grads = {n: g.float() for n, g in reduced.items()}
            # Clipping as the shards do it: the norm in fp32, the coefficient applied in the reduce dtype.
            norm = torch.nn.utils.get_total_norm(list(grads.values()), norm_type)
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for n, p in master.named_parameters():
                p.grad = (reduced[n] * coef.to(policy.grad_dtype)).float()
            norms.append(norm.item())
        opt.step()
        opt.zero_grad()
    return losses, norms, grads, master.state_dict()


def _mixed_precision_gradient(strategy, master, step_data, world, policy, sync_all, owners):
    """The data-parallel mean gradient of one step, in the reduce dtype, as the ranks compute it,
    and the step's global loss. step_data: (accum, world * local_bs, seq + 1); owners: `_owners`."""
    compute = copy.deepcopy(master).to(policy.param_dtype)
    accum = step_data.shape[0]
    # sent[r][k]: what rank r contributes to reduction k, divided by the world size. zero2/3 reduce
    # every backward's gradient; zero1 accumulates in p.grad (compute dtype) and reduces once,
    # unless every backward synchronises (sync_all): then it too reduces each one.
    per_backward = strategy != "zero1" or sync_all
    sent: list[list[dict[str, torch.Tensor]]] = []
    step_loss = 0.0
    for chunk in step_data.view(accum, world, -1, step_data.shape[-1]).unbind(1):  # rank r's micro-batches
        compute.zero_grad()
        sent.append([])
        for a in range(accum):  # one rank's micro-batches, as that rank runs them
            x = chunk[a]
            loss = gpt_loss(compute(x[:, :-1]), x[:, 1:]) / accum
            loss.backward()
            step_loss += loss.item() / world
            if per_backward:
                sent[-1].append({n: p.grad.to(policy.grad_dtype) / world for n, p in compute.named_parameters()})
                compute.zero_grad()
        if not per_backward:
            sent[-1].append({n: p.grad.to(policy.grad_dtype) / world for n, p in compute.named_parameters()})
    # Each reduction sums the ranks' pieces in the reduce dtype; the reduced gradients accumulate in
    # the gradient shard, also in the reduce dtype (zero1 reducing once: its shard is that sum).
    reduced = {n: torch.zeros_like(p, dtype=policy.grad_dtype) for n, p in master.named_parameters()}
    onto_own_slice = strategy == "zero1" and sync_all  # see the module docstring
    for k in range(len(sent[0])):
        for n in reduced:
            pieces = [sent[r][k][n] for r in range(world)]
            if onto_own_slice:
                pieces = [torch.where(owners[n] == r, reduced[n] + x, x) for r, x in enumerate(pieces)]
            summed = pieces[0]
            for x in pieces[1:]:
                summed = summed + x
            reduced[n] = summed if onto_own_slice else reduced[n] + summed
    return reduced, step_loss


@st.composite
def zero_cases(draw):
    n_head = draw(st.integers(1, 2))
    seq = draw(st.integers(1, 6))
    precision = draw(st.sampled_from(list(PRECISIONS)))  # fp32 first: failures shrink towards it
    # bf16 reduction: only worlds whose reduction order the reference reproduces (module docstring).
    world = draw(st.integers(1, 2 if precision == "bf16_bf16" else 4))
    # Reshaping the global batch into per-rank chunks needs world | rows, which _batches guarantees.
    return dict(
        cfg=dict(vocab_size=draw(st.integers(5, 61)), block_size=seq, n_layer=draw(st.integers(1, 2)),
                 n_head=n_head, n_embd=n_head * draw(st.sampled_from([4, 8])), bias=draw(st.booleans()),
                 tie_weights=draw(st.booleans()), seed=draw(st.integers(0, 2**16))),
        world=world, local_bs=draw(st.integers(1, 3)), accum=draw(st.integers(1, 2)), seq=seq,
        sync_all=draw(st.booleans()),  # every micro-batch's backward synchronises (no no_sync)
        precision=precision, offload=draw(st.booleans()),
        norm_type=draw(st.sampled_from([1.0, 2.0, math.inf])),
        wrap=draw(st.sampled_from(["blocks", "block_class", "size"])),  # used by zero3 only
        data_seed=draw(st.integers(0, 2**16)),
    )


_BASE = dict(cfg=dict(vocab_size=13, block_size=3, n_layer=2, n_head=1, n_embd=4, bias=True, tie_weights=True,
                      seed=5), local_bs=1, accum=2, seq=3, sync_all=False, offload=False, norm_type=2.0, wrap="blocks",
             data_seed=1)


# The examples run for every stage, so each stage meets every precision whatever hypothesis draws.
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@ci_examples(3)
@given(case=zero_cases())
@example(case={**_BASE, "world": 3, "precision": "fp32"})
@example(case={**_BASE, "world": 4, "precision": "bf16", "norm_type": math.inf})
@example(case={**_BASE, "world": 3, "precision": "bf16", "offload": True, "norm_type": 1.0})
@example(case={**_BASE, "world": 2, "precision": "bf16_bf16", "wrap": "size"})
@example(case={**_BASE, "world": 2, "precision": "bf16_bf16", "offload": True, "norm_type": math.inf,
               "cfg": {**_BASE["cfg"], "tie_weights": False}})
# Two synchronising backwards before zero_grad: the second adds onto the reduced shards.
@example(case={**_BASE, "world": 3, "precision": "fp32", "sync_all": True})
@example(case={**_BASE, "world": 2, "precision": "bf16_bf16", "sync_all": True, "norm_type": 1.0})
# The shapes the examples above hold fixed: one layer of two heads without biases, an untied head, 3
# rows a rank of 6 tokens, one backward a step, the block-class wrap; and one process.
@example(case={**_BASE, "world": 4, "precision": "fp32", "local_bs": 3, "accum": 1, "seq": 6, "norm_type": 1.0,
               "wrap": "block_class", "data_seed": 2, "cfg": dict(vocab_size=61, block_size=6, n_layer=1, n_head=2,
                                                                 n_embd=16, bias=False, tie_weights=False, seed=7)})
@example(case={**_BASE, "world": 1, "precision": "bf16", "local_bs": 2, "seq": 1, "sync_all": True,
               "norm_type": math.inf, "wrap": "size", "cfg": dict(vocab_size=5, block_size=1, n_layer=1, n_head=2,
                                                                 n_embd=8, bias=False, tie_weights=True, seed=9)})
def test_zero_equals_single_process(pools, strategy, case):
    """Three AdamW steps with clipping that fires: losses, gradient norms (types 1, 2, inf), gradients
    and parameters equal the reference (fp32 at fp32 tolerance; bf16 compute, with fp32 or bf16
    reduction, at bf16 tolerance), for each stage and sizes no world size divides, tied and untied
    heads, accumulation (under no_sync but the last micro-batch, or every backward synchronising,
    before one zero_grad), CPU offload and every wrap policy."""
    cfg, world = case["cfg"], case["world"]
    data = batches(case["data_seed"], 3, case["accum"], world, case["local_bs"], case["seq"], cfg["vocab_size"])
    max_norm = 0.02 if case["norm_type"] != 1.0 else 0.5
    results = pools.run(world, _train_sharded, strategy, cfg, data, case["local_bs"], case["precision"],
                        case["offload"], max_norm, case["norm_type"], case["wrap"], case["sync_all"])
    ref = _train_reference(strategy, cfg, data, world, case["precision"], max_norm, case["norm_type"],
                           case["sync_all"], results[0][4])
    assert max(ref[1]) > max_norm, "clipping must fire for this test to mean anything"
    tol = {} if case["precision"] == "fp32" else dict(rtol=1.6e-2, atol=1e-5)  # the defaults for fp32 / bf16
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    for rank, (losses, norms, grads, params, _) in enumerate(results):
        torch.testing.assert_close(f32(losses), f32(ref[0]), **tol, msg=lambda m: f"rank {rank} losses: {m}")
        torch.testing.assert_close(f32(norms), f32(ref[1]), **tol, msg=lambda m: f"rank {rank} norms: {m}")
        for name, g in ref[2].items():
            torch.testing.assert_close(grads[name], g, **tol, msg=lambda m: f"rank {rank} grad {name}: {m}")
        assert params.keys() == ref[3].keys()
        for name, p in ref[3].items():
            assert params[name].shape == p.shape  # no padding in the state dict
            torch.testing.assert_close(params[name], p, **tol, msg=lambda m: f"rank {rank} {name}: {m}")
            assert torch.equal(params[name], results[0][3][name])


# -- empty shards, tied weights split across units -----------------------------------


def _tiny_model() -> nn.Module:
    """5 elements: at world 4 the shards hold 2, 2, 1 and 0 of them (a partial and an empty shard)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 1), nn.Tanh(), nn.Linear(1, 1), nn.Tanh(), nn.Linear(1, 1, bias=False))


def _tiny(ctx, strategy):
    torch.manual_seed(0)
    model = _tiny_model()  # 6 elements in all
    mesh = Mesh()
    sharded = ShardedModule(model, mesh=mesh, strategy=strategy,
                            wrap_policy=(nn.Linear,) if strategy == "zero3" else None)
    opt = sharded.build_optimizer(torch.optim.AdamW, lr=0.1, weight_decay=WD, eps=EPS)
    xs = torch.linspace(-1, 1, 4 * ctx.world_size).view(-1, 1).to(ctx.device)
    for _ in range(3):
        x = xs.chunk(ctx.world_size)[ctx.rank]
        sharded.train_step(x, None, lambda out, _: out.pow(2).mean())
        opt.step()
        opt.zero_grad()
    real = [g.layout.real_len for g in sharded.strategy.groups]
    state_sizes = [v.numel() for st in opt.optimizer.state.values() for k, v in st.items() if k == "exp_avg"]
    return _cpu(sharded.full_state_dict()), real, state_sizes


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_empty_shards_work_and_padding_never_reaches_the_optimizer(pools, strategy):
    torch.manual_seed(0)
    ref = _tiny_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=WD, eps=EPS)
    xs = torch.linspace(-1, 1, 16).view(-1, 1)
    for _ in range(3):
        ref(xs).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    results = pools.run(4, _tiny, strategy)
    assert any(0 in real for _, real, _ in results), "some rank must hold an empty shard"
    assert sum(sum(real) for _, real, _ in results) == 5  # the real elements, each owned once
    assert sum(sum(sizes) for _, _, sizes in results) == 5  # optimizer state: no padding
    for sd, _, _ in results:
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(sd[k], v)


class TiedAcrossUnits(nn.Module):
    """An embedding and an output layer sharing one weight, each wrapped in its own unit."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.emb = nn.Embedding(7, 4)
        self.mid = nn.Linear(4, 4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.emb.weight
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, idx):
        return self.out(torch.tanh(self.mid(self.emb(idx))))


def _tied(ctx):
    mesh = Mesh()
    model = TiedAcrossUnits()
    sharded = ShardedModule(model, mesh=mesh, strategy="zero3", wrap_policy=(nn.Linear, nn.Embedding))
    units = {u.name: [id(p) for p in u.params] for u in sharded.strategy.units}
    opt = sharded.build_optimizer(torch.optim.AdamW, lr=0.05, weight_decay=WD, eps=EPS)
    idx = torch.arange(7).repeat(ctx.world_size, 2)[ctx.rank].view(1, -1).to(ctx.device)
    for _ in range(3):
        sharded.train_step(idx, idx, lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()))
        opt.step()
        opt.zero_grad()
    return units["<root>"] == [id(model.emb.weight)], _cpu(sharded.full_state_dict())


def test_tied_weight_in_two_units_goes_to_the_root(pools):
    ref = TiedAcrossUnits()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=WD, eps=EPS)
    idx = torch.arange(7).repeat(2, 2)
    for _ in range(3):
        nn.functional.cross_entropy(ref(idx).flatten(0, 1), idx.flatten()).backward()
        opt.step()
        opt.zero_grad()
    for in_root, sd in pools.run(2, _tied):
        assert in_root
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(sd[k], v)


# -- memory, communication, freeing ---------------------------------------------------


def _memory(ctx, strategy, precision):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    mesh = Mesh()
    sharded = ShardedModule(model, mesh=mesh, strategy=strategy, mixed_precision=PRECISIONS[precision],
                            wrap_policy=(nn.Linear,) if strategy == "zero3" else None)
    opt = sharded.build_optimizer(torch.optim.AdamW, lr=1e-3)
    x = torch.randn(8, 256).to(ctx.device)
    sharded.train_step(x, None, lambda out, _: out.float().pow(2).mean())
    opt.step()  # optimizer state now exists; memory_stats counts what persists past the step
    stats = sharded.memory_stats()
    return stats, sum(p.numel() for p in model.parameters())


FORMULAS = sorted([("ddp", "fp32"),  # minipar's DDP computes in the parameters' dtype: no bf16 row
                   ("zero1", "fp32"), ("zero2", "fp32"), ("zero3", "fp32"),
                   ("zero1", "bf16"), ("zero2", "bf16"), ("zero3", "bf16")])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy, precision", FORMULAS)
def test_memory_stats_match_the_formulas(pools, world, strategy, precision):
    """Per rank, params/grads/optimizer bytes are within 5% of the ZeRO paper's formulas
    (`minipar.plan.formulas.shard_formula`: bf16 2 + 2 + 12 bytes per parameter, fp32 Adam 4 + 4 + 8 with
    the master being the parameter; DDP holds all of it on every rank, the optimizer state of the
    optimizer build_optimizer made). tests/test_plan.py proves the exact figures, padding included."""
    param = 2 if precision == "bf16" else 4
    for stats, phi in pools.run(world, _memory, strategy, "bf16_bf16" if precision == "bf16" else "fp32"):
        formula = formulas.shard_formula(strategy, phi, world, param=param)
        expected = [formula["params"], formula["grads"], formula["optimizer"]]
        measured = [stats["params"], stats["grads"], stats["optimizer"]]
        for what, m, e in zip(("params", "grads", "optimizer"), measured, expected):
            assert abs(m - e) <= 0.05 * e, f"{what}: measured {m}, formula {e:.0f}"
        assert abs(sum(measured) - sum(expected)) <= 0.05 * sum(expected)



def _volume(ctx, strategy):
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])  # 216 elements: divisible by 1..4 ranks
    mesh = Mesh()
    sharded = ShardedModule(model, mesh=mesh, strategy=strategy, bucket_cap_mb=25.0,  # one bucket: 216 | n
                            wrap_policy=(nn.Linear,) if strategy == "zero3" else None)
    opt = sharded.build_optimizer(torch.optim.SGD, lr=0.1)
    x = torch.randn(4, 8).to(ctx.device)
    with mesh.comm.counting() as stats:
        sharded.train_step(x, None, lambda out, _: out.pow(2).mean())
        opt.step()
    return stats.wire_bytes(tag="grad") + stats.wire_bytes(tag="param"), stats.summary()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_communication_volume(pools, world):
    """Counted by the collective layer: zero1 and zero2 put on the wire exactly what DDP's all-reduce
    does; zero3 (every unit resharded after forward, nothing left in the root) 1.5x as much."""
    ddp = pools.run(world, _volume, "ddp")[0][0]
    phi_bytes = 216 * 4
    assert ddp == formulas.wire_bytes("all_reduce", world, phi_bytes)
    for strategy, factor in (("zero1", 1.0), ("zero2", 1.0), ("zero3", 1.5)):
        for wire, summary in pools.run(world, _volume, strategy):
            assert wire == pytest.approx(factor * ddp, rel=1e-9), (strategy, summary)


def _frees(ctx, reshard_after_forward):
    mesh = Mesh()
    model = GPT(GPTConfig(vocab_size=20, block_size=4, n_layer=3, n_head=2, n_embd=8))
    sharded = ShardedModule(model, mesh=mesh, strategy="zero3", reshard_after_forward=reshard_after_forward)
    seen = []
    for i, block in enumerate(model.layers):
        unit = next(u for u in sharded.strategy.units if u.module is block)
        block.register_forward_pre_hook(
            lambda m, a, u=unit: seen.append(("pre", u.name, u.state.value, u.full_bytes)))
        block.register_forward_hook(
            lambda m, a, o, u=unit: seen.append(("post", u.name, u.state.value, u.full_bytes)))
    x = torch.randint(0, 20, (2, 5)).to(ctx.device)
    with mesh.comm.counting() as stats:
        loss = gpt_loss(sharded(x[:, :-1]), x[:, 1:])
    after_forward = dict(sharded.strategy.unit_states())
    loss.backward()
    return seen, after_forward, dict(sharded.strategy.unit_states()), stats.calls(op="all_gather", tag="param")


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_zero3_frees_full_parameters_after_forward(pools, reshard_after_forward):
    for seen, after_fwd, after_bwd, gathers in pools.run(2, _frees, reshard_after_forward):
        pre = [s for s in seen if s[0] == "pre"]
        post = [s for s in seen if s[0] == "post"]
        assert len(pre) == len(post) == 3
        assert all(state == "full" and nbytes > 0 for _, _, state, nbytes in pre)
        if reshard_after_forward:
            assert all(state == "sharded" and nbytes == 0 for _, _, state, nbytes in post)
            assert [after_fwd[f"layers.{i}"] for i in range(3)] == ["sharded"] * 3
        else:
            assert all(state == "full" for _, _, state, _ in post)
        assert after_fwd["<root>"] == "full"  # the root stays gathered for backward
        assert set(after_bwd.values()) == {"sharded"}  # everything freed once backward is done
        assert gathers == 4  # root + three blocks in forward


# -- loss scaling, state dicts, bad input ---------------------------------------------


_FP16_CFG = dict(vocab_size=20, block_size=4, n_layer=1, n_head=2, n_embd=8)


def _fp16_batch(rank: int) -> torch.Tensor:
    return torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(rank))


def _fp16_overflow(ctx, strategy):
    mesh = Mesh()
    sharded = ShardedModule(GPT(GPTConfig(**_FP16_CFG)), mesh=mesh, strategy=strategy,
                            mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32,
                                                           init_scale=1024.0))
    # SGD, not Adam: Adam's update barely depends on the gradient's scale, so only SGD would notice
    # a loss scale that was never divided out.
    opt = sharded.build_optimizer(torch.optim.SGD, lr=0.1)
    x = _fp16_batch(ctx.rank).to(ctx.device)
    log, first_step = [], None
    for step in range(3):
        poison = step == 1 and ctx.rank == ctx.world_size - 1  # one rank overflows in step 1
        sharded.train_step(x[:, :-1], x[:, 1:], lambda out, y: gpt_loss(out, y) * (float("inf") if poison else 1.0))
        before = sharded.full_state_dict()
        stepped = opt.step()
        after = sharded.full_state_dict()
        first_step = first_step or after
        opt.zero_grad()
        log.append((stepped, sharded.strategy.scaler.scale, all(torch.equal(before[k], after[k]) for k in before)))
    return log, _cpu(first_step)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(pools, strategy):
    """fp16 with a dynamic loss scale: the first step equals a reference doing the same casts (fp16
    compute of the scaled loss per rank, fp32 reduction, scale divided out, fp32 SGD on the master);
    an inf on one rank skips the step on every rank and halves the scale everywhere."""
    master = GPT(GPTConfig(**_FP16_CFG))
    sums = {n: torch.zeros_like(p) for n, p in master.named_parameters()}
    for r in range(3):
        compute = copy.deepcopy(master).half()
        x = _fp16_batch(r)
        (gpt_loss(compute(x[:, :-1]), x[:, 1:]) * 1024.0).backward()
        for n, p in compute.named_parameters():
            sums[n] += p.grad.float() / 3
    for n, p in master.named_parameters():
        p.grad = sums[n] / 1024.0
    torch.optim.SGD(master.parameters(), lr=0.1).step()
    ref = master
    for log, first_step in pools.run(3, _fp16_overflow, strategy):
        assert log == [(True, 1024.0, False), (False, 512.0, True), (True, 512.0, False)]
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(first_step[k], v)


def _resume(ctx, strategy):
    mesh = Mesh()
    cfg = GPTConfig(vocab_size=23, block_size=4, n_layer=2, n_head=2, n_embd=8)
    data = torch.randint(0, 23, (4, 2, 5), generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device)

    def build(state=None):
        model = GPT(cfg)
        if state is not None:
            model.load_state_dict(state)
        sharded = ShardedModule(model, mesh=mesh, strategy=strategy)
        return sharded, sharded.build_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=WD)

    def step(sharded, opt, x):
        sharded.train_step(x[:, :-1], x[:, 1:], gpt_loss)
        opt.step()
        opt.zero_grad()

    a, opt_a = build()
    for s in range(2):
        step(a, opt_a, data[s])
    saved_model, saved_opt = a.full_state_dict(), copy.deepcopy(opt_a.state_dict())
    b, opt_b = build(saved_model)
    opt_b.load_state_dict(saved_opt)
    for s in range(2, 4):
        step(a, opt_a, data[s])
        step(b, opt_b, data[s])
    sa, sb = a.full_state_dict(), b.full_state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_optimizer_state_dict_round_trips(pools, strategy):
    """Save after two steps, load into a fresh ShardedModule: the next steps are bitwise identical."""
    assert pools.run(2, _resume, strategy) == [True, True]


def _where_state_lives(ctx, strategy, offload, precision):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    mesh = Mesh()
    sharded = ShardedModule(model, mesh=mesh, strategy=strategy, cpu_offload=offload,
                            mixed_precision=PRECISIONS[precision])
    opt = sharded.build_optimizer(torch.optim.AdamW, lr=0.1)
    sharded.train_step(torch.randn(4, 6).to(ctx.device), None, lambda out, _: out.float().pow(2).mean())
    opt.step()
    out = []
    for g in sharded.strategy.groups:
        state = opt.optimizer.state[g.master]
        out.append(dict(
            master=(g.master.device.type, g.master.dtype, g.master.data_ptr() == g.shard.data_ptr()),
            shard=(g.shard.device.type, g.shard.dtype),
            state={(v.device.type, v.dtype) for k, v in state.items() if k != "step"},
            # the compute shard received the stepped master (cast to the compute dtype)
            written=torch.equal(g.shard[:g.layout.real_len].cpu(), g.master.detach().to(g.shard.dtype).cpu())))
    mesh.destroy()
    return out, torch.device(ctx.device).type


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("offload, precision", [(True, "fp32"), (True, "bf16"), (False, "fp32"), (False, "bf16")])
def test_cpu_offload_keeps_masters_and_optimizer_state_on_the_cpu(pools, strategy, offload, precision):
    """cpu_offload: the fp32 masters and Adam's moments live on the CPU (a copy apart from the
    compute shard, which stays on the mesh's device), and the step writes the result back into the
    shard. Without offload, an fp32 master *is* the shard (no second copy) and everything stays on
    the device. (On this CPU-only machine the device is the CPU too; the copy-apart and write-back
    checks still bite, and a GPU run checks the placement.)"""
    compute = torch.float32 if precision == "fp32" else torch.bfloat16
    for groups, device in pools.run(2, _where_state_lives, strategy, offload, precision):
        assert groups
        for g in groups:
            opt_device = "cpu" if offload else device
            assert g["master"] == (opt_device, torch.float32, not offload and precision == "fp32"), g
            assert g["shard"] == (device, compute), g
            assert g["state"] == {(opt_device, torch.float32)}, g
            assert g["written"], g


def _bad_wrap(ctx):
    mesh = Mesh()
    with pytest.raises(ValueError, match=r"matches no submodule; the model has \['Linear', 'ReLU'\]"):
        ShardedModule(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), mesh=mesh, strategy="zero3",
                      wrap_policy=(nn.Conv2d,))
    with pytest.raises(ValueError, match="supports torch.optim.Adam, torch.optim.AdamW"):
        ShardedModule(nn.Linear(2, 2), mesh=mesh, strategy="zero2", cpu_offload=True).build_optimizer(
            torch.optim.Adagrad, lr=0.1)
    dist.barrier()
    return True


def test_bad_configurations_raise(pools):
    assert pools.run(2, _bad_wrap) == [True, True]
    with pytest.raises(ValueError, match="offload does not apply to strategy='ddp'.*use 'zero1' or 'zero2' or 'zero3'"):
        ShardedModule(nn.Linear(2, 2), strategy="ddp", cpu_offload=True)
    with pytest.raises(ValueError, match="unknown strategy 'zero4'; choose one of ddp, zero1, zero2, zero3, fsdp"):
        ShardedModule(nn.Linear(2, 2), strategy="zero4")


def _wrap_policy_error_collectives(ctx):
    mesh = Mesh()
    with mesh.comm.counting() as stats, pytest.raises(ValueError, match="matches no submodule"):
        ShardedModule(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), mesh=mesh, strategy="zero3",
                      wrap_policy=(nn.Conv2d,))
    dist.barrier()  # every rank raised and the world is still in step
    return [(r.op, r.tag) for r in stats.records]


def test_wrap_policy_matching_nothing_raises_before_any_collective(pools):
    """A configuration error (a zero3 wrap policy matching no submodule) is raised on every rank
    before any collective is issued (STYLE.md, house rules)."""
    issued = pools.run(2, _wrap_policy_error_collectives)
    assert issued == [[], []], f"collectives issued before the ValueError, per rank: {issued}"


# -- "fsdp" is another name for "zero3" -----------------------------------------------


def _fsdp_and_zero3(ctx):
    mesh = Mesh()
    data = torch.randint(0, 20, (3, 2, 5), generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device)
    out = {}
    for strategy in ("fsdp", "zero3"):
        model = GPT(GPTConfig(vocab_size=20, block_size=4, n_layer=2, n_head=2, n_embd=8))  # same seed: same weights
        sharded = ShardedModule(model, mesh=mesh, strategy=strategy)
        opt = sharded.build_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=WD, eps=EPS)
        losses = []
        for x in data:
            losses.append(sharded.train_step(x[:, :-1], x[:, 1:], gpt_loss).item())
            opt.step()
            opt.zero_grad()
        units = [u.name for u in sharded.strategy.units]
        out[strategy] = type(sharded.strategy).__name__, units, losses, _cpu(sharded.full_state_dict())
    return out


def test_fsdp_is_another_name_for_zero3(pools):
    """strategy="fsdp" is accepted and is ZeRO-3: the same strategy class and units, and three AdamW
    steps on the same data give the same losses and parameters as strategy="zero3" (fp32 tolerance:
    the same computation run twice, which a GPU need not repeat bitwise)."""
    for rank, out in enumerate(pools.run(2, _fsdp_and_zero3)):
        (kind, units, losses, params), (kind3, units3, losses3, params3) = out["fsdp"], out["zero3"]
        assert kind == kind3 == "Zero3"
        assert units == units3 == ["layers.0", "layers.1", "<root>"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses3), msg=lambda m: f"rank {rank}: {m}")
        assert params.keys() == params3.keys()
        for k in params3:
            torch.testing.assert_close(params[k], params3[k], msg=lambda m: f"rank {rank} {k}: {m}")
