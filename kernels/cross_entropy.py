"""Softmax cross-entropy, forward and backward, without materialising the probabilities.

For logits z (N, V) and targets t (N,), with label smoothing eps, per row i:

    m_i   = max_j z_ij
    s_i   = sum_j exp(z_ij - m_i)
    lse_i = m_i + log s_i                                   (log-sum-exp)
    loss_i = (1 - eps) (lse_i - z_{i,t_i}) + eps (lse_i - sum_j z_ij / V)
           = (lse_i - z_{i,t_i}) + eps (z_{i,t_i} - sum_j z_ij / V)       (the form computed)
    dloss_i / dz_ij = softmax_ij - eps / V - (1 - eps) [j = t_i],   softmax_ij = exp(z_ij - lse_i)

``cross_entropy`` is the mean of loss_i over the rows whose target is not
``ignore_index`` (ignored rows: zero loss, zero gradient); when every row is
ignored it is 0, not NaN. Everything is computed in fp32 whatever the logits'
dtype; the gradient comes back in the logits' dtype.

Two primitives carry the work, and both take a vocabulary *slice*, so that
tensor parallelism (``minipar.tensor_parallel.cross_entropy``) reuses them on
(N, V / tp) logits, with the global reduction in between done by collectives:

    row_stats(z, t, vocab_start)  -> m, s, z_t, sum_j z      one pass over z (online max, rescaled sum)
    xent_grad(z, lse, t, vocab_start, coef, eps, V)  -> coef_i * dloss_i/dz_ij on the slice

Only the log-sum-exp (N,) is kept between forward and backward, with the
logits and targets (alive anyway: they are the inputs); backward recomputes
the softmax from them. In Triton the only (N, V) tensor ever allocated is the
gradient itself (the PyTorch reference path allocates fp32 temporaries). The
logits are never written.

Both primitives run in Triton (one program per row, see ``cross_entropy_triton``)
when the dispatch rule picks it, in PyTorch otherwise; the autograd Function is
the same for both. Neither primitive checks targets: a target outside the slice
is how a rank learns it does not hold it (z_t = 0, no -(1 - eps) term in its gradient).
``cross_entropy`` raises IndexError for an out-of-range target that is not
``ignore_index`` on CPU tensors, as ``F.cross_entropy`` does, but not on a GPU,
where the check would make the host wait for the device (``minipar.syncs``),
nor under the interpreter, which stands in for the GPU.
``ShardedModule.train_step`` checks every target before any compute.
"""

from __future__ import annotations

import torch

from .dispatch import interpreting, launch, triton_module, use_triton


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                  label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of logits (..., V) against int64 targets (...): an fp32 scalar.

    Equals ``F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=...,
    label_smoothing=...)``, except that when every target is ignored it is 0 (zero gradients), not NaN.
    """
    v = logits.shape[-1]
    flat_targets = targets.reshape(-1)
    if not (logits.is_cuda or interpreting()):  # free on CPU; on a GPU the check would wait for the device
        bad = (flat_targets != ignore_index) & ((flat_targets < 0) | (flat_targets >= v))
        if bad.any():
            raise IndexError(f"cross_entropy: target {flat_targets[bad][0].item()} is out of bounds "
                             f"for {v} classes")
    return _CrossEntropy.apply(logits.reshape(-1, v), flat_targets, ignore_index, label_smoothing)


class _CrossEntropy(torch.autograd.Function):
    """Mean loss from logits (N, V); saves the logits, targets and lse (N,), never probabilities."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index: int, label_smoothing: float):
        v = logits.shape[-1]
        m, s, z_t, sum_z = row_stats(logits, targets, 0)
        lse = m + s.log()
        loss = token_losses(lse, z_t, sum_z, label_smoothing, v)
        valid = targets != ignore_index
        # where, not a product: an ignored row's loss may be inf or NaN, and must still count 0
        total = torch.where(valid, loss, 0.0).sum()
        ctx.save_for_backward(logits, targets, lse)
        ctx.ignore_index, ctx.label_smoothing = ignore_index, label_smoothing
        return total / valid.sum().clamp(min=1)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, targets, lse = ctx.saved_tensors
        valid = targets != ctx.ignore_index
        coef = torch.where(valid, grad_loss.float() / valid.sum().clamp(min=1), 0.0)
        grad = xent_grad(logits, lse, targets, 0, coef, ctx.label_smoothing, logits.shape[-1])
        return grad, None, None, None


