"""Collective matmul: the sequence-parallel all-gather and reduce-scatter of the tensor-parallel
layers split into tp chunks that travel a ring while the previous chunk multiplies.

Under sequence parallelism (``TensorParallelConfig(sequence_parallel=True, async_comm=True)``) the
column-parallel layer needs the whole sequence, ``Y = AllGather_seq(X) A^T``, and the row-parallel
layer sums its partial products and keeps its sequence chunk, ``Y = ReduceScatter_seq(X A^T)``. Both
are products of the sequence chunk by chunk, so the collective need not finish before the matmul
starts: n = tp ranks in a ring, rank r sends to r+1 and receives from r-1
(``minipar.core.comm.ring_pass``, the hop ring attention uses too).

all-gather-matmul (`all_gather_matmul`; X_c: (B, T/n, in), the chunk of rank c; A: (out/n, in)):

    step s = 0 .. n-1: rank r holds X_c, c = (r - s) mod n (its own at s = 0, then each received
    from r-1); it posts the pass of X_c on (to r+1, receiving X_{c-1}) and *then* computes
    Y[:, c] = X_c A^T, and waits for the pass only after that matmul.     n-1 hops of T/n rows.

    backward: dX = ReduceScatter_seq(dY A) by matmul-reduce-scatter (below), and
    dA = dY^T AllGather_seq(X) (the gathered X is kept from forward, as the synchronous layer keeps
    it), db = sum dY; dA is one matmul over all rows, run while the first hop is in flight.

matmul-reduce-scatter (`matmul_reduce_scatter`; X: (B, T, in/n), A: (out, in/n)):

    step s = 0 .. n-1: rank r computes its partial product of the chunk c = (r - s - 1) mod n,
    P_c = X[:, c] A^T, adds the running sum of chunk c received from r-1 (step s >= 1; r-1 computed
    chunk c at step s-1) and passes the sum to r+1. The pass posted at step s is waited only after
    the matmul of step s+1. At s = n-1, c = r: the sum of every rank's P_r has come home, so
    Y = sum_ranks P_r = ReduceScatter_seq(X A^T)[r].                      n-1 hops of T/n rows.

    backward: dX = AllGather_seq(dY) A by all-gather-matmul, dA = AllGather_seq(dY)^T X.

Each is the conjugate of the other's shape: the forward of one is the backward of the other. Both
move what the synchronous collectives move under the ring algorithm ((n-1)/n of the full tensor from
each rank), as sends and receives through the counted comm layer. The products are the synchronous
layers' products row for row; only the reduce-scatter's sum runs in ring order (r+1, r+2, ..., r)
instead of the backend's, so results equal the synchronous layers to fp32 rounding (bit for bit at
tp = 2, where a sum of two is one addition either way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.comm import AxisGroup, Comm, ring_pass

SEQ_DIM = 1  # activations are (batch, seq, features)


def all_gather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm,
                      group: AxisGroup) -> torch.Tensor:
    """``F.linear(AllGather_seq(x_shard), weight, bias)`` with the gather overlapped chunk by chunk.
    x_shard: (B, T/n, in) -> (B, T, out_local)."""
    return _AllGatherMatmul.apply(x_shard, weight, bias, comm, group)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, comm: Comm, group: AxisGroup) -> torch.Tensor:
    """``ReduceScatter_seq(F.linear(x, weight))`` with the reduce-scatter overlapped chunk by chunk.
    x: (B, T, in_local) -> (B, T/n, out)."""
    if x.shape[SEQ_DIM] % group.size:  # before the first hop: every rank holds this shape and raises
        raise ValueError(f"matmul_reduce_scatter: sequence length {x.shape[SEQ_DIM]} is not divisible by tp="
                         f"{group.size}; under sequence parallelism use a sequence length tp divides")
    return _MatmulReduceScatter.apply(x, weight, comm, group)


class _AllGatherMatmul(torch.autograd.Function):
    """Y = AllGather_seq(X) A^T + b;  dX = ReduceScatter_seq(dY A), dA = dY^T AllGather_seq(X), db = sum dY."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, comm, group):
        y, x_full = _gather_and_multiply(x_shard, weight, bias, comm, group, "tp_gather_mm")
        ctx.save_for_backward(x_full, weight)
        ctx.comm, ctx.group, ctx.has_bias = comm, group, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x_full, weight = ctx.saved_tensors
        dy = dy.contiguous()
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        weight_grad = (lambda: _weight_grad(dy, x_full)) if need_dw else None
        dx, dw = _multiply_and_scatter(dy, weight.t(), ctx.comm, ctx.group, "tp_mm_scatter", weight_grad) \
            if need_dx else (None, weight_grad() if need_dw else None)
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and need_db else None
        return dx, dw, db, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    """Y = ReduceScatter_seq(X A^T);  dX = AllGather_seq(dY) A, dA = AllGather_seq(dY)^T X."""

    @staticmethod
    def forward(ctx, x, weight, comm, group):
        y, _ = _multiply_and_scatter(x.contiguous(), weight, comm, group, "tp_mm_scatter")
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.group = comm, group
        return y

    @staticmethod
    def backward(ctx, dy_shard):
        x, weight = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        # dX[:, c] = dY_c A: the same ring as the column-parallel forward, with A^T's transpose
        dx, dy_full = _gather_and_multiply(dy_shard, weight.t(), None, ctx.comm, ctx.group, "tp_gather_mm",
                                           compute=need_dx)
        dw = _weight_grad(dy_full, x) if need_dw else None
        return dx, dw, None, None


