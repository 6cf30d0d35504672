"""Reference models, installed as ``minipar.models``."""

from .gpt import GPT, Block, CausalSelfAttention, GPTConfig, MLP, gpt_loss
from .moe_gpt import MoEGPT, MoEGPTConfig, deepseek_moe_config

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP", "gpt_loss", "MoEGPT", "MoEGPTConfig",
           "deepseek_moe_config"]
