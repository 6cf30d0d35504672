"""What a model's activations send between ranks in one step: tensor, pipeline, context and expert
parallelism (`minipar.plan.formulas` holds the data-parallel strategies' state and traffic).

Each function lists the collectives one rank issues, as the collective layer records them
(`formulas.Call`: op, axis, tag, payload bytes, wire bytes), or the bytes it sends;
tests/test_plan.py checks every list against the calls minipar counts on 2- and 4-rank CPU worlds.
"""

from __future__ import annotations

from .formulas import Call, call, dtype_bytes


def tp_calls(layers: int, act_bytes: int, tp: int, sequence_parallel: bool, backward: bool = True,
             norms_bytes: int = 0, pos_grad_bytes: int = 0) -> list[Call]:
    """Tensor parallelism's activation traffic ("tp") for a GPT of ``layers`` blocks, one forward and
    backward; ``act_bytes``: one full (batch, seq, hidden) activation. Without sequence parallelism:
    the vocab-parallel embedding's all-reduce, then two per block (after attention and after the
    MLP), the same two per block backward plus the LM head's input gradient. With it each all-reduce
    becomes a reduce-scatter and an all-gather of the same full tensor (the first all-gather and the
    last reduce-scatter bracket the blocks). ``pos_grad_bytes``: the sequence-sharded learned position
    table's gradient, all-gathered in backward; ``norms_bytes``: each norm's (weight, bias) partial
    gradient, all-reduced ("sp_grad", not counted here)."""
    if not sequence_parallel:
        fwd = call("all_reduce", "tp", tp, "tp", act_bytes) * (1 + 2 * layers)
        bwd = call("all_reduce", "tp", tp, "tp", act_bytes) * (2 * layers + 1)
    else:
        pair = call("all_gather", "tp", tp, "tp", act_bytes) + call("reduce_scatter", "tp", tp, "tp", act_bytes)
        fwd = call("reduce_scatter", "tp", tp, "tp", act_bytes) + pair * 2 * layers + \
            call("all_gather", "tp", tp, "tp", act_bytes)
        bwd = pair * (2 * layers + 1) + (call("all_gather", "tp", tp, "tp", pos_grad_bytes) if pos_grad_bytes else [])
    return fwd + (bwd if backward else [])


def pp_calls(stage: int, stages: int, microbatches: int, act_bytes: int) -> list[Call]:
    """One pipeline step's sends of stage ``stage``: each micro-batch's output activation forward
    ("pp_act", all but the last stage) and its input gradient backward ("pp_grad", all but the first);
    ``act_bytes``: one micro-batch's (micro_batch, seq / tp under sp, hidden) activation."""
    out = []
    if stage < stages - 1:
        out += call("send", "pp", stages, "pp_act", act_bytes) * microbatches
    if stage > 0:
        out += call("send", "pp", stages, "pp_grad", act_bytes) * microbatches
    return out


def ring_calls(layers: int, batch: int, heads: int, seq_len: int, head_dim: int, cp: int, dtype) -> list[Call]:
    """Ring attention's sends: per layer, K and V stacked in one message per hop ("cp_kv"), C - 1
    hops forward and C - 1 backward, then the dK/dV accumulators on C hops ("cp_kv_grad"; the last
    hop returns each to its owner). One block (K or V, dK or dV) is B·H·(T/C)·D elements."""
    kv = 2 * batch * heads * (seq_len // cp) * head_dim * dtype_bytes(dtype)
    hops = call("send", "cp", cp, "cp_kv", kv) * (2 * (cp - 1)) + call("send", "cp", cp, "cp_kv_grad", kv) * cp
    return hops * layers


def ring_bytes(batch: int, heads: int, seq_len: int, head_dim: int, cp: int, dtype) -> dict:
    """Bytes each rank sends per ring-attention layer, {"forward": ..., "backward": ...}: `ring_calls`
    of one layer, split at the end of the forward (its first C - 1 hops). With C = 1 nothing is sent."""
    sends = [c.bytes for c in ring_calls(1, batch, heads, seq_len, head_dim, cp, dtype)]
    return {"forward": sum(sends[:cp - 1]), "backward": sum(sends[cp - 1:])}


def ulysses_calls(layers: int, batch: int, heads: int, seq_len: int, head_dim: int, cp: int, dtype) -> list[Call]:
    """Ulysses: per layer four all-to-alls forward (q, k, v to heads; the output back to tokens) and
    four backward, each of one (batch, heads, seq / cp, head_dim) tensor ("cp_ulysses")."""
    block = batch * heads * (seq_len // cp) * head_dim * dtype_bytes(dtype)
    return call("all_to_all", "cp", cp, "cp_ulysses", block) * (8 * layers)


def ep_bytes(tokens: int, top_k: int, hidden: int, dtype, moe_layers: int) -> int:
    """Bytes one rank puts into the MoE all-to-alls of a step, averaged over the ep group (no token
    dropped): per MoE layer it dispatches tokens·k rows forward and combines as many back; backward
    sends the gradients of both. Each rank's share depends on routing; the group's mean does not."""
    return 4 * tokens * top_k * hidden * dtype_bytes(dtype) * moe_layers
