"""ZeRO-3's parameter all-gather in FP8 (``Float8Config(all_gather=True)``, `minipar.fp8.gather`).

The claim: gathering a unit's FP8 weights as e4m3 bytes changes nothing the model computes. For any
weight shapes, shard count and recipe (tensorwise, blockwise), the shards quantised apart and
dequantised after the gather are the values `quantise` makes of the whole weight, and an FP8 layer
fed them computes bit for bit what it computes from the original weight (forward, dX, dW). Then
ZeRO-3 (dp=2; dp=2 x tp=2; HSDP) trains three AdamW steps (clipping fires) with all_gather=True as
with all_gather=False (the first loss bit for bit, the rest to fp32's defaults: the gradient norm's
partial sums follow the shards), and in fp32 params as the single-process FP8 run to test_fp8's
tolerance. The bytes counted on the "param" tag are the formula's; the FP8 weights'
share is half of bf16's; the planner's formulas (`minipar.plan.formulas`) give every rank's state
and its "grad", "param" and "param_amax" calls exactly. With the shards and masters on disk the run
is unchanged. Bad combinations are ValueErrors that say the fix.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minipar import Mesh, MixedPrecision, Offload, ShardedModule
from minipar.fp8 import Float8Config, apply_fp8, check_fp8
from minipar.fp8.gather import Fp8Gather, all_gather_bytes
from minipar.fp8.quantize import dequantise, quantise, scale_from_amax
from minipar.models import GPT, GPTConfig
from minipar.plan import formulas as F

from helpers import EPS, LR, WD, train_rows

LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
MAX_NORM = 0.05
STEPS = 3


# -- one process: the shards' quantisation is the whole weight's, and the layer cannot tell -------------

def _simulate(weights: list[torch.Tensor], scaling: str, world: int) -> list[torch.Tensor]:
    """The flat group of ``weights`` cut into ``world`` shards, each quantised by its own `Fp8Gather` (the
    amax max over the shards, as the all-reduce does), then concatenated and dequantised: each weight as
    the gather lands it."""
    numel = sum(w.numel() for w in weights)
    size = max(1, math.ceil(numel / world))
    flat = torch.zeros(size * world, dtype=weights[0].dtype)
    starts, at = [], 0
    for w in weights:
        flat[at: at + w.numel()] = w.flatten()
        starts.append(at)
        at += w.numel()
    spec = [(s, tuple(w.shape), None) for s, w in zip(starts, weights)]
    gathers = [Fp8Gather(spec, scaling, r * size, size) for r in range(world)]
    shards = [flat[r * size:(r + 1) * size] for r in range(world)]
    amax = torch.stack([g.local_amax(s) for g, s in zip(gathers, shards)]).amax(0)
    scale = scale_from_amax(amax, "e4m3", True)
    data = torch.cat([g.quantise_shard(s, scale) for g, s in zip(gathers, shards)])
    full = torch.empty_like(flat)
    gathers[0].dequantise(data, scale.reciprocal(), full)
    return [full[s: s + w.numel()].view(w.shape) for s, w in zip(starts, weights)]


@settings(deadline=None)
@given(scaling=st.sampled_from(["tensorwise", "blockwise"]), world=st.integers(1, 5),
       shapes=st.lists(st.tuples(st.sampled_from([16, 32, 48, 128, 144]), st.sampled_from([16, 64, 128, 160])),
                       min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_shards_quantised_apart_land_as_the_whole_weight_and_the_layer_cannot_tell(scaling, world, shapes, dtype,
                                                                                   seed):
    """For any weights, shard count and recipe: the landed weight is dequantise(quantise(whole weight)), bit
    for bit; and Fp8Matmul on it gives the same y, dX and dW, bit for bit, as on the original weight (its
    requantisation scale is s or 2s: the `minipar.fp8.gather` docstring's argument)."""
    from minipar.fp8.linear import fp8_linear
    g = torch.Generator().manual_seed(seed)
    # magnitudes spread over decades, so blocks and weights get different scales
    weights = [(torch.randn(s, generator=g) * 10.0 ** torch.randint(-3, 2, (1,), generator=g)).to(dtype)
               for s in shapes]
    config = Float8Config(scaling)
    form = "tensor" if scaling == "tensorwise" else "block"
    for w, landed in zip(weights, _simulate(weights, scaling, world)):
        want = dequantise(quantise(w, "e4m3", form, True)).to(dtype)
        assert torch.equal(landed, want)
        x = torch.randn(16, w.shape[1], generator=g, dtype=torch.float32).to(dtype)
        dy = torch.randn(16, w.shape[0], generator=g, dtype=torch.float32).to(dtype)
        outs = []
        for weight in (w, landed):
            weight = weight.clone().requires_grad_()
            xx = x.clone().requires_grad_()
            y = fp8_linear(xx, weight, None, config)
            y.backward(dy)
            outs.append((y, xx.grad, weight.grad))
        for a, b, what in zip(*outs, ("y", "dX", "dW")):
            assert torch.equal(a, b), what


def test_bad_combinations_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="use scaling='tensorwise' or 'blockwise' with all_gather"):
        Float8Config("rowwise", all_gather=True)
    with pytest.raises(ValueError, match="use pow2_scales=True with all_gather"):
        Float8Config(pow2_scales=False, all_gather=True)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    with pytest.raises(ValueError, match="use strategy='zero3'"):
        check_fp8(model, Float8Config(all_gather=True), zero3=False)
    apply_fp8(model, Float8Config(all_gather=True))  # one process, no ZeRO-3: its forward refuses
    with pytest.raises(ValueError, match="no ZeRO-3 strategy gathers.*use strategy='zero3'"):
        model(torch.zeros(1, 4, dtype=torch.long))