def token_losses(lse: torch.Tensor, z_t: torch.Tensor, sum_z: torch.Tensor, label_smoothing: float,
                 vocab_size: int) -> torch.Tensor:
    """loss_i (N,) from the global lse, z_t and sum_j z (N,) each, as (lse - z_t) + eps (z_t - sum_z / V).

    Differences of like quantities first: exact 0 for V = 1. The smoothing term is left out when
    eps = 0, where a -inf logit would make it 0 * inf = NaN.
    """
    loss = lse - z_t
    if label_smoothing:
        loss = loss + label_smoothing * (z_t - sum_z / vocab_size)
    return loss


# ----------------------------------------------------------------------------- the two primitives

def row_stats(logits_local: torch.Tensor, targets: torch.Tensor,
              vocab_start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of logits_local (N, V_local), fp32 (N,) each: local max m, sum_j exp(z_j - m),
    the target's logit z_t if ``vocab_start <= t < vocab_start + V_local`` else 0, and sum_j z_j.
    """
    n, v = logits_local.shape
    if not use_triton(logits_local):
        z = logits_local.float()
        m = z.amax(dim=-1)
        shift = torch.where(m == float("-inf"), 0.0, m)  # a row of -inf sums to 0, not NaN (as in Triton)
        s = torch.exp(z - shift.unsqueeze(-1)).sum(dim=-1)
        local_t = targets - vocab_start
        here = (local_t >= 0) & (local_t < v)
        z_t = torch.where(here, z.gather(-1, local_t.clamp(0, v - 1).unsqueeze(-1)).squeeze(-1), 0.0)
        return m, s, z_t, z.sum(dim=-1)
    z = _rows_unit_stride(logits_local)
    m, s, z_t, sum_z = torch.empty(4, n, dtype=torch.float32, device=z.device)
    if n:
        tk = triton_module("cross_entropy_triton")
        block_v = tk.block_for(v)
        launch(tk.row_stats_kernel, (n,), z, targets.contiguous(), m, s, z_t, sum_z, v, z.stride(0), vocab_start,
               BLOCK_V=block_v, num_warps=tk.warps_for(block_v))
    return m, s, z_t, sum_z


def xent_grad(logits_local: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, vocab_start: int,
              coef: torch.Tensor, label_smoothing: float, vocab_size: int) -> torch.Tensor:
    """(N, V_local) in logits' dtype: coef_i * (softmax_ij - eps/V - (1 - eps)[j = t_i - vocab_start]).

    softmax_ij = exp(z_ij - lse_i) with lse (N,) fp32 the global log-sum-exp; coef (N,) fp32
    (0 for ignored rows); eps = label_smoothing; V = vocab_size, the global vocabulary.
    """
    n, v = logits_local.shape
    smooth, hit = label_smoothing / vocab_size, 1.0 - label_smoothing
    if not use_triton(logits_local):
        grad = torch.exp(logits_local.float() - lse.unsqueeze(-1)) - smooth  # a fresh tensor: safe to edit
        local_t = targets - vocab_start
        rows = ((local_t >= 0) & (local_t < v)).nonzero().squeeze(-1)
        grad[rows, local_t[rows]] -= hit
        return (grad * coef.unsqueeze(-1)).to(logits_local.dtype)
    z = _rows_unit_stride(logits_local)
    grad = torch.empty((n, v), dtype=z.dtype, device=z.device)
    if n:
        tk = triton_module("cross_entropy_triton")
        block_v = tk.block_for(v)
        launch(tk.xent_grad_kernel, (n,), z, lse.float().contiguous(), targets.contiguous(),
               coef.float().contiguous(), grad, v, z.stride(0), vocab_start, smooth, hit,
               BLOCK_V=block_v, num_warps=tk.warps_for(block_v))
    return grad


def _rows_unit_stride(x: torch.Tensor) -> torch.Tensor:
    """x itself when its columns are adjacent (any row stride, e.g. a slice of wider rows), else a copy."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()
