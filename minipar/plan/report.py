"""The planner's answers as text: `table` (the ranked layouts) and `explain` (one layout's arithmetic).

Times and sizes go through `minipar.plan.readable` (us/ms/s; B/KB/MB/GB, decimal), so a 48 ms step
reads "48.3 ms" and a 250 MB gradient exchange "250 MB", whatever the model's scale.
"""

from __future__ import annotations

from . import MEMORY_HEADROOM, Layout, evaluate
from .layout import registered
from . import formulas as F
from .presets import Cluster, ModelShape
from .readable import count, seconds, size

COLUMNS = (("layout", 44, "<"), ("m", 5, ">"), ("step", 9, ">"), ("MFU", 5, ">"), ("bubble", 6, ">"),
           ("memory", 9, ">"), ("state", 9, ">"), ("activ.", 9, ">"), ("intra", 9, ">"), ("inter", 9, ">"))


def _row(cells) -> str:
    return " ".join(f"{cell:{align}{width}}" for cell, (_, width, align) in zip(cells, COLUMNS)).rstrip()


def table(result: dict) -> str:
    """`plan`'s result as a table, best first: per layout the micro-batches per step (m), the predicted
    step time, MFU, the pipeline bubble's share, memory per GPU (total, of it the parameters, gradients
    and optimizer state, and the activations) and the wire bytes per step inside a node and across."""
    m, c = result["model"], result["cluster"]
    lines = [f"{m['name']} on {c['gpus_per_node'] * c['nodes']} GPUs ({c['nodes']} node(s) of {c['gpus_per_node']}, "
             f"{size(c['memory'])} each), global batch {result['global_batch']} x {m['seq']} tokens"
             + (f"; FP8 {result['fp8']['scaling']}{', ZeRO-3 gathering in FP8' if result['fp8']['all_gather'] else ''} "
                "(MFU against the bf16 peak)" if result.get("fp8") else "")]
    if not result["layouts"]:
        return "\n".join(lines + [result["why"]])
    lines.append(_row(name for name, _, _ in COLUMNS))
    for r in result["layouts"]:
        mem = r["memory"]
        lines.append(_row((r["layout"], r["microbatches"], seconds(r["step_s"]), f"{r['mfu']:.2f}", f"{r['bubble']:.2f}",
                           size(mem["total"]), size(mem["params"] + mem["grads"] + mem["optimizer"]),
                           size(mem["activations"]), size(r["comm_by_link"]["intra"]),
                           size(r["comm_by_link"]["inter"]))))
    lines += ["best first: the fastest; among equal step times, the fewer bytes moved per step, then the less memory",
              "m: micro-batches per step; memory per GPU (state: params + grads + optimizer; activ.: activations); "
              "intra, inter: wire bytes per step inside a node, across nodes",
              f"{result['rejected']} layouts do not fit in {MEMORY_HEADROOM:.0%} of memory; --json for every figure, "
              "--explain LAYOUT for the arithmetic"]
    return "\n".join(lines)


def _state_note(strategy: str, ranks: int) -> str:
    """What the state figures assume, read from what the strategy shards (its registration)."""
    split = F.shards(registered(strategy))
    if not split:
        return f"[{strategy}: fp32, 4 + 4 + 8 bytes/param, nothing sharded]"
    kept = ", ".join(sorted(split, key=("optimizer", "grads", "params").index))
    return f"[{strategy}: bf16 params/grads, fp32 master + 2 moments; {kept} sharded over {ranks} dp x cp ranks]"


