"""Context parallelism for Hugging Face models: their attention routed through minipar's slot.

A transformers attention module (Llama's ``LlamaAttention``, Mistral's, Qwen's: ``q_proj`` and a
``config``) projects q, k, v, rotates them, then calls the function its config names
(``config._attn_implementation``: "sdpa", "eager", ...) with ``(module, q, k, v, mask, **kwargs)``.
`wire` points the config at a function of ours, registered under ``"minipar_cp_" + the original
name`` (with the original's mask builder), that hands q and k/v (key/value heads repeated to the
query heads) to the module's ``context_attention``, the slot minipar's own attention has: ring or
Ulysses attention over the cp ranks while a split forward runs, the original function (mask and
all) for any other call. The registration is by name, the same function for every model; what a
model does is its own modules' ``context_attention``, so models in one process do not interact.

Positions: the model computes position ids 0..T/C-1 for its local tokens and hands them to its
rotary embedding (``rotary_emb(x, position_ids=...)``); `rotary_modules` are where
`ContextParallel` maps them to the tokens' true positions.

Which models: those whose attention is causal softmax(q kᵀ / sqrt(head_dim)) v over every earlier
token, which ring and Ulysses compute. `check_plain_causal` proves it on the model in one process
(its own attention against that one, same logits); a sliding window shorter than the longest
sequence (``max_position_embeddings``), chunked attention and attention dropout are refused by
their config fields.
"""

from __future__ import annotations

from typing import Any, Callable

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

PREFIX = "minipar_cp_"


def hf_attention_modules(module: nn.Module) -> list[nn.Module]:
    """The transformers attention modules of ``module``: a ``q_proj`` and a config naming an attention
    implementation (minipar's own attention has no config)."""
    return [m for m in module.modules() if hasattr(m, "q_proj") and hasattr(m, "head_dim")
            and isinstance(getattr(getattr(m, "config", None), "_attn_implementation", None), str)]


def rotary_modules(module: nn.Module) -> list[nn.Module]:
    """The rotary embeddings that turn position ids into (cos, sin): ``forward(x, position_ids)``."""
    return [m for m in module.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def wire(module: nn.Module, cp: int) -> Callable[[], None]:
    """Route ``module``'s transformers attention through ``context_attention`` (None: the original) and
    return the function that undoes it. ValueError, changing nothing, for a model whose attention ring
    and Ulysses cannot compute: dropout, a sliding window or chunks, or an implementation without q, k, v."""
    attns = hf_attention_modules(module)
    configs = {id(a.config): a.config for a in attns}.values()
    name = type(module).__name__
    for config in configs:
        why = _refusal(config)
        if why:
            raise ValueError(f"context parallelism (cp={cp}) splits each sequence over the cp ranks and runs causal "
                             f"attention over all of it, but {name} {why}; train it with cp=1")
    from transformers import AttentionInterface, AttentionMaskInterface  # only for models that have it
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    undo = []
    for config in configs:
        original = config._attn_implementation
        if original.startswith(PREFIX):
            continue  # wired already (a second ShardedModule around the same model)
        if original_attention(attns[0], original) is None:
            raise ValueError(f"context parallelism (cp={cp}) needs {name}'s attention as q, k, v, but its "
                             f"implementation {original!r} is not one transformers lists; use 'sdpa' or 'eager'")
        AttentionInterface.register(PREFIX + original, _attention)
        if original in ALL_MASK_ATTENTION_FUNCTIONS:  # unsplit calls get the mask the original gets
            AttentionMaskInterface.register(PREFIX + original, ALL_MASK_ATTENTION_FUNCTIONS[original])
        config._attn_implementation = PREFIX + original
        undo.append((config, original))
    for a in attns:
        a.context_attention = None
    return lambda: [setattr(c, "_attn_implementation", o) for c, o in undo]


def _refusal(config: Any) -> str | None:
    if getattr(config, "attention_dropout", 0.0):
        return (f"has attention dropout ({config.attention_dropout}), whose masks a split attention cannot match; "
                "build it with attention_dropout=0.0 or")
    window, longest = getattr(config, "sliding_window", None), getattr(config, "max_position_embeddings", None)
    if window and getattr(config, "use_sliding_window", True) is not False and not (longest and window >= longest):
        return f"attends over a sliding window of {window} tokens (config.sliding_window)"
    if getattr(config, "attention_chunk_size", None):
        return f"attends within chunks of {config.attention_chunk_size} tokens (config.attention_chunk_size)"
    return None


def original_attention(attention: nn.Module, config_name: str) -> Callable | None:
    """The transformers function named ``config_name``; "eager" is the one in the module's own modeling file."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if config_name == "eager":
        return getattr(sys.modules[type(attention).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS[config_name] if config_name in ALL_ATTENTION_FUNCTIONS else None


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q (B, H, T, D), k and v (B, H_kv, T, D) -> ((B, T, H, D), None)."""
    def original() -> torch.Tensor:  # what the model computes unwired: (B, H, T, D)
        fn = original_attention(module, module.config._attn_implementation[len(PREFIX):])
        return fn(module, query, key, value, attention_mask, **kwargs)[0].transpose(1, 2)
    attend = module.context_attention
    if attend is None:
        out = original()
    else:  # key/value head j serves query heads j * groups ... (j + 1) * groups - 1 (transformers' repeat_kv)
        groups = query.shape[1] // key.shape[1]
        out = attend(query, key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1),
                     original=original)
    return out.transpose(1, 2).contiguous(), None


@torch.no_grad()
def check_plain_causal(module: nn.Module, attns: list[nn.Module], ids: torch.Tensor, close: Callable) -> str | None:
    """None when ``module``'s own attention computes, on ``ids``, the logits of causal
    softmax(q kᵀ / sqrt(D)) v (what ring and Ulysses compute); else the reason (another scale, a
    soft cap, sinks, a window shorter than the check). One process, two forwards, nothing changed."""
    def plain(q, k, v, original=None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    try:
        for a in attns:
            a.context_attention = None
        own = module(ids)
        for a in attns:
            a.context_attention = plain
        causal = module(ids)
    finally:
        for a in attns:
            a.context_attention = None
    own, causal = getattr(own, "logits", own), getattr(causal, "logits", causal)
    if close(own, causal):
        return None
    diff = (own.float() - causal.float()).abs().max().item()
    return (f"computes attention other than causal softmax(q k^T / sqrt(head_dim)) v (its own attention and that one "
            f"give logits {diff:.3g} apart: another scale, a soft cap, sinks or a window)")
