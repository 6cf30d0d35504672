"""MoE token permute and unpermute: gather rows by index, and its adjoint, scatter-add rows by index.

With x (N, D) and index (M,) int64, every entry in [0, N):

    permute(x, index)           y[m]    = x[index[m]]                    (M, D)
    unpermute(y, index, N)      out[n]  = sum_{m : index[m] = n} y[m]    (N, D), zero where n is never indexed

Each is the other's adjoint, so each one's backward is the other:
grad_x = unpermute(grad_y, index, N) and grad_y = permute(grad_out, index).

The Triton scatter-add writes every destination row exactly once and owns it:
the rows that land on n are found through a stable sort of ``index`` and a
binary search of the sorted index for where each n starts (device work: no
count is read back, so the host never waits), and one program sums them in
index order. No atomics, no zero fill, and the result is deterministic
(bitwise the same as ``index_add_`` in fp32 on CPU, which adds in the same
order). Empty inputs (M = 0 or N = 0 or D = 0) launch nothing. Both kernels
move tiles of several rows per program (``permute_triton`` has the layout).

The launchers are ``torch.library`` custom ops (``minipar::gather_rows`` and
``minipar::scatter_add_rows``, with fake implementations giving the shapes)
that the autograd Functions call, so ``torch.compile`` traces permute and
unpermute whole (fullgraph) and keeps the kernels.
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
    return gather_rows_op(x, index)


def scatter_add_rows(y: torch.Tensor, index: torch.Tensor, n_rows: int) -> torch.Tensor:
    """out[n] = sum of y[m] over m with index[m] = n; zero rows where n is never indexed."""
    if not use_triton(y):
        return torch.zeros((n_rows,) + tuple(y.shape[1:]), dtype=y.dtype, device=y.device).index_add_(0, index, y)
    return scatter_add_rows_op(y, index, n_rows)


# ----------------------------------------------------------------------------- the launchers, as custom ops

@torch.library.custom_op("minipar::gather_rows", mutates_args=())
def gather_rows_op(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (N, ...), index (M,) int -> (M, ...) in x's dtype: the Triton gather."""
    x = x.contiguous()
    out = x.new_empty((index.shape[0],) + tuple(x.shape[1:]))
    if out.numel() == 0:
        return out
    tk = triton_module("permute_triton")
    d, m = out[0].numel(), index.shape[0]
    config = tk.config(d, x.element_size(), max(x.numel(), out.numel()))
    launch(tk.gather_rows_kernel, (-(-m // config["ROWS"]), -(-d // config["BLOCK_D"])), x, index.contiguous(), out,
           m, d, **config, num_warps=tk.GATHER_WARPS)
    return out


@torch.library.custom_op("minipar::scatter_add_rows", mutates_args=())
def scatter_add_rows_op(y: torch.Tensor, index: torch.Tensor, n_rows: int) -> torch.Tensor:
    """y (M, ...), index (M,) int -> (n_rows, ...) in y's dtype: the Triton segment sum."""
    y = y.contiguous()
    out = y.new_empty((n_rows,) + tuple(y.shape[1:]))
    if out.numel() == 0:
        return out
    tk = triton_module("permute_triton")
    d = out[0].numel()
    config = tk.config(d, y.element_size(), max(y.numel(), out.numel()))
    # Row ownership without reading anything back: the sources of destination n are
    # order[bounds[n] : bounds[n + 1]]. The stable sort keeps them in index order, the order index_add_
    # adds them in, and a binary search of the sorted index finds where each n starts (n_rows + 1 bounds).
    sorted_index, order = torch.sort(index, stable=True)
    bounds = torch.searchsorted(sorted_index, torch.arange(n_rows + 1, device=y.device, dtype=sorted_index.dtype),
                                out_int32=not config["INT64"])
    launch(tk.segment_sum_rows_kernel, (-(-n_rows // config["ROWS"]), -(-d // config["BLOCK_D"])), y, order, bounds,
           out, n_rows, d, **config, num_warps=tk.SEGMENT_SUM_WARPS)
    return out


@gather_rows_op.register_fake
def _(x, index):
    return x.new_empty((index.shape[0],) + tuple(x.shape[1:]))


@scatter_add_rows_op.register_fake
def _(y, index, n_rows):
    return y.new_empty((n_rows,) + tuple(y.shape[1:]))