# -- ZeRO-3 trains the same, and moves the bytes of the formula --------------------------------------------

def _cfg(scaling: str, tp: int) -> dict:
    n_embd = 128 * tp if scaling == "blockwise" else 32 * tp  # tp shards multiples of the recipe's tile
    return dict(vocab_size=64, block_size=16, n_layer=1 if scaling == "blockwise" else 2, n_head=2 * tp,
                n_embd=n_embd, seed=11)


def _data(cfg: dict, rows: int) -> torch.Tensor:
    return torch.randint(0, cfg["vocab_size"], (STEPS, rows, cfg["block_size"] + 1),
                         generator=torch.Generator().manual_seed(7))


def _train(ctx, cfg, scaling, sizes, all_gather, param_dtype, data, nvme=None):
    """Three clipped steps; with ``nvme`` (a folder) the masters and the parameter shards live on disk."""
    mesh = Mesh(**sizes)
    policy = MixedPrecision(param_dtype=param_dtype, fp8=Float8Config(scaling, all_gather=all_gather))
    offload = None
    if nvme is not None:
        # one folder for every rank (the options must agree); each rank names its own files there
        offload = Offload(optimizer="nvme", params="nvme", path=Path(nvme), chunk_mb=1e-3)  # several chunks a group
    model = ShardedModule(GPT(GPTConfig(**cfg)), mesh=mesh, strategy="zero3", mixed_precision=policy,
                          offload=offload)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    with mesh.comm.counting() as stats:
        losses, norms = train_rows(model, opt, data, MAX_NORM)
    gathers = [(r.bytes, r.dtype) for r in stats.records if r.op == "all_gather" and r.tag == "param"]
    amax_bytes = stats.bytes(op="all_reduce", tag="param_amax")
    units = [(u.is_root, [p.numel() for p in part.group.layout.params], part.fp8 is not None)
             for u in model.strategy.units for part in u.parts]
    state = {k: v.float().cpu() for k, v in model.full_state_dict().items()}
    ps = F.ParamSet.of(model.module)
    ps.tensors = [torch.empty(t.numel(), device="meta") for t in ps.tensors]  # sizes only, to send back
    # what the planner's formulas need to say this rank's state and traffic (`_formulas_hold`)
    formula = dict(memory=model.memory_stats(), ps=ps, dp=mesh.dp, shard=mesh.dp_shard,
                   shard_rank=mesh.group(mesh.shard_axis).rank,
                   calls=Counter((r.op, r.group, r.tag, r.bytes, r.wire_bytes) for r in stats.records
                                 if r.tag in ("grad", "param", "param_amax")))
    mesh.destroy()
    return losses, norms, state, gathers, amax_bytes, units, formula