def explain(model: ModelShape, cluster: Cluster, global_batch: int, lay: Layout, fp8=None) -> str:
    """The arithmetic behind one layout's figures, or why it is not a layout for this model and cluster
    (``fp8``: a `minipar.fp8.Float8Config`, as `minipar.plan.plan` takes it)."""
    r = evaluate(model, cluster, global_batch, lay, fp8)
    if r["why"]:
        return f"{lay.name}: not a layout for {model.name} on {cluster.gpus} GPUs: {r['why']}"
    mem = r["memory"]
    dp = r["dp"] * r["cp"]
    state = f"  params {size(mem['params'])}, grads {size(mem['grads'])}, optimizer {size(mem['optimizer'])}   "
    lines = [f"{lay.name} for {model.name} ({count(model.params())} parameters, {count(model.params(True))} "
             f"active) on {cluster.gpus} GPUs; worst stage {r['worst_stage']}",
             "memory per rank (minipar.plan.formulas.state_bytes over this stage's tp/ep shard, padding exact):",
             state + _state_note(lay.strategy, dp),
             f"  activations {size(mem['activations'])} (without recomputation {size(mem['activations_full'])}, with "
             f"{size(mem['activations_recompute'])}): layers x in-flight micro-batches (1F1B: min(pp - stage, m)) x "
             f"layer_activation_bytes(micro-batch {lay.micro_batch} x seq {model.seq} / cp {lay.cp}, /tp {lay.tp} with sp) + logits",
             f"  buffers {size(mem['buffers'])}; total {size(mem['total'])} of {MEMORY_HEADROOM:.0%} x "
             f"{size(cluster.memory)}: {'fits' if r['fits'] else 'does NOT fit'}",
             "communication per step per rank (wire bytes; ring algorithm):"]
    for axis, row in r["comm"].items():
        lines.append(f"  {axis:13} {size(row['bytes']):>9} payload  {size(row['wire']):>9} on the wire  "
                     f"{row['link']}-node -> {seconds(r['comm_s'][axis])}")
    lines += [f"  in all {size(r['wire_per_step'])} on the wire per step (the tie-break between equal step times)",
              f"time: compute = 6·N·tokens (+ attention{', 8·N with recomputation' if lay.recompute else ''}) / "
              f"(GPUs · {cluster.peak_flops / 1e12:.0f} TFLOP/s · {cluster.efficiency}) = {seconds(r['compute_s'])}"
              if fp8 is None else
              f"time: compute = the blocks' linear matmuls ({r['fp8_flops_share']:.1%} of 6·N·tokens + attention"
              f"{', 8·N with recomputation' if lay.recompute else ''}) at {cluster.fp8_flops / 1e12:.0f} TFLOP/s "
              f"(FP8 {fp8.scaling}), the rest at {cluster.peak_flops / 1e12:.0f}, over GPUs · {cluster.efficiency} "
              f"= {seconds(r['compute_s'])}; casts not counted: a bound",
              _fp8_gather_line(r["comm"]) if fp8 is not None and fp8.all_gather else "",
              f"      bubble = compute · (pp - 1) / m = {seconds(r['compute_s'])} · {lay.pp - 1} / {r['microbatches']} = "
              f"{seconds(r['bubble_s'])}  ((p-1)/(m+p-1) = {r['bubble']:.3f} of the step)",
              "      exposed communication: " + ", ".join(f"{k} {seconds(v)}" for k, v in r["exposed_s"].items()),
              f"      (tp with collective matmul, async_comm=True: at best {seconds(r['exposed_tp_async_s'])} exposed, "
              "each hop behind a chunk's matmul: minipar.plan.overlap)" if lay.tp > 1 else "",
              _dualpipe_line(r["dualpipe_v"], seconds) if r.get("dualpipe_v") else "",
              f"      step = {seconds(r['step_s'])}; {r['tokens_per_s']:,.0f} tokens/s; MFU {r['mfu']:.3f}"]
    return "\n".join(line for line in lines if line)


def _fp8_gather_line(comm: dict) -> str:
    return ("      (Float8Config(all_gather=True): the blocks' linear weights gather as e4m3 bytes, one a weight, "
            "after their amaxes (tag param_amax): minipar.plan.formulas.fp8_gather_calls)")


def _dualpipe_line(d: dict, seconds) -> str:
    return (f"      (schedule='dualpipe_v': bubble {seconds(d['bubble_s'])} ({d['bubble']:.3f} of the step), "
            f"ep all-to-all {seconds(d['exposed_ep_s'])} exposed with {d['pairs']} overlapped pairs on the "
            f"slowest rank; step {seconds(d['step_s'])}: minipar.plan.overlap)")
