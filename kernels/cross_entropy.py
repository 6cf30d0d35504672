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

Triton path of ``cross_entropy`` (three launches, no torch op around them):

    forward   row_stats_kernel (LOSS)  reads z once; writes lse_i and loss_i (N,) fp32
              xent_mean_kernel         one program: count = #valid rows, loss = sum_i loss_i / max(count, 1)
    backward  xent_grad_kernel         reads z once, writes the gradient once:
                                       grad_loss / max(count, 1) * dloss_i/dz_ij on valid rows, 0 elsewhere

so the logits are read once forward and once backward, and the gradient
written once: the least traffic for a loss whose incoming gradient is unknown
until backward. Saved for backward: the logits and targets (the inputs, alive
anyway), lse (N,) fp32 and the count (a 0-d fp32 tensor): never probabilities.
The sums are per-lane partials reduced in a fixed order, no float atomics:
the loss is the same on every run. Nothing reads a value on the host.

Two primitives carry the vocab-parallel loss (``minipar.tensor_parallel.cross_entropy``);
both take a vocabulary *slice*, with the global reduction between them done by collectives:

    row_stats(z, t, vocab_start)  -> m, s, z_t, sum_j z      one pass over z (online max, rescaled sum)
    xent_grad(z, lse, t, vocab_start, coef, eps, V)  -> coef_i * dloss_i/dz_ij on the slice
    token_losses(lse, z_t, sum_z, eps, V)            -> loss_i                (torch ops, (N,) each)

In Triton they are row_stats_kernel (STATS) and xent_grad_kernel (ROW_COEF).
Neither primitive checks targets: a target outside the slice is how a rank
learns it does not hold it (z_t = 0, no -(1 - eps) term in its gradient).

Every launcher is a custom op (``torch.ops.minipar.*``, with a fake
implementation giving shapes), so torch.compile traces through the autograd
Function into opaque kernel calls. The PyTorch path (``use_triton`` false)
runs the same autograd Function shape with the primitives in torch ops (fp32
temporaries of the logits' size), the reference the kernels are tested against.
``cross_entropy`` raises IndexError for an out-of-range target that is not
``ignore_index`` on the PyTorch path on CPU tensors, as ``F.cross_entropy`` does, but not on a GPU,
where the check would make the host wait for the device (``minipar.core.syncs``),
nor under the interpreter, which stands in for the GPU, nor while torch.compile traces.
``ShardedModule.train_step`` checks every target before any compute.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .dispatch import launch, triton_module, use_triton


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                  label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of logits (..., V) against int64 targets (...): an fp32 scalar.

    Equals ``F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=...,
    label_smoothing=...)``, except that when every target is ignored it is 0 (zero gradients), not NaN.
    """
    v = logits.shape[-1]
    flat_targets = targets.reshape(-1)
    check_targets(logits, flat_targets, v, ignore_index)
    if use_triton(logits):
        return _TritonCrossEntropy.apply(logits.reshape(-1, v), flat_targets, ignore_index, float(label_smoothing))
    return _CrossEntropy.apply(logits.reshape(-1, v), flat_targets, ignore_index, label_smoothing)


def check_targets(like: torch.Tensor, flat_targets: torch.Tensor, v: int, ignore_index: int) -> None:
    """IndexError for a target outside [0, v) that is not ignore_index, where it is free: on CPU tensors on
    the PyTorch path, outside torch.compile (on a GPU the check would make the host wait for the device)."""
    if like.is_cuda or use_triton(like) or torch.compiler.is_compiling():  # (the interpreter stands for a GPU)
        return
    bad = (flat_targets != ignore_index) & ((flat_targets < 0) | (flat_targets >= v))
    if bad.any():
        raise IndexError(f"cross_entropy: target {flat_targets[bad][0].item()} is out of bounds for {v} classes")


class _TritonCrossEntropy(torch.autograd.Function):
    """Mean loss from logits (N, V) through the kernels: forward reads the logits once, backward reads them
    once and writes the gradient once. Saves logits, targets, lse (N,) and count (), never probabilities."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index: int, label_smoothing: float):
        loss, lse, count = torch.ops.minipar.cross_entropy_fwd(logits, targets, ignore_index, label_smoothing)
        ctx.save_for_backward(logits, targets, lse, count)
        ctx.ignore_index, ctx.label_smoothing = ignore_index, label_smoothing
        return loss

    @staticmethod
    @once_differentiable  # the backward is a kernel, not torch ops: a double backward must fail loudly
    def backward(ctx, grad_loss):
        logits, targets, lse, count = ctx.saved_tensors
        grad = torch.ops.minipar.cross_entropy_bwd(grad_loss, logits, targets, lse, count, ctx.ignore_index,
                                                   ctx.label_smoothing)
        return grad, None, None, None


