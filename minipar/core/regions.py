"""Autograd-aware collectives: each a forward/backward pair of conjugate operations.

Tensor, sequence and expert parallelism are built from these. Each function's
docstring names its math; the backward of each is the adjoint of its forward:

=============================  ==========================  ==========================
function                       forward                     backward
=============================  ==========================  ==========================
copy_to_region                 identity                    all-reduce (sum)
reduce_from_region             all-reduce (sum)            identity
scatter_to_region              keep own chunk along dim    all-gather along dim
gather_from_region             all-gather along dim        keep own chunk along dim
gather_sequence                all-gather along dim        reduce-scatter along dim
reduce_scatter_sequence        reduce-scatter along dim    all-gather along dim
all_to_all                     all-to-all(splits)          all-to-all(swapped splits)
seq_to_heads                   all-to-all tokens -> heads  all-to-all heads -> tokens
heads_to_seq                   all-to-all heads -> tokens  all-to-all tokens -> heads
=============================  ==========================  ==========================

``seq_to_heads`` / ``heads_to_seq`` are Ulysses context parallelism's pair: (B, H, T/C, D), this rank's
tokens of every head, <-> (B, H/C, T, D), every token of this rank's heads. Each is a permutation of
the group's elements, so its adjoint is its inverse: the other one.

Every collective goes through `Comm`, so it is counted with the rest.
"""

from __future__ import annotations

from typing import Sequence

import torch
from einops import rearrange

from .comm import AxisGroup, Comm
from .interleave import WhileInFlight


def _all_gather_dim(x: torch.Tensor, comm: Comm, group: AxisGroup, dim: int, tag: str | None) -> torch.Tensor:
    n = group.size
    if n == 1:
        return x
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((n * x0.shape[0],) + tuple(x0.shape[1:]))
    comm.all_gather(out, x0, group, tag=tag)
    # contiguous once here: the column-parallel layers reading the gathered input (q, k, v) would
    # otherwise each copy the strided view for their matmul, and autograd would keep every copy
    return out.movedim(0, dim).contiguous()


def _reduce_scatter_dim(x: torch.Tensor, comm: Comm, group: AxisGroup, dim: int, tag: str | None) -> torch.Tensor:
    n = group.size
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"reduce-scatter along dim {dim}: size {x.shape[dim]} is not divisible by the "
                         f"{group.name} size {n}")
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // n,) + tuple(x0.shape[1:]))
    comm.reduce_scatter(out, x0, group, tag=tag)
    return out.movedim(0, dim)


