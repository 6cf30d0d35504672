"""Tensor parallelism (Megatron-style): parallel layers, vocab-parallel cross-entropy, plans.

    from minipar.tensor_parallel import parallelize
    model = parallelize(GPT(cfg), mesh, GPT(cfg).tp_plan(mesh.tp))

A Hugging Face model's own plan (``model.tp_plan``, a dict) is translated by `hf_plan`.
"""

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, mark_sequence_parallel
from .parallelize import STYLES, SequenceShard, TensorParallelConfig, check_plan, parallelize
from .grads import clip_grad_norm_, tp_grad_norm
from .hf_plan import hf_plan

__all__ = ["parallelize", "check_plan", "TensorParallelConfig", "SequenceShard", "STYLES", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "mark_sequence_parallel",
           "clip_grad_norm_", "tp_grad_norm", "hf_plan"]