class _CrossEntropy(torch.autograd.Function):
    """The PyTorch path: mean loss from logits (N, V) through the torch primitives; saves the logits,
    targets and lse (N,), never probabilities."""

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
    if use_triton(logits_local):
        return tuple(torch.ops.minipar.xent_row_stats(logits_local, targets, vocab_start).unbind(0))
    v = logits_local.shape[-1]
    z = logits_local.float()
    m = z.amax(dim=-1)
    shift = torch.where(m == float("-inf"), 0.0, m)  # a row of -inf sums to 0, not NaN (as in Triton)
    s = torch.exp(z - shift.unsqueeze(-1)).sum(dim=-1)
    local_t = targets - vocab_start
    here = (local_t >= 0) & (local_t < v)
    z_t = torch.where(here, z.gather(-1, local_t.clamp(0, v - 1).unsqueeze(-1)).squeeze(-1), 0.0)
    return m, s, z_t, z.sum(dim=-1)


def xent_grad(logits_local: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, vocab_start: int,
              coef: torch.Tensor, label_smoothing: float, vocab_size: int) -> torch.Tensor:
    """(N, V_local) in logits' dtype: coef_i * (softmax_ij - eps/V - (1 - eps)[j = t_i - vocab_start]).

    softmax_ij = exp(z_ij - lse_i) with lse (N,) fp32 the global log-sum-exp; coef (N,) fp32
    (0 for ignored rows); eps = label_smoothing; V = vocab_size, the global vocabulary.
    """
    if use_triton(logits_local):
        return torch.ops.minipar.xent_grad(logits_local, lse, targets, coef, vocab_start, float(label_smoothing),
                                           vocab_size)
    v = logits_local.shape[-1]
    smooth, hit = label_smoothing / vocab_size, 1.0 - label_smoothing
    grad = torch.exp(logits_local.float() - lse.unsqueeze(-1)) - smooth  # a fresh tensor: safe to edit
    local_t = targets - vocab_start
    here = (local_t >= 0) & (local_t < v)
    # -hit at (i, t_i) on the rows whose target is in this slice; a scatter, not indexing by nonzero(),
    # which would make the host wait for a GPU
    grad.scatter_add_(-1, local_t.clamp(0, v - 1).unsqueeze(-1), (here * -hit).to(grad.dtype).unsqueeze(-1))
    return (grad * coef.unsqueeze(-1)).to(logits_local.dtype)


# ----------------------------------------------------------------------------- the launchers, as custom ops

