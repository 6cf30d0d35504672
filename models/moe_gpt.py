"""The GPT of `minipar.models.gpt` with mixture-of-experts MLPs: every block's MLP is a
`minipar.moe.layer.MoELayer` (top-k router, capacity, GELU experts; the DeepSeekMoE options of
`deepseek_moe_config`: shared and fine-grained experts, sigmoid gate, bias balancing, dropless,
node-limited routing, the first blocks dense). Everything else -- attention,
norms, embeddings, the tied head, deterministic initialisation -- is the dense GPT's.

``route_groups`` is for the single-process reference of a multi-rank run: the
reference of ``R`` data-parallel ranks (times ``m`` micro-batches under pipeline
parallelism) routes each rank's share of the batch as its own group, so
capacity and drops are decided exactly as each rank decides them.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipar.moe.layer import MoELayer, check_moe_config, moe_layers

from .gpt import GPT, GPTConfig


@dataclass
class MoEGPTConfig(GPTConfig):
    n_experts: int = 4
    top_k: int = 2
    capacity_factor: float | None = 1.25  # None: dropless
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    expert_hidden: int | None = None   # each expert's hidden width; default 4 * n_embd
    route_groups: int = 1
    route_seq_chunks: int = 1          # the reference of a sequence-parallel run: tp (x cp)
    route_seq_order: tuple[int, ...] | None = None  # the reference of a ring cp run: positions in cp-rank order
    moe_blocks: tuple[int, ...] | None = None  # which blocks get an MoE MLP; default every block
    # DeepSeekMoE (docs/moe_deepseek.md); the defaults are the classic router
    n_shared_experts: int = 0
    gate: str = "softmax"
    route_scale: float = 1.0
    balance: str = "aux"
    bias_update_rate: float = 1e-3
    expert_groups: int = 1
    route_limit: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_moe_config(self.n_experts, self.top_k, self.capacity_factor, **self.layer_options())

    def layer_options(self) -> dict:
        """The `MoELayer` keyword options of this config (the DeepSeekMoE ones)."""
        return dict(n_shared_experts=self.n_shared_experts, gate=self.gate, route_scale=self.route_scale,
                    balance=self.balance, aux_loss_coef=self.aux_loss_coef, bias_update_rate=self.bias_update_rate,
                    expert_groups=self.expert_groups, route_limit=self.route_limit)


def deepseek_moe_config(**overrides) -> MoEGPTConfig:
    """A small DeepSeekMoE-shaped GPT (DeepSeek-V3's choices at toy scale): 16 fine-grained experts of
    a quarter of the dense MLP's width each, top-4 routing, one shared expert, sigmoid gate with the
    chosen scores normalised, bias balancing (no auxiliary loss), dropless, each token's experts
    from at most 2 of 4 expert groups, and the first block dense. ``overrides`` replace any field."""
    n_embd = overrides.get("n_embd", 64)
    n_layer = overrides.get("n_layer", 4)
    first_dense = overrides.pop("first_dense", 1)
    cfg = dict(vocab_size=256, block_size=64, n_layer=n_layer, n_head=4, n_embd=n_embd, n_experts=16, top_k=4,
               expert_hidden=n_embd, n_shared_experts=1, gate="sigmoid", route_scale=1.0, balance="bias",
               aux_loss_coef=0.0, z_loss_coef=0.0, capacity_factor=None, expert_groups=4, route_limit=2,
               moe_blocks=tuple(range(first_dense, n_layer)))
    return MoEGPTConfig(**(cfg | overrides))


class MoEGPT(GPT):
    def __init__(self, cfg: MoEGPTConfig) -> None:
        super().__init__(cfg)
        hidden = cfg.expert_hidden or 4 * cfg.n_embd
        for i, block in enumerate(self.layers):
            if cfg.moe_blocks is not None and i not in cfg.moe_blocks:
                continue  # this block keeps the dense MLP
            options = cfg.layer_options()
            del options["aux_loss_coef"]
            block.mlp = MoELayer(cfg.n_embd, hidden, cfg.n_experts, cfg.top_k, cfg.capacity_factor,
                                 cfg.aux_loss_coef, cfg.z_loss_coef, seed=cfg.seed * 7919 + i + 1, **options)
            block.mlp.route_groups, block.mlp.route_seq_chunks = cfg.route_groups, cfg.route_seq_chunks
            block.mlp.route_seq_order = cfg.route_seq_order

    def tp_plan(self, tp: int, sequence_parallel: bool = False, gather_logits: bool = False) -> dict:
        """The dense GPT's plan without the MoE blocks' MLP entries: the MoE layers run replicated on
        every tensor-parallel rank (their experts are split over ep, not tp), on the whole sequence,
        or under sequence parallelism on this rank's slice of it."""
        plan = super().tp_plan(tp, sequence_parallel=sequence_parallel, gather_logits=gather_logits)
        if self.config.moe_blocks is None:
            return {k: v for k, v in plan.items() if ".mlp" not in k}
        dense = [str(i) for i in range(self.config.n_layer) if i not in self.config.moe_blocks]
        return {k.replace("layers.*.", f"layers.{i}."): v for k, v in plan.items() for i in dense if ".mlp" in k} | \
            {k: v for k, v in plan.items() if ".mlp" not in k}

    def moe_stats(self) -> dict[str, float]:
        """Auxiliary loss, z-loss (means over layers) and dropped assignments of the last forward."""
        layers = [m for m in moe_layers(self) if m.last_aux is not None]
        if not layers:
            return {}
        return {"aux": sum(float(m.last_aux) for m in layers) / len(layers),
                "z": sum(float(m.last_z) for m in layers) / len(layers),
                "dropped": sum(m.last_dropped for m in layers)}