def _formulas_hold(out: dict, param_bytes: int) -> None:
    """memory_stats() equals `formulas.state_bytes` and the counted "grad", "param" and "param_amax"
    collectives of the three steps equal `formulas.dp_calls`, exactly: the planner's arithmetic knows
    the FP8 weights' own flat group (its padding) and gather (one byte an element, the amaxes)."""
    ps = out["ps"]
    dp = F.DataParallelShape("zero3", out["dp"], out["shard"], param=param_bytes, rank=out["shard_rank"])
    assert out["memory"] == F.state_bytes(ps, dp), (out["memory"], F.state_bytes(ps, dp))
    want = Counter((c.op, c.axis, c.tag, c.bytes, c.wire) for c in F.dp_calls(ps, dp) * STEPS)
    assert out["calls"] == want, (out["calls"], want)


LAYOUTS = {"dp2": dict(dp=2), "dp2xtp2": dict(dp=2, tp=2), "hsdp": dict(dp=4, dp_shard=2)}
CASES = [("tensorwise", "dp2"), ("blockwise", "dp2"), ("tensorwise", "dp2xtp2"), ("tensorwise", "hsdp")]
if LONG:
    CASES += [("blockwise", "dp2xtp2"), ("blockwise", "hsdp")]


@pytest.mark.parametrize("scaling, layout", CASES, ids=[f"{s}-{l}" for s, l in CASES])
def test_zero3_trains_exactly_as_without_the_fp8_gather(pools, scaling, layout):
    """bf16 params: all_gather=True equals all_gather=False, since every FP8 product sees the same operands
    (the first test): the first loss bit for bit; then losses, clipped norms and parameters after three
    steps to fp32's default tolerances (rtol 1.3e-6, atol 1e-5), because the FP8 weights' own flat group
    changes how the shards cut the model, and so the order of the gradient norm's partial sums: the clip
    factor may differ in its last bit (blockwise HSDP: the first norm 1e-7 relative apart). The FP8
    weights travel as one byte each (the records' dtype uint8), the rest as bf16."""
    sizes = LAYOUTS[layout]
    tp = sizes.get("tp", 1)
    world = sizes["dp"] * tp
    cfg = _cfg(scaling, tp)
    data = _data(cfg, 2 * sizes["dp"])
    runs = {g: pools.run(world, _train, cfg, scaling, sizes, g, torch.bfloat16, data) for g in (False, True)}
    assert max(runs[False][0][1]) > MAX_NORM, "clipping must fire"
    for rank, (plain, fp8) in enumerate(zip(runs[False], runs[True])):
        assert plain[0][0] == fp8[0][0], (rank, plain[0], fp8[0])
        torch.testing.assert_close(torch.tensor(fp8[0]), torch.tensor(plain[0]), msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(torch.tensor(fp8[1]), torch.tensor(plain[1]), msg=lambda m: f"rank {rank}: {m}")
        for k, v in plain[2].items():
            torch.testing.assert_close(fp8[2][k], v, msg=lambda m: f"rank {rank} {k}: {m}")
        dtypes = {d for _, d in fp8[3]}
        assert dtypes == {torch.uint8, torch.bfloat16}, dtypes
        assert fp8[4] > 0 and plain[4] == 0
        assert fp8[6]["ps"].fp8 and not plain[6]["ps"].fp8
        _formulas_hold(fp8[6], 2)


def test_fp8_gather_bytes_equal_the_formula_and_halve_bf16(pools):
    """dp=2, tensorwise, three steps: every "param" all-gather is counted, and their bytes are the formula's
    (`all_gather_bytes`): per gather of a unit (the blocks twice a step, forward and backward; the root
    once), its FP8 weights' flat group padded to a multiple of dp at one byte per element, its other
    parameters' group at two (bf16), and 4 bytes of amax per FP8 weight. The FP8 weights move exactly half
    of what the same run moves for them in bf16."""
    cfg, sizes = _cfg("tensorwise", 1), dict(dp=2)
    data = _data(cfg, 4)
    results = {g: pools.run(2, _train, cfg, "tensorwise", sizes, g, torch.bfloat16, data)[0] for g in (False, True)}
    _, _, _, gathers, amax_bytes, parts, _ = results[True]
    plain_gathers = results[False][3]
    pad = lambda n: math.ceil(n / 2) * 2  # noqa: E731
    want, want_amax, fp8_as_bf16 = [], 0, 0
    for is_root, numels, is_fp8 in parts:
        times = STEPS * (1 if is_root else 2)
        if is_fp8:
            formula = all_gather_bytes(sum(numels), len(numels), 2)
            assert formula["param"] == pad(sum(numels)) and formula["param_amax"] == 4 * len(numels)
            want += [(formula["param"], torch.uint8)] * times
            want_amax += formula["param_amax"] * times
            fp8_as_bf16 += 2 * pad(sum(numels)) * times
        else:
            want += [(2 * pad(sum(numels)), torch.bfloat16)] * times
    by_bytes = lambda rs: sorted(rs, key=lambda r: (r[0], str(r[1])))  # noqa: E731
    assert by_bytes(gathers) == by_bytes(want)
    assert amax_bytes == want_amax > 0
    fp8_bytes = sum(b for b, d in gathers if d == torch.uint8)
    assert fp8_bytes / fp8_as_bf16 == 0.5
    total_fp8 = sum(b for b, _ in gathers) + amax_bytes
    total_bf16 = sum(b for b, _ in plain_gathers)
    print(f"FP8 all-gather, dp=2 tensorwise GPT(n_embd=32, 2 blocks), 3 steps: FP8 weights {fp8_bytes} B "
          f"(in bf16 {fp8_as_bf16} B: ratio 0.5) + {amax_bytes} B of amaxes; every parameter {total_fp8} B "
          f"against {total_bf16} B all in bf16 (ratio {total_fp8 / total_bf16:.3f})")


def test_fp8_gather_in_fp32_params_equals_the_single_process_fp8_run(pools):
    """fp32 params (masters, compute and reduction in fp32), all_gather=True: the single-process FP8 run
    (`test_fp8._reference`) to test_fp8's dp=2 tolerance (1e-5: only the gradient sum's order differs)."""
    from test_fp8 import TOLERANCE, _reference
    cfg = _cfg("tensorwise", 1)
    data = _data(cfg, 4)
    ref_losses, ref_norms, ref_params = _reference(cfg, "tensorwise", data, chunks=2)
    for rank, (losses, norms, state, gathers, *_) in enumerate(
            pools.run(2, _train, cfg, "tensorwise", dict(dp=2), True, torch.float32, data)):
        assert {d for _, d in gathers} == {torch.uint8, torch.float32}
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOLERANCE["loss"])
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **TOLERANCE["norm"])
        for k, p in ref_params.items():
            torch.testing.assert_close(state[k], p, **TOLERANCE["param"], msg=lambda m: f"rank {rank} {k}: {m}")


