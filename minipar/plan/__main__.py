"""The layouts of a model that fit a cluster, best first: memory per GPU, traffic per step, a step time.

``python -m minipar.plan --model llama3-70b --gpus 64``. ``--json`` prints {"layouts": [...]} for tools;
``--explain LAYOUT`` (a name from the table, e.g. tp8.pp4.dp2.cp1.ep1.zero1.mbs1.norc) shows the
arithmetic behind one layout's figures. A model is a preset (``--model``), a Hugging Face-style
config.json (``--config``), or flags overriding either. docs/planner.md explains the output.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from . import MEMORY_HEADROOM, Layout, evaluate, plan, validate
from ..fp8.config import SCALINGS, Float8Config
from .presets import H100, MODELS, ModelShape
from .progress import Progress
from .report import explain, table

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


MODEL_HELP = {"layers": "transformer blocks", "hidden": "model width (hidden size)", "heads": "attention heads",
              "kv_heads": "key/value heads (grouped-query attention; a custom model: --heads)",
              "ffn": "MLP width (intermediate size)", "vocab": "vocabulary size", "seq": "sequence length in tokens",
              "experts": "routed experts per MoE layer (0: a dense model)", "top_k": "experts each token is routed to",
              "moe_ffn": "one expert's MLP width"}
EXAMPLES = """examples:
  python -m minipar.plan --model llama3-70b --gpus 64 --global-batch 1024
  python -m minipar.plan --config config.json --gpus 16 --top 5 --json
  python -m minipar.plan --model gpt2-124m --gpus 2 --global-batch 64 --explain tp1.pp1.dp2.cp1.ep1.zero1.mbs1.norc
  python -m minipar.plan --model llama3-70b --gpus 64 --fp8 tensorwise --fp8-all-gather
