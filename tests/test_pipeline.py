"""Pipeline parallelism.

Stages (no processes): the default cut balances the stages' parameter counts (embedding on the
first stage, final norm and head on the last, a tied head counted once) with at least one block per
stage, no other cut has a smaller largest stage, and explicit boundaries are taken as block counts
or cut points, anything else refused.

Training (rank processes): for pp in {2, 4}, micro-batches 1-8, both schedules and every layout of
4 processes over dp, tp and pp (pp=4; pp=2 x dp=2; pp=2 x tp=2; and pp=2 alone on 2), the losses
(reported on every rank), the one gradient norm over all stages, the gradients and the parameters
after three AdamW steps equal the single-process run on the global batch; the tied embedding / head
copies on the first and last stage stay bitwise identical; for one fixed global batch the losses,
norms and gradients do not depend on the micro-batch count; DDP synchronises gradients once per
step, after the last micro-batch; ZeRO-1/2 on the data-parallel axis equal their references.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, strategies as st

from minipar import Mesh, ShardedModule
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.full_state import full_tensors
from minipar.pipeline.stage import GPTStage, balanced_boundaries, default_boundaries, resolve_boundaries, \
    stage_params

from conftest import ci_examples
from helpers import EPS, LR, WD, accumulated_step
from test_zero import PRECISIONS, _train_reference

# name -> (world size, mesh sizes): every layout of 4 processes with pp > 1, and pp=2 alone.
LAYOUTS = {"pp2": (2, dict(pp=2)), "pp4": (4, dict(pp=4)), "pp2xdp2": (4, dict(pp=2, dp=2)),
           "pp2xtp2": (4, dict(pp=2, tp=2))}


# -- stages: where the cuts go (no processes) ----------------------------------------------------

def _stage_costs(gpt_cfg: dict, bounds: list[int]) -> list[int]:
    """Each stage's parameter count, counted on the GPTStage modules themselves (the last stage's
    copy of a tied weight left out: it is the embedding's, counted on the first stage)."""
    stages = len(bounds) - 1
    costs = []
    for s in range(stages):
        stage = GPTStage(GPT(GPTConfig(**gpt_cfg)), s, stages, boundaries=bounds)
        skip = stage.tied_weight() if stage.last and not stage.first else None
        costs.append(sum(p.numel() for p in stage.parameters() if p is not skip))
    return costs


@given(n_layer=st.integers(1, 7), stages=st.integers(1, 7), n_embd=st.sampled_from([8, 16]),
       vocab=st.sampled_from([8, 64, 700]), tie=st.booleans())
def test_default_stages_balance_parameters_and_no_cut_does_better(n_layer, stages, n_embd, vocab, tie):
    """For any GPT shape and stage count <= n_layer: every stage has at least one block, the costs the
    balancer uses are the stage modules' real parameter counts, and no contiguous cut (checked by
    enumerating them all) has a smaller largest stage."""
    cfg = dict(vocab_size=vocab, block_size=8, n_layer=n_layer, n_head=2, n_embd=n_embd, tie_weights=tie)
    if stages > n_layer:
        with pytest.raises(ValueError, match=f"{stages} pipeline stages but only {n_layer} layers"):
            default_boundaries(GPT(GPTConfig(**cfg)), stages)
        return
    bounds = default_boundaries(GPT(GPTConfig(**cfg)), stages)
    assert bounds[0] == 0 and bounds[-1] == n_layer and all(b < c for b, c in zip(bounds, bounds[1:]))
    blocks, first, last = stage_params(GPT(GPTConfig(**cfg)))
    costs = _stage_costs(cfg, bounds)
    assert sum(costs) == sum(p.numel() for p in GPT(GPTConfig(**cfg)).parameters())  # tied weight once
    assert costs == [sum(blocks[bounds[s]:bounds[s + 1]]) + (first if s == 0 else 0)
                     + (last if s == stages - 1 else 0) for s in range(stages)]
    for cuts in itertools.combinations(range(1, n_layer), stages - 1):
        other = [0, *cuts, n_layer]
        assert max(costs) <= max(sum(blocks[other[s]:other[s + 1]]) + (first if s == 0 else 0)
                                 + (last if s == stages - 1 else 0) for s in range(stages))