@torch.library.custom_op("minipar::xent_row_stats", mutates_args=())
def _row_stats_op(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """(4, N) fp32: the rows m, s, z_t, sum z of `row_stats` (one tensor: a custom op's outputs may not
    share storage, and the caller unbinds it into views)."""
    n, v = logits.shape
    z = rows_unit_stride(logits)
    out = torch.empty(4, n, dtype=torch.float32, device=z.device)
    if n:
        tk = triton_module("cross_entropy_triton")
        rows, block_v = tk.tile_for(n, v)
        launch(tk.row_stats_kernel, (triton_cdiv(n, rows),), z, targets.contiguous(), *out, n, v, z.stride(0),
               vocab_start, 0, 0.0, LOSS=False, SMOOTH=False, ROWS=rows, BLOCK_V=block_v,
               OFF64=needs_int64(z), num_warps=tk.warps_for(rows * block_v))
    return out


@_row_stats_op.register_fake
def _(logits, targets, vocab_start):
    return logits.new_empty((4, logits.shape[0]), dtype=torch.float32)


@torch.library.custom_op("minipar::xent_grad", mutates_args=())
def _xent_grad_op(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, coef: torch.Tensor,
                  vocab_start: int, label_smoothing: float, vocab_size: int) -> torch.Tensor:
    """`xent_grad` through xent_grad_kernel (ROW_COEF): (N, V_local) contiguous, logits' dtype."""
    n, v = logits.shape
    z = rows_unit_stride(logits)
    grad = torch.empty((n, v), dtype=z.dtype, device=z.device)
    if n:
        tk = triton_module("cross_entropy_triton")
        rows, block_v = tk.tile_for(n, v)
        coef = coef.float().contiguous()
        launch(tk.xent_grad_kernel, (triton_cdiv(n, rows),), z, lse.float().contiguous(), targets.contiguous(),
               coef, coef, grad, n, v, z.stride(0), vocab_start, 0, label_smoothing / vocab_size,
               1.0 - label_smoothing, ROW_COEF=True, SMOOTH=label_smoothing != 0.0, ROWS=rows, BLOCK_V=block_v,
               OFF64=needs_int64(z, grad), num_warps=tk.warps_for(rows * block_v))
    return grad


@_xent_grad_op.register_fake
def _(logits, lse, targets, coef, vocab_start, label_smoothing, vocab_size):
    return logits.new_empty(logits.shape)


@torch.library.custom_op("minipar::cross_entropy_fwd", mutates_args=())
def _cross_entropy_fwd_op(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                          label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss (), lse (N,), count ()), fp32: the mean loss over valid rows, each row's log-sum-exp and the
    number of valid rows. Two launches: row_stats_kernel (LOSS), xent_mean_kernel."""
    n, v = logits.shape
    z = rows_unit_stride(logits)
    targets = targets.contiguous()
    lse = torch.empty(n, dtype=torch.float32, device=z.device)
    row_loss = torch.empty(n, dtype=torch.float32, device=z.device)
    loss = torch.empty((), dtype=torch.float32, device=z.device)
    count = torch.empty((), dtype=torch.float32, device=z.device)
    tk = triton_module("cross_entropy_triton")
    if n:
        rows, block_v = tk.tile_for(n, v)
        launch(tk.row_stats_kernel, (triton_cdiv(n, rows),), z, targets, lse, row_loss, lse, lse, n, v,
               z.stride(0), 0, ignore_index, label_smoothing, LOSS=True, SMOOTH=label_smoothing != 0.0,
               ROWS=rows, BLOCK_V=block_v, OFF64=needs_int64(z), num_warps=tk.warps_for(rows * block_v))
    launch(tk.xent_mean_kernel, (1,), row_loss, targets, count, loss, n, ignore_index, COUNT=True, MEAN=True,
           BLOCK=MEAN_BLOCK, num_warps=4)
    return loss, lse, count


@_cross_entropy_fwd_op.register_fake
def _(logits, targets, ignore_index, label_smoothing):
    scalar = logits.new_empty((), dtype=torch.float32)
    return scalar, logits.new_empty((logits.shape[0],), dtype=torch.float32), torch.empty_like(scalar)


@torch.library.custom_op("minipar::cross_entropy_bwd", mutates_args=())
def _cross_entropy_bwd_op(grad_loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                          count: torch.Tensor, ignore_index: int, label_smoothing: float) -> torch.Tensor:
    """d (grad_loss * mean loss) / d logits: (N, V) contiguous in logits' dtype; one launch of
    xent_grad_kernel, which reads grad_loss and count itself (no torch op makes the row coefficients)."""
    n, v = logits.shape
    z = rows_unit_stride(logits)
    grad = torch.empty((n, v), dtype=z.dtype, device=z.device)
    if n:
        tk = triton_module("cross_entropy_triton")
        rows, block_v = tk.tile_for(n, v)
        launch(tk.xent_grad_kernel, (triton_cdiv(n, rows),), z, lse, targets.contiguous(), grad_loss, count,
               grad, n, v, z.stride(0), 0, ignore_index, label_smoothing / v, 1.0 - label_smoothing,
               ROW_COEF=False, SMOOTH=label_smoothing != 0.0, ROWS=rows, BLOCK_V=block_v,
               OFF64=needs_int64(z, grad), num_warps=tk.warps_for(rows * block_v))
    return grad


@_cross_entropy_bwd_op.register_fake
def _(grad_loss, logits, targets, lse, count, ignore_index, label_smoothing):
    return logits.new_empty(logits.shape)


# ----------------------------------------------------------------------------- launch helpers

MEAN_BLOCK = 1024  # xent_mean_kernel's lanes: 8 per thread of its 4 warps


def rows_unit_stride(x: torch.Tensor) -> torch.Tensor:
    """x itself when its columns are adjacent (any row stride, e.g. a slice of wider rows), else a copy."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def needs_int64(*tensors: torch.Tensor) -> bool:
    """True when an offset into one of these 2-D tensors, or a tile's worth of columns past its last
    element (where a masked tile still computes addresses), can reach 2**31: then, and only then, the
    kernels compute offsets in int64 (32-bit integer arithmetic is cheaper, and enough below that)."""
    return any(t.numel() and (t.shape[0] - 1) * t.stride(0) + (t.shape[1] - 1) * t.stride(1) + _TILE_MARGIN >= 2**31
               for t in tensors)


_TILE_MARGIN = 4096  # cross_entropy_triton.MAX_BLOCK_V: columns a masked tile may address past a row's end


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