docs/planner.md says what the figures mean and how the ranking is made."""


def parse(argv=None):
    """(the parser, the parsed arguments). Every option says what it is and its default (``--help``)."""
    ap = argparse.ArgumentParser(prog="python -m minipar.plan", description=__doc__.split("\n\n")[0],
                                 epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = ap.add_argument_group("the model (a preset, a config.json, or every size flag; flags override either)")
    model.add_argument("--model", choices=sorted(MODELS), metavar="NAME",
                       help=f"a preset: {', '.join(sorted(MODELS))} (default: none; give --model or --config)")
    model.add_argument("--config", metavar="PATH", help="a Hugging Face-style config.json (default: none)")
    for k in FLAGS:
        model.add_argument(f"--{k.replace('_', '-')}", type=int, metavar="N",
                           help=f"{MODEL_HELP[k]} (default: the preset's or config's)")
    cluster = ap.add_argument_group("the cluster (default: H100 nodes of 8)")
    cluster.add_argument("--gpus", type=int, default=8, metavar="N",
                         help="GPUs in all: a multiple of --gpus-per-node, or fewer (one node of that many) "
                              "(default: %(default)s)")
    cluster.add_argument("--gpus-per-node", type=int, default=H100.gpus_per_node, metavar="N",
                         help="GPUs per node, joined by NVLink (default: %(default)s)")
    cluster.add_argument("--memory-gb", type=float, default=H100.memory / 1e9, metavar="GB",
                         help="memory per GPU in GB (10^9 bytes); layouts must fit in "
                              f"{MEMORY_HEADROOM:.0%}% of it (default: %(default)g)")
    cluster.add_argument("--peak-tflops", type=float, default=H100.peak_flops / 1e12, metavar="TFLOPS",
                         help="dense bf16 peak per GPU (default: %(default)g)")
    cluster.add_argument("--fp8-peak-tflops", type=float, default=H100.fp8_flops / 1e12, metavar="TFLOPS",
                         help="dense FP8 peak per GPU, for --fp8's matmuls (default: %(default)g)")
    cluster.add_argument("--intra-gbps", type=float, default=H100.intra_bw / 1e9, metavar="GB/s",
                         help="bandwidth per GPU per direction inside a node (default: %(default)g)")
    cluster.add_argument("--inter-gbps", type=float, default=H100.inter_bw / 1e9, metavar="GB/s",
                         help="bandwidth per GPU per direction across nodes (default: %(default)g)")
    cluster.add_argument("--efficiency", type=float, default=H100.efficiency, metavar="SHARE",
                         help="the share of peak a large matmul-bound step reaches, in (0, 1] (default: %(default)g)")
    train = ap.add_argument_group("how it trains")
    train.add_argument("--fp8", choices=SCALINGS, metavar="RECIPE",
                       help=f"the blocks' linear layers in FP8 with this recipe ({', '.join(SCALINGS)}), as "
                            "MixedPrecision(fp8=Float8Config(RECIPE)) (default: none, bf16)")
    train.add_argument("--fp8-all-gather", action="store_true",
                       help="with --fp8: ZeRO-3 gathers those weights in FP8, Float8Config(all_gather=True) "
                            "(default: off)")
    run = ap.add_argument_group("the search and its output")
    run.add_argument("--global-batch", type=int, default=1024, metavar="N",
                     help="sequences per optimizer step (default: %(default)s)")
    run.add_argument("--top", type=int, default=10, metavar="N", help="how many layouts to list (default: %(default)s)")
    run.add_argument("--json", action="store_true",
                     help='print {"layouts": [...]} with every figure, for tools (default: a table)')
    run.add_argument("--explain", metavar="LAYOUT",
                     help="show the arithmetic behind one layout, named as in the table, e.g. "
                          "tp8.pp4.dp2.cp1.ep1.zero1.mbs1.norc (default: none: list the best layouts)")
    run.add_argument("--progress-after", type=float, default=3.0, metavar="SECONDS",
                     help="a search still running after this long prints a progress line with an ETA on "
                          "stderr; 0: always, inf: never (default: %(default)g)")
    return ap, ap.parse_args(argv)


def main(argv=None) -> int:
    """0 with layouts printed, 1 when none fits, 2 (argparse's usage error, message on stderr) for
    inputs that make no sense: every size and rate is validated before any arithmetic."""
    parser, args = parse(argv)
    try:
        model, cluster, fp8 = inputs(args)
        layout = Layout.parse(args.explain) if args.explain else None
    except ValueError as e:
        parser.error(str(e))  # exits 2
    if layout is not None:
        print(explain(model, cluster, args.global_batch, layout, fp8))
        return 1 if evaluate(model, cluster, args.global_batch, layout, fp8)["why"] else 0
    progress = Progress(f"{model.name} on {cluster.gpus} GPUs", after=args.progress_after)
    result = plan(model, cluster, args.global_batch, top=args.top, progress=progress, fp8=fp8)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(table(result))
    return 0 if result["layouts"] else 1


def inputs(args):
    """(model, cluster, fp8 config or None) from the arguments; ValueError for any that make no sense (`validate`)."""
    model = model_from(args)
    if args.explain and args.json:
        raise ValueError("--explain prints the arithmetic as text; leave out --json (or --explain)")
    for flag in ("gpus", "gpus_per_node"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1")
    if not args.progress_after >= 0:  # nan fails the comparison too
        raise ValueError(f"--progress-after {args.progress_after} must be seconds >= 0 (inf: never)")
    for flag in ("memory_gb", "peak_tflops", "fp8_peak_tflops", "intra_gbps", "inter_gbps", "efficiency"):
        if not 0 < getattr(args, flag) < math.inf:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be a finite number > 0")
    if args.gpus % args.gpus_per_node and args.gpus > args.gpus_per_node:
        raise ValueError(f"--gpus {args.gpus} is not a multiple of --gpus-per-node {args.gpus_per_node}")
    per_node = min(args.gpus, args.gpus_per_node)
    cluster = replace(H100, name=f"{args.gpus} GPUs", gpus_per_node=per_node,
                      nodes=args.gpus // per_node, memory=args.memory_gb * 1e9, peak_flops=args.peak_tflops * 1e12,
                      fp8_flops=args.fp8_peak_tflops * 1e12,
                      intra_bw=args.intra_gbps * 1e9, inter_bw=args.inter_gbps * 1e9, efficiency=args.efficiency)
    if args.fp8_all_gather and not args.fp8:
        raise ValueError("--fp8-all-gather gathers the FP8 weights of --fp8: give --fp8 RECIPE too")
    fp8 = Float8Config(args.fp8, all_gather=args.fp8_all_gather) if args.fp8 else None  # its own refusals
    validate(model, cluster, args.global_batch, args.top, fp8)
    return model, cluster, fp8


if __name__ == "__main__":
    sys.exit(main())