def test_the_embedding_moves_blocks_off_the_first_stage():
    """Worked examples. Equal blocks and nothing else: the even split by layer count, earlier stages
    taking the extra block. A large vocabulary leaves the middle stage the most blocks: untied, the
    embedding sits on the first stage and the head on the last; tied, the weight counts once, on the
    first, so the last stage takes more blocks than the first."""
    assert balanced_boundaries(5, 4) == [0, 2, 3, 4, 5]
    assert balanced_boundaries(7, 3) == [0, 3, 5, 7]
    assert balanced_boundaries(8, 3) == [0, 3, 6, 8]
    # n_embd=16: a block holds 12*16^2 + 13*16 = 3280 parameters; a 700 x 16 table 11200.
    untied = GPTConfig(vocab_size=700, block_size=8, n_layer=8, n_head=2, n_embd=16, tie_weights=False)
    blocks, first, last = stage_params(GPT(untied))
    assert (blocks, first, last) == ([3280] * 8, 11200 + 8 * 16, 2 * 16 + 11200)
    # costs 11328 + 3280 = 14608, 5 * 3280 = 16400, 2 * 3280 + 11232 = 17792; by layer count
    # (3, 3, 2) the first stage would hold 21168
    assert default_boundaries(GPT(untied), 3) == [0, 1, 6, 8]
    tied = GPTConfig(**{**vars(untied), "tie_weights": True})
    assert stage_params(GPT(tied))[2] == 2 * 16  # ln_f only
    assert default_boundaries(GPT(tied), 3) == [0, 1, 5, 8]  # costs 14608, 13120, 9872


def test_explicit_boundaries_are_block_counts_or_cut_points():
    cfg = GPTConfig(vocab_size=16, block_size=4, n_layer=4, n_head=1, n_embd=4)
    assert resolve_boundaries([1, 3], 4, 2) == resolve_boundaries([0, 1, 4], 4, 2) == [0, 1, 4]
    stages = [GPTStage(GPT(cfg), s, 2, boundaries=[1, 3]) for s in range(2)]
    assert [len(s.layers) for s in stages] == [1, 3] and stages[1].layer_offset == 1
    assert stages[0].boundaries == [0, 1, 4]


@pytest.mark.parametrize("spec, match", [
    ([2, 1], "pipeline_boundaries=\\[2, 1\\] as block counts must be 2 numbers, each at least 1, summing to n_layer=4"),
    ([4, 0], "each at least 1"),
    ([0, 2, 2, 4], "pipeline_boundaries=\\[0, 2, 2, 4\\] for 2 stages: give 2 block counts or 3 cut points"),
    ([0, 3, 3], "pipeline_boundaries=\\[0, 3, 3\\] as cut points must rise strictly from 0 to n_layer=4"),
    ([1, 2, 4], "must rise strictly from 0"),
    ([1.5, 2.5], "must be integers"),
])
def test_bad_explicit_boundaries_raise(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        GPTStage(GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=4, n_head=1, n_embd=4)), 0, 2, boundaries=spec)
    assert "e.g. [1, 3] (block counts) or [0, 1, 4] (cut points)" in str(info.value)  # the fix, in the message


# -- what a rank reports ---------------------------------------------------------------------------

def _stage_full(model: ShardedModule, value_of) -> dict[str, torch.Tensor]:
    """``value_of(p)`` for each of this stage's parameters, gathered over tp as ``full_state_dict``
    does, under the single-process names (a tied weight under both of its names)."""
    params = {id(p) for p in model.module.parameters()}
    full = full_tensors(model, lambda t: value_of(t) if id(t) in params else None, all_stages=False)
    return {k: v.float().cpu() for k, v in full.items()}


def _grads_now(model: ShardedModule) -> dict[str, torch.Tensor]:
    """This stage's reduced gradients (DDP: p.grad; ZeRO: the shards gathered over dp)."""
    full = model.strategy.full_grads()
    return _stage_full(model, lambda p: full[id(p)])


def _params_now(model: ShardedModule) -> dict[str, torch.Tensor]:
    """This stage's parameters as stepped (ZeRO: the fp32 masters gathered over dp)."""
    full = model.strategy.full_params()
    return _stage_full(model, lambda p: full.get(id(p), p))


def _train(model: ShardedModule, local_steps: list[torch.Tensor], max_norm: float):
    """Train on this rank's batch of each step; returns losses, norms and the last step's gradients
    (reduced, before clipping)."""
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    losses, norms, peaks = [], [], []
    for i, x in enumerate(local_steps):
        losses.append(model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy).item())  # vocab-parallel if tp
        if i == len(local_steps) - 1:  # after two steps have moved the weights away from their init
            grads = _grads_now(model)
        norms.append(model.clip_grad_norm_(max_norm).item())
        opt.step()
        opt.zero_grad()
        peaks.append(model.peak_live_activations)
    return losses, norms, grads, peaks


def _report(model: ShardedModule, losses, norms, grads, peaks) -> dict:
    mesh = model.mesh
    return dict(losses=losses, norms=norms, grads=grads, peaks=peaks, stage_params=_params_now(model),
                state={k: v.cpu() for k, v in model.full_state_dict().items()},
                pp_rank=mesh.pp_rank, dp_rank=mesh.dp_rank, tp_rank=mesh.tp_rank, pp=mesh.pp)


