"""A small GPT in one file: the single-process reference every strategy is tested against.

Token and position embeddings, pre-norm blocks (causal self-attention through
``scaled_dot_product_attention``, GELU MLP), a final LayerNorm and an LM head
that can share the token embedding's weight. Attention has separate q/k/v/o
projections and reshapes with ``-1`` heads, so tensor parallelism can split the
projections without touching this file; ``fused_qkv=True`` makes q, k and v one
projection (one matmul on one device; refused by the tensor-parallel plan). ``norm="rmsnorm"``, ``mlp="swiglu"`` and
``pos="rope"`` give the Llama-style variants (RMSNorm; a gated SiLU MLP with
separate gate and up projections; rotary position embeddings on queries and
keys instead of a learned position table).

Norms, activations and the loss go through ``minipar.kernels``: fused Triton
kernels on a GPU (or under ``TRITON_INTERPRET=1``), the PyTorch functions
otherwise. A block's residual add after attention and the norm before its MLP
are one kernel (``ln_2(delta, residual=x)``).

Initialisation is deterministic from ``GPTConfig.seed`` alone (its own
generator, not the global RNG): every rank that builds ``GPT(config)`` holds
the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minipar import kernels


@dataclass
class GPTConfig:
    vocab_size: int = 512
    block_size: int = 64       # longest sequence
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64           # must be divisible by n_head
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True   # LM head shares the token embedding's weight
    norm: str = "layernorm"    # or "rmsnorm"
    mlp: str = "gelu"          # or "swiglu": proj(silu(gate(x)) * fc(x))
    pos: str = "learned"       # or "rope": rotary embeddings in attention, no wpe table
    rope_base: float = 10000.0
    fused_qkv: bool = False    # one (3 n_embd, n_embd) projection for q, k and v: one matmul, one read of x
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm={self.norm!r}; choose 'layernorm' or 'rmsnorm'")
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"mlp={self.mlp!r}; choose 'gelu' or 'swiglu'")
        if self.pos not in ("learned", "rope"):
            raise ValueError(f"pos={self.pos!r}; choose 'learned' or 'rope'")
        if self.pos == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"pos='rope' rotates pairs of features: the head size n_embd / n_head = "
                             f"{self.n_embd // self.n_head} must be even")


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and state dict) computed by ``minipar.kernels.layer_norm``.

    ``norm(x, residual=r)`` -> (h, norm(h)) with h = r + x: the residual add before a pre-norm fused
    with the norm (``kernels.add_layer_norm``: one pass, one gradient written in backward)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return kernels.layer_norm(x, self.weight, self.bias, self.eps)
        if residual.dtype != x.dtype:  # under autocast the stream is fp32 and x bf16: the add promotes
            h = residual + x
            return h, kernels.layer_norm(h, self.weight, self.bias, self.eps)
        return kernels.add_layer_norm(residual, x, self.weight, self.bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same parameters and state dict) computed by ``minipar.kernels.rms_norm``;
    ``residual=`` as `LayerNorm`'s (``kernels.add_rms_norm``)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        if residual.dtype != x.dtype:
            h = residual + x
            return h, kernels.rms_norm(h, self.weight, self.eps)
        return kernels.add_rms_norm(residual, x, self.weight, self.eps)


def make_norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.n_embd, eps=1e-6)
    return LayerNorm(cfg.n_embd, bias=cfg.bias)


class Rotary(nn.Module):
    """Rotary position embedding (RoPE, as in Llama): feature i of a head and feature i + d/2 are
    rotated together by the angle pos * base^(-2i/d), for queries and keys alike, so that q . k
    depends on the positions only through their difference.

    ``forward(positions)`` -> (cos, sin), each (seq, head_dim): the module's input is the tokens'
    positions, like a learned position table's, so that context parallelism can hand it the true
    positions of a rank's tokens (``takes_positions``). No parameters, and no state-dict entry.
    """

    takes_positions = True

    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        angles = torch.cat((angles, angles), dim=-1)  # feature i and i + d/2 share an angle
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., seq, head_dim) rotated: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) per pair
    (x1 = x[..., :d/2], x2 = x[..., d/2:]); computed in fp32, returned in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.rotary = Rotary(self.head_dim, cfg.rope_base) if cfg.pos == "rope" else None
        if cfg.fused_qkv:  # rows [0, D) make q, [D, 2D) k, [2D, 3D) v
            self.qkv_proj = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        else:
            self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
            self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
            self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        # Context parallelism (`minipar.context_parallel.context`) sets this: q, k, v (batch, heads, local
        # tokens, head_dim) -> output, attention over the whole sequence that the cp ranks split.
        self.context_attention = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, seq, n_embd) -> (batch, seq, n_embd)."""
        if hasattr(self, "qkv_proj"):  # one matmul; its backward writes dx once instead of summing three
            q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # Shapes come from the projections, not from x: under sequence parallelism x holds a slice of
        # the sequence and the projections the whole of it; under tensor parallelism each rank holds
        # n_head / tp heads, hence -1.
        b, t = q.shape[:2]
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        if self.rotary is not None:
            cos, sin = self.rotary(torch.arange(t, device=q.device))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.context_attention is not None:
            y = self.context_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """gelu: proj(gelu(fc(x))); swiglu: proj(silu(gate(x)) * fc(x)). Hidden width 4 * n_embd."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gate = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias) if cfg.mlp == "swiglu" else None
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.proj(kernels.swiglu(self.gate(x), self.fc(x)))
        return self.proj(kernels.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the residual add after attention and the norm before the MLP, one kernel: h = x + attn, y = ln_2(h)
        h, y = self.ln_2(self.drop(self.attn(self.ln_1(x))), residual=x)
        return h + self.drop(self.mlp(y))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        # rope: positions enter in attention (CausalSelfAttention.rotary); no learned table
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.pos == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.reset_parameters()

    def tp_plan(self, tp: int, sequence_parallel: bool = False, gather_logits: bool = False) -> dict:
        """The tensor-parallel plan for ``minipar.tensor_parallel.parallelize``.

        Attention heads and MLP features split (q/k/v and fc column-wise, o and
        proj row-wise), the embedding and LM head split over the vocabulary (so
        a tied head stays tied). The logits stay vocab-parallel for
        ``vocab_parallel_cross_entropy`` unless ``gather_logits``. With
        sequence parallelism the position embedding's output is split along
        the sequence like the token embedding's.
        """
        from minipar.tensor_parallel import SequenceShard  # the model itself knows nothing of parallelism

        cfg = self.config
        if cfg.fused_qkv:
            raise ValueError("GPTConfig(fused_qkv=True) holds q, k and v in one weight, which a column split would "
                             "cut across the three: under tensor parallelism build the GPT with fused_qkv=False")
        for what, n in (("n_head", cfg.n_head), ("vocab_size", cfg.vocab_size), ("n_embd", cfg.n_embd)):
            if n % tp:
                raise ValueError(f"GPT {what}={n} is not divisible by tp={tp}: tensor parallelism splits it; "
                                 f"choose a multiple of {tp} (pad the vocabulary if needed)")
        if sequence_parallel and cfg.block_size % tp:
            raise ValueError(f"block_size={cfg.block_size} must be divisible by tp={tp} for sequence parallelism")
        plan: dict = {"wte": "vocab", "lm_head": "colwise_gather" if gather_logits else "colwise",
                      # q, k and v read one input: it enters the tp region once, for all three
                      "layers.*.attn": "enter_region", "layers.*.attn.q_proj": "colwise_in_region",
                      "layers.*.attn.k_proj": "colwise_in_region", "layers.*.attn.v_proj": "colwise_in_region",
                      "layers.*.attn.o_proj": "rowwise",
                      "layers.*.mlp.fc": "colwise", "layers.*.mlp.proj": "rowwise"}
        if cfg.mlp == "swiglu":  # gate and up read one input: it enters the tp region once, for both
            plan.update({"layers.*.mlp": "enter_region", "layers.*.mlp.fc": "colwise_in_region",
                         "layers.*.mlp.gate": "colwise_in_region"})
        if sequence_parallel and self.wpe is not None:
            plan["wpe"] = SequenceShard(0)
        return plan

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, 0.02) weights, zero biases, unit norms; residual projections scaled by 1/sqrt(2 n_layer) (GPT-2)."""
        gen = torch.Generator().manual_seed(self.config.seed)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():  # named_parameters() yields a tied weight once
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:  # norm weight
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith(("o_proj.weight", "mlp.proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx: (batch, seq) token ids -> logits (batch, seq, vocab_size); with ``targets`` (batch, seq)
        the mean cross-entropy instead (-100 ignored), the LM head and the loss computed together in row
        chunks (``kernels.linear_cross_entropy``): the logits are never held, in any dtype."""
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.config.block_size}")
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(t, device=idx.device))
        x = self.drop(x)
        for block in self.layers:
            x = block(x)
        if targets is None:
            return self.lm_head(self.ln_f(x))
        if type(self.lm_head) is not nn.Linear:  # e.g. split over the vocabulary by tensor parallelism
            raise ValueError(f"GPT.forward(idx, targets) computes the loss with the whole LM head; this one is a "
                             f"{type(self.lm_head).__name__}: compute the logits and pass them to a loss function")
        return kernels.linear_cross_entropy(self.ln_f(x), self.lm_head.weight, targets, ignore_index=-100)


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy (``minipar.kernels.cross_entropy``: the probabilities are never
    materialised). logits: (batch, seq, vocab); targets: (batch, seq), -100 ignored."""
    return kernels.cross_entropy(logits, targets, ignore_index=-100)
