"""What a pipeline needs to know of a model: where its blocks are, and what runs before and after.

Pipeline stages can be cut from any *block-sequential* model: an embedding that turns token ids
into hidden states, a list of blocks each taking and returning hidden states (batch, seq,
hidden), and a head that turns the last hidden states into logits. A `StageSpec` says where each
part lives (dotted module paths) and how to call it:

    blocks        the nn.ModuleList of blocks ("layers", "transformer.h", "model.layers")
    first, last   the modules only the embedding (first stage) or the head (last stage) uses; the
                  other stages drop them
    embed(s, ids) -> hidden, run on the first stage; ``s`` is the stage, which has the model's
                  attribute tree (``s.transformer.wte`` where the model has ``model.transformer.wte``)
    head(s, h)    -> logits, run on the last stage
    block_kwargs(s, h) -> what every block takes besides the hidden states (positions, rotary
                  cos/sin), computed on each stage from the hidden states it holds; modules it
                  uses (a rotary embedding: no parameters) stay on every stage
    hidden_size   the width of what travels between stages
    tied          (embedding weight, head weight) paths, when the model shares one Parameter
    example       a tiny input of the model (batch, seq, ...) for the check when it is wrapped
                  (`cut_check.check_spec`); default: token ids (1, 2), or (1, 2, in_features) floats when
                  the first stage's first layer is a Linear

`spec_for(model)` recognises minipar's GPT (and MoE GPT), Hugging Face GPT-2 (``transformer.wte /
wpe / h / ln_f``, ``lm_head``) and Llama-family models (``model.embed_tokens / layers / norm /
rotary_emb``, ``lm_head``: Llama, Mistral, Qwen2 and the like); any other model passes its own
spec (``ShardedModule(..., pipeline=PipelineConfig(stage_spec=...))``).

A Hugging Face block is called with the hidden states and keyword arguments only, no cache; a
block that returns a tuple gives its first element. Its attention mask is the one the model builds
at its top for a batch without padding, for the attention implementation its config names
(`hf_causal_mask`): a 4-d additive mask for ``eager`` (whose attention applies no causal mask of its
own: without it a block attends to the future), None for ``sdpa`` (which is then causal by itself),
a block mask for ``flex_attention``, sliding-window masks where the config asks for them. A model
whose layers use different kinds of mask (``config.layer_types``) is refused: the stages give every
block the same keyword arguments. Padding masks do not travel between stages: the pipeline takes
token ids only (`minipar.checks.check_batch` refuses other inputs under pipeline parallelism).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn


@dataclass(frozen=True)
class StageSpec:
    blocks: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    embed: Callable[[Any, torch.Tensor], torch.Tensor]
    head: Callable[[Any, torch.Tensor], torch.Tensor]
    hidden_size: int
    block_kwargs: Callable[[Any, torch.Tensor], dict] | None = None
    tied: tuple[str, str] | None = None
    example: torch.Tensor | None = None

    def check_paths(self, model: nn.Module) -> None:
        """ValueError unless every path names a module of ``model``, the blocks are an nn.ModuleList, the
        tied paths name parameters and hidden_size is a positive integer."""
        for path in (self.blocks,) + self.first + self.last:
            if not isinstance(find(model, path), nn.Module):
                raise ValueError(f"stage spec: {type(model).__name__} has no module at {path!r}")
        if not isinstance(find(model, self.blocks), nn.ModuleList):
            raise ValueError(f"stage spec: {self.blocks!r} of {type(model).__name__} must be an nn.ModuleList of "
                             f"blocks, not {type(find(model, self.blocks)).__name__}")
        for path in self.tied or ():  # (find gives None for both of two typos: they would look tied)
            if not isinstance(find(model, path), nn.Parameter):
                raise ValueError(f"stage spec: {type(model).__name__} has no parameter at {path!r}; name the shared "
                                 "weight as StageSpec(tied=(embedding weight, head weight)), e.g. ('wte.weight', "
                                 "'lm_head.weight'), or tied=None when the model shares none")
        if isinstance(self.hidden_size, bool) or not isinstance(self.hidden_size, int) or self.hidden_size < 1:
            raise ValueError(f"StageSpec(hidden_size={self.hidden_size!r}) must be a positive integer: the width of "
                             "the hidden states the stages send each other")

    def tied_in(self, model: nn.Module) -> bool:
        """Whether ``model`` really shares one Parameter between the embedding and the head."""
        return self.tied is not None and find(model, self.tied[0]) is find(model, self.tied[1])


def find(root: Any, path: str) -> Any:
    """``root.a.b.c`` for path "a.b.c" (None when a step is missing)."""
    for name in path.split("."):
        root = getattr(root, name, None)
        if root is None:
            return None
    return root


def hidden_of(out: Any) -> torch.Tensor:
    """A block's hidden states: the output, or its first element when the block returns a tuple."""
    return out[0] if isinstance(out, tuple) else out


def _positions(h: torch.Tensor) -> torch.Tensor:
    return torch.arange(h.shape[1], device=h.device)


# -- minipar's GPT ----------------------------------------------------------------------------------

