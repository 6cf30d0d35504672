"""An LM head and its cross-entropy in row chunks: the loss of ``hidden @ weight.T`` without its logits.

For hidden h (N, D), the head's weight W (V, D) and targets t (N,), with z = h W^T (N, V) and the
per-row loss and gradient of ``cross_entropy`` (label smoothing eps, mean over the rows whose target is
not ``ignore_index``, count = their number, 0 when there are none):

    L = sum_i loss_i(z_i) / max(count, 1)
    G = dL/dz:  G_ij = (softmax_ij - eps/V - (1 - eps)[j = t_i]) / max(count, 1)   (0 on ignored rows)
    dL/dh = G W      (N, D)            dL/dW = G^T h      (V, D)

G is only needed through those two products, and row i of G depends on row i of z alone, so the forward
walks the rows in chunks of ``chunk_rows`` and keeps nothing of the size N x V:

    z_c = h_c W^T                     in the compute dtype, as nn.Linear would (one GEMM)
    loss_c, z_c := G_c                one Triton kernel (xent_loss_grad_kernel): the chunk's row losses,
                                      and the gradient written OVER the logits, in place (z_c is this
                                      function's own buffer: nobody else can see it)
    dh_c = G_c W                      (a GEMM into rows c of the (N, D) result)
    dW  += G_c^T h_c                  a GEMM in the compute dtype, added into an fp32 (V, D) buffer

then L = sum of the row losses / count (xent_mean_kernel; count by the same kernel before the loop).
Backward only scales: dL/dh and dL/dW times the incoming scalar gradient (N x D and V x D: small next
to N x V), so nothing is recomputed. Saved for backward: dh (N, D) in the compute dtype and dW (V, D)
fp32 (each only if that input requires a gradient); never the logits.

The weight gradient is accumulated in fp32, not in the compute dtype: a bf16 running sum would round
the whole sum again at every chunk (an error growing with the number of chunks, where the unchunked
GEMM rounds once). Each chunk's G_c^T h_c is one GEMM in the compute dtype (fp32 accumulation inside
the GEMM, its output rounded once to bf16/fp16), added into the fp32 buffer: one rounding per chunk's
contribution, none of the running sum, and per chunk 2 V D bytes written and read back plus the 8 V D
of the fp32 add. (Not ``addmm`` into the fp32 buffer: PyTorch's fp32-output GEMM for bf16 operands,
``out_dtype=torch.float32``, wants its addend in the operands' dtype and exists on CUDA only; an fp32
output GEMM plus the add would cost 4 V D more bytes per chunk to save roundings that the final cast of
dW to the weight's dtype mostly repeats.) fp32 compute uses ``addmm_`` into the buffer in place.

Memory and speed: besides the saved gradients, one (chunk_rows, V) logits buffer in the compute dtype,
reused by every chunk, and one (V, D) product in the compute dtype at a time. The default
`default_chunk_rows` = 8 D / element size (4 D rows in bf16) makes the logits buffer 8 V D bytes, twice
the fp32 weight gradient, so the extra memory is bounded by a function of V and D alone (at D = 1024,
V = 50304: 393 MiB, against 1.5 GiB for bf16 logits of 16k tokens and twice that in fp32). The size is
set by the weight gradient's fp32 accumulation: per chunk it moves 12 V D bytes (the product written and
read back, the fp32 buffer read and written) beside the 2 chunk_rows V D flops of its GEMM, so the adds
cost about 6 F / (B chunk_rows) of that GEMM's time (F / B: the GPU's flops per byte, ~300 on a H100):
~40% at 4 D rows and D = 1024 (~15% of the chunk's three GEMMs), twice that at half the rows.

PyTorch path (``use_triton`` false): the same chunked algorithm with torch ops in place of the kernel
(``row_stats``/``xent_grad`` of ``cross_entropy``), so it saves the same memory on CPU; its per-chunk
temporaries are fp32 (chunk_rows, V). Both paths run in the same autograd Function; the Triton path's
forward is one custom op (``torch.ops.minipar.linear_cross_entropy_fwd``), opaque to torch.compile.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .cross_entropy import MEAN_BLOCK, check_targets, needs_int64, row_stats, token_losses, triton_cdiv, xent_grad
from .dispatch import launch, triton_module, use_triton


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         label_smoothing: float = 0.0, chunk_rows: int | None = None) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, targets, ignore_index, label_smoothing)`` without the logits.

    hidden (..., D) and weight (V, D) in the same (compute) dtype, targets (...) int64; returns the mean
    loss, an fp32 scalar (0 when every target is ignored). Differentiable in hidden and weight (either
    may not require a gradient; a weight tied elsewhere gets the sum, as autograd always does).
    ``chunk_rows``: rows per chunk (default `default_chunk_rows`).
    """
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be (V, D) with D = hidden.shape[-1] = {hidden.shape[-1]}; "
                         f"got {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:-1])} (hidden without its last "
                         f"dimension); got {tuple(targets.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} and weight {weight.dtype}: cast both to the compute dtype")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1; got {chunk_rows}")
    v, d = weight.shape
    flat_targets = targets.reshape(-1)
    check_targets(hidden, flat_targets, v, ignore_index)
    rows = chunk_rows or default_chunk_rows(v, d, hidden.element_size())
    return _LinearCrossEntropy.apply(hidden.reshape(-1, d), weight, flat_targets, ignore_index,
                                     float(label_smoothing), rows)


