"""Cross-entropy over vocab-parallel logits, without ever gathering the full logits.

Each tp rank holds logits z[:, lo:hi] of its vocabulary slice (V_local = V / tp
columns). ``minipar.kernels.cross_entropy.row_stats`` reads the slice once and
gives, per token, the local max m_r, the local sum s_r = sum_{j in slice}
exp(z_j - m_r), the target's logit (0 unless this slice holds it) and the
local sum of the logits. Two all-reduces make them global:

    m     = max_r m_r                                   (all-reduce max of (tokens,))
    S     = sum_r s_r exp(m_r - m)                      (each rank rescales its sum to the global max,
    z_t   = sum_r z_t,r,   sum_z = sum_r sum_z,r          then one all-reduce sum of the stacked (3, tokens))
    lse   = log S + m
    loss_i = (1 - eps) (lse_i - z_{i,t_i}) + eps (lse_i - sum_j z_ij / V)     (label smoothing eps)
    dloss_i/dz_ij = p_ij - (1 - eps) [j = t_i] - eps / V,   p = softmax(z) = exp(z - lse)

Backward recomputes p on each slice from the saved logits and lse
(``xent_grad``); no communication, and no (tokens, V_local) probabilities are
kept between forward and backward. Tokens whose target is ``ignore_index``
give zero loss and zero gradient, and the mean is over the other tokens, as
``F.cross_entropy`` does. The logits are read, never written.
"""

from __future__ import annotations

import torch

from ..core.comm import AxisGroup, Comm
from ..kernels.cross_entropy import row_stats, token_losses, xent_grad


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses (tokens,) from local logits (tokens, V / tp); backward as in the module docstring."""

    @staticmethod
    def forward(ctx, logits, targets, comm: Comm, group: AxisGroup, vocab_size: int, ignore_index: int,
                label_smoothing: float):
        vocab_start = group.rank * logits.shape[-1]
        m_local, s_local, z_t, sum_z = row_stats(logits, targets, vocab_start)
        m = m_local.clone()
        comm.all_reduce(m, group, op="max", tag="tp_ce")
        # exp(m_local - m) <= 1: moving each rank's sum to the global max cannot overflow
        sums = torch.stack([s_local * torch.exp(m_local - m), sum_z, z_t])  # one all-reduce for all three
        comm.all_reduce(sums, group, tag="tp_ce")
        sum_exp, sum_z, z_t = sums
        lse = sum_exp.log() + m
        valid = targets != ignore_index
        loss = torch.where(valid, token_losses(lse, z_t, sum_z, label_smoothing, vocab_size), 0.0)
        ctx.save_for_backward(logits, targets, lse, valid)
        ctx.vocab_start, ctx.vocab_size, ctx.label_smoothing = vocab_start, vocab_size, label_smoothing
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, targets, lse, valid = ctx.saved_tensors
        coef = torch.where(valid, dloss.float(), 0.0)
        grad = xent_grad(logits, lse, targets, ctx.vocab_start, coef, ctx.label_smoothing, ctx.vocab_size)
        return grad, None, None, None, None, None, None


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