def _gpt_embed(s, ids):
    h = s.wte(ids)
    if getattr(s, "wpe", None) is not None:  # learned positions; pos="rope" rotates q, k in attention instead
        h = h + s.wpe(_positions(ids))
    return s.drop(h)


def gpt_spec(model: nn.Module) -> StageSpec:
    return StageSpec(blocks="layers", first=("wte", "drop") + (("wpe",) if model.wpe is not None else ()),
                     last=("ln_f", "lm_head"), embed=_gpt_embed, head=lambda s, h: s.lm_head(s.ln_f(h)),
                     hidden_size=model.config.n_embd, tied=("wte.weight", "lm_head.weight"))


# -- Hugging Face models: the attention mask ----------------------------------------------------------

def hf_causal_mask(config: Any, h: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """The attention mask a Hugging Face model builds before its first layer for hidden states ``h``
    (batch, seq, hidden) without padding: ``transformers.masking_utils``' causal mask (or its sliding-
    window form when the config asks for one) for ``config._attn_implementation``. The argument names
    of those functions changed across transformers releases; they are matched by name."""
    from transformers import masking_utils

    sliding = _mask_kind(config) == "sliding_attention"
    fn = masking_utils.create_sliding_window_causal_mask if sliding else masking_utils.create_causal_mask
    params = inspect.signature(fn).parameters
    given = {"config": config, "inputs_embeds": h, "input_embeds": h, "attention_mask": None, "cache": None,
             "past_key_values": None, "position_ids": position_ids,
             "cache_position": torch.arange(h.shape[1], device=h.device)}
    return fn(**{k: v for k, v in given.items() if k in params})


def _mask_kind(config: Any) -> str:
    """"full_attention" or "sliding_attention": the one kind of mask every layer of the model uses."""
    kinds = set(getattr(config, "layer_types", None) or ())
    if len(kinds) > 1:
        raise ValueError(f"pipeline stages give every block the same attention mask, but this model's layers use "
                         f"{sorted(kinds)} (config.layer_types): train it without pipeline parallelism, or pass a "
                         "StageSpec whose blocks build their own masks")
    if kinds:
        return kinds.pop()
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


# -- Hugging Face GPT-2 -----------------------------------------------------------------------------

def _gpt2_embed(s, ids):
    t = s.transformer
    return t.drop(t.wte(ids) + t.wpe(_positions(ids)))


def _gpt2_kwargs(config, s, h):
    return {"attention_mask": hf_causal_mask(config, h, _positions(h)[None])}


def hf_gpt2_spec(model: nn.Module) -> StageSpec:
    _mask_kind(model.config)
    return StageSpec(blocks="transformer.h", first=("transformer.wte", "transformer.wpe", "transformer.drop"),
                     last=("transformer.ln_f", "lm_head"), embed=_gpt2_embed,
                     head=lambda s, h: s.lm_head(s.transformer.ln_f(h)), hidden_size=model.config.n_embd,
                     block_kwargs=functools.partial(_gpt2_kwargs, model.config),
                     tied=("transformer.wte.weight", "lm_head.weight"))


# -- Hugging Face Llama family ----------------------------------------------------------------------

def _llama_kwargs(config, s, h):
    position_ids = _positions(h)[None]
    # the rotary module computes (cos, sin) for these positions; every decoder layer takes them
    return {"position_ids": position_ids, "position_embeddings": s.model.rotary_emb(h, position_ids),
            "attention_mask": hf_causal_mask(config, h, position_ids)}


def hf_llama_spec(model: nn.Module) -> StageSpec:
    _mask_kind(model.config)
    return StageSpec(blocks="model.layers", first=("model.embed_tokens",), last=("model.norm", "lm_head"),
                     embed=lambda s, ids: s.model.embed_tokens(ids), head=lambda s, h: s.lm_head(s.model.norm(h)),
                     hidden_size=model.config.hidden_size, block_kwargs=functools.partial(_llama_kwargs, model.config),
                     tied=("model.embed_tokens.weight", "lm_head.weight"))


def spec_for(model: nn.Module) -> StageSpec:
    """The built-in spec of a recognised model; ValueError saying how to give one otherwise."""
    if isinstance(find(model, "layers"), nn.ModuleList) and all(
            isinstance(find(model, n), nn.Module) for n in ("wte", "ln_f", "lm_head")) and hasattr(model, "config"):
        return gpt_spec(model)
    if all(isinstance(find(model, n), nn.Module) for n in ("transformer.wte", "transformer.wpe", "transformer.h",
                                                           "transformer.ln_f", "lm_head")):
        return hf_gpt2_spec(model)
    if all(isinstance(find(model, n), nn.Module) for n in ("model.embed_tokens", "model.layers", "model.norm",
                                                           "model.rotary_emb", "lm_head")):
        return hf_llama_spec(model)
    raise ValueError(f"pipeline stages cannot be cut from {type(model).__name__}: it is not minipar's GPT, a Hugging "
                     "Face GPT-2 or a Llama-family model; describe it with minipar.pipeline.StageSpec(blocks=..., "
                     "first=..., last=..., embed=..., head=..., hidden_size=...) and pass "
                     "pipeline=PipelineConfig(stage_spec=...)")