# -- the two rings --------------------------------------------------------------------


def _gather_and_multiply(x_shard: torch.Tensor, weight: torch.Tensor, bias, comm: Comm, group: AxisGroup,
                         tag: str, compute: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(F.linear(x_full, weight, bias) or None when not ``compute``, x_full): x_full is the sequence
    gathered from every rank's (B, m, in) shard, each chunk passed on before it is multiplied."""
    n, r = group.size, group.rank
    held = x_shard.contiguous()
    m = held.shape[SEQ_DIM]
    full_shape = list(held.shape)
    full_shape[SEQ_DIM] = n * m
    x_full = held.new_empty(full_shape)
    y = None  # allocated from the first product: its dtype is the matmul's (autocast may change it)
    for step in range(n):
        c = (r - step) % n  # whose chunk we hold
        works = []
        if step < n - 1:  # launch the next chunk's transfer before multiplying this one (overlap)
            held_next = torch.empty_like(held)
            works = ring_pass(comm, group, held, held_next, tag)
        rows = slice(c * m, (c + 1) * m)
        x_full[:, rows] = held
        if compute:
            y_chunk = _chunk_matmul(held, weight, bias, step)
            if y is None:
                y = y_chunk.new_empty(full_shape[:-1] + [y_chunk.shape[-1]])
            y[:, rows] = y_chunk
        for w in works:
            w.wait()
        if works:
            held = held_next
    return y, x_full


def _multiply_and_scatter(x: torch.Tensor, weight: torch.Tensor, comm: Comm, group: AxisGroup, tag: str,
                          overlap_with=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(ReduceScatter_seq(F.linear(x, weight))[this rank], overlap_with() or None): x (B, n*m, in) ->
    (B, m, out). The running sum of each chunk travels the ring; this rank's part of the next chunk is
    multiplied while it travels. ``overlap_with``, a computation independent of the ring (the weight
    gradient), runs while the first hop is in flight."""
    n, r = group.size, group.rank
    m = x.shape[SEQ_DIM] // n
    extra = None
    incoming = None  # (works, buffer): the running sum of the chunk in hand, in flight from r-1
    acc = None
    for step in range(n):
        c = (r - step - 1) % n  # the chunk whose sum passes through this rank now; c = r at the last step
        mine = _chunk_matmul(x[:, c * m:(c + 1) * m], weight, None, step)
        if step == 1 and overlap_with is not None:
            extra = overlap_with()
        if incoming is not None:
            for w in incoming[0]:
                w.wait()
            mine = incoming[1] + mine  # r-1's running sum of chunk c, then ours
        acc = mine.contiguous()
        if step < n - 1:
            received = torch.empty_like(acc)
            incoming = (ring_pass(comm, group, acc, received, tag), received)
    if overlap_with is not None and extra is None:  # n = 1: nothing was in flight
        extra = overlap_with()
    return acc, extra


def _chunk_matmul(x_chunk: torch.Tensor, weight: torch.Tensor, bias, step: int) -> torch.Tensor:
    """One chunk's product (``step`` names its place in the ring; the order tests wrap this function)."""
    return F.linear(x_chunk, weight, bias)


def _weight_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dA = dY^T X over every row at once: the synchronous layer's one matmul, so the same rounding."""
    return dy.reshape(-1, dy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
