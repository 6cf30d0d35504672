"""``python -m minipar.plan --model llama3-70b --gpus 64``: the feasible layouts, fastest first.

``--json`` prints {"layouts": [...]} for tools; ``--explain LAYOUT`` (a name from the table, e.g.
tp8.pp4.dp2.cp1.ep1.zero1.mbs1.norc) shows the arithmetic behind one layout's figures. A model is a
preset (``--model``), a Hugging Face-style config.json (``--config``), or flags overriding either.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from . import MEMORY_HEADROOM, Layout, evaluate, plan, validate
from .presets import H100, MODELS, ModelShape

GIB = 2**30
HF_KEYS = {"num_hidden_layers": "layers", "hidden_size": "hidden", "num_attention_heads": "heads",
           "num_key_value_heads": "kv_heads", "intermediate_size": "ffn", "vocab_size": "vocab",
           "max_position_embeddings": "seq", "n_routed_experts": "experts", "num_experts_per_tok": "top_k",
           "moe_intermediate_size": "moe_ffn", "n_shared_experts": "shared_experts",
           "first_k_dense_replace": "dense_layers", "tie_word_embeddings": "tied"}
FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "experts", "top_k", "moe_ffn")


def model_from(args) -> ModelShape:
    """The model the arguments describe; ValueError when they contradict each other or miss a size."""
    if args.model and args.config:
        raise ValueError(f"--model {args.model} and --config {args.config} both describe the model: give one "
                         "(flags such as --layers override either)")
    base = MODELS[args.model] if args.model else None
    fields = {}
    if args.config:
        try:
            with open(args.config) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"--config {args.config}: cannot read a JSON config ({e})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"--config {args.config}: a config.json is one JSON object, not {type(cfg).__name__}")
        fields = {ours: cfg[theirs] for theirs, ours in HF_KEYS.items() if cfg.get(theirs) is not None}
        fields.setdefault("kv_heads", fields.get("heads"))
    fields.update({k: getattr(args, k) for k in FLAGS if getattr(args, k) is not None})
    if base is None:
        missing = [k for k in ("layers", "hidden", "heads", "ffn", "vocab", "seq") if fields.get(k) is None]
        if missing:
            raise ValueError(f"give --model (one of {', '.join(MODELS)}) or --config, or every one of "
                             f"--{' --'.join(missing).replace('_', '-')}"
                             + (f" (missing from {args.config})" if args.config else ""))
        fields.setdefault("kv_heads", fields["heads"])
        return ModelShape(name=args.config or "custom", **fields)
    return replace(base, **fields)


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minipar.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS))
    ap.add_argument("--config", help="a Hugging Face-style config.json")
    for k in FLAGS:
        ap.add_argument(f"--{k.replace('_', '-')}", type=int)
    ap.add_argument("--gpus", type=int, default=8, help="GPUs in all (a multiple of --gpus-per-node)")
    ap.add_argument("--gpus-per-node", type=int, default=H100.gpus_per_node)
    ap.add_argument("--memory-gb", type=float, default=H100.memory / 1e9)
    ap.add_argument("--peak-tflops", type=float, default=H100.peak_flops / 1e12)
    ap.add_argument("--intra-gbps", type=float, default=H100.intra_bw / 1e9, help="GB/s per GPU inside a node")
    ap.add_argument("--inter-gbps", type=float, default=H100.inter_bw / 1e9, help="GB/s per GPU across nodes")
    ap.add_argument("--efficiency", type=float, default=H100.efficiency)
    ap.add_argument("--global-batch", type=int, default=1024, help="sequences per step")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--explain", metavar="LAYOUT")
    return ap, ap.parse_args(argv)


def main(argv=None) -> int:
    """0 with layouts printed, 1 when none fits, 2 (argparse's usage error, message on stderr) for
    inputs that make no sense: every size and rate is validated before any arithmetic."""
    parser, args = parse(argv)
    try:
        model, cluster = inputs(args)
        layout = Layout.parse(args.explain) if args.explain else None
    except ValueError as e:
        parser.error(str(e))  # exits 2
    if layout is not None:
        print(explain(model, cluster, args.global_batch, layout))
        return 1 if evaluate(model, cluster, args.global_batch, layout)["why"] else 0
    result = plan(model, cluster, args.global_batch, top=args.top)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(table(result))
    return 0 if result["layouts"] else 1


def inputs(args):
    """(model, cluster) from the arguments; ValueError for any that make no sense (`validate`)."""
    model = model_from(args)
    if args.explain and args.json:
        raise ValueError("--explain prints the arithmetic as text; leave out --json (or --explain)")
    for flag in ("gpus", "gpus_per_node"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1")
    for flag in ("memory_gb", "peak_tflops", "intra_gbps", "inter_gbps", "efficiency"):
        if not 0 < getattr(args, flag) < math.inf:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be a finite number > 0")
    if args.gpus % args.gpus_per_node and args.gpus > args.gpus_per_node:
        raise ValueError(f"--gpus {args.gpus} is not a multiple of --gpus-per-node {args.gpus_per_node}")
    per_node = min(args.gpus, args.gpus_per_node)
    cluster = replace(H100, name=f"{args.gpus} GPUs", gpus_per_node=per_node,
                      nodes=args.gpus // per_node, memory=args.memory_gb * 1e9, peak_flops=args.peak_tflops * 1e12,
                      intra_bw=args.intra_gbps * 1e9, inter_bw=args.inter_gbps * 1e9, efficiency=args.efficiency)
    validate(model, cluster, args.global_batch, args.top)
    return model, cluster


def table(result: dict) -> str:
    m, c = result["model"], result["cluster"]
    lines = [f"{m['name']} on {c['gpus_per_node'] * c['nodes']} GPUs ({c['nodes']} node(s) of {c['gpus_per_node']}, "
             f"{c['memory'] / 1e9:.0f} GB), global batch {result['global_batch']} x {m['seq']} tokens"]
    if not result["layouts"]:
        return "\n".join(lines + [result["why"]])
    lines.append(f"{'layout':44} {'m':>4} {'step s':>8} {'MFU':>5} {'bubble':>6} {'mem GiB':>8} {'state':>6} "
                 f"{'act':>6} {'intra GB':>9} {'inter GB':>9}")
    for r in result["layouts"]:
        mem = r["memory"]
        state = mem["params"] + mem["grads"] + mem["optimizer"]
        lines.append(f"{r['layout']:44} {r['microbatches']:>4} {r['step_s']:>8.2f} {r['mfu']:>5.2f} "
                     f"{r['bubble']:>6.2f} {mem['total'] / GIB:>8.1f} {state / GIB:>6.1f} {mem['activations'] / GIB:>6.1f} "
                     f"{r['comm_by_link']['intra'] / 1e9:>9.2f} {r['comm_by_link']['inter'] / 1e9:>9.2f}")
    lines.append(f"({result['rejected']} layouts do not fit in {MEMORY_HEADROOM:.0%} of memory; --json for every "
                 "figure, --explain LAYOUT for the arithmetic)")
    return "\n".join(lines)


def explain(model: ModelShape, cluster, global_batch: int, lay: Layout) -> str:
    r = evaluate(model, cluster, global_batch, lay)
    if r["why"]:
        return f"{lay.name}: not a layout for {model.name} on {cluster.gpus} GPUs: {r['why']}"
    mem, gib = r["memory"], lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    dp = r["dp"] * r["cp"]
    lines = [f"{lay.name} for {model.name} ({model.params() / 1e9:.1f}B parameters, "
             f"{model.params(True) / 1e9:.1f}B active) on {cluster.gpus} GPUs; worst stage {r['worst_stage']}",
             "memory per rank (minipar.plan.formulas.state_bytes over this stage's tp/ep shard, padding exact):",
             f"  params {gib(mem['params'])}, grads {gib(mem['grads'])}, optimizer {gib(mem['optimizer'])}"
             f"   [{lay.strategy}: bf16 params/grads, fp32 master + 2 moments, sharded over {dp} dp x cp ranks]"
             if lay.strategy != "ddp" else
             f"  params {gib(mem['params'])}, grads {gib(mem['grads'])}, optimizer {gib(mem['optimizer'])}   [ddp: 4 + 4 + 8 bytes/param]",
             f"  activations {gib(mem['activations'])} (without recomputation {gib(mem['activations_full'])}, with "
             f"{gib(mem['activations_recompute'])}): layers x in-flight micro-batches (1F1B: min(pp - stage, m)) x "
             f"layer_activation_bytes(micro-batch {lay.micro_batch} x seq {model.seq} / cp {lay.cp}, /tp {lay.tp} with sp) + logits",
             f"  buffers {gib(mem['buffers'])}; total {gib(mem['total'])} of {MEMORY_HEADROOM:.0%} x "
             f"{gib(cluster.memory)}: {'fits' if r['fits'] else 'does NOT fit'}",
             "communication per step per rank (wire bytes; ring algorithm):"]
    for axis, row in r["comm"].items():
        lines.append(f"  {axis:13} {row['bytes'] / 1e9:10.3f} GB payload  {row['wire'] / 1e9:10.3f} GB on the wire  "
                     f"{row['link']}-node -> {r['comm_s'][axis]:.3f} s")
    lines += [f"time: compute = 6·N·tokens (+ attention{', 8·N with recomputation' if lay.recompute else ''}) / "
              f"(GPUs · {cluster.peak_flops / 1e12:.0f} TFLOP/s · {cluster.efficiency}) = {r['compute_s']:.3f} s",
              f"      bubble = compute · (pp - 1) / m = {r['compute_s']:.3f} · {lay.pp - 1} / {r['microbatches']} = "
              f"{r['bubble_s']:.3f} s  ((p-1)/(m+p-1) = {r['bubble']:.3f} of the step)",
              "      exposed communication: " + ", ".join(f"{k} {v:.3f} s" for k, v in r["exposed_s"].items()),
              f"      step = {r['step_s']:.3f} s; {r['tokens_per_s']:,.0f} tokens/s; MFU {r['mfu']:.3f}"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
