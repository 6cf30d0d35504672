"""Offload (`minipar.offload`): optimizer state and zero3 parameter shards in host memory or files.

Offloading moves state, never arithmetic, so the proof is bitwise: every layout below trains
exactly as the same run without offload (which the ZeRO tests prove equal to one process), in
fp32 and in bf16. In the same runs the device/host/disk bytes equal `formulas.offload_state_bytes`
and the bytes moved per step equal `formulas.offload_traffic`. Then: checkpoints with offloaded
state, the chunked step's bounded reads, and every way a disk can fail.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import minipar.offload as offload_module
from minipar import Mesh, MixedPrecision, Offload, OffloadError, ShardedModule, checkpoint
from minipar import formulas as F
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.offload import check_path

from helpers import EPS, LR, WD, batches

CFG = dict(vocab_size=23, block_size=8, n_layer=3, n_head=3, n_embd=9, bias=True, seed=3)  # 3,445 parameters
PRECISION = {"fp32": None, "bf16": MixedPrecision(param_dtype=torch.bfloat16)}
CHUNK = 100  # elements per chunk of the nvme step: a group takes several, the last one short
MAX_NORM = 0.3  # below every step's gradient norm: clipping fires


def _train(ctx, strategy, precision, opt_where, params_where, root, steps, accum=2, chunk=CHUNK, save=None):
    """``steps`` clipped AdamW steps of ``accum`` micro-batches (no_sync on all but the last) on this
    rank's rows; returns losses, norms, the full parameters, memory_stats and each step's traffic."""
    mesh = Mesh()
    off = None
    if opt_where is not None:
        path = None
        if "nvme" in (opt_where, params_where):
            path = Path(root) / f"run-{opt_where}-{params_where}"
            path.mkdir(exist_ok=True)
        off = Offload(optimizer=opt_where, params=params_where, path=path, chunk_mb=chunk * 4 / 2**20)
    model = ShardedModule(GPT(GPTConfig(**CFG)), mesh=mesh, strategy=strategy, bucket_cap_mb=2e-3,
                          mixed_precision=PRECISION[precision], offload=off)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    data = batches(7, steps, accum, mesh.dp, 2, 7, CFG["vocab_size"])
    rows = slice(2 * mesh.dp_rank, 2 * mesh.dp_rank + 2)
    losses, norms, traffic = [], [], []
    for s in range(steps):
        before = model.strategy.offload_traffic()
        total = 0.0
        for a in range(accum):
            x = data[s, a, rows]
            with (model.no_sync() if a < accum - 1 else torch.enable_grad()):
                total += model.train_step(x[:, :-1], x[:, 1:], lambda o, y: gpt_loss(o, y) / accum).item()
        norms.append(model.clip_grad_norm_(MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        after = model.strategy.offload_traffic()
        traffic.append({k: after[k] - before[k] for k in after})
        losses.append(total)
        if save is not None and s == save[1] - 1:
            checkpoint.save(save[0], model, opt)
    ps = F.ParamSet.of(model.module)
    out = dict(losses=losses, norms=norms, memory=model.memory_stats(), traffic=traffic,
               params={k: v.clone() for k, v in model.full_state_dict().items()},
               ps=([t.numel() for t in ps.tensors], ps.expert, ps.units, ps.has_root), dp_rank=mesh.dp_rank,
               files=sorted(p.name for p in Path(root).rglob("*") if p.is_file()) if root else [])
    mesh.destroy()
    return out


def _paramset(out) -> F.ParamSet:
    numels, expert, units, has_root = out["ps"]
    return F.ParamSet([torch.empty(n, device="meta") for n in numels], expert, units, has_root)


CASES = [  # (world, strategy, precision, optimizer, params)
    (2, "zero1", "fp32", "cpu", None),
    (2, "zero1", "bf16", "nvme", None),
    (3, "zero2", "fp32", "nvme", None),
    (2, "zero2", "bf16", "cpu", None),
    (2, "zero3", "fp32", "nvme", "nvme"),
    (3, "zero3", "fp32", "cpu", "cpu"),
    (2, "zero3", "bf16", "nvme", "cpu"),
    (2, "zero3", "fp32", "cpu", "nvme"),
    (3, "zero3", "bf16", "cpu", None),
]


@pytest.mark.parametrize("world, strategy, precision, opt_where, params_where", CASES)
def test_offload_changes_nothing_but_where_state_lives(pools, tmp_path, world, strategy, precision, opt_where,
                                                        params_where):
    """Bitwise equal to the same run without offload (losses, clipped norms, parameters after 3
    steps of 2 accumulated micro-batches); memory_stats() and every step's counted transfers equal
    the formulas; the nvme step went through several chunks per group."""
    steps = 3
    plain = pools.run(world, _train, strategy, precision, None, None, None, steps)
    runs = pools.run(world, _train, strategy, precision, opt_where, params_where, str(tmp_path), steps)
    pb = 2 if precision == "bf16" else 4
    for base, out in zip(plain, runs):
        assert out["losses"] == base["losses"] and out["norms"] == base["norms"]
        assert min(out["norms"]) > MAX_NORM  # clipping fired every step
        assert out["params"].keys() == base["params"].keys()
        for k in base["params"]:
            assert torch.equal(out["params"][k], base["params"][k]), k
        ps = _paramset(out)
        dp = F.DataParallel(strategy, world, param=pb, bucket_cap_mb=2e-3, rank=out["dp_rank"])
        assert out["memory"] == F.offload_state_bytes(ps, dp, opt_where, params_where), out["memory"]
        assert out["memory"]["optimizer"] == 0 and out["memory"]["host"] > 0
        assert out["memory"]["params"] == (0 if params_where else base["memory"]["params"])
        assert out["memory"]["grads"] == base["memory"]["grads"]
        for s, moved in enumerate(out["traffic"]):
            assert moved == F.offload_traffic(ps, dp, opt_where, params_where, backwards=2, first_step=s == 0), \
                (s, moved)
        if opt_where == "nvme":
            groups = F.flat_groups(ps, dp)
            assert max(g.layout.real_len for g in groups) > 2 * CHUNK  # the step really is chunked
    if "nvme" in (opt_where, params_where):
        assert any(f.endswith(".master") or f.endswith(".shard") for f in runs[0]["files"]), runs[0]["files"]


def test_offload_formulas_at_scale():
    """The closed form: a 7B model's AdamW state over 64 ranks, ZeRO-3, bf16 compute."""
    ps = F.ParamSet.of_sizes([[(7_000_000_000 // 32, False)]] * 32, [])
    dp = F.DataParallel("zero3", 64, param=2)
    none = F.state_bytes(ps, dp)
    full = F.offload_state_bytes(ps, dp, "nvme", "nvme")
    assert full["params"] == 0 and full["optimizer"] == 0 and full["grads"] == none["grads"]
    assert full["disk"] == none["params"] + none["optimizer"] - 4 * len(F.flat_groups(ps, dp))
    cpu = F.offload_state_bytes(ps, dp, "cpu", None)
    assert cpu["host"] == none["optimizer"] and cpu["params"] == none["params"]
