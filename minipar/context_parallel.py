"""Context parallelism: the ranks of a cp group split every sequence and cooperate on attention.

Everything but attention works token by token, so a rank can run it on its own tokens alone; only
attention needs the other tokens' keys and values. `ShardedModule` (``mesh.cp > 1``) does four
things, here:

1. **Split.** The ranks of a cp group are given the same batch of full sequences; each keeps its
   tokens of the inputs and the targets. ``ring``: the sequence is cut into 2C chunks and rank r
   keeps chunks r and 2C-1-r (zig-zag), so every rank has the same causal work (a query in a late
   chunk sees many keys, one in an early chunk few). ``ulysses``: rank r keeps the r-th of C
   contiguous chunks (every rank attends over the whole sequence for its heads: balanced anyway).
2. **Positions.** The model computes positions 0..T/C-1 for its local tokens; a forward pre-hook
   on each module that takes positions (the learned table `GPT.wpe`, the rotary embedding
   `Rotary` of a ``pos="rope"`` model) maps them to the tokens' true positions.
3. **Attention.** Each attention module's ``context_attention`` becomes ring attention (K/V blocks
   passed around the cp ring, partial outputs merged by their log-sum-exp,
   `minipar.ring_attention.ring_attention`) or Ulysses (all-to-all to all tokens of H/C heads,
   local attention, all-to-all back, `minipar.ring_attention.ulysses_attention`).
4. **Loss.** A rank's loss is the mean over its own non-ignored targets (-100 ignored). Weighted
   by n_local * C / n_sequence (n counts non-ignored targets), the mean over the cp ranks is the
   mean over all tokens of their sequences; gradients are then averaged over dp x cp
   (``mesh.grad_axis``), and the loss `train_step` returns is the global batch's.

Parameters are replicated over cp like over dp: the data-parallel strategies treat dp x cp as
their data axis (ZeRO shards over it). Attention dropout is refused (the masks of a split
attention cannot match one process's).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from .mesh import Mesh
from .ring_attention import contiguous_positions, ring_attention, ulysses_attention, zigzag_positions

FORMS = ("ring", "ulysses")


def check_form(form: Any) -> None:
    if form is not None and form not in FORMS:
        raise ValueError(f"context_parallel={form!r}; choose one of {', '.join(map(repr, FORMS))} (or None: "
                         "ring when the mesh has cp > 1)")


def attention_modules(module: nn.Module) -> list[nn.Module]:
    """The modules whose attention context parallelism replaces (minipar's GPT attention)."""
    return [m for m in module.modules() if hasattr(m, "context_attention") and hasattr(m, "q_proj")]


class ContextParallel:
    """Context parallelism over ``mesh``'s cp group for ``module`` (see the module docstring)."""

    def __init__(self, module: nn.Module, mesh: Mesh, form: str | None) -> None:
        check_form(form)
        self.mesh, self.form = mesh, form or "ring"
        self.group, self.cp = mesh.group("cp"), mesh.cp
        attns = attention_modules(module)
        if not attns:
            raise ValueError(f"context parallelism (cp={mesh.cp}) found no attention to split in "
                             f"{type(module).__name__}: it needs modules with q_proj and a context_attention "
                             "slot (minipar.models.GPT's CausalSelfAttention)")
        for a in attns:
            if a.dropout:
                raise ValueError(f"attention dropout ({a.dropout}) under context parallelism is not supported: "
                                 "the masks of a split attention cannot match one process's; build the model "
                                 "with dropout=0.0 or use cp=1")
            heads = a.q_proj.weight.shape[0] // a.head_dim // mesh.tp  # a tp rank's heads (built before tp)
            if self.form == "ulysses" and heads % self.cp:
                raise ValueError(f"Ulysses context parallelism gives each cp rank heads / cp heads, but the "
                                 f"attention has {heads} heads per tp rank and cp={self.cp}; use a head count "
                                 f"(per tp rank) divisible by cp, or context_parallel='ring'")
            a.context_attention = self._attention
        self.positions: torch.Tensor | None = None  # this rank's tokens' true positions, set by split
        self.seq_len = 0
        self._hooks = [m.register_forward_pre_hook(self._true_positions) for m in position_modules(module)]

    @property
    def seq_multiple(self) -> int:
        """What the sequence length must be a multiple of: 2C (ring's chunks) or C (Ulysses)."""
        return 2 * self.cp if self.form == "ring" else self.cp

    def local_positions(self, seq_len: int) -> torch.Tensor:
        split = zigzag_positions if self.form == "ring" else contiguous_positions
        return split(seq_len, self.cp, self.group.rank, device=self.mesh.device)

    def split(self, inputs: torch.Tensor, targets: Any, loss_fn: Callable) -> tuple[torch.Tensor, Any, Callable]:
        """This rank's tokens of ``inputs`` and ``targets`` (batch, seq, ...), and ``loss_fn``
        weighted so that the mean over the cp ranks is the mean over every token."""
        self.seq_len = inputs.shape[1]
        self.positions = self.local_positions(self.seq_len)
        local_inputs = inputs.index_select(1, self.positions.to(inputs.device))
        if not torch.is_tensor(targets):
            return local_inputs, targets, loss_fn
        local_targets = targets.index_select(1, self.positions.to(targets.device))
        counted = lambda t: (t != -100).sum().to(torch.float32)  # noqa: E731
        weight = counted(local_targets) * self.cp / counted(targets).clamp(min=1.0)  # no host sync

        def weighted(output, y):
            return loss_fn(output, y) * weight.to(output.device)
        return local_inputs, local_targets, weighted

    def _true_positions(self, module: nn.Module, args: tuple) -> tuple | None:
        if self.positions is None or not args or not torch.is_tensor(args[0]):
            return None
        return (self.positions.to(args[0].device)[args[0]],) + tuple(args[1:])

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.form == "ring":
            return ring_attention(q, k, v, self.mesh.comm, self.group, self.seq_len)
        return ulysses_attention(q, k, v, self.mesh.comm, self.group)


def position_modules(module: nn.Module) -> list[nn.Module]:
    """The modules whose input is the tokens' positions: learned position tables (minipar's GPT and
    its stages: ``wpe``) and any module that declares ``takes_positions`` (rotary embeddings)."""
    return [m for name, m in module.named_modules()
            if getattr(m, "takes_positions", False) or (name.split(".")[-1] == "wpe" and isinstance(m, nn.Embedding))]