def _reference(cfg: dict, steps: list[torch.Tensor], max_norm: float):
    """One process, the global batch of each step: losses, norms, the last step's gradients (under
    every name, a tied weight's twice) before clipping, and the final state dict."""
    model = GPT(GPTConfig(**cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses, norms = [], []
    for x in steps:
        loss = gpt_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, grads, model.state_dict()


def _assert_equal_to_reference(results: list[dict], ref, tol: dict | None = None) -> None:
    ref_losses, ref_norms, ref_grads, ref_state = ref
    tol = tol or {}
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    covered = set()
    for rank, r in enumerate(results):
        torch.testing.assert_close(f32(r["losses"]), f32(ref_losses), **tol, msg=lambda s: f"rank {rank} losses: {s}")
        torch.testing.assert_close(f32(r["norms"]), f32(ref_norms), **tol, msg=lambda s: f"rank {rank} norms: {s}")
        assert set(r["grads"]) <= set(ref_grads), set(r["grads"]) - set(ref_grads)
        for k, g in r["grads"].items():
            torch.testing.assert_close(g, ref_grads[k], **tol, msg=lambda s: f"rank {rank} grad {k}: {s}")
        covered |= set(r["grads"])
        assert r["state"].keys() == ref_state.keys()
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, **tol, msg=lambda s: f"rank {rank} {k}: {s}")
    assert covered == set(ref_grads), "every gradient is held by some stage"


def _assert_tied_copies_identical(results: list[dict], tied: bool) -> None:
    """The first stage's wte.weight and the last stage's lm_head.weight (same dp rank) are bitwise equal."""
    last_stage = results[0]["pp"] - 1
    by_place = {(r["pp_rank"], r["dp_rank"], r["tp_rank"]): r["stage_params"] for r in results}
    pairs = [(params, by_place[(last_stage, d, t)]) for (s, d, t), params in by_place.items() if s == 0]
    assert pairs
    for first, last in pairs:
        if tied:
            assert torch.equal(first["wte.weight"], last["lm_head.weight"]), "the tied copies drifted apart"
        else:
            assert "lm_head.weight" not in first


# -- pipeline (with dp or tp beside it) equals the single-process run ---------------------------

def _train_pp(ctx, layout: dict, cfg: dict, data: torch.Tensor, schedule: str, m: int, max_norm: float,
              strategy: str = "ddp", precision: str = "fp32", boundaries=None):
    """data: (steps, global batch, seq + 1); this rank takes its data-parallel slice of each step."""
    mesh = Mesh(**layout)
    model = ShardedModule(GPT(GPTConfig(**cfg)), mesh=mesh, strategy=strategy, schedule=schedule, microbatches=m,
                          mixed_precision=PRECISIONS[precision], bucket_cap_mb=1e-3, pipeline_boundaries=boundaries)
    local = data.shape[1] // mesh.dp
    steps = [data[s, mesh.dp_rank * local:(mesh.dp_rank + 1) * local].to(ctx.device) for s in range(data.shape[0])]
    out = _report(model, *_train(model, steps, max_norm))
    mesh.destroy()
    return out


@example(layout="pp2", schedule="gpipe", m=1, n_layer=4, tie=True, seed=11)
@example(layout="pp2", schedule="1f1b", m=8, n_layer=5, tie=False, seed=12)
@example(layout="pp4", schedule="gpipe", m=5, n_layer=5, tie=True, seed=2)
@example(layout="pp4", schedule="1f1b", m=8, n_layer=4, tie=False, seed=13)
@example(layout="pp2xdp2", schedule="gpipe", m=2, n_layer=5, tie=False, seed=14)
@example(layout="pp2xdp2", schedule="1f1b", m=7, n_layer=4, tie=True, seed=15)
@example(layout="pp2xtp2", schedule="gpipe", m=4, n_layer=5, tie=False, seed=16)
@example(layout="pp2xtp2", schedule="1f1b", m=3, n_layer=4, tie=True, seed=1)
@example(layout="pp4", schedule="1f1b", m=3, n_layer=5, tie=True, seed=17)  # fewer micro-batches than stages
@ci_examples(3)
@given(layout=st.sampled_from(sorted(LAYOUTS)), schedule=st.sampled_from(["gpipe", "1f1b"]), m=st.integers(1, 8),
       n_layer=st.integers(4, 5), tie=st.booleans(), seed=st.integers(0, 2**16))
def test_pipeline_equals_single_process(pools, layout, schedule, m, n_layer, tie, seed):
    """Losses (reported on every rank), the gradient norm (one norm over all stages, the tied weight
    counted once), the gradients before the last step and the parameters after three clipped AdamW
    steps equal the reference; the tied copies stay bitwise identical; 1F1B never holds more than
    pp - stage micro-batches' activations, GPipe all m. The explicit examples put every layout with
    both schedules into every run, and 1F1B with fewer micro-batches than stages at pp 2 and 4 (the
    ci profile adds 3 drawn examples)."""
    world, mesh_sizes = LAYOUTS[layout]
    dp, pp = mesh_sizes.get("dp", 1), mesh_sizes["pp"]
    cfg = dict(vocab_size=24, block_size=5, n_layer=n_layer, n_head=2, n_embd=8, tie_weights=tie, seed=seed)
    data = torch.randint(0, 24, (3, dp * m, 6), generator=torch.Generator().manual_seed(seed + 1))
    ref = _reference(cfg, list(data), 0.05)
    assert max(ref[1]) > 0.05, "clipping must fire for the norm to matter"
    results = pools.run(world, _train_pp, mesh_sizes, cfg, data, schedule, m, 0.05)
    _assert_equal_to_reference(results, ref)
    _assert_tied_copies_identical(results, tie)
    for r in results:
        bound = min(pp - r["pp_rank"], m) if schedule == "1f1b" else m
        assert max(r["peaks"]) == bound, (schedule, r["pp_rank"], r["peaks"])


@pytest.mark.parametrize("layout, boundaries", [("pp2", [1, 4]), ("pp2", [0, 3, 5]), ("pp4", [2, 1, 1, 1])])
def test_explicit_pipeline_boundaries(pools, layout, boundaries):
    """``pipeline_boundaries`` (block counts or cut points) places the blocks where asked: each
    stage holds that many blocks, and training equals the reference as with the balanced default."""
    world, mesh_sizes = LAYOUTS[layout]
    cfg = dict(vocab_size=24, block_size=5, n_layer=5, n_head=2, n_embd=8, tie_weights=True, seed=31)
    data = torch.randint(0, 24, (3, 2, 6), generator=torch.Generator().manual_seed(32))
    ref = _reference(cfg, list(data), 0.05)
    results = pools.run(world, _train_pp, mesh_sizes, cfg, data, "1f1b", 2, 0.05, "ddp", "fp32", boundaries)
    _assert_equal_to_reference(results, ref)
    counts = boundaries if len(boundaries) == mesh_sizes["pp"] else \
        [b - a for a, b in zip(boundaries, boundaries[1:])]
    for r in results:
        blocks = {k.split(".")[1] for k in r["grads"] if k.startswith("layers.")}
        assert len(blocks) == counts[r["pp_rank"]], (boundaries, r["pp_rank"], sorted(blocks))


def _sweep_microbatches(ctx, layout: dict, cfg: dict, data: torch.Tensor, schedule: str, counts: list[int]):
    return [_train_pp(ctx, layout, cfg, data, schedule, m, 0.05) for m in counts]


@pytest.mark.parametrize("layout, schedule", [("pp2xdp2", "1f1b"), ("pp2xtp2", "gpipe"), ("pp4", "1f1b")])
def test_microbatch_count_changes_nothing_but_the_schedule(pools, layout, schedule):
    """One fixed global batch (8 sequences per data-parallel rank), m in {1, 2, 4, 8}: losses, gradient
    norms and gradients are equal across m and equal to the reference's, for two steps."""
    world, mesh_sizes = LAYOUTS[layout]
    dp = mesh_sizes.get("dp", 1)
    cfg = dict(vocab_size=24, block_size=5, n_layer=4, n_head=2, n_embd=8, tie_weights=True, seed=21)
    data = torch.randint(0, 24, (2, dp * 8, 6), generator=torch.Generator().manual_seed(22))
    ref = _reference(cfg, list(data), 0.05)
    counts = [1, 2, 4, 8]
    per_rank = pools.run(world, _sweep_microbatches, mesh_sizes, cfg, data, schedule, counts)
    for i, m in enumerate(counts):
        runs = [rank_runs[i] for rank_runs in per_rank]
        _assert_equal_to_reference(runs, ref)
        for rank, (r, r1) in enumerate(zip(runs, (rank_runs[0] for rank_runs in per_rank))):  # against m = 1
            torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(r1["norms"]),
                                       msg=lambda s: f"m={m} rank {rank} norms vs m=1: {s}")
            for k, g in r["grads"].items():
                torch.testing.assert_close(g, r1["grads"][k], msg=lambda s: f"m={m} rank {rank} grad {k} vs m=1: {s}")


