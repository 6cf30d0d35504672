"""Tensor-parallel layers: the matrices themselves split across the ranks of the ``tp`` axis.

Shards are contiguous chunks in tp-rank order: ``full.chunk(tp, dim)[tp_rank]``,
dim 0 (output features / vocabulary rows) for column-parallel and vocab-parallel,
dim 1 (input features) for row-parallel.

Column-parallel ``Y_i = X A_i^T + b_i`` (A split by output rows): the input is
replicated, so it enters through ``copy_to_region`` (identity forward, all-reduce
of dX backward); each rank produces its slice of Y's features.

Row-parallel ``Y = sum_i X_i A_i^T + b`` (A split by input columns): the input
arrives already split along features, each rank computes a partial product,
``reduce_from_region`` sums them (all-reduce forward, identity backward), and
the bias is added once, after the sum.

With sequence parallelism the replicated activations between these layers are
instead split along the sequence: the column-parallel layer all-gathers the
sequence first (``gather_sequence``: all-gather forward, reduce-scatter
backward), and the row-parallel layer reduce-scatters its output along the
sequence (``reduce_scatter_sequence``) instead of all-reducing it. Parameters
that then see only a sequence shard (the row-parallel bias; norms outside
these layers) are marked ``sequence_parallel``: their gradients are partial
sums and are all-reduced over tp as they arrive (`mark_sequence_parallel`).

With ``async_comm`` (sequence parallelism only) a layer that gathers its own input and the
row-parallel layer overlap that all-gather / reduce-scatter with their matmul, chunk by chunk
around a ring (`minipar.tensor_parallel.collective_matmul`); the results are the same. An input
entered once for several layers (q, k, v under "enter_region", or siblings sharing an entry) keeps
the one synchronous gather: overlapping it would need one ring per layer, three times the bytes.
An FP8 layer (`minipar.fp8`, which takes over the layer's ``F.linear`` for its whole input) keeps the
synchronous collectives too: its chunks would be scaled one by one, and its backward is its own.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.comm import AxisGroup
from ..core.mesh import Mesh
from ..core.placement import place, placement_of
from ..core.regions import copy_to_region, gather_from_region, gather_sequence, reduce_from_region, \
    reduce_scatter_sequence, scatter_to_region
from .collective_matmul import all_gather_matmul, matmul_reduce_scatter

SEQ_DIM = 1  # activations are (batch, seq, features)


def mark_sequence_parallel(p: nn.Parameter, mesh: Mesh) -> None:
    """``p`` is replicated over tp but sees only this rank's slice of the sequence, so its gradient
    is a partial sum: sum it over tp as it arrives (a hook on the incoming gradient, before it is
    accumulated, so gradient accumulation and every data-parallel strategy see the full sum)."""
    if placement_of(p).sequence_parallel:
        return
    place(p, sequence_parallel=True)
    comm, group = mesh.comm, mesh.group("tp")

    def all_reduce_grad(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        comm.all_reduce(grad, group, tag="sp_grad")
        return grad
    p.register_hook(all_reduce_grad)


def _shard(full: torch.Tensor, group: AxisGroup, dim: int, what: str) -> nn.Parameter:
    """This rank's contiguous chunk of ``full`` along ``dim``, placed as a tensor-parallel shard."""
    if full.shape[dim] % group.size:
        raise ValueError(f"{what}: size {full.shape[dim]} along dim {dim} is not divisible by tp={group.size}; "
                         "choose sizes divisible by the tensor-parallel size")
    p = nn.Parameter(full.detach().chunk(group.size, dim)[group.rank].clone())
    return place(p, tp_dim=dim)


def check_async_comm(async_comm: bool, sequence_parallel: bool, what: str) -> None:
    """Collective matmul overlaps the sequence all-gather / reduce-scatter: without sequence
    parallelism there is none (the input is replicated, the output all-reduced)."""
    if async_comm and not sequence_parallel:
        raise ValueError(f"{what}: async_comm=True overlaps the sequence-parallel all-gather and reduce-scatter "
                         "with the matmul, so it needs sequence_parallel=True; pass sequence_parallel=True or "
                         "async_comm=False")


def _overlaps(layer: nn.Module) -> bool:
    """Whether ``layer`` runs its collective as a collective matmul (see the module docstring)."""
    return layer.async_comm and layer.group.size > 1 and getattr(layer, "fp8_config", None) is None


def enter_region(x: torch.Tensor, comm, group: AxisGroup, sequence_parallel: bool) -> torch.Tensor:
    """Make a replicated (or, with sequence parallelism, sequence-split) input whole for column-parallel work.

    Several column-parallel layers reading one input (q, k, v) should enter
    once, before all of them: then backward sums their input gradients once,
    not once per layer (see the "enter_region" plan style).
    """
    if sequence_parallel:
        return gather_sequence(x, comm, group, dim=SEQ_DIM, tag="tp")
    return copy_to_region(x, comm, group, tag="tp")