def default_chunk_rows(vocab_size: int, hidden_size: int, element_size: int) -> int:
    """Rows per chunk whose logits take 8 V D bytes, twice the fp32 weight gradient: 8 D / element_size
    (4 D in bf16; module docstring). ``vocab_size`` cancels out of the rows; the bytes are 8 V D."""
    return max(1, 8 * hidden_size // element_size)


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean loss from hidden (N, D), weight (V, D), targets (N,); forward computes both gradients chunk by
    chunk (module docstring), backward scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index: int, label_smoothing: float, chunk_rows: int):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if use_triton(hidden):
            loss, grad_h, grad_w = torch.ops.minipar.linear_cross_entropy_fwd(
                hidden, weight, targets, ignore_index, label_smoothing, chunk_rows, need_h, need_w)
        else:
            loss, grad_h, grad_w = _chunked_torch(hidden, weight, targets, ignore_index, label_smoothing,
                                                  chunk_rows, need_h, need_w)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    @once_differentiable  # the gradients were computed in forward: a double backward must fail loudly
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # times a 0-d fp32 tensor: the product is rounded once to grad_h's dtype (exact for grad_loss = 1)
        dh = grad_h * grad_loss if need_h else None
        dw = (grad_w * grad_loss).to(ctx.weight_dtype) if need_w else None
        return dh, dw, None, None, None, None