# -- when the data-parallel gradient sync happens ------------------------------------------------

def _count_second_step(model: ShardedModule, x: torch.Tensor):
    """Two training steps (train_step, clip, optimizer step, zero_grad) on ``x``; the collectives of
    the second, as counted by the collective layer."""
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR)
    for _ in range(2):
        with model.mesh.comm.counting() as stats:
            model.train_step(x[:, :-1], x[:, 1:], gpt_loss)
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
    return stats


def _count_grad_sync(ctx, strategy: str, counts: list[int], schedule: str = "1f1b"):
    """Per m: calls of the gradient collective over dp in the second step (train_step, clip,
    optimizer step), the number of buckets/shard groups, and whether every call came after the last
    backward started."""
    out = {}
    for m in counts:
        mesh = Mesh(pp=2, dp=2)
        cfg = GPTConfig(vocab_size=24, block_size=5, n_layer=4, n_head=2, n_embd=8, seed=3)
        model = ShardedModule(GPT(cfg), mesh=mesh, strategy=strategy, schedule=schedule, microbatches=m,
                              bucket_cap_mb=1e-3, record_timeline=True)  # ~1 KiB buckets: many of them, so counts mean something
        stats = _count_second_step(model, torch.randint(0, 24, (8, 6), generator=torch.Generator().manual_seed(mesh.dp_rank)))
        op = "all_reduce" if strategy == "ddp" else "reduce_scatter"
        calls = [r for r in stats.records if r.op == op and r.group == "dp" and r.tag == "grad"]
        last_backward = max(start for action, start, _ in model.timeline if action[0] in "BW")
        groups = len(model.strategy.buckets) if strategy == "ddp" else len(model.strategy.groups)
        out[m] = dict(calls=len(calls), groups=groups, unused_maps=stats.calls("all_reduce", "dp", "unused_map"),
                      after_last_backward=all(r.time_s >= last_backward for r in calls))
        mesh.destroy()
    return out


