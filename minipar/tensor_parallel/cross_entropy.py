"""Cross-entropy over vocab-parallel logits, without ever gathering the full logits.

Each tp rank holds logits z[:, lo:hi] of its vocabulary slice. With m the
global max, S = sum_j exp(z_j - m) and lse = log S + m (all three reduced over
tp: one max and two sums of a (tokens,) vector each):

    nll_i    = lse_i - z_{i, t_i}                       (z_t found on the one rank that owns t_i)
    loss_i   = (1 - eps) nll_i + eps (lse_i - sum_j z_ij / V)     (label smoothing eps)
    dloss_i/dz_ij = p_ij - (1 - eps) [j = t_i] - eps / V,   p = softmax(z)

Tokens whose target is ``ignore_index`` give zero loss and zero gradient, and
the mean is over the other tokens, as ``F.cross_entropy`` does. The logits are
read, never written.
"""

from __future__ import annotations

import torch

from ..comm import AxisGroup, Comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses (tokens,) from local logits (tokens, V / tp); backward as in the module docstring."""

    @staticmethod
    def forward(ctx, logits, targets, comm: Comm, group: AxisGroup, vocab_size: int, ignore_index: int,
                label_smoothing: float):
        z = logits.float()
        v_local = z.shape[-1]
        lo = group.rank * v_local
        m = z.max(dim=-1).values
        comm.all_reduce(m, group, op="max", tag="tp_ce")
        e = torch.exp(z - m.unsqueeze(-1))
        sums = torch.stack([e.sum(dim=-1), z.sum(dim=-1)])  # one all-reduce for both sums
        local_t = targets - lo
        mine = (local_t >= 0) & (local_t < v_local)
        z_t = torch.where(mine, z.gather(-1, local_t.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1), 0.0)
        sums = torch.cat([sums, z_t.unsqueeze(0)])
        comm.all_reduce(sums, group, tag="tp_ce")
        sum_exp, sum_z, z_t = sums
        lse = sum_exp.log() + m
        loss = (1 - label_smoothing) * (lse - z_t) + label_smoothing * (lse - sum_z / vocab_size)
        valid = targets != ignore_index
        loss = torch.where(valid, loss, 0.0)
        ctx.save_for_backward(e / sum_exp.unsqueeze(-1), local_t, mine, valid)
        ctx.label_smoothing, ctx.vocab_size, ctx.dtype = label_smoothing, vocab_size, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, dloss):
        p, local_t, mine, valid = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = p - eps / ctx.vocab_size
        rows = mine.nonzero().squeeze(-1)
        grad[rows, local_t[rows]] -= 1 - eps
        grad *= torch.where(valid, dloss, 0.0).unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, comm: Comm, group: AxisGroup,
                                 ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of vocab-parallel ``logits`` (..., V / tp) against global ``targets`` (...).

    Equal to ``F.cross_entropy(full_logits.flatten(0, -2), targets.flatten(), ignore_index=...,
    label_smoothing=...)`` on the full logits, except that a batch whose every target is ignored
    gives 0 (and zero gradients), not NaN.
    """
    v_local = logits.shape[-1]
    per_token = _VocabParallelCrossEntropy.apply(logits.reshape(-1, v_local), targets.reshape(-1), comm, group,
                                                 v_local * group.size, ignore_index, label_smoothing)
    count = (targets != ignore_index).sum().clamp(min=1)
    return per_token.sum() / count