class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` with output features split. x: (..., in) replicated -> (..., out / tp), or (..., out)
    with ``gather_output``. With ``sequence_parallel`` x is (batch, seq / tp, in). With
    ``input_in_region`` the input has already entered the region (`enter_region`) and is used as is.
    ``async_comm`` (with ``sequence_parallel``): the input's all-gather overlaps the matmul (`all_gather_matmul`)."""

    def __init__(self, linear: nn.Linear, mesh: Mesh, gather_output: bool = False,
                 sequence_parallel: bool = False, input_in_region: bool = False, async_comm: bool = False) -> None:
        super().__init__()
        check_async_comm(async_comm, sequence_parallel, "ColumnParallelLinear")
        self.comm, self.group = mesh.comm, mesh.group("tp")
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.async_comm = async_comm
        self.input_in_region = input_in_region
        self.region: list[nn.Module] = []  # set by parallelize: the module whose input entered the region
        # set by parallelize for column-parallel siblings (q, k, v): {id(x): (x, x entered)}, filled
        # during their parent's forward and cleared around it, so one input enters the region once
        self.shared_entry: dict | None = None
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = _shard(linear.weight, self.group, 0, "ColumnParallelLinear out_features")
        self.bias = None if linear.bias is None else _shard(linear.bias, self.group, 0, "bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _overlaps(self) and not self.input_in_region and self.shared_entry is None:
            y = all_gather_matmul(x, self.weight, self.bias, self.comm, self.group)
            return gather_from_region(y, self.comm, self.group, dim=-1, tag="tp") if self.gather_output else y
        if not self.input_in_region:
            x = self._enter(x)
        elif self.region and not getattr(self.region[0], "_minipar_in_region", False):
            # Without the entry the backward all-reduce is missing and gradients are silently wrong.
            raise RuntimeError(f"{type(self.region[0]).__name__} was marked 'enter_region' but its forward did "
                               "not run around this layer (was it called directly?); use 'colwise' here")
        y = F.linear(x, self.weight, self.bias)
        return gather_from_region(y, self.comm, self.group, dim=-1, tag="tp") if self.gather_output else y

    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` entered into the region, once per tensor among the siblings sharing ``shared_entry``:
        their input gradients then meet in one backward all-reduce (as under "enter_region"). Keyed by
        the tensor itself (``is``), so siblings given different inputs each enter their own."""
        if self.shared_entry is None:
            return enter_region(x, self.comm, self.group, self.sequence_parallel)
        hit = self.shared_entry.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        entered = enter_region(x, self.comm, self.group, self.sequence_parallel)
        self.shared_entry[id(x)] = (x, entered)
        return entered


class RowParallelLinear(nn.Module):
    """``nn.Linear`` with input features split. x: (..., in / tp) if ``input_is_parallel`` else (..., in)
    -> (..., out) replicated, or (batch, seq / tp, out) with ``sequence_parallel``. ``async_comm`` (with
    ``sequence_parallel``): the output's reduce-scatter overlaps the matmul (`matmul_reduce_scatter`)."""

    def __init__(self, linear: nn.Linear, mesh: Mesh, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, async_comm: bool = False) -> None:
        super().__init__()
        check_async_comm(async_comm, sequence_parallel, "RowParallelLinear")
        self.comm, self.group = mesh.comm, mesh.group("tp")
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.async_comm = async_comm
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = _shard(linear.weight, self.group, 1, "RowParallelLinear in_features")
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        if self.bias is not None and sequence_parallel:
            mark_sequence_parallel(self.bias, mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.comm, self.group, dim=-1, tag="tp")
        if _overlaps(self):
            y = matmul_reduce_scatter(x, self.weight, self.comm, self.group)
            return y if self.bias is None else y + self.bias
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(partial, self.comm, self.group, dim=SEQ_DIM, tag="tp")
        else:
            y = reduce_from_region(partial, self.comm, self.group, tag="tp")
        return y if self.bias is None else y + self.bias  # once, after the sum


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with the vocabulary split. ids: (batch, seq) -> (batch, seq, dim) replicated, or
    (batch, seq / tp, dim) with ``sequence_parallel``.

    Each rank looks up the ids in its range [lo, hi), zeroes the rows of the
    others, and the ranks' partial tables are summed: exactly one rank
    contributes each row.
    """

    def __init__(self, embedding: nn.Embedding, mesh: Mesh, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.comm, self.group = mesh.comm, mesh.group("tp")
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise ValueError("VocabParallelEmbedding supports padding_idx but not max_norm, scale_grad_by_freq "
                             "or sparse; build the nn.Embedding without them")
        self.sequence_parallel = sequence_parallel
        self.num_embeddings = embedding.num_embeddings
        self.weight = _shard(embedding.weight, self.group, 0, "VocabParallelEmbedding vocabulary")
        self.vocab_start = self.group.rank * self.weight.shape[0]
        # The padding row never trains: only the rank that owns it needs to know.
        pad = embedding.padding_idx
        self.local_padding_idx = pad - self.vocab_start if pad is not None and \
            0 <= pad - self.vocab_start < self.weight.shape[0] else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=self.local_padding_idx)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(rows, self.comm, self.group, dim=SEQ_DIM, tag="tp")
        return reduce_from_region(rows, self.comm, self.group, tag="tp")