@pytest.mark.parametrize("strategy, schedule", [("ddp", "1f1b"), ("zero1", "1f1b"), ("zero2", "1f1b"),
                                               ("ddp", "zb_v"), ("zero2", "zb_h1"), ("zero1", "interleaved_1f1b")])
def test_data_parallel_gradient_sync_runs_once_per_step_after_the_last_microbatch(pools, strategy, schedule):
    """DDP under pp: one all-reduce per bucket per step (and one unused-parameter map), whatever the
    micro-batch count, all issued after the stage's last backward (B or W) began; ZeRO-1 and ZeRO-2
    likewise one reduce-scatter per shard group per step (ZeRO-2 holds the local gradient in p.grad
    across the step's micro-batches, as the others do, instead of reduce-scattering m times). The
    same under the schedules with chunks and a split backward."""
    counts = [2, 4] if schedule == "interleaved_1f1b" else [1, 4]
    for rank, per_m in enumerate(pools.run(4, _count_grad_sync, strategy, counts, schedule)):
        assert per_m[counts[0]]["groups"] > 1
        for m, c in per_m.items():
            assert c["calls"] == c["groups"], (rank, m, c)
            assert c["after_last_backward"], (rank, m, c)
            if strategy == "ddp":
                assert c["unused_maps"] == 1, (rank, m, c)
        assert per_m[counts[0]]["calls"] == per_m[4]["calls"]


# -- configuration errors ------------------------------------------------------------------------

def _bad(ctx, kwargs, layout):
    """Build the bad configuration and train one step; returns the error message, where it was raised
    ("construction" or "train_step") and the collectives recorded in that call before the error."""
    mesh = Mesh(**layout)
    x = torch.randint(0, 10, (3, 5))
    where = "construction"
    with pytest.raises(ValueError) as info:
        with mesh.comm.counting() as stats:
            model = ShardedModule(GPT(GPTConfig(vocab_size=10, block_size=4, n_layer=2, n_head=1, n_embd=4)),
                                  mesh=mesh, **kwargs)
        # A valid construction communicates (its configuration check): count the train_step alone.
        where = "train_step"
        with mesh.comm.counting() as stats:
            model.train_step(x[:, :-1], x[:, 1:], gpt_loss)
    dist.barrier()  # every rank raised and the world is still in step
    mesh.destroy()
    # the batch check's all-gather is how every rank learns that some rank's batch is bad
    return str(info.value), where, [(r.op, r.group, r.tag) for r in stats.records if r.tag != "batch_check"]


@pytest.mark.parametrize("kwargs, layout, match, where", [
    ({}, dict(pp=4), "4 pipeline stages but only 2 layers", "construction"),
    ({"schedule": "zigzag"}, dict(pp=2), "unknown schedule 'zigzag'; choose one of gpipe, 1f1b", "construction"),
    ({"schedule": "zb_v"}, dict(pp=2), "makes 4 pipeline pieces but the model has 2 blocks", "construction"),
    ({"schedule": "interleaved_1f1b", "microbatches": 3}, dict(pp=2), "must be a multiple of 2", "construction"),
    ({"virtual_stages": 2}, dict(pp=2), "'1f1b' runs 1 model chunk(s) per rank", "construction"),
    ({"schedule": "zb_h1", "strategy": "zero3", "reshard_after_forward": True}, dict(pp=2),
     "reshard_after_forward=True", "construction"),
    ({"microbatches": 2}, dict(pp=2), "a batch of 3 does not split into microbatches=2", "train_step"),
    ({"pipeline_boundaries": [2, 1]}, dict(pp=2), "pipeline_boundaries", "construction"),
])
def test_bad_pipeline_configurations_raise(pools, kwargs, layout, match, where):
    """A bad pipeline configuration raises ValueError on every rank before the first collective
    (STYLE.md, house rules): the stage count, schedule and boundaries in the constructor, before its
    configuration check; a batch that does not split into the micro-batches in train_step, after
    only the batch check (which makes one rank's bad batch an error on all of them), before any
    activation is sent or any loss all-reduced."""
    world = 4 if layout["pp"] == 4 else 2
    for rank, (msg, raised_in, issued) in enumerate(pools.run(world, _bad, kwargs, layout)):
        assert match in msg, (rank, msg)
        assert raised_in == where, (rank, raised_in, msg)
        assert issued == [], f"rank {rank}: collectives issued in the {raised_in} before the ValueError: {issued}"


