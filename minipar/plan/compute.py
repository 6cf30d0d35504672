"""The compute side of a step in closed form: the activations a block keeps, the FLOPs, the bubble.

`minipar.plan.formulas` holds what a data-parallel strategy keeps and sends; this module what the
model itself costs on one rank, whatever the strategy. tests/test_plan.py checks the activation
bytes against the saved-tensor meter and tests/test_pipeline_schedule.py the bubble against the
simulator.
"""

from __future__ import annotations


def layer_activation_bytes(tokens: int, hidden: int, kv_hidden: int, ffn: int, act: int, tp: int = 1,
                           sequence_parallel: bool = True, gated: bool = True, norm_keeps_output: bool = False) -> int:
    """Bytes one transformer block saves for backward on one rank, for ``tokens`` tokens (micro-batch
    × sequence / cp), flash attention (no score matrix kept) and no dropout.

    Attention: its norm's input, q/k/v's input, q, k and v, the attention output (o_proj's input);
    the MLP: its norm's input, up's input, then GELU's input and output (2·ffn) or, gated
    (SwiGLU), the gate's output (SiLU's input), SiLU's output and up's output (the product's
    inputs) and the product (down's input): 4·ffn. Under tensor parallelism what is split by heads
    or features is /tp; the norms' inputs are /tp only with sequence parallelism. The projections'
    inputs stay whole: minipar keeps the all-gathered input for the weight gradient, where
    Megatron-LM keeps the shard and gathers it again in backward (Korthikanti et al. 2022 count
    that: 34·s·b·h for a GPT-3 block, 4h GELU MLP, 16-bit, all of it /tp). ``norm_keeps_output``: a norm that keeps its normalized output beside its input for
    the weight's gradient (minipar's RMSNorm kernel) adds one hidden per norm.
    `tests/test_plan.py` checks this against the saved-tensor meter (`minipar.recompute.ActivationMemory`)."""
    norms = (4 if norm_keeps_output else 2) * hidden  # the two norms' inputs (and outputs)
    whole = 2 * hidden                                # attention's and the MLP's projection inputs
    split = 2 * hidden + 2 * kv_hidden + (4 if gated else 2) * ffn  # q, out, k, v; the MLP's
    per_token = norms / (tp if sequence_parallel else 1) + whole + split / tp
    return int(tokens * per_token * act)


def checkpointed_layer_bytes(tokens: int, hidden: int, act: int, tp: int = 1, sequence_parallel: bool = True) -> int:
    """Bytes a recomputed (checkpointed) block keeps between its forward and its backward: its input
    alone (a sequence shard under sequence parallelism)."""
    return int(tokens * hidden * act / (tp if sequence_parallel else 1))


def training_flops(params_active: float, tokens: int, layers: int, seq: int, hidden: int,
                   recompute: bool = False) -> float:
    """6 N per token (forward 2N, backward 4N) plus causal attention's 6·L·s·h (12·L·s·h halved by
    the mask); full recomputation repeats the forward: 8 N and 8·L·s·h."""
    mult = 8 if recompute else 6
    return tokens * (mult * params_active + mult * layers * seq * hidden)


def bubble_fraction(stages: int, microbatches: int, chunks: int = 1) -> float:
    """1F1B's and GPipe's idle share of a step, (p - 1) / (m + p - 1); interleaved with v chunks per
    rank, (p - 1) / (v·m + p - 1) (Narayanan et al. 2021; tests/test_pipeline_schedule.py checks both
    against `minipar.pipeline.simulate`)."""
    return (stages - 1) / (chunks * microbatches + stages - 1)
