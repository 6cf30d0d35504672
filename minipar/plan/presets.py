"""Model and cluster shapes the planner knows by name, and one rank's parameter tensors of a model.

The Llama-3 shapes are the published configurations; the DeepSeek-style MoE is DeepSeek-V3's
(61 layers, 3 dense then 58 MoE, 256 routed experts of width 2048 plus one shared, top-8), with its
multi-head latent attention approximated by plain 128-head attention of the same hidden size (about
the same parameters: 205M against MLA's 187M per layer), so 673B parameters, 38B active.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipar.plan.formulas import ParamSet


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    experts: int = 0          # routed experts per MoE layer (0: dense)
    top_k: int = 0
    moe_ffn: int = 0          # one expert's width
    shared_experts: int = 0
    dense_layers: int = 0     # the first layers stay dense in an MoE model
    tied: bool = False
    gated: bool = True        # SwiGLU (three matrices) rather than GELU (two)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    def block_sizes(self, tp: int, ep: int, moe: bool) -> list[tuple]:
        """One block's tensors on a rank, in registration order: (numel, expert, (N, K)) for the weight of an
        nn.Linear (what `minipar.fp8.apply_fp8` trains in FP8), (numel, expert) for the rest: norms, the
        router, the routed experts (minipar's grouped products, which stay in high precision)."""
        h, hd, mats = self.hidden, self.head_dim, 3 if self.gated else 2
        kv_local = max(1, self.kv_heads // tp) * hd  # fewer kv heads than tp ranks: they are replicated
        q = self.heads * hd // tp

        def linear(n: int, expert: bool = False) -> tuple:
            return (n * h, expert, (n, h))

        out = [(h, False), linear(q), linear(kv_local), linear(kv_local), linear(q), (h, False)]
        if not moe:
            return out + [linear(self.ffn // tp)] * mats
        out.append((self.experts * h, False))  # the router, replicated (and never FP8)
        out += [(h * self.moe_ffn // tp, True)] * (mats * (self.experts // ep))
        return out + [linear(self.moe_ffn * self.shared_experts // tp)] * (mats if self.shared_experts else 0)

    def stage_params(self, tp: int, ep: int, pp: int, stage: int, fp8_form: str | None = None) -> ParamSet:
        """Stage ``stage``'s tensors on one tensor-/expert-parallel rank (blocks split as evenly as they
        go, the remainder to the first stages), one ZeRO-3 unit per block plus the root. ``fp8_form``
        ("tensor" or "block"): the blocks' linear weights are gathered in FP8 (`Float8Config(all_gather=True)`)."""
        per, extra = divmod(self.layers, pp)
        first = stage * per + min(stage, extra)
        blocks = range(first, first + per + (stage < extra))
        root_before = [(self.vocab * self.hidden // tp, False)] if stage == 0 else []
        root_after = [(self.hidden, False)] + ([(self.vocab * self.hidden // tp, False)]
                                               if not (self.tied and pp == 1) else []) if stage == pp - 1 else []
        return ParamSet.of_sizes([self.block_sizes(tp, ep, self.experts > 0 and i >= self.dense_layers)
                                  for i in blocks], root_before + root_after, root_first=len(root_before),
                                 fp8=(fp8_form, tp) if fp8_form else None)

    def stage_layers(self, pp: int, stage: int) -> int:
        per, extra = divmod(self.layers, pp)
        return per + (stage < extra)

    def params(self, active: bool = False) -> int:
        """Parameters of the whole model (``active``: those one token goes through)."""
        return self._count(active, linear_only=False)

    def linear_params(self) -> int:
        """The weights of the blocks' nn.Linear layers (each token goes through every one): the matmuls FP8
        runs in FP8. The LM head, the router, the routed experts and attention's own products stay in high
        precision."""
        return self._count(active=True, linear_only=True)

    def _count(self, active: bool, linear_only: bool) -> int:
        total = sum(sum(t[0] for t in self.block_sizes(1, 1, self.experts > 0 and i >= self.dense_layers)
                        if len(t) > 2 or not linear_only) for i in range(self.layers))
        if active and self.experts and not linear_only:  # (routed experts are no nn.Linear: not counted there)
            per_expert = (3 if self.gated else 2) * self.hidden * self.moe_ffn
            total -= self.moe_layers * per_expert * (self.experts - self.top_k)
        return total if linear_only else total + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int = 8
    nodes: int = 1
    memory: float = 80e9        # bytes per GPU
    peak_flops: float = 989e12  # dense bf16 per GPU
    fp8_flops: float = 1979e12  # dense FP8 per GPU (the matmuls of `plan(..., fp8=...)`)
    intra_bw: float = 450e9     # bytes/s per GPU per direction inside a node (NVLink)
    inter_bw: float = 50e9      # bytes/s per GPU across nodes (400 Gb/s)
    efficiency: float = 0.5     # the share of peak a large matmul-bound step reaches

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


MODELS = {m.name: m for m in [
    ModelShape("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    ModelShape("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    ModelShape("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
    ModelShape("deepseek-v3-like", 61, 7168, 128, 128, 18432, 129280, 4096, experts=256, top_k=8, moe_ffn=2048,
               shared_experts=1, dense_layers=3),
    ModelShape("gpt2-124m", 12, 768, 12, 12, 3072, 50304, 1024, tied=True, gated=False),
    ModelShape("minipar-gpt", 2, 64, 2, 2, 256, 512, 64, tied=True, gated=False),  # GPTConfig()'s defaults
]}

H100 = Cluster("h100")