def test_fp8_gather_with_shards_and_masters_on_disk_changes_nothing(pools, tmp_path):
    """dp=2, tensorwise, bf16 params, all_gather=True, with Offload(optimizer="nvme", params="nvme"):
    the FP8 gather reads each shard as the disk brings it in, so the run is bit for bit the one without
    offload (losses, clipped norms, parameters), and the FP8 weights still travel as bytes."""
    cfg = _cfg("tensorwise", 1)
    data = _data(cfg, 4)
    plain = pools.run(2, _train, cfg, "tensorwise", dict(dp=2), True, torch.bfloat16, data)
    disk = pools.run(2, _train, cfg, "tensorwise", dict(dp=2), True, torch.bfloat16, data, str(tmp_path))
    assert any(tmp_path.rglob("*.shard")), "the parameter shards must live on disk"
    for rank, (base, out) in enumerate(zip(plain, disk)):
        assert out[0] == base[0] and out[1] == base[1], (rank, out[:2], base[:2])
        assert max(out[1]) > MAX_NORM, "clipping must fire"
        for k, v in base[2].items():
            assert torch.equal(out[2][k], v), (rank, k)
        assert out[3] == base[3] and {d for _, d in out[3]} == {torch.uint8, torch.bfloat16}


def _zero1_refuses(ctx):
    mesh = Mesh(dp=2)
    policy = MixedPrecision(param_dtype=torch.float32, fp8=Float8Config(all_gather=True))
    try:
        with mesh.comm.counting() as stats:
            ShardedModule(GPT(GPTConfig(**_cfg("tensorwise", 1))), mesh=mesh, strategy="zero1", mixed_precision=policy)
    except ValueError as e:
        return str(e), [r.op for r in stats.records]
    finally:
        mesh.destroy()
    return None, []


def test_all_gather_without_zero3_is_refused_on_every_rank(pools):
    """zero1 (which gathers no parameters) with all_gather=True: a ValueError on every rank when the
    model is wrapped, before any collective (the front door asks `check_fp8` whether the strategy
    shards its parameters, from its registration)."""
    for message, issued in pools.run(2, _zero1_refuses):
        assert message and "use strategy='zero3'" in message, message
        assert issued == [], issued
