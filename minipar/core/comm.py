"""The one collective layer: every collective minipar issues goes through `Comm`.

Each call is recorded in whatever `CommStats` are open (``with comm.counting()
as stats``), so tests can assert communication volume and benchmarks can print
it. Two byte figures are kept per call:

* ``bytes``: the payload, i.e. the size of the *full* tensor the collective is
  about: the tensor for all-reduce and broadcast, the full (unsharded) input of a
  reduce-scatter, the full output of an all-gather, what this rank sends in an
  all-to-all or a send; for a recv, the tensor received.
* ``wire_bytes``: what this rank puts on the wire under the bandwidth-optimal
  (ring) algorithm for a group of n ranks: all-reduce 2(n-1)/n·B, reduce-scatter
  and all-gather (n-1)/n·B, broadcast B, all-to-all the bytes addressed to other
  ranks, send B, recv 0. These are the algorithm's figures: on gloo minipar
  runs a reduce-scatter as an all-reduce (twice the bytes, but half the time
  of gloo's own reduce-scatter, which does the same internally). This is the figure that makes "ZeRO-3 moves 1.5x DDP" true:
  2 all-gathers + 1 reduce-scatter = 3(n-1)/n·Φ against 2(n-1)/n·Φ.

A group of size 1 issues nothing (and records nothing): the result is already
in place. Every method takes an `AxisGroup` (see `minipar.core.mesh`), never a raw
process group, so each record says which mesh axis it travelled on.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Sequence

import torch
import torch.distributed as dist

from .comm_errors import _named, first_difference

# torch 2.13 renamed the flat-tensor collectives; 2.11 has only the old names.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


@dataclass(frozen=True)
class AxisGroup:
    """One process group of the mesh as seen from this rank.

    ``ranks`` are global ranks in group order, ``rank`` is this process's index
    in it. ``pg`` is None when the group has one member (nothing to talk to).
    """

    name: str
    ranks: tuple[int, ...]
    rank: int
    pg: Any = None

    @property
    def size(self) -> int:
        return len(self.ranks)


class CommRecord(NamedTuple):
    op: str
    group: str
    tag: str | None
    bytes: int
    wire_bytes: int
    dtype: torch.dtype
    time_s: float


@dataclass(eq=False)  # identity, not content: nested blocks must close the right one
class CommStats:
    """Collectives recorded while a `Comm.counting()` block was open."""

    records: list[CommRecord] = field(default_factory=list)

    def _select(self, op: str | None, group: str | None, tag: str | None):
        return [
            r
            for r in self.records
            if (op is None or r.op == op)
            and (group is None or r.group == group)
            and (tag is None or r.tag == tag)
        ]

    def calls(self, op: str | None = None, group: str | None = None, tag: str | None = None) -> int:
        return len(self._select(op, group, tag))

    def bytes(self, op: str | None = None, group: str | None = None, tag: str | None = None) -> int:
        return sum(r.bytes for r in self._select(op, group, tag))

    def wire_bytes(self, op: str | None = None, group: str | None = None, tag: str | None = None) -> int:
        return sum(r.wire_bytes for r in self._select(op, group, tag))

    def summary(self) -> dict[tuple[str, str], dict[str, int]]:
        """{(op, group): {"calls", "bytes", "wire_bytes"}} for printing."""
        out: dict[tuple[str, str], dict[str, int]] = {}
        for r in self.records:
            row = out.setdefault((r.op, r.group), {"calls": 0, "bytes": 0, "wire_bytes": 0})
            row["calls"] += 1
            row["bytes"] += r.bytes
            row["wire_bytes"] += r.wire_bytes
        return out


class _Done:
    """Handle of a collective that needed no communication (group of one)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Joined:
    """Handle of a collective built from several: wait for all of them, then run ``finish`` once."""

    def __init__(self, works: list, finish=None) -> None:
        self._works, self._finish = works, finish

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        self._works = []
        if self._finish is not None:
            self._finish()
            self._finish = None
        return True


def _is_gloo(group: AxisGroup) -> bool:
    return dist.get_backend(group.pg) == "gloo"