def _own_chunk(x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
    if group.size == 1:
        return x
    if x.shape[dim] % group.size:
        raise ValueError(f"split along dim {dim}: size {x.shape[dim]} is not divisible by the "
                         f"{group.name} size {group.size}")
    return x.chunk(group.size, dim)[group.rank].contiguous()


class _CopyToRegion(torch.autograd.Function):
    """y = x;  dx = sum_ranks dy."""

    @staticmethod
    def forward(ctx, x, comm, group, tag):
        ctx.comm, ctx.group, ctx.tag = comm, group, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        dx = dy.contiguous().clone()
        ctx.comm.all_reduce(dx, ctx.group, tag=ctx.tag)
        return dx, None, None, None


class _ReduceFromRegion(torch.autograd.Function):
    """y = sum_ranks x;  dx = dy."""

    @staticmethod
    def forward(ctx, x, comm, group, tag):
        y = x.contiguous().clone()
        comm.all_reduce(y, group, tag=tag)
        return y

    @staticmethod
    def backward(ctx, dy):
        return dy, None, None, None


class _ScatterToRegion(torch.autograd.Function):
    """y = chunk_rank(x, dim);  dx = all_gather(dy, dim)."""

    @staticmethod
    def forward(ctx, x, comm, group, dim, tag):
        ctx.comm, ctx.group, ctx.dim, ctx.tag = comm, group, dim, tag
        return _own_chunk(x, group, dim)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather_dim(dy, ctx.comm, ctx.group, ctx.dim, ctx.tag), None, None, None, None


class _GatherFromRegion(torch.autograd.Function):
    """y = all_gather(x, dim);  dx = chunk_rank(dy, dim)."""

    @staticmethod
    def forward(ctx, x, comm, group, dim, tag):
        ctx.group, ctx.dim = group, dim
        return _all_gather_dim(x, comm, group, dim, tag)

    @staticmethod
    def backward(ctx, dy):
        return _own_chunk(dy, ctx.group, ctx.dim), None, None, None, None


class _GatherSequence(torch.autograd.Function):
    """y = all_gather(x, dim);  dx = reduce_scatter(dy, dim)."""

    @staticmethod
    def forward(ctx, x, comm, group, dim, tag):
        ctx.comm, ctx.group, ctx.dim, ctx.tag = comm, group, dim, tag
        return _all_gather_dim(x, comm, group, dim, tag)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter_dim(dy, ctx.comm, ctx.group, ctx.dim, ctx.tag), None, None, None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """y = reduce_scatter(x, dim);  dx = all_gather(dy, dim)."""

    @staticmethod
    def forward(ctx, x, comm, group, dim, tag):
        ctx.comm, ctx.group, ctx.dim, ctx.tag = comm, group, dim, tag
        return _reduce_scatter_dim(x, comm, group, dim, tag)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather_dim(dy, ctx.comm, ctx.group, ctx.dim, ctx.tag), None, None, None, None


class _AllToAll(torch.autograd.Function):
    """y = A(x) with rows input_splits[j] sent to rank j;  dx = A^T(dy), the same exchange with splits swapped.

    ``in_flight`` (a `WhileInFlight`, or None): what runs while the exchange is in flight, forward and
    backward, read when each is launched (DualPipe's pair hands over to its other half there)."""

    @staticmethod
    def forward(ctx, x, comm, group, output_splits, input_splits, tag, in_flight):
        ctx.comm, ctx.group, ctx.tag, ctx.in_flight = comm, group, tag, in_flight
        ctx.output_splits, ctx.input_splits = output_splits, input_splits
        return _exchange_rows(x, comm, group, output_splits, input_splits, tag, in_flight)

    @staticmethod
    def backward(ctx, dy):
        dx = _exchange_rows(dy, ctx.comm, ctx.group, ctx.input_splits, ctx.output_splits, ctx.tag, ctx.in_flight)
        return dx, None, None, None, None, None, None


def _exchange_rows(x: torch.Tensor, comm: Comm, group: AxisGroup, output_splits, input_splits, tag,
                   in_flight) -> torch.Tensor:
    rows = sum(output_splits) if output_splits is not None else x.shape[0]
    y = x.new_empty((rows,) + tuple(x.shape[1:]))
    if not in_flight:
        comm.all_to_all(y, x.contiguous(), group, output_splits, input_splits, tag=tag)
        return y
    work = comm.all_to_all(y, x.contiguous(), group, output_splits, input_splits, async_op=True, tag=tag)
    in_flight()
    work.wait()
    return y


def copy_to_region(x: torch.Tensor, comm: Comm, group: AxisGroup, tag: str | None = None) -> torch.Tensor:
    """Enter a parallel region with a replicated input: identity forward, all-reduce backward."""
    return _CopyToRegion.apply(x, comm, group, tag)


def reduce_from_region(x: torch.Tensor, comm: Comm, group: AxisGroup, tag: str | None = None) -> torch.Tensor:
    """Leave a parallel region by summing partial results: all-reduce forward, identity backward."""
    return _ReduceFromRegion.apply(x, comm, group, tag)


def scatter_to_region(x: torch.Tensor, comm: Comm, group: AxisGroup, dim: int = -1,
                      tag: str | None = None) -> torch.Tensor:
    """Keep this rank's chunk of a replicated tensor along ``dim``; all-gather backward."""
    return _ScatterToRegion.apply(x, comm, group, dim, tag)


def gather_from_region(x: torch.Tensor, comm: Comm, group: AxisGroup, dim: int = -1,
                       tag: str | None = None) -> torch.Tensor:
    """Concatenate every rank's chunk along ``dim``; keep own chunk of the gradient backward."""
    return _GatherFromRegion.apply(x, comm, group, dim, tag)


def gather_sequence(x: torch.Tensor, comm: Comm, group: AxisGroup, dim: int = 1,
                    tag: str | None = None) -> torch.Tensor:
    """Sequence parallel -> tensor parallel: all-gather along ``dim``, reduce-scatter backward."""
    return _GatherSequence.apply(x, comm, group, dim, tag)


def reduce_scatter_sequence(x: torch.Tensor, comm: Comm, group: AxisGroup, dim: int = 1,
                            tag: str | None = None) -> torch.Tensor:
    """Tensor parallel -> sequence parallel: reduce-scatter along ``dim``, all-gather backward."""
    return _ReduceScatterSequence.apply(x, comm, group, dim, tag)


def all_to_all(x: torch.Tensor, comm: Comm, group: AxisGroup, output_splits: Sequence[int] | None = None,
               input_splits: Sequence[int] | None = None, tag: str | None = None,
               in_flight: WhileInFlight | None = None) -> torch.Tensor:
    """Exchange rows of ``x`` (dim 0) across the group; the backward sends gradients back the same way.
    ``in_flight``: run while the exchange is in flight, forward and backward (`minipar.core.interleave`)."""
    out_s = None if output_splits is None else [int(s) for s in output_splits]
    in_s = None if input_splits is None else [int(s) for s in input_splits]
    return _AllToAll.apply(x, comm, group, out_s, in_s, tag, in_flight)


def _exchange(x: torch.Tensor, comm: Comm, group: AxisGroup, tag: str | None, cut: str, what: str,
              send_pattern: str, recv_pattern: str) -> torch.Tensor:
    """One all-to-all over ``group`` with dim ``cut`` of x split in group.size blocks, block c sent to
    rank c (``send_pattern`` puts the destination first); what arrives from rank c is block c of the
    result (``recv_pattern``)."""
    n = group.size
    if n == 1:
        return x
    dim = {"heads": 1, "tokens": 2}[cut]
    if x.shape[dim] % n:
        raise ValueError(f"{what}: {x.shape[dim]} {cut} do not divide by the {group.name} size {n}")
    send = rearrange(x, send_pattern, c=n).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group, tag=tag)
    return rearrange(recv, recv_pattern)