def _add_weight_grad(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """grad_w (V, D) fp32 += g^T h for g (rows, V), h (rows, D) in the compute dtype (module docstring)."""
    if g.dtype == torch.float32:
        return grad_w.addmm_(g.t(), h)
    return grad_w.add_(torch.mm(g.t(), h))


def _grad_buffers(hidden, weight, need_h, need_w):
    """dh (N, D) in the compute dtype and dW (V, D) fp32, each empty ((0, D)) when not wanted."""
    n, d = hidden.shape
    grad_h = torch.empty((n if need_h else 0, d), dtype=hidden.dtype, device=hidden.device)
    grad_w = (torch.zeros if need_w else torch.empty)((weight.shape[0] if need_w else 0, d), dtype=torch.float32,
                                                      device=hidden.device)
    return grad_h, grad_w


@torch.library.custom_op("minipar::linear_cross_entropy_fwd", mutates_args=())
def _linear_cross_entropy_fwd_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 ignore_index: int, label_smoothing: float, chunk_rows: int,
                                 need_grad_hidden: bool, need_grad_weight: bool
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss (), dL/dh (N, D) or (0, D), dL/dW (V, D) fp32 or (0, D)) through the kernels, chunk by chunk."""
    n, d = hidden.shape
    v = weight.shape[0]
    tk = triton_module("cross_entropy_triton")
    targets = targets.contiguous()
    row_loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    count = torch.empty((), dtype=torch.float32, device=hidden.device)
    loss = torch.empty((), dtype=torch.float32, device=hidden.device)
    # the valid rows of the whole batch first: every chunk's gradient is divided by their number
    launch(tk.xent_mean_kernel, (1,), row_loss, targets, count, loss, n, ignore_index, COUNT=True, MEAN=False,
           BLOCK=MEAN_BLOCK, num_warps=4)
    grad_h, grad_w = _grad_buffers(hidden, weight, need_grad_hidden, need_grad_weight)
    rows = min(chunk_rows, n)
    logits = torch.empty((rows, v), dtype=hidden.dtype, device=hidden.device)  # every chunk's, reused
    tile_rows, block_v = tk.tile_for(rows, v)
    config = dict(SMOOTH=label_smoothing != 0.0, ROWS=tile_rows, BLOCK_V=block_v, OFF64=needs_int64(logits),
                  num_warps=tk.warps_for(tile_rows * block_v))
    for start in range(0, n, max(rows, 1)):
        end = min(start + rows, n)
        h, z = hidden[start:end], logits[:end - start]
        torch.mm(h, weight.t(), out=z)
        launch(tk.xent_loss_grad_kernel, (triton_cdiv(end - start, tile_rows),), z, targets[start:end], count,
               row_loss[start:end], end - start, v, ignore_index, label_smoothing, **config)
        if need_grad_hidden:
            torch.mm(z, weight, out=grad_h[start:end])
        if need_grad_weight:
            grad_w = _add_weight_grad(grad_w, z, h)
    launch(tk.xent_mean_kernel, (1,), row_loss, targets, count, loss, n, ignore_index, COUNT=False, MEAN=True,
           BLOCK=MEAN_BLOCK, num_warps=4)
    return loss, grad_h, grad_w


@_linear_cross_entropy_fwd_op.register_fake
def _(hidden, weight, targets, ignore_index, label_smoothing, chunk_rows, need_grad_hidden, need_grad_weight):
    n, d = hidden.shape
    grad_h = hidden.new_empty((n if need_grad_hidden else 0, d))
    grad_w = hidden.new_empty((weight.shape[0] if need_grad_weight else 0, d), dtype=torch.float32)
    return hidden.new_empty((), dtype=torch.float32), grad_h, grad_w


def _chunked_torch(hidden, weight, targets, ignore_index, label_smoothing, chunk_rows, need_h, need_w):
    """The PyTorch path: the Triton op's algorithm with the torch primitives of ``cross_entropy``."""
    n, v = hidden.shape[0], weight.shape[0]
    valid = targets != ignore_index
    count = valid.sum().clamp(min=1)
    row_loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    grad_h, grad_w = _grad_buffers(hidden, weight, need_h, need_w)
    for start in range(0, n, chunk_rows):
        end = min(start + chunk_rows, n)
        h, t, ok = hidden[start:end], targets[start:end], valid[start:end]
        z = torch.mm(h, weight.t())
        m, s, z_t, sum_z = row_stats(z, t, 0)
        lse = m + s.log()
        row_loss[start:end] = torch.where(ok, token_losses(lse, z_t, sum_z, label_smoothing, v), 0.0)
        g = xent_grad(z, lse, t, 0, ok / count, label_smoothing, v)
        del z  # the chunk's logits, before the GEMMs allocate
        if need_h:
            torch.mm(g, weight, out=grad_h[start:end])
        if need_w:
            grad_w = _add_weight_grad(grad_w, g, h)
    return row_loss.sum() / count, grad_h, grad_w
