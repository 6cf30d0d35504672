"""Cutting the GPT into pipeline stages: embedding + first blocks, ..., last blocks + head.

Every rank builds the whole single-process model from the same seed and keeps
its stage's pieces, so stage s holds exactly the weights the reference holds
for those layers. A tied embedding / LM head lives on the first stage (as the
embedding) and on the last (as the head): two copies, kept identical by
summing their gradients between those two stages before every step
(`sync_tied_grads`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..mesh import Mesh


def balanced_boundaries(n_layer: int, stages: int) -> list[int]:
    """Layer index where each stage starts (stage s runs layers [b[s], b[s+1])), as even as possible."""
    if stages > n_layer:
        raise ValueError(f"{stages} pipeline stages but only {n_layer} layers: use at most {n_layer} stages "
                         "(every stage needs at least one layer)")
    base, extra = divmod(n_layer, stages)
    out, start = [], 0
    for s in range(stages):
        out.append(start)
        start += base + (1 if s < extra else 0)
    return out + [n_layer]


class GPTStage(nn.Module):
    """One pipeline stage of ``minipar.models.GPT``. Input: token ids (first stage) or the previous
    stage's hidden states (batch, seq, n_embd); output: hidden states, or logits on the last stage."""

    def __init__(self, gpt: nn.Module, stage: int, stages: int, boundaries: list[int] | None = None) -> None:
        super().__init__()
        cfg = gpt.config
        bounds = boundaries or balanced_boundaries(cfg.n_layer, stages)
        if len(bounds) != stages + 1 or bounds[0] != 0 or bounds[-1] != cfg.n_layer or \
                any(b >= c for b, c in zip(bounds, bounds[1:])):
            raise ValueError(f"boundaries {bounds} must rise strictly from 0 to n_layer={cfg.n_layer} in "
                             f"{stages + 1} entries")
        self.first, self.last = stage == 0, stage == stages - 1
        self.layer_offset = bounds[stage]  # this stage's layers.k is the model's layers.(offset + k)
        self.tied = cfg.tie_weights and stages > 1
        if self.first:
            self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
        self.layers = nn.ModuleList(gpt.layers[bounds[stage]:bounds[stage + 1]])
        if self.last:
            self.ln_f = gpt.ln_f
            self.lm_head = gpt.lm_head
            if self.tied:  # the last stage's own copy of the shared weight
                self.lm_head.weight = nn.Parameter(gpt.wte.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x

    def global_names(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This stage's ``state`` (as from ``state_dict()``) under the single-process model's names."""
        out = {}
        for k, v in state.items():
            if k.startswith("layers."):
                _, idx, rest = k.split(".", 2)
                k = f"layers.{int(idx) + self.layer_offset}.{rest}"
            out[k] = v.detach().clone()
        if self.tied and self.first:
            out["lm_head.weight"] = out["wte.weight"]
        if self.tied and self.last:
            out["wte.weight"] = out["lm_head.weight"]
        return out

    def tied_weight(self) -> nn.Parameter | None:
        if not self.tied:
            return None
        return self.wte.weight if self.first else (self.lm_head.weight if self.last else None)


@torch.no_grad()
def sync_tied_grads(stage: GPTStage, mesh: Mesh, shape: torch.Size) -> None:
    """Sum the tied weight's gradient over the first and last stage (middle stages add zeros)."""
    if not stage.tied:
        return
    w = stage.tied_weight()
    dtype = next(stage.parameters()).dtype  # the gradient's dtype (the compute dtype), equal on every stage
    buf = torch.zeros(shape, dtype=dtype, device=mesh.device) if w is None or w.grad is None else w.grad
    mesh.comm.all_reduce(buf, mesh.group("pp"), tag="tied_grad")
    if w is not None and w.grad is None:
        w.grad = buf