def _through_host(tensor: torch.Tensor, group: AxisGroup) -> bool:
    """gloo's send and receive move host memory only (its collectives take CUDA tensors): a CUDA
    tensor (gloo ranks on GPUs, MINIPAR_DEVICE=cuda) travels through a host copy."""
    return tensor.is_cuda and _is_gloo(group)


# What one call puts on the wire from this rank under the ring algorithms, as a share of its
# payload. The collective layer records every call with it (an all-to-all with its actual splits:
# what it keeps at home is known; the table's entry is the even-split model the planner uses), and
# the formulas read the same table (`minipar.plan.formulas.wire_bytes`): one copy of this arithmetic.
WIRE_SHARE = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: 1, "send": lambda n: 1,
              "recv": lambda n: 0, "all_to_all": lambda n: (n - 1) / n}


def wire_bytes(op: str, n: int, payload: int) -> int:
    """Bytes one ``op`` call over ``n`` ranks with ``payload`` bytes puts on the wire from this rank."""
    return int(round(WIRE_SHARE[op](n) * payload))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Comm:
    """Counted, traceable wrappers over torch.distributed collectives.

    One instance belongs to each `Mesh`; nothing here is module-level state.
    Methods with ``async_op=True`` return a handle with ``wait()``.
    """

    def __init__(self) -> None:
        self._open_stats: list[CommStats] = []
        self._current: tuple | None = None  # the collective being issued (`_record`), for error messages

    @contextlib.contextmanager
    def counting(self) -> Iterator[CommStats]:
        """Record every collective issued inside the block."""
        stats = CommStats()
        self._open_stats.append(stats)
        try:
            yield stats
        finally:
            self._open_stats.remove(stats)

    def _record(self, op: str, group: AxisGroup, tag: str | None, payload: int, wire: int, dtype,
                shape: Any = None) -> None:
        # The ledger of the call in progress: what an error (a timeout, a lost peer) is reported as.
        self._current = (op, group, tag, shape, dtype)  # formatted only if it fails
        if self._open_stats:
            rec = CommRecord(op, group.name, tag, int(payload), int(wire), dtype, time.perf_counter())
            for s in self._open_stats:
                s.records.append(rec)

    # -- collectives -----------------------------------------------------------

    @_named
    def all_reduce(self, tensor: torch.Tensor, group: AxisGroup, op: str = "sum",
                   async_op: bool = False, tag: str | None = None):
        """In place: tensor <- op over the group of every rank's tensor."""
        n = group.size
        if n == 1:
            return _Done() if async_op else None
        b = _nbytes(tensor)
        self._record("all_reduce", group, tag, b, wire_bytes("all_reduce", n, b), tensor.dtype, tensor.shape)
        return dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group.pg, async_op=async_op)

    @_named
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: AxisGroup,
                       op: str = "sum", async_op: bool = False, tag: str | None = None,
                       input_is_scratch: bool = False):
        """output <- shard ``group.rank`` (along dim 0) of the op-reduction of every rank's input.

        input: (n * m, ...) full; output: (m, ...) this rank's shard, which may be input's own slice
        ``input[rank * m:(rank + 1) * m]`` (in place: NCCL and the gloo path below allow it).
        ``input_is_scratch``: the caller will not read the rest of ``input`` again, so it may be
        overwritten (gloo then reduces it in place instead of reducing a copy).
        """
        n = group.size
        if input.shape[0] != n * output.shape[0]:
            raise ValueError(f"reduce_scatter: input dim 0 ({input.shape[0]}) must be {n} x output dim 0 "
                             f"({output.shape[0]})")
        m = output.shape[0]
        in_place = output.data_ptr() == input[group.rank * m:(group.rank + 1) * m].data_ptr()
        if n == 1:
            if not in_place:
                output.copy_(input)
            return _Done() if async_op else None
        b = _nbytes(input)
        self._record("reduce_scatter", group, tag, b, wire_bytes("reduce_scatter", n, b), input.dtype, input.shape)
        if _is_gloo(group):
            # gloo's reduce-scatter copies the input and all-reduces all of it anyway, then scatters:
            # doing that ourselves (one copy, one all-reduce, keep our slice) takes half the time.
            full = input if input_is_scratch else input.clone()
            work = dist.all_reduce(full, op=_REDUCE_OPS[op], group=group.pg, async_op=True)
            if in_place and full is input:  # the result is already where the output is
                handle = _Joined([work])
            else:
                handle = _Joined([work], lambda: output.copy_(full[group.rank * m:(group.rank + 1) * m]))
            return handle if async_op else handle.wait() and None
        return _reduce_scatter_flat(output, input, op=_REDUCE_OPS[op], group=group.pg, async_op=async_op)

    @_named
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: AxisGroup,
                   async_op: bool = False, tag: str | None = None):
        """output <- every rank's input, concatenated along dim 0 in group order.

        input: (m, ...) this rank's shard; output: (n * m, ...) full. ``input`` may be output's own
        slice ``output[rank * m:(rank + 1) * m]`` (in place: NCCL and the gloo path below allow it).
        """
        n = group.size
        if output.shape[0] != n * input.shape[0]:
            raise ValueError(f"all_gather: output dim 0 ({output.shape[0]}) must be {n} x input dim 0 "
                             f"({input.shape[0]})")
        if n == 1:
            output.copy_(input)
            return _Done() if async_op else None
        b = _nbytes(output)
        self._record("all_gather", group, tag, b, wire_bytes("all_gather", n, b), input.dtype, output.shape)
        if _is_gloo(group):
            # gloo's all-gather goes through a temporary and is ~3x slower than one broadcast per
            # rank straight into the output's slices, which moves the same bytes.
            m = input.shape[0]
            output[group.rank * m:(group.rank + 1) * m].copy_(input)
            works = [dist.broadcast(output[i * m:(i + 1) * m], src=src, group=group.pg, async_op=True)
                     for i, src in enumerate(group.ranks)]
            handle = _Joined(works)
            return handle if async_op else handle.wait() and None
        return _all_gather_flat(output, input, group=group.pg, async_op=async_op)

    @_named
    def broadcast(self, tensor: torch.Tensor, src: int, group: AxisGroup,
                  async_op: bool = False, tag: str | None = None):
        """In place: tensor <- the tensor of group member ``src`` (an index into group.ranks)."""
        if group.size == 1:
            return _Done() if async_op else None
        b = _nbytes(tensor)
        self._record("broadcast", group, tag, b, wire_bytes("broadcast", group.size, b), tensor.dtype, tensor.shape)
        return dist.broadcast(tensor, src=group.ranks[src], group=group.pg, async_op=async_op)

    @_named
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, group: AxisGroup,
                   output_splits: Sequence[int] | None = None, input_splits: Sequence[int] | None = None,
                   async_op: bool = False, tag: str | None = None):
        """Rank i sends rows input_splits[j] (along dim 0) to rank j and receives output_splits[j] from it.

        Splits None means equal splits. Uneven splits must agree across ranks:
        input_splits[j] on rank i == output_splits[i] on rank j.
        """
        n = group.size
        row_bytes = _nbytes(input) // max(input.shape[0], 1) if input.dim() else input.element_size()
        if input_splits is None:
            sent_to_others = input.shape[0] - input.shape[0] // n
        else:
            input_splits = [int(s) for s in input_splits]
            sent_to_others = sum(input_splits) - input_splits[group.rank]
        if n == 1:
            output.copy_(input)
            return _Done() if async_op else None
        b = _nbytes(input)
        self._record("all_to_all", group, tag, b, int(sent_to_others * row_bytes), input.dtype, input.shape)
        out_splits = None if output_splits is None else [int(s) for s in output_splits]
        return dist.all_to_all_single(output, input, out_splits, input_splits, group=group.pg, async_op=async_op)

    @_named
    def send(self, tensor: torch.Tensor, dst: int, group: AxisGroup, async_op: bool = False,
             tag: str | None = None):
        """Point-to-point send to group member ``dst``."""
        b = _nbytes(tensor)
        self._record("send", group, tag, b, wire_bytes("send", group.size, b), tensor.dtype, tensor.shape)
        staged = _through_host(tensor, group)
        if staged:
            tensor = tensor.to("cpu")  # waits for the device: the value must exist before it leaves
        if async_op:
            work = dist.isend(tensor, group.ranks[dst], group=group.pg)
            return _Joined([work], finish=lambda: tensor) if staged else work  # the host copy lives until wait
        dist.send(tensor, group.ranks[dst], group=group.pg)
        return None

    @_named
    def recv(self, tensor: torch.Tensor, src: int, group: AxisGroup, async_op: bool = False,
             tag: str | None = None):
        """Point-to-point receive from group member ``src`` into ``tensor``."""
        self._record("recv", group, tag, _nbytes(tensor), wire_bytes("recv", group.size, _nbytes(tensor)), tensor.dtype,
                     tensor.shape)
        if _through_host(tensor, group):
            staging = torch.empty_like(tensor, device="cpu")
            work = dist.irecv(staging, group.ranks[src], group=group.pg)
            handle = _Joined([work], finish=lambda: tensor.copy_(staging))
            return handle if async_op else handle.wait() and None
        if async_op:
            return dist.irecv(tensor, group.ranks[src], group=group.pg)
        dist.recv(tensor, group.ranks[src], group=group.pg)
        return None

    @_named
    def recv_any(self, tensor: torch.Tensor, group: AxisGroup, tag: str | None = None) -> int:
        """Blocking receive into ``tensor`` from whichever group member sends first; returns that
        member's index in the group. Recorded as a "recv". gloo only (NCCL has no any-source receive)."""
        self._record("recv", group, tag, _nbytes(tensor), wire_bytes("recv", group.size, _nbytes(tensor)), tensor.dtype,
                     tensor.shape)
        return group.ranks.index(dist.recv(tensor, None, group=group.pg))

    @_named
    def all_gather_object(self, obj: Any, group: AxisGroup, tag: str | None = None) -> list[Any]:
        """Every rank's picklable ``obj``, in group order (used for configuration checks)."""
        if group.size == 1:
            return [obj]
        out: list[Any] = [None] * group.size
        self._record("all_gather_object", group, tag, 0, 0, torch.uint8)
        dist.all_gather_object(out, obj, group=group.pg)
        return out

    def check_same(self, what: str, value: Any, group: AxisGroup, where: Any = None) -> None:
        """Raise ValueError on every rank of ``group`` unless all ranks passed an equal ``value``.

        One small collective that every rank reaches, so a configuration that
        differs between ranks fails loudly instead of hanging a later collective.
        The message names the ranks (with ``where(rank)``, e.g. their mesh
        coordinates, when given) and the first difference. ``value`` must be a
        stable description (names, shapes, numbers): never an object address.
        """
        values = self.all_gather_object(value, group, tag="config_check")
        odd = next((i for i, v in enumerate(values) if v != values[0]), None)
        if odd is None:
            return
        name = lambda i: f"rank {group.ranks[i]}" + (f" ({where(group.ranks[i])})" if where else "")  # noqa: E731
        others = [group.ranks[i] for i, v in enumerate(values) if v != values[0]]
        lines = [f"{what} differs between ranks of the {group.name!r} group; build it identically on every rank.",
                 f"{', '.join(f'rank {r}' for r in others)} differ(s) from rank {group.ranks[0]}; {name(0)} and "
                 f"{name(odd)} differ first at "
                 f"{first_difference(values[0], values[odd])}"]
        if all(len(repr(v)) <= 300 for v in values):
            lines += [f"  rank {r}: {v!r}" for r, v in zip(group.ranks, values)]
        raise ValueError("\n".join(lines))


def ring_pass(comm: Comm, group: AxisGroup, send: torch.Tensor, recv: torch.Tensor, tag: str) -> list:
    """One hop of a ring (ring attention's K/V, async tp's collective matmul): send ``send`` to r+1 and
    receive from r-1 into ``recv``, both posted before either is waited on (the handles are returned),
    so no rank blocks on a neighbour that is itself blocked. Every rank posts its hops in the same
    order, so the n-th send from r meets the n-th receive on r+1 (p2p between a pair is ordered). Even
    ranks post the send first, odd ranks the receive: with two ranks both go to the one peer, and NCCL
    runs a pair's operations in posting order, so the two sides must post them in opposite orders."""
    r, n = group.rank, group.size
    post_recv = lambda: comm.recv(recv, (r - 1) % n, group, async_op=True, tag=tag)  # noqa: E731
    post_send = lambda: comm.send(send, (r + 1) % n, group, async_op=True, tag=tag)  # noqa: E731
    return [post_send(), post_recv()] if r % 2 == 0 else [post_recv(), post_send()]
