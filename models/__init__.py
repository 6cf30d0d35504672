"""Reference models, installed as ``minipar.models``."""

from .gpt import GPT, Block, CausalSelfAttention, GPTConfig, MLP, gpt_loss

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP", "gpt_loss"]
