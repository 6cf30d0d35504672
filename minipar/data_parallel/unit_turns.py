"""ZeRO-3's ranks agree on every collective they issue, and take turns when their units differ.

Every gather of a unit's parameters, and every reduce-scatter of its gradients, is a collective. A
rank that skips a unit (a branch on its data, a head only some ranks' losses read) or runs units in
another order would pair its collectives with another unit's on the other ranks: a size mismatch
deep in gloo, a hang, or, when the shapes agree, a silently mixed model. So before each one the
ranks of its group exchange what they are about to do (an index into ``marks``, 8 bytes each, on a
CPU group: no device sync), and every forward and backward ends with a marker, so a rank with
collectives left over meets the others' end instead of waiting for them. Every rank sees the same
exchange and takes the same decision:

* all asked for the same thing: it happens (the common case; one exchange per collective);
* they differ, in a *phase* (one forward, or one backward): every rank takes part in the gather
  that comes first in the phase's order (the lowest unit index in forward, the highest in
  backward), and a rank whose request was another asks again (`before_gather`). Each exchange
  serves at least one request and a rank that has ended its phase keeps serving (`end_phase`), so
  every rank issues the same gathers in the same order and none waits for ever; a rank may gather a
  unit it never runs, held until the phase ends. From then on the phase is *diverged*: its
  reduce-scatters are held back (`before_reduce` says no) until the backward's end, where every
  rank sends them in the fixed order (`draining`), zeros for the units it did not run.

Served on one shard axis. With expert parameters the units also shard over ``edp``, whose groups
are other ranks than dp's: taking turns on two kinds of group at once could wait in a cycle, so a
difference there is a ValueError on every rank instead (`refuse`), naming what each rank was about
to do.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from ..core.mesh import Mesh
from ..core.syncs import read_on_host


class UnitTurns:
    """The exchange and its decisions, for one ZeRO-3 strategy (see the module docstring).

    marks: what each index means ("gathers unit 'layers.1'", then "reduce-scatters ..."), the first
    ``n_units`` being the gathers; groups: axis name -> the CPU group its exchanges run on; axes: the
    shard axes with more than one rank; gather(k): issue the gather of unit k now (synchronously)."""

    END_OF_FORWARD, END_OF_BACKWARD = -1, -2

    def __init__(self, mesh: Mesh, marks: list[str], groups: dict[str, Any], n_units: int, axes: list[str],
                 gather: Callable[[int], None]) -> None:
        self.mesh, self.marks, self.groups, self.n_units = mesh, marks, groups, n_units
        self.axis = axes[0] if len(axes) == 1 else None  # where turns are taken (None: no axis, or two)
        self.served = len(axes) <= 1
        self.gather = gather
        self.phase = "forward"   # its order decides which gather comes first
        self.diverged = False    # this phase's ranks asked for different things (they all know at once)
        self._draining = False   # the backward's end: what is left goes out in the fixed order

    # -- the exchange ---------------------------------------------------------------------------

    def exchange(self, mark: int, axis: str) -> list[int]:
        """Every rank's ``mark`` in the ``axis`` group (this rank's alone in a group of one)."""
        group = self.groups[axis]
        if group.size == 1:
            return [mark]
        marks = torch.empty(group.size, dtype=torch.int64)
        self.mesh.comm.all_gather(marks, torch.tensor([mark]), group, tag="unit_check")
        return read_on_host(marks)  # a CPU group: host memory, no device sync

    def agree(self, mark: int, axes: list[str] | None = None) -> None:
        """Exchange ``mark`` over ``axes`` (default: all); ValueError on every rank unless all gave the same."""
        for axis in dict.fromkeys(axes if axes is not None else self.groups):
            marks = self.exchange(mark, axis)
            if len(set(marks)) > 1:
                self.refuse(axis, marks)

    def refuse(self, axis: str, marks: list[int]) -> None:
        raise ValueError(self._message(self.groups[axis], marks))

    # -- the decisions ---------------------------------------------------------------------------

    def start(self, phase: str) -> None:
        """A forward or a backward begins (every rank at the same point of its exchanges)."""
        self.phase, self.diverged = phase, False

    def before_gather(self, k: int, axes: list[str]) -> None:
        """Return once this rank may issue the gather of unit ``k``, having taken part in the ones
        that come first (on ``axes``, its parts' shard axes)."""
        if self.axis is None:
            self.agree(k, axes)
            return
        while not self._serve(self.exchange(k, self.axis), k):
            pass

    def end_phase(self, mark: int) -> None:
        """A forward's or backward's end: exchange ``mark`` until every rank has reached it, serving
        the gathers the others still ask for."""
        if self.axis is None:
            self.agree(mark)
            return
        while not self._serve(self.exchange(mark, self.axis), mark):
            pass

    def before_reduce(self, i: int, axis: str) -> bool:
        """May the reduce-scatter of staging ``i`` (on ``axis``) go out now? Not once the phase's units
        differed: then it waits for the backward's end (`draining`)."""
        mark = self.n_units + i
        if self._draining:
            return True
        if self.axis is None:  # several live shard axes (or none): every rank must launch the same one
            self.agree(mark, [axis])
            return True
        if axis != self.axis:  # a group of one rank: nothing to pair
            return True
        if self.diverged:
            return False
        ops = self.exchange(mark, self.axis)
        if len(set(ops)) == 1:
            return True
        self._serve(ops, mark)
        return False

    @contextlib.contextmanager
    def draining(self) -> Iterator[None]:
        """Inside: every rank is at its backward's end, and the reduce-scatters go out in the fixed order."""
        self._draining = True
        try:
            yield
        finally:
            self._draining = False

    def _serve(self, ops: list[int], mine: int) -> bool:
        """Given every rank's request: True when this rank's own (``mine``) is the gather to issue now;
        else issue the one that is (if any rank asked for a gather) and return False."""
        if len(set(ops)) == 1:
            return True
        if not self.served:
            self.refuse(self.axis, ops)
        self.diverged = True
        gathers = [op for op in ops if 0 <= op < self.n_units]  # (not reduce-scatters, not end markers)
        if not gathers:
            return False
        target = min(gathers) if self.phase == "forward" else max(gathers)
        if target == mine:
            return True
        self.gather(target)
        return False

    # -- the message -------------------------------------------------------------------------------

    def _what(self, mark: int) -> str:
        if mark == self.END_OF_FORWARD:
            return "ends its forward"
        if mark == self.END_OF_BACKWARD:
            return "ends its backward"
        return self.marks[mark]

    def _message(self, group, marks: list[int]) -> str:
        lines = [f"zero3: the ranks of a {group.name!r} group ran different units, so their gathers and "
                 "reduce-scatters no longer pair up. At this point:"]
        lines += [f"  rank {r} ({self.mesh.where(r)}) {self._what(m)}" for r, m in zip(group.ranks, marks)]
        lines.append("zero3 serves units that only some ranks run when the units shard over one axis; with "
                     "expert parameters (sharded over edp too) every rank must run the same units in the same "
                     "order. Run a skipped block on every rank (its output times zero keeps the result), give "
                     "the block's parameters to a larger unit (wrap_policy), or use ddp, zero1 or zero2, which "
                     "reduce an unused parameter's gradient as zero.")
        return "\n".join(lines)