def _seq_to_heads(x: torch.Tensor, comm: Comm, group: AxisGroup, tag: str | None) -> torch.Tensor:
    # rank c gets heads block c of our tokens; what arrives from rank c is its tokens of our heads
    return _exchange(x, comm, group, tag, "heads", "seq_to_heads", "b (c h) t d -> c b h t d",
                     "c b h t d -> b h (c t) d")


def _heads_to_seq(x: torch.Tensor, comm: Comm, group: AxisGroup, tag: str | None) -> torch.Tensor:
    # rank c gets tokens block c of our heads; what arrives from rank c is its heads of our tokens
    return _exchange(x, comm, group, tag, "tokens", "heads_to_seq", "b h (c t) d -> c b h t d",
                     "c b h t d -> b (c h) t d")


class _SeqToHeads(torch.autograd.Function):
    """y = A(x), tokens-split -> heads-split;  dx = Aᵀ(dy) = A⁻¹(dy), heads-split -> tokens-split."""

    @staticmethod
    def forward(ctx, x, comm, group, tag):
        ctx.comm, ctx.group, ctx.tag = comm, group, tag
        return _seq_to_heads(x, comm, group, tag)

    @staticmethod
    def backward(ctx, dy):
        return _heads_to_seq(dy, ctx.comm, ctx.group, ctx.tag), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    """y = A⁻¹(x), heads-split -> tokens-split;  dx = A(dy), tokens-split -> heads-split."""

    @staticmethod
    def forward(ctx, x, comm, group, tag):
        ctx.comm, ctx.group, ctx.tag = comm, group, tag
        return _heads_to_seq(x, comm, group, tag)

    @staticmethod
    def backward(ctx, dy):
        return _seq_to_heads(dy, ctx.comm, ctx.group, ctx.tag), None, None, None


def seq_to_heads(x: torch.Tensor, comm: Comm, group: AxisGroup, tag: str | None = None) -> torch.Tensor:
    """(B, H, T/C, D) this rank's tokens of all heads -> (B, H/C, T, D) all tokens (in rank order) of heads
    group.rank·H/C ... (group.rank+1)·H/C - 1; one all-to-all forward, its inverse backward."""
    return _SeqToHeads.apply(x, comm, group, tag)


def heads_to_seq(x: torch.Tensor, comm: Comm, group: AxisGroup, tag: str | None = None) -> torch.Tensor:
    """The inverse of `seq_to_heads`: (B, H/C, T, D) -> (B, H, T/C, D); one all-to-all each way."""
    return _HeadsToSeq.apply(x, comm, group, tag)
