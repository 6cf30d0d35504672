"""MoE token permute and unpermute: gather rows by index, and its adjoint, scatter-add rows by index.

With x (N, D) and index (M,) int64, every entry in [0, N):

    permute(x, index)           y[m]    = x[index[m]]                    (M, D)
    unpermute(y, index, N)      out[n]  = sum_{m : index[m] = n} y[m]    (N, D), zero where n is never indexed

Each is the other's adjoint, so each one's backward is the other:
grad_x = unpermute(grad_y, index, N) and grad_y = permute(grad_out, index).

The Triton scatter-add writes every destination row exactly once and owns it:
the rows that land on n are found through a stable sort of ``index``, and one
program sums them in index order. No atomics, no zero fill, and the result is
deterministic (bitwise the same as ``index_add_`` in fp32 on CPU, which adds in
the same order). Empty inputs (M = 0 or N = 0 or D = 0) launch nothing.
The Triton path does not check that ``index`` is in range (a check would
synchronise the device); the PyTorch path raises as ``index_select`` does.
"""

from __future__ import annotations

import torch

from .dispatch import launch, triton_module, use_triton


def permute(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``x[index]``: x (N, D), index (M,) int64 -> (M, D), same dtype; differentiable in x."""
    return _Permute.apply(x, index)


def unpermute(y: torch.Tensor, index: torch.Tensor, n_rows: int) -> torch.Tensor:
    """``zeros(n_rows, D).index_add_(0, index, y)``: y (M, D) -> (n_rows, D), same dtype; differentiable in y."""
    return _Unpermute.apply(y, index, n_rows)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.n_rows = x.shape[0]
        return gather_rows(x, index)

    @staticmethod
    def backward(ctx, grad_y):
        (index,) = ctx.saved_tensors
        return scatter_add_rows(grad_y, index, ctx.n_rows), None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, index, n_rows):
        ctx.save_for_backward(index)
        return scatter_add_rows(y, index, n_rows)

    @staticmethod
    def backward(ctx, grad_out):
        (index,) = ctx.saved_tensors
        return gather_rows(grad_out, index), None, None


# ----------------------------------------------------------------------------- the two primitives

def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """out[m] = x[index[m]]."""
    if not use_triton(x):
        return x.index_select(0, index)
    x = x.contiguous()
    out = torch.empty((index.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    tk = triton_module("permute_triton")
    d = out[0].numel()
    block_d = tk.block_for(d)
    launch(tk.gather_rows_kernel, (index.shape[0], -(-d // block_d)), x, index.contiguous(), out, d, BLOCK_D=block_d)
    return out


def scatter_add_rows(y: torch.Tensor, index: torch.Tensor, n_rows: int) -> torch.Tensor:
    """out[n] = sum of y[m] over m with index[m] = n; zero rows where n is never indexed."""
    if not use_triton(y):
        return torch.zeros((n_rows,) + tuple(y.shape[1:]), dtype=y.dtype, device=y.device).index_add_(0, index, y)
    y = y.contiguous()
    out = torch.empty((n_rows,) + tuple(y.shape[1:]), dtype=y.dtype, device=y.device)
    if out.numel() == 0:
        return out
    # Row ownership: sources of destination n are order[start[n] : start[n] + count[n]].
    # A stable sort keeps them in index order, the order index_add_ adds them in.
    order = torch.sort(index, stable=True).indices
    count = torch.bincount(index, minlength=n_rows)
    start = torch.cumsum(count, 0) - count
    tk = triton_module("permute_triton")
    d = out[0].numel()
    block_d = tk.block_for(d)
    launch(tk.segment_sum_rows_kernel, (n_rows, -(-d // block_d)), y, order, start, count, out, d, BLOCK_D=block_d)
    return out
