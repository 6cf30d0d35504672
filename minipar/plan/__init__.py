"""The planner: which layouts of a model fit a cluster, and which is fastest, on paper.

``plan(model, cluster, global_batch)`` enumerates layouts (tp up to a node, pp, cp, ep, a data-parallel
strategy, micro-batch size, recomputation), predicts each one's per-rank memory and per-step
communication with `minipar.plan.formulas` (the arithmetic tests/test_plan.py proves equal to what minipar
measures), drops those that do not fit, and ranks the rest by a roofline step time:

    compute   = training FLOPs / (GPUs · peak · efficiency)        (6N per token, 8N with recomputation,
                                                                   plus causal attention's 6·L·s·h)
    bubble    = compute · (pp - 1) / m                             (1F1B: (p - 1) / (m + p - 1) of the step)
    exposed   = tp + ep + pp traffic in full, cp beyond the attention it overlaps, dp beyond the
                backward it overlaps (without a pipeline 2/3 of compute; under one, the last micro-batch's)
    step      = compute + bubble + exposed

each traffic figure being wire bytes over the bandwidth of its link class: a group whose ranks fit in
one node talks over NVLink, any other over the network. Equal step times (common: the backward hides
every data-parallel strategy's traffic alike) are broken by the bytes moved per step, then by memory
(`rank_key`). ``python -m minipar.plan`` prints it (docs/planner.md).

With ``fp8`` (a `minipar.fp8.Float8Config`, as `MixedPrecision(fp8=...)` takes it) the blocks' linear
matmuls count at the cluster's FP8 peak (the LM head, the router and attention's products at bf16's);
memory is unchanged (minipar saves X and W in their own dtype and quantises inside each matmul); with
``all_gather=True`` ZeRO-3 gathers those weights at one byte an element (`formulas.fp8_gather_calls`).
A layout whose tensor-parallel shards are not multiples of the recipe's tile is refused, as
`minipar.fp8.apply_fp8` refuses it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Callable

from minipar.plan import compute as C, formulas as F, model_traffic as T
from minipar.core.comm import wire_bytes

from ..data_parallel.strategy import planned_strategies, strategy_entry
from ..fp8.config import Float8Config
from ..fp8.linear import FORMS
from .layout import Layout, positive_int, registered, strategies
from .overlap import dualpipe_v_times, exposed_comm_s
from .presets import H100, MODELS, Cluster, ModelShape
from .readable import size



MEMORY_HEADROOM = 0.9  # allocator fragmentation and the framework's own buffers: plan for 90%


def validate(model: ModelShape, cluster: Cluster, global_batch: int, top: int | None = None,
             fp8: Float8Config | None = None) -> None:
    """ValueError naming the first input that makes no sense: a size that is not a positive integer,
    a rate or memory that is not a positive finite number, an efficiency outside (0, 1], or options
    that contradict each other (heads that do not divide the width, expert options without experts).
    Without it the arithmetic runs on anyway and prints negative or infinite step times."""
    for key in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"):
        positive_int(f"model {key}", getattr(model, key))
    for key in ("experts", "top_k", "moe_ffn", "shared_experts", "dense_layers"):
        if isinstance(getattr(model, key), bool) or not isinstance(getattr(model, key), int) or getattr(model, key) < 0:
            raise ValueError(f"model {key}={getattr(model, key)!r} must be an integer >= 0")
    if model.hidden % model.heads:
        raise ValueError(f"model hidden={model.hidden} must be divisible by heads={model.heads} (the head size)")
    if model.kv_heads > model.heads or model.heads % model.kv_heads:
        raise ValueError(f"model kv_heads={model.kv_heads} must divide heads={model.heads} (grouped-query attention)")
    if model.experts:
        if not 1 <= model.top_k <= model.experts or model.moe_ffn < 1:
            raise ValueError(f"an MoE model (experts={model.experts}) needs 1 <= top_k <= experts (got "
                             f"{model.top_k}) and moe_ffn >= 1 (got {model.moe_ffn})")
        if model.dense_layers >= model.layers:
            raise ValueError(f"dense_layers={model.dense_layers} leaves none of the {model.layers} layers MoE; "
                             "give fewer dense layers, or experts=0 for a dense model")
    else:
        given = [f"{k}={getattr(model, k)}" for k in ("top_k", "moe_ffn", "shared_experts", "dense_layers")
                 if getattr(model, k)]
        if given:
            raise ValueError(f"{', '.join(given)} describe experts, but the model has experts=0; give the "
                             "number of experts (--experts), or leave the expert options out")
    positive_int("gpus_per_node", cluster.gpus_per_node)
    positive_int("nodes", cluster.nodes)
    for key in ("memory", "peak_flops", "fp8_flops", "intra_bw", "inter_bw", "efficiency"):
        value = getattr(cluster, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"cluster {key}={value!r} must be a finite number > 0")
    if cluster.efficiency > 1:
        raise ValueError(f"cluster efficiency={cluster.efficiency} is a share of peak: at most 1")
    positive_int("global batch", global_batch)
    if top is not None:
        positive_int("top", top)
    if fp8 is not None and not isinstance(fp8, Float8Config):
        raise ValueError(f"fp8={fp8!r} must be a minipar.fp8.Float8Config (as MixedPrecision(fp8=...) takes) or None")


def _param_bytes(strategy: str) -> int:
    """Compute bytes per element: 2 (bf16) for a strategy that takes mixed precision, else 4 (DDP's fp32)."""
    return 2 if "mixed_precision" in strategy_entry(registered(strategy)).options else 4


def _dp(model: ModelShape, cluster: Cluster, lay: Layout) -> F.DataParallelShape:
    """The data-parallel strategy of ``lay``: one that takes no mixed precision (DDP) in fp32, the others
    (the ZeRO stages) in bf16 with fp32 masters; hsdp is zero3 sharded within a node, replicated across."""
    strategy = registered(lay.strategy)
    grad_ranks = lay.dp * lay.cp
    shard = None
    if lay.strategy == "hsdp":
        per_node = max(1, cluster.gpus_per_node // (lay.tp * lay.cp))
        shard = math.gcd(lay.dp, per_node) * lay.cp
    edp = lay.dp // lay.ep * lay.cp
    return F.DataParallelShape(strategy, grad_ranks, shard, edp=edp, param=_param_bytes(strategy),
                          bucket_cap_mb=25.0, reshard_after_forward=lay.pp == 1, cp=lay.cp)


@lru_cache(maxsize=1024)
def _stage_params(model: ModelShape, tp: int, ep: int, pp: int, stage: int, fp8_form: str | None = None) -> F.ParamSet:
    """One stage's tensors on a tp/ep rank: the same whatever the strategy, micro-batch or recomputation
    (``fp8_form``: the blocks' linear weights gathered in FP8 with that scale form)."""
    return model.stage_params(tp, ep, pp, stage, fp8_form)


def _fp8_form(fp8: Float8Config | None, dp: F.DataParallelShape) -> str | None:
    """The scale form of the weights ZeRO-3 gathers in FP8 under ``fp8``, or None (no FP8 gather)."""
    gathers = fp8 is not None and fp8.all_gather and "params" in F.shards(dp.strategy)
    return FORMS[fp8.scaling][1] if gathers else None


@lru_cache(maxsize=4096)
def _stage_state(model: ModelShape, lay: Layout, dp: F.DataParallelShape, stage: int, fp8_form: str | None = None):
    """(state bytes, largest unit numel, dp traffic per step, dp traffic per backward) of one stage's
    rank: independent of recomputation and of the micro-batch size, so cached across them (the caller
    passes ``lay`` with micro_batch=1, recompute=False). The step's dp traffic over m micro-batches is
    per step + m x per backward: summing each repeated call once, never the whole list (for ZeRO-3
    over 1,024 micro-batches it holds ~10^5 calls)."""
    ps = _stage_params(model, lay.tp, lay.ep, lay.pp, stage, fp8_form)
    unit = max(sum(ps.tensors[i].numel() for i in u) for u in ps.units)
    per_step: list[F.Call] = []
    per_backward: list[F.Call] = []
    for calls, step_times, backward_times in F.dp_repeats(ps, dp, pipeline=lay.pp > 1):
        per_step += calls * step_times
        per_backward += calls * backward_times
    return F.state_bytes(ps, dp), unit, F.summarize(per_step), F.summarize(per_backward)


def _dp_traffic(per_step: dict, per_backward: dict, m: int) -> dict:
    """{axis: {"bytes", "wire"}} of a step of m micro-batches (a new dict: the cached ones stay clean)."""
    return {axis: {key: per_step.get(axis, {}).get(key, 0) + m * per_backward.get(axis, {}).get(key, 0)
                   for key in ("bytes", "wire")} for axis in {**per_step, **per_backward}}


def _link(axis: str, lay: Layout, cluster: Cluster) -> str:
    """"intra" when every group of ``axis`` lies inside one node (mesh order: pp, dp, cp, tp fastest)."""
    if axis == "dp_shard":
        return "intra"  # hsdp shards within a node (`_dp`)
    span = {"tp": lay.tp, "cp": lay.tp * lay.cp, "ep": lay.tp * lay.cp * lay.ep,
            "pp": lay.tp * lay.cp * lay.dp * lay.pp}.get(axis, lay.tp * lay.cp * lay.dp)
    return "intra" if span <= cluster.gpus_per_node else "inter"


def evaluate(model: ModelShape, cluster: Cluster, global_batch: int, lay: Layout,
             fp8: Float8Config | None = None) -> dict:
    """Every prediction for one layout: memory per rank, traffic per axis and link, times. ``feasible``
    False with ``why`` when it cannot run or does not fit. ``fp8``: train the linear layers in FP8 (the
    module docstring). ValueError for nonsense inputs (`validate`)."""
    validate(model, cluster, global_batch, fp8=fp8)
    return _predict(model, cluster, global_batch, lay, _refusal(model, cluster, global_batch, lay, fp8), fp8)


def _predict(model: ModelShape, cluster: Cluster, global_batch: int, lay: Layout, why: str,
             fp8: Float8Config | None = None) -> dict:
    """`evaluate` once ``why`` (`_refusal`'s answer) is known."""
    gpus = lay.tp * lay.pp * lay.dp * lay.cp
    m = max(1, global_batch // (lay.dp * lay.micro_batch)) if not why else 1
    act_b = _param_bytes(lay.strategy)  # bf16 activations, fp32 for a strategy without mixed precision
    tokens = lay.micro_batch * model.seq // lay.cp  # one micro-batch's tokens on a cp rank
    kv_hidden = max(1, model.kv_heads // lay.tp) * model.head_dim * lay.tp
    ffn = model.moe_ffn * (model.top_k + model.shared_experts) if model.experts else model.ffn
    per_layer = C.layer_activation_bytes(tokens, model.hidden, kv_hidden, ffn, act_b, lay.tp, True, model.gated)
    boundary = C.checkpointed_layer_bytes(tokens, model.hidden, act_b, lay.tp)  # a block's input, sequence-parallel
    dp = _dp(model, cluster, lay)
    worst: dict = {}
    for stage in sorted({0, lay.pp - 1, min(1, lay.pp - 1)}):
        # micro-batch size and recomputation change neither the state nor the dp traffic (m carries the count)
        base = replace(lay, micro_batch=1, recompute=False)
        state, unit, per_step, per_backward = _stage_state(model, base, dp, stage, _fp8_form(fp8, dp))
        dp_traffic = _dp_traffic(per_step, per_backward, m)
        layers = model.stage_layers(lay.pp, stage)
        in_flight = min(lay.pp - stage, m)  # 1F1B: stage s holds p - s micro-batches at its peak
        full = layers * per_layer * in_flight
        recomputed = layers * boundary * in_flight + per_layer  # block inputs, plus one block redone
        logits = tokens * model.vocab // lay.tp * 6 if stage == lay.pp - 1 else 0  # bf16 logits + fp32 grad
        act = (recomputed if lay.recompute else full) + logits
        buffers = 2 * unit * act_b if "params" in F.shards(dp.strategy) else 2 * 25 * 2**20
        mem = dict(state, activations=act, activations_full=full + logits, activations_recompute=recomputed + logits,
                   buffers=buffers)
        mem["total"] = state["params"] + state["grads"] + state["optimizer"] + act + buffers
        if not worst or mem["total"] > worst["memory"]["total"]:
            worst = dict(stage=stage, memory=mem, dp_traffic=dp_traffic, layers=layers)
    traffic = worst["dp_traffic"]
    layers = worst["layers"]
    tp_calls = T.tp_calls(layers, tokens * model.hidden * act_b, lay.tp, True)
    if lay.recompute:
        tp_calls += T.tp_calls(layers, tokens * model.hidden * act_b, lay.tp, True, backward=False)
    # each is issued once per micro-batch: summarize one micro-batch's calls, times m
    for calls in (tp_calls, T.pp_calls(min(1, lay.pp - 1), lay.pp, 1, boundary),
                  T.ring_calls(layers, lay.micro_batch, max(1, model.kv_heads // lay.tp), model.seq,
                               model.head_dim, lay.cp, act_b)):
        traffic.update(F.summarize(calls, times=m))
    if lay.ep > 1:
        moe = sum(1 for i in range(model.layers) if i >= model.dense_layers) * layers // model.layers
        sent = T.ep_bytes(tokens // lay.tp, model.top_k, model.hidden, act_b, moe) * m
        traffic["ep"] = {"bytes": sent, "wire": wire_bytes("all_to_all", lay.ep, sent)}
    for axis, row in traffic.items():
        row["link"] = _link(axis, lay, cluster)
    return dict(layout=lay.name, **asdict(lay), gpus=gpus, microbatches=m, feasible=not why, why=why,
                **_times(model, cluster, global_batch, lay, m, traffic, worst["memory"], fp8), memory=worst["memory"],
                comm=traffic, comm_by_link=_by_link(traffic), wire_per_step=sum(_by_link(traffic).values()),
                worst_stage=worst["stage"])


def _refusal(model: ModelShape, cluster: Cluster, global_batch: int, lay: Layout,
             fp8: Float8Config | None = None) -> str:
    """Why ``lay`` cannot run ("" when it can)."""
    gpus = lay.tp * lay.pp * lay.dp * lay.cp
    if gpus != cluster.gpus:
        return f"tp·pp·dp·cp = {gpus}, not the cluster's {cluster.gpus} GPUs"
    if model.heads % lay.tp or lay.tp > cluster.gpus_per_node:
        return f"tp={lay.tp} must divide the {model.heads} heads and fit in a node of {cluster.gpus_per_node}"
    if lay.pp > model.layers:
        return f"pp={lay.pp} > {model.layers} layers"
    if global_batch % (lay.dp * lay.micro_batch):
        return f"global batch {global_batch} does not split into dp={lay.dp} x micro-batch {lay.micro_batch}"
    if lay.ep > 1 and (not model.experts or lay.dp % lay.ep or model.experts % lay.ep):
        return f"ep={lay.ep} must divide dp={lay.dp} and the {model.experts} experts"
    if model.seq % (2 * lay.cp * lay.tp):
        return f"sequence {model.seq} does not split into 2·cp·tp = {2 * lay.cp * lay.tp} chunks"
    return _fp8_refusal(model, lay, fp8) if fp8 is not None else ""


def _fp8_refusal(model: ModelShape, lay: Layout, fp8: Float8Config) -> str:
    """What `minipar.fp8` would refuse: a linear weight's tp shard whose dims are not multiples of the
    recipe's tile, or the FP8 all-gather under a strategy that gathers no parameters."""
    if fp8.all_gather and "params" not in F.shards(registered(lay.strategy)):
        return f"Float8Config(all_gather=True) needs a strategy that gathers parameters (zero3, hsdp), not {lay.strategy}"
    for moe in {False, model.experts > 0}:
        for t in model.block_sizes(lay.tp, lay.ep, moe):
            if len(t) > 2 and any(d % fp8.tile for d in t[2]):
                return (f"FP8 ({fp8.scaling}) needs linear weights whose tp={lay.tp} shards are multiples of "
                        f"{fp8.tile}: one is {t[2][0]} x {t[2][1]}")
    return ""


@lru_cache(maxsize=64)
def _active_params(model: ModelShape) -> int:
    """`ModelShape.params(active=True)`, once per model rather than once per layout (it sums every layer)."""
    return model.params(active=True)


def _times(model: ModelShape, cluster: Cluster, global_batch: int, lay: Layout, m: int, traffic: dict,
           mem: dict, fp8: Float8Config | None = None) -> dict:
    gpus = lay.tp * lay.pp * lay.dp * lay.cp
    tokens = global_batch * model.seq
    active = _active_params(model)
    flops = C.training_flops(active, tokens, model.layers, model.seq, model.hidden, lay.recompute)
    # under FP8 the blocks' linear matmuls (6 or 8 FLOPs per weight and token) run at the FP8 peak
    fp8_flops = C.training_flops(model.linear_params(), tokens, 0, model.seq, model.hidden, lay.recompute) \
        if fp8 is not None else 0
    compute = ((flops - fp8_flops) / cluster.peak_flops + fp8_flops / cluster.fp8_flops) / (gpus * cluster.efficiency)
    bubble = compute * (lay.pp - 1) / m
    seconds = {axis: row["wire"] / (cluster.intra_bw if row["link"] == "intra" else cluster.inter_bw)
               for axis, row in traffic.items()}
    attention_share = model.layers * model.seq * model.hidden / (active + model.layers * model.seq * model.hidden)
    overlap_dp = (2 / 3) * compute / (m if lay.pp > 1 else 1)
    dp_time = sum(t for a, t in seconds.items() if a in ("dp", "dp_cp", "dp_shard", "dp_replicate", "edp"))
    exposed = {"dp": max(0.0, dp_time - overlap_dp), "cp": max(0.0, seconds.get("cp", 0) - compute * attention_share),
               "tp": seconds.get("tp", 0), "pp": seconds.get("pp", 0), "ep": seconds.get("ep", 0)}
    step = compute + bubble + sum(exposed.values())
    fits = mem["total"] <= cluster.memory * MEMORY_HEADROOM
    # With collective matmul (TensorParallelConfig(async_comm=True)) each tp hop flies during a chunk's
    # matmul: the linear layers' compute, (tp - 1)/tp of it split over the hops (`minipar.plan.overlap`).
    # Reported beside the ranking, not in it: minipar overlaps fc, lm_head and the row-parallel layers,
    # not q/k/v's shared gather, so this is the bound collective matmul approaches.
    linear = compute - flops * attention_share / (gpus * cluster.peak_flops * cluster.efficiency)  # all but attention
    tp_async = exposed_comm_s(lay.tp, exposed["tp"] / max(lay.tp - 1, 1), linear / lay.tp) if lay.tp > 1 else 0.0
    # Under schedule="dualpipe_v" (two chunks per rank: 2·pp layers at least) the ramp is ZB-V's and the
    # overlapped pairs hide the ep all-to-all behind the other half's compute (`minipar.plan.overlap`).
    # Beside the ranking too: it is a schedule choice within the layout.
    dualpipe = None
    if lay.pp > 1 and model.layers >= 2 * lay.pp:
        dualpipe = dualpipe_v_times(lay.pp, m, compute, exposed["ep"])
        dualpipe["step_s"] = step - bubble - exposed["ep"] + dualpipe["bubble_s"] + dualpipe["exposed_ep_s"]
    return dict(step_s=step, compute_s=compute, fp8_flops_share=fp8_flops / flops, bubble_s=bubble,
                bubble=C.bubble_fraction(lay.pp, m),
                exposed_s=exposed, exposed_tp_async_s=tp_async, dualpipe_v=dualpipe, comm_s=seconds,
                tokens_per_s=tokens / step,
                mfu=6 * active * tokens / step / (gpus * cluster.peak_flops), fits=fits)


def _by_link(traffic: dict) -> dict:
    out = {"intra": 0, "inter": 0}
    for row in traffic.values():
        out[row["link"]] += row["wire"]
    return out


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(1, limit))) + 1)]


def layouts(model: ModelShape, cluster: Cluster, global_batch: int, fp8: Float8Config | None = None) -> list[Layout]:
    """Every layout worth predicting: powers of two per axis, tp within a node, cp up to sequence / 4096
    (so only for sequences of 8k tokens and more), ep only for MoE models."""
    out = []
    for tp in [t for t in _powers(cluster.gpus_per_node) if model.heads % t == 0]:
        for cp in _powers(max(1, model.seq // 4096)):
            for pp in [p for p in _powers(model.layers) if cluster.gpus % (tp * cp * p) == 0]:
                dp = cluster.gpus // (tp * cp * pp)
                if dp < 1:
                    continue
                for ep in ([e for e in _powers(min(dp, model.experts)) if model.experts % e == 0]
                           if model.experts else [1]):
                    for strategy in strategies():
                        for mbs in (1, 2, 4):
                            for rc in (False, True):
                                lay = Layout(tp, pp, dp, cp, ep, strategy, mbs, rc)
                                if not _refusal(model, cluster, global_batch, lay, fp8):
                                    out.append(lay)
    return out


def rank_key(result: dict) -> tuple:
    """How `plan` orders layouts: fastest first; among those whose step times agree to 9 significant
    digits (the same time but for float rounding: e.g. every data-parallel strategy whose traffic the
    backward hides), the one moving fewer bytes per step (wire bytes, every axis and link), then the
    one needing less memory per GPU, then by name (a stable order)."""
    return (float(f"{result['step_s']:.9g}"), result["wire_per_step"], result["memory"]["total"], result["layout"])


def plan(model: ModelShape | str, cluster: Cluster | None = None, global_batch: int = 1024,
         top: int | None = None, progress: Callable[[int, int], None] | None = None,
         fp8: Float8Config | None = None) -> dict:
    """{"layouts": the feasible layouts, best first (`rank_key`; each `evaluate`'s dict), "model", "cluster",
    "global_batch", "fp8", "rejected": how many did not fit, "closest": the smallest infeasible one when none
    fits}. ``progress(done, total)`` is called after each layout predicted (`minipar.plan.progress.Progress`);
    ``fp8``: train the linear layers in FP8 (the module docstring). ValueError for nonsense inputs (`validate`)."""
    if isinstance(model, str) and model not in MODELS:
        raise ValueError(f"unknown model {model!r}; the presets are {', '.join(MODELS)}")
    model = MODELS[model] if isinstance(model, str) else model
    cluster = cluster or H100
    validate(model, cluster, global_batch, top, fp8)
    candidates = layouts(model, cluster, global_batch, fp8)
    results = []
    for done, lay in enumerate(candidates, 1):
        # layouts() keeps only those _refusal lets through: predict them without asking it again
        results.append(_predict(model, cluster, global_batch, lay, "", fp8))
        if progress is not None:
            progress(done, len(candidates))
    fits = sorted((r for r in results if r["fits"]), key=rank_key)
    out = dict(model=asdict(model), cluster=asdict(cluster), global_batch=global_batch,
               fp8=asdict(fp8) if fp8 is not None else None, layouts=fits[:top] if top else fits, rejected=len(results) - len(fits))
    if not fits:
        closest = min(results, key=lambda r: r["memory"]["total"], default=None)
        out["closest"] = closest
        out["why"] = ("no layout was possible for this model and GPU count" if closest is None else
                      f"nothing fits: the smallest layout, {closest['layout']}, needs "
                      f"{size(closest['memory']['total'])} per GPU, more than "
                      f"{MEMORY_HEADROOM:.0%} of {size(cluster.memory)}")
    return out