# -- pipeline x ZeRO-1/2, and dp x tp x pp -------------------------------------------------------

def _train_pp_sharded(ctx, layout, strategy, precision, cfg, data, schedule, max_norm, options=None):
    """data: (steps, m, global micro-batch, seq + 1): this rank's micro-batches, one after another,
    which the pipeline cuts back apart in order. options: more ShardedModule keyword arguments."""
    mesh = Mesh(**layout)
    m, local = data.shape[1], data.shape[2] // mesh.dp
    model = ShardedModule(GPT(GPTConfig(**cfg)), mesh=mesh, strategy=strategy, schedule=schedule, microbatches=m,
                          mixed_precision=PRECISIONS[precision], bucket_cap_mb=1e-3, **(options or {}))
    steps = [data[s, :, mesh.dp_rank * local:(mesh.dp_rank + 1) * local].flatten(0, 1).to(ctx.device)
             for s in range(data.shape[0])]
    out = _report(model, *_train(model, steps, max_norm))
    mesh.destroy()
    return out


def _check_pp_sharded(pools, world, layout, strategy, precision, schedule, m, tie, seed, options=None):
    dp = layout.get("dp", 1)
    cfg = dict(vocab_size=12, block_size=4, n_layer=4, n_head=2, n_embd=8, tie_weights=tie, seed=seed)
    data = torch.randint(0, 12, (3, m, dp * 2, 5), generator=torch.Generator().manual_seed(seed + 1))
    # The ZeRO reference replays each data-parallel rank's micro-batches as that strategy runs them,
    # in fp32 or emulating bf16 exactly: under pp both stages accumulate the micro-batches in p.grad
    # (the compute dtype) and reduce once, which is what the reference calls "zero1".
    ref_losses, ref_norms, ref_grads, ref_state = _train_reference("zero1", cfg, data, dp, precision, 0.05, 2.0)
    if tie:  # the reference names the shared gradient once; stages report it under both names
        ref_grads["lm_head.weight"] = ref_grads["wte.weight"]
    assert max(ref_norms) > 0.05, "clipping must fire for the norm to matter"
    tol = {} if precision == "fp32" else dict(rtol=1.6e-2, atol=1e-5)  # the defaults for fp32 / bf16
    results = pools.run(world, _train_pp_sharded, layout, strategy, precision, cfg, data, schedule, 0.05, options)
    _assert_equal_to_reference(results, (ref_losses, ref_norms, ref_grads, ref_state), tol)
    _assert_tied_copies_identical(results, tie)


@st.composite
def pp_zero_cases(draw):
    layout = draw(st.sampled_from(["pp2xdp2", "pp2xtp2", "pp4"]))
    tie = draw(st.booleans())
    # bf16 is drawn only where the reference emulates every rounding: see the test's docstring.
    exact_bf16 = layout != "pp2xtp2" and not tie
    strategy = draw(st.sampled_from(["zero1", "zero2", "zero3"]))
    options = dict(cpu_offload=draw(st.booleans()))
    if strategy == "zero3":
        options["reshard_after_forward"] = draw(st.booleans())
    if layout == "pp2xtp2":
        options["sequence_parallel"] = draw(st.booleans())
    return dict(strategy=strategy, layout=layout, tie=tie,
                precision=draw(st.sampled_from(["fp32", "bf16"] if exact_bf16 else ["fp32"])),
                schedule=draw(st.sampled_from(["gpipe", "1f1b"])), m=draw(st.integers(1, 4)),
                seed=draw(st.integers(0, 2**16)), options=options)


@example(case=dict(strategy="zero2", layout="pp2xdp2", precision="fp32", schedule="1f1b", m=3, tie=True, seed=3,
                   options={}))
@example(case=dict(strategy="zero1", layout="pp2xdp2", precision="bf16", schedule="gpipe", m=2, tie=False, seed=4,
                   options={"cpu_offload": True}))
@example(case=dict(strategy="zero2", layout="pp4", precision="bf16", schedule="1f1b", m=4, tie=False, seed=5,
                   options={}))
@example(case=dict(strategy="zero1", layout="pp2xtp2", precision="fp32", schedule="gpipe", m=2, tie=True, seed=4,
                   options={"sequence_parallel": True}))
@example(case=dict(strategy="zero3", layout="pp2xdp2", precision="fp32", schedule="1f1b", m=3, tie=True, seed=6,
                   options={}))
