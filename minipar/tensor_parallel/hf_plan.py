"""A Hugging Face model's own tensor-parallel plan, in minipar's styles.

transformers models carry a plan: ``model.tp_plan`` (a dict, not a method), made of the
config's ``base_model_tp_plan`` under the base model's prefix (``"model."`` for
``LlamaForCausalLM``) and the class's ``_tp_plan`` (the LM head), e.g.
``{"model.layers.*.self_attn.q_proj": "colwise", ..., "lm_head": "colwise_gather_output"}``.
Its styles are DTensor layouts of each module's input and output (transformers 5,
``transformers.distributed.tensor_parallel``); `hf_plan` keeps the entries whose
meaning minipar computes exactly and refuses the plan, naming each other entry and
why, before any collective:

    HF style                          means                                      minipar
    colwise                           in replicated, out split on features       "colwise"
    colwise_gather_output, _rep       in replicated, out gathered (replicated)   "colwise_gather"
    rowwise                           in split on features, out summed           "rowwise"
    rowwise_split_input, _rep         in replicated (each rank takes its slice)  "rowwise_scatter"
    embedding_rowwise                 vocabulary split, lookups summed           "vocab"
    replicated_with_grad_allreduce    whole parameters, gradient a partial sum   "partial_grad"
    replicate                         whole on every rank                        (left out: exact)

Refused: ``packed_colwise`` / ``packed_rowwise`` (a fused gate|up matrix split half by
half: minipar's contiguous split would hand a rank gate rows and up rows of other
features), the MoE styles (minipar splits experts over ep, in its own MoE layer),
``embedding_colwise`` (the hidden dimension split), ``mla_kv_a_proj``, ``local_params``,
``all_reduce``, ``sequence_parallel`` and any style this table does not know (older
transformers: ``local_colwise``, ``gather``, ...), and entries that name a parameter
rather than a module (HF shards those inside a fused module). Entries matching no
module of this model (parts its config did not build) are dropped: nothing to split.

A plan is not enough for an attention to work split: the model must reshape its
projections with ``-1`` heads (Llama, Mistral, Qwen, Gemma do: ``view(*shape, -1,
head_dim)``) and keep the query/key-value group ratio, which a split by whole heads does.
"""

from __future__ import annotations

import fnmatch

import torch.nn as nn

EXACT = {
    "colwise": "colwise",
    "colwise_gather_output": "colwise_gather",
    "colwise_rep": "colwise_gather",
    "rowwise": "rowwise",
    "rowwise_split_input": "rowwise_scatter",
    "rowwise_rep": "rowwise_scatter",
    "embedding_rowwise": "vocab",
    "replicated_with_grad_allreduce": "partial_grad",
}
WHOLE = ("replicate",)  # every rank keeps the whole module: leaving it out of the plan is the same

_PACKED = ("splits a fused matrix (gate and up side by side) half by half; minipar splits a matrix in tp "
           "contiguous chunks, which would give a rank gate rows of some features and up rows of others")
_MOE = "shards transformers' fused experts over tp; minipar splits experts over ep, in its own MoE layer"
WHY_REFUSED = {
    "packed_colwise": _PACKED,
    "packed_rowwise": _PACKED,
    "moe_tp_experts": _MOE,
    "moe_identity_expert": _MOE,
    "ep_router": _MOE,
    "embedding_colwise": "splits the embedding's hidden dimension; minipar splits embeddings by vocabulary ('vocab')",
    "mla_kv_a_proj": "splits part of a projection's output and keeps the rotary part whole; no minipar style does",
    "local_params": "shards bare parameters (attention sinks) for a forward that uses them locally",
    "all_reduce": "sums a module's partial output, a half of a pair with transformers' other local styles",
    "sequence_parallel": "is transformers' sequence-parallel layout, which minipar does not take for its models",
}


def is_hf_plan(module: nn.Module) -> bool:
    """Whether ``module`` carries a Hugging Face plan: a dict ``tp_plan`` (minipar's models have a method)."""
    return isinstance(getattr(module, "tp_plan", None), dict)


def hf_plan(module: nn.Module, tp: int) -> dict[str, str]:
    """``module.tp_plan`` (a transformers model's own) in minipar's styles, or ValueError naming what to
    pass: the model has no plan, or an entry's style is not one minipar reproduces exactly."""
    name = type(module).__name__
    own = module.tp_plan
    if not own:
        conv = [n for n, m in module.named_modules() if type(m).__name__ == "Conv1D"]
        raise ValueError(
            f"the mesh has tp={tp} but {name} carries no tensor-parallel plan (its config's base_model_tp_plan "
            "is empty)" + (f"; its projections ({conv[0]}, ...) are transformers' Conv1D (an nn.Linear stored "
                           "transposed; GPT-2's c_attn fuses q, k and v), which minipar's tensor-parallel layers do "
                           "not take" if conv else "")
            + ": train it with tp=1 (data, ZeRO and pipeline parallelism take it as it is), or pass "
            "tp_plan={'module.pattern': 'colwise' | 'rowwise' | 'vocab', ...} over its nn.Linear / nn.Embedding "
            "modules")
    plan, refused = translate(module)
    if refused:
        raise ValueError(f"the mesh has tp={tp} and {name}'s own tensor-parallel plan (model.tp_plan) has entries "
                         "minipar cannot reproduce exactly: " + "; ".join(refused) + ". Pass tp_plan= yourself, "
                         "e.g. the entries minipar translates, which leave those modules whole on every tp rank: "
                         f"{plan}")
    return plan


def translate(module: nn.Module) -> tuple[dict[str, str], list[str]]:
    """(the entries of ``module.tp_plan`` minipar reproduces exactly, in its styles; the others, each with
    why). The first alone is a plan that leaves the others' modules whole on every tp rank."""
    modules = [n for n, _ in module.named_modules() if n]
    parameters = [n for n, _ in module.named_parameters()]
    plan: dict[str, str] = {}
    refused: list[str] = []
    for pattern, style in module.tp_plan.items():
        if not any(fnmatch.fnmatchcase(n, pattern) for n in modules):
            if any(fnmatch.fnmatchcase(n, pattern) for n in parameters):
                refused.append(f"{pattern!r}: {style!r} names parameters, which transformers shards inside "
                               "their fused module")
            continue  # a part this config did not build: nothing to split
        if style in EXACT:
            plan[pattern] = EXACT[style]
        elif style not in WHOLE:
            refused.append(f"{pattern!r}: {style!r} " + WHY_REFUSED.get(
                style, f"is not a style minipar translates (it does: {', '.join(EXACT)}, {', '.join(WHOLE)})"))
    return plan, refused
