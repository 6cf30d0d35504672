"""The routed experts' computation: rows sorted by expert through their experts in two grouped products.

For x (M, d_model) whose rows are sorted by (local) expert, counts[e] of them for expert e
(any of them 0; M their sum, with no padding to a capacity), and stacked weights
w1 (E, d_model, d_hidden), b1 (E, d_hidden), w2 (E, d_hidden, d_model), b2 (E, d_model)::

    group[r]   = the expert of row r            (M,)  repeat_interleave(arange(E), counts)
    h          = gelu(grouped_mm(x, w1, counts) + b1[group])     (M, d_hidden)
    y          = grouped_mm(h, w2, counts) + b2[group]           (M, d_model)

so y[r] = gelu(x[r] W1_e + b1_e) W2_e + b2_e with e = group[r]: one grouped product per weight
whatever the expert count (``minipar.kernels.grouped_mm``: ``torch._grouped_mm``, a loop of
``torch.mm`` or a Triton kernel), instead of one matmul pair per expert.

The bias is added per row by a gather of the expert's bias row rather than inside the product:
the gather's backward is a segment sum (db_e = the sum of the rows' gradients of expert e), which
autograd already has, and the product stays one concept with one backward. The activations held
for backward are the M rows (x, the hidden pre- and post-activation), exactly the routed rows: a
dropless layer holds what its routing sends and nothing for empty capacity slots.

An expert with no rows gets zero gradients (the grouped product's dw of an empty group is zero,
the gather's segment sum of nothing is zero), never None: every rank's expert gradients have the
same shape for the data-parallel reduction.
"""

from __future__ import annotations

import torch

from ..kernels import gelu
from ..kernels.grouped_mm import grouped_mm

__all__ = ["expert_mlp"]


def expert_mlp(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
               b2: torch.Tensor) -> torch.Tensor:
    """x (M, d_model) sorted by expert, counts (E,) int on x's device -> (M, d_model); see the module doc."""
    n_experts = w1.shape[0]
    # output_size: the length is known (M), so a GPU need not read the counts back to size the result.
    group = torch.repeat_interleave(torch.arange(n_experts, device=x.device), counts, output_size=x.shape[0])
    h = gelu(grouped_mm(x, w1, counts) + b1.index_select(0, group))
    return grouped_mm(h, w2, counts) + b2.index_select(0, group)
