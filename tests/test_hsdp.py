"""HSDP: the data-parallel ranks split into shard groups of ``dp_shard`` (S) ranks and replica groups
of R = dp / S. The ZeRO stages shard within a shard group and all-reduce their gradient shards across
the replicas once per step, whatever the micro-batch count; proven equal to one process, with the
replica traffic and the per-rank memory asserted against their formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from minipar import Mesh, ShardedModule
from minipar.plan import formulas
from minipar.models import GPT, GPTConfig, gpt_loss

from helpers import EPS, LR, WD, accumulated_step, batches

CFG = dict(vocab_size=19, block_size=5, n_layer=2, n_head=2, n_embd=8, bias=True, tie_weights=True, seed=7)
MAX_NORM = 0.05  # below every gradient norm here: clipping fires every step


def _named(module: nn.Module, full: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: full[id(p)].cpu().clone() for n, p in module.named_parameters()}


def _peeking_step(sharded, step_data, rows, device) -> float:
    """As `accumulated_step`, reading the reduced gradient after every micro-batch: a later backward
    then adds to gradient shards already all-reduced across the replicas."""
    total, accum = 0.0, step_data.shape[0]
    for a in range(accum):
        x = step_data[a, rows].to(device)
        with sharded.no_sync():
            total += sharded.train_step(x[:, :-1], x[:, 1:], lambda out, y: gpt_loss(out, y) / accum).item()
        sharded.strategy.full_grads()
    return total


def _train(ctx, sizes, strategy, data, local_bs, extra):
    extra = dict(extra)
    step = _peeking_step if extra.pop("peek", False) else accumulated_step
    mesh = Mesh(**sizes)
    model = GPT(GPTConfig(**{**CFG, "seed": CFG["seed"] + mesh.dp_rank}))  # dp rank 0's weights must win
    sharded = ShardedModule(model, mesh=mesh, strategy=strategy, bucket_cap_mb=1e-3, **extra)
    opt = sharded.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    rows = slice(mesh.dp_rank * local_bs, (mesh.dp_rank + 1) * local_bs)
    losses, norms, replica_reduces, shard_reduces = [], [], [], []
    for s in range(data.shape[0]):
        with mesh.comm.counting() as stats:
            if mesh.pp > 1:
                x = data[s].flatten(0, 1)[rows].to(mesh.device)
                losses.append(sharded.train_step(x[:, :-1], x[:, 1:], gpt_loss).item())
            else:
                losses.append(step(sharded, data[s], rows, mesh.device))
            grads = _named(sharded.module, sharded.strategy.full_grads()) if mesh.pp == 1 else {}
            norms.append(sharded.clip_grad_norm_(MAX_NORM).item())
        replica_reduces.append(stats.calls("all_reduce", "dp_replicate", "grad"))
        shard_reduces.append(stats.calls("reduce_scatter", "dp_shard", "grad"))
        opt.step()
        opt.zero_grad()
    out = dict(losses=losses, norms=norms, grads=grads, state={k: v.cpu() for k, v in sharded.full_state_dict().items()},
               replica_reduces=replica_reduces, shard_reduces=shard_reduces, groups=len(sharded.strategy.groups))
    mesh.destroy()
    return out


def _reference(data):
    model = GPT(GPTConfig(**CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses, norms = [], []
    for s in range(data.shape[0]):
        x = data[s].flatten(0, 1)  # (accum * rows, seq + 1): the accumulated loss is their mean
        loss = gpt_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, grads, model.state_dict()


# (world, mesh sizes, strategy, gradient-accumulation steps, ShardedModule options)
CASES = {
    "zero1_S2_R2": (4, dict(dp_shard=2), "zero1", 2, {}),
    "zero2_S2_R2_accum3": (4, dict(dp_shard=2), "zero2", 3, {}),
    "zero3_S2_R2_accum2": (4, dict(dp_shard=2), "zero3", 2, {}),
    "zero3_S1_R4": (4, dict(dp_shard=1), "zero3", 1, {}),  # every rank holds everything: DDP-like, via ZeRO-3
    "zero3_S2_R2_pp2_m2": (8, dict(dp=4, dp_shard=2, pp=2), "zero3", 2, dict(microbatches=2)),
    "zero2_S2_R2_offload": (4, dict(dp_shard=2), "zero2", 2, dict(cpu_offload=True)),
    # the reduced gradient read between micro-batches: each read all-reduces, and what comes after
    # is added without counting the earlier part R times
    "zero1_S2_R2_peek": (4, dict(dp_shard=2), "zero1", 2, dict(peek=True)),
    "zero2_S2_R2_peek": (4, dict(dp_shard=2), "zero2", 2, dict(peek=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hsdp_equals_single_process_and_reduces_replicas_once_per_step(pools, name):
    """Three AdamW steps with clipping that fires, each rank on its own rows, gradient accumulation
    (or micro-batches under pp): losses, gradient norms, gradients and parameters equal the
    single-process run's; each step reduce-scatters within the shard group once per backward (zero2,
    zero3) and all-reduces each gradient shard across the replicas exactly once."""
    world, sizes, strategy, accum, extra = CASES[name]
    dp = sizes.get("dp", world)
    local_bs = 2
    data = batches(seed=11, steps=3, accum=accum, world=dp, local_bs=local_bs, seq=CFG["block_size"],
                   vocab=CFG["vocab_size"])
    if "microbatches" in extra:  # under pp the micro-batches are the step's batch, cut by the schedule
        data = data.transpose(1, 2).reshape(3, 1, dp * local_bs * accum, -1)
        local_bs *= accum
    ref_losses, ref_norms, ref_grads, ref_state = _reference(data)
    assert min(ref_norms) > MAX_NORM
    replicas = dp // sizes["dp_shard"]
    for rank, out in enumerate(pools.run(world, _train, sizes, strategy, data, local_bs, extra)):
        where = lambda s: f"rank {rank}: {s}"  # noqa: E731
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref_losses), msg=where)
        torch.testing.assert_close(torch.tensor(out["norms"]), torch.tensor(ref_norms), msg=where)
        for k, g in out["grads"].items():
            torch.testing.assert_close(g, ref_grads[k], msg=lambda s: f"rank {rank} grad {k}: {s}")
        for k, v in ref_state.items():
            torch.testing.assert_close(out["state"][k], v, msg=lambda s: f"rank {rank} {k}: {s}")
        expected = (accum if extra.get("peek") else 1) * out["groups"] if replicas > 1 else 0
        assert out["replica_reduces"] == [expected] * 3, (rank, out["replica_reduces"], out["groups"])
        if strategy in ("zero2", "zero3") and "microbatches" not in extra and sizes["dp_shard"] > 1:
            assert out["shard_reduces"] == [accum * out["groups"]] * 3, (rank, out["shard_reduces"])


def _accounting(ctx, strategy, sizes):
    mesh = Mesh(**sizes)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])  # 16,640 parameters
    sharded = ShardedModule(model, mesh=mesh, strategy=strategy, bucket_cap_mb=25.0,
                            wrap_policy=(nn.Linear,) if strategy == "zero3" else None)
    opt = sharded.build_optimizer(torch.optim.AdamW, lr=1e-3)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(mesh.dp_rank)).to(mesh.device)
    with mesh.comm.counting() as stats:
        sharded.train_step(x, None, lambda out, _: out.pow(2).mean())
        opt.step()
    shard_elements = sum(g.layout.shard_size for g in sharded.strategy.groups)
    out = dict(memory=sharded.memory_stats(), phi=sum(p.numel() for p in model.parameters()),
               replica_wire=stats.wire_bytes("all_reduce", "dp_replicate", "grad"),
               replica_calls=stats.calls("all_reduce", "dp_replicate"), shard_elements=shard_elements,
               shard_wire=stats.wire_bytes("reduce_scatter", "dp_shard", "grad"))
    mesh.destroy()
    return out


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
@pytest.mark.parametrize("world, shard", [(4, 2), (4, 1)])
def test_hsdp_memory_and_replica_traffic_match_the_formulas(pools, strategy, world, shard):
    """fp32 AdamW, per rank: zero3 holds 16 Phi / S bytes (params 4, grads 4, moments 8, the master
    being the shard), zero2 4 Phi + 12 Phi / S; the inter-replica all-reduce puts 2 (Phi / S) (R - 1) / R
    elements' bytes on the wire per step, exactly (with padding) and within 1% of the formula; the
    shard-group reduce-scatter (S - 1) / S Phi."""
    replicas = world // shard
    for out in pools.run(world, _accounting, strategy, dict(dp_shard=shard)):
        phi, mem = out["phi"], out["memory"]
        total = mem["params"] + mem["grads"] + mem["optimizer"]
        formula = formulas.shard_formula(strategy, phi, shard)  # sharded over S ranks, not dp
        assert abs(total - sum(formula.values())) <= 0.02 * sum(formula.values()), (mem, formula)
        assert abs(mem["grads"] - formula["grads"]) <= 0.02 * formula["grads"], mem
        exact = formulas.wire_bytes("all_reduce", replicas, out["shard_elements"] * 4)
        assert out["replica_wire"] == exact, out
        assert out["replica_wire"] == pytest.approx(formulas.wire_bytes("all_reduce", replicas, phi / shard * 4),
                                                    rel=0.01)
        assert out["shard_wire"] == pytest.approx(formulas.wire_bytes("reduce_scatter", shard, 4 * phi), rel=0.01)


def _refused(ctx, sizes, strategy):
    try:
        mesh = Mesh(**sizes)
    except ValueError as e:
        return str(e)
    try:
        ShardedModule(nn.Linear(4, 4), mesh=mesh, strategy=strategy)
    except ValueError as e:
        return str(e)
    finally:
        mesh.destroy()
    return None


@pytest.mark.parametrize("sizes, strategy, message", [
    (dict(dp_shard=3), "zero3", "dp_shard=3 must divide dp=4"),
    (dict(dp_shard=2), "ddp", "DDP shards nothing; use strategy='zero1', 'zero2' or 'zero3'"),
])
def test_impossible_hsdp_layouts_raise_on_every_rank(pools, sizes, strategy, message):
    for msg in pools.run(4, _refused, sizes, strategy):
        assert msg is not None and message in msg, msg