@example(case=dict(strategy="zero3", layout="pp2xdp2", precision="bf16", schedule="gpipe", m=2, tie=False, seed=7,
                   options={"reshard_after_forward": True, "cpu_offload": True}))
@example(case=dict(strategy="zero3", layout="pp2xtp2", precision="fp32", schedule="1f1b", m=2, tie=True, seed=8,
                   options={"sequence_parallel": True, "reshard_after_forward": True}))
@example(case=dict(strategy="zero3", layout="pp4", precision="bf16", schedule="1f1b", m=4, tie=False, seed=9,
                   options={"cpu_offload": True}))
# with the ones above, every stage on every layout
@example(case=dict(strategy="zero1", layout="pp4", precision="fp32", schedule="gpipe", m=1, tie=True, seed=10,
                   options={}))
@example(case=dict(strategy="zero2", layout="pp2xtp2", precision="fp32", schedule="1f1b", m=2, tie=False, seed=11,
                   options={"sequence_parallel": True, "cpu_offload": True}))
@ci_examples(3)
@given(case=pp_zero_cases())
def test_pipeline_with_zero_equals_single_process(pools, case):
    """ZeRO-1, ZeRO-2 and ZeRO-3 on the data-parallel axis of a pipeline (with tp, sequence parallel
    or not, or dp beside it), with or without CPU offload, ZeRO-3 keeping its units gathered across
    the micro-batches or resharding after each, fp32 or bf16 compute: losses, the one gradient norm
    over all stages (tied weight once), the gradients before the last step and the parameters after
    three clipped AdamW steps equal the reference, the tied weight's local gradient summed across
    the first and last stage before the data-parallel reduction, its two fp32 masters bitwise
    identical.

    bf16 is drawn only without tp and with an untied head: the reference emulates the casts
    exactly, but not tensor parallelism's bf16 partial matmuls and their reduction, nor a tied
    weight's two bf16 gradient accumulators (one per stage, summed) where it has one; AdamW
    amplifies those roundings beyond the bf16 tolerance for near-zero gradients."""
    world, layout = LAYOUTS[case["layout"]]
    _check_pp_sharded(pools, world, layout, case["strategy"], case["precision"], case["schedule"], case["m"],
                      case["tie"], case["seed"], case["options"])


@pytest.mark.parametrize("strategy, sequence_parallel", [("ddp", True), ("zero1", False), ("zero2", True),
                                                         ("zero3", True)])
def test_dp_tp_pp_all_greater_than_one(pools, strategy, sequence_parallel):
    """8 processes as dp=2 x tp=2 x pp=2 with a tied head, each data-parallel strategy, with and
    without sequence parallelism: the full composition equals the reference."""
    _check_pp_sharded(pools, 8, dict(dp=2, tp=2, pp=2), strategy, "fp32", "1f1b", 2, True, 7,
                      dict(sequence_parallel=sequence_parallel))


def _count_zero3_gathers(ctx, reshard: bool, m: int, schedule: str):
    """Per step (the second): zero3's all-gathers and reduce-scatters of this stage, its unit count
    (non-root, root) and every unit's padded size."""
    mesh = Mesh(pp=2, dp=2)
    cfg = GPTConfig(vocab_size=24, block_size=5, n_layer=4, n_head=2, n_embd=8, seed=3)
    model = ShardedModule(GPT(cfg), mesh=mesh, strategy="zero3", schedule=schedule, microbatches=m,
                          reshard_after_forward=reshard)
    stats = _count_second_step(model, torch.randint(0, 24, (2 * m, 6), generator=torch.Generator().manual_seed(mesh.dp_rank)))
    units = model.strategy.units
    out = dict(gathers=stats.calls("all_gather", "dp", "param"), scatters=stats.calls("reduce_scatter", "dp", "grad"),
               gathered_elements=sum(r.bytes for r in stats.records if r.op == "all_gather" and r.tag == "param")
               // 4, padded=sum(part.group.layout.padded for u in units for part in u.parts),
               nonroot=sum(not u.is_root for u in units), root=sum(u.is_root for u in units),
               states=set(model.strategy.unit_states().values()))
    mesh.destroy()
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_zero3_under_the_pipeline_gathers_once_per_step_or_per_microbatch(pools, schedule):
    """ZeRO-3 under pp, counted by the collective layer over one step (train_step, clip, step):
    by default every unit of a stage is all-gathered once per step, whatever m, and its gradient
    reduce-scattered once, after the last micro-batch; with reshard_after_forward=True every
    non-root unit is gathered for each micro-batch's forward and again for its backward (2m), the
    root (which stays gathered from its forward through its backward) between once and 2m times.
    After the step every unit is sharded again."""
    m = 3
    for reshard in (False, True):
        for rank, c in enumerate(pools.run(4, _count_zero3_gathers, reshard, m, schedule)):
            units = c["nonroot"] + c["root"]
            assert c["nonroot"] >= 2 and c["scatters"] == units, (rank, reshard, c)
            assert c["states"] == {"sharded"}, (rank, reshard, c)
            if not reshard:
                assert c["gathers"] == units, (rank, c)
                assert c["gathered_elements"] == c["padded"], (rank, c)
            else:
                low, high = 2 * m * c["nonroot"] + c["root"], 2 * m * units
                assert low <= c["gathers"] <= high, (rank, c)


# -- fp16 with dynamic loss scaling under pp ---------------------------------------------------------

def _fp16_run(ctx, layout: dict, data: torch.Tensor, m: int):
    """zero1 with fp16 compute and a dynamic loss scale, three steps on the whole batch (dp = 1)."""
    from minipar import MixedPrecision
    mesh = Mesh(**layout)
    policy = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32, init_scale=2.0**12)
    cfg = GPTConfig(vocab_size=24, block_size=5, n_layer=2, n_head=2, n_embd=8, bias=False, seed=41)
    extra = dict(schedule="1f1b", microbatches=m) if mesh.pp > 1 else {}
    model = ShardedModule(GPT(cfg), mesh=mesh, strategy="zero1", mixed_precision=policy, **extra)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    losses = []
    for x in data:
        if mesh.pp > 1:
            losses.append(model.train_step(x[:, :-1], x[:, 1:], gpt_loss).item())
        else:  # the same micro-batches, accumulated: the pipeline's arithmetic without the pipeline
            losses.append(accumulated_step(model, x.reshape(m, -1, x.shape[-1]), slice(None), ctx.device))
        model.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()
    scale = model.strategy.scaler.scale
    state = {k: v.cpu() for k, v in model.full_state_dict().items()}
    mesh.destroy()
    return losses, scale, state


def test_fp16_loss_scaling_under_the_pipeline_equals_one_process(pools):
    """pp=2 with ZeRO-1 in fp16 (the loss scaled on the last stage, gradients crossing stages in
    fp16, the scale divided out and agreed on by every rank) trains as one process doing the same
    casts with the same micro-batches; both keep the scale they started with (no overflow)."""
    data = torch.randint(0, 24, (3, 4, 6), generator=torch.Generator().manual_seed(42))
    ref_losses, ref_scale, ref_state = pools.run(1, _fp16_run, {}, data, 2)[0]
    results = pools.run(2, _fp16_run, dict(pp=2), data, 2)
    for rank, (losses, scale, state) in enumerate(results):
        assert scale == ref_scale == 2.0**12
        # fp16 rounding differs where the two runs cast a stage boundary's activations: compare at
        # fp16's tolerance, parameters to a tenth of one Adam step
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=1e-3)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-3, atol=0.1 * LR, msg=lambda s: f"rank {rank} {k}: {s}")


# -- accumulation over train_steps ---------------------------------------------------------------

def _two_train_steps(ctx, strategy: str, cfg: dict, batches: list[torch.Tensor], clip: float | None):
    mesh = Mesh(pp=2, dp=ctx.world_size // 2)
    model = ShardedModule(GPT(GPTConfig(**cfg)), mesh=mesh, strategy=strategy, schedule="1f1b", microbatches=2)
    model.build_optimizer(torch.optim.AdamW, lr=LR)
    rows = batches[0].shape[0] // mesh.dp
    for i, x in enumerate(batches):  # no zero_grad in between: the gradients of both steps add up
        x = x[mesh.dp_rank * rows:(mesh.dp_rank + 1) * rows]
        model.train_step(x[:, :-1], x[:, 1:], gpt_loss)
        if clip is not None and i == 0:  # changes the first step's sum in place before the second step
            model.clip_grad_norm_(clip)
    grads = _grads_now(model)
    mesh.destroy()
    return grads


@pytest.mark.parametrize("clip", [None, 0.1])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_train_steps_without_zero_grad_accumulate_the_tied_weight_once(pools, strategy, clip):
    """Two train_steps and no zero_grad: every gradient, the tied embedding/head one included, is
    the sum of the two steps' gradients. The tied weight's two copies (first and last stage) are
    summed per step; summing again what an earlier step already summed would count it twice."""
    cfg = dict(vocab_size=12, block_size=4, n_layer=2, n_head=2, n_embd=8, tie_weights=True, seed=2)
    gen = torch.Generator().manual_seed(9)
    batches = [torch.randint(0, 12, (4, 5), generator=gen) for _ in range(2)]
    ref = GPT(GPTConfig(**cfg))
    for i, x in enumerate(batches):
        gpt_loss(ref(x[:, :-1]), x[:, 1:]).backward()
        if clip is not None and i == 0:
            assert torch.nn.utils.clip_grad_norm_(ref.parameters(), clip) > clip  # it fires
    want = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    for rank, grads in enumerate(pools.run(4, _two_train_steps, strategy, cfg, batches, clip)):
        for k, g in grads.items():
            torch.testing.assert_close(g, want[k], msg=lambda m: f"rank {rank} {strategy} {k}: {m}")
