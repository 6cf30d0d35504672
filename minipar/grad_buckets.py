"""Gradient staging for the sharded strategies: a group's local gradient on its way to its shard.

ZeRO-2 stages each bucket and ZeRO-3 each unit (`GradStaging`); ZeRO-1's
persistent buckets (`minipar.zero.FullGrads`) play the same part. `LaunchOrder`
launches their reduce-scatters in one fixed order on every rank and bounds
how many are in flight; `StagingPool` recycles the transient buffers.
"""

from __future__ import annotations

import torch

from .comm import Comm
from .flat import ShardGroup


class StagingPool:
    """Recycles staging buffers between groups and steps, keeping at most ``keep`` free ones.

    A staging buffer is needed only from a group's first gradient until its
    reduce-scatter lands, and `LaunchOrder` keeps few alive at once. Allocating
    each afresh costs, on a CPU, page faults over the whole buffer at every
    step (large allocations are mapped and unmapped again); a GPU's caching
    allocator recycles them anyway, and this does the same everywhere. The
    free buffers are a bounded cache (``keep`` times the largest group), not
    model state: ``memory_stats`` does not count them.
    """

    def __init__(self, keep: int = 3) -> None:
        self.keep = keep
        self._free: list[torch.Tensor] = []

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of at least ``numel`` elements (the smallest free one that fits), contents undefined."""
        fits = [i for i, t in enumerate(self._free) if t.numel() >= numel and t.dtype == dtype and t.device == device]
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer ``take`` gave out."""
        self._free.append(buffer)
        if len(self._free) > self.keep:  # drop the smallest: the largest fit the most groups
            self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


def claim(ready: list[bool], i: int) -> None:
    """Mark parameter ``i``'s gradient as received in this backward; a second one is an error."""
    if ready[i]:
        raise RuntimeError("a parameter received its gradient twice in one backward; ZeRO reduce-scatters "
                           "each gradient once per backward")
    ready[i] = True


def divide_into(view: torch.Tensor, grad: torch.Tensor, divisor: int) -> None:
    """view <- grad / divisor, in one pass when the dtypes agree; else cast first and divide in the
    view's (reduce) dtype, not in the gradient's lower one."""
    if grad.dtype == view.dtype:
        torch.div(grad, divisor, out=view)
    else:
        view.copy_(grad).div_(divisor)


class GradStaging:
    """One group's full local gradient, from its first piece until its reduce-scatter lands in the shard.

    ZeRO-1/2 keep one per bucket, ZeRO-3 one per unit. A staging buffer exists
    only between the first ``add`` and ``land`` (taken from and given back to
    ``pool`` when the owner sets one).
    """

    def __init__(self, group: ShardGroup, dtype: torch.dtype) -> None:
        self.group, self.dtype = group, dtype
        self.pool: StagingPool | None = None
        self.ready = [False] * len(group.layout.params)
        self._base: torch.Tensor | None = None  # the buffer taken, of which _flat is the first padded elements
        self._flat: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._out: torch.Tensor | None = None
        self._work = None

    @property
    def complete(self) -> bool:
        return all(self.ready)

    def _buffer(self) -> torch.Tensor:
        if self._flat is None:  # contents undefined until added, or zeroed at launch
            n, device = self.group.layout.padded, self.group.shard.device
            self._base = self.pool.take(n, self.dtype, device) if self.pool is not None else \
                torch.empty(n, dtype=self.dtype, device=device)
            self._flat = self._base[:n]
            self._views = self.group.layout.views(self._flat)
        return self._flat

    def add(self, i: int, grad: torch.Tensor) -> None:
        """Stage ``grad / divisor`` (the sum over ranks of grad / N is the mean): one pass over it."""
        claim(self.ready, i)
        self._buffer()
        divide_into(self._views[i], grad, self.group.divisor)

    def launch(self, comm: Comm) -> None:
        flat = self._buffer()
        for view, ready in zip(self._views, self.ready):
            if not ready:
                view.zero_()  # a parameter that got no gradient contributes zero
        flat[self.group.layout.numel:].zero_()  # and so does the padding
        self._out = torch.empty(self.group.layout.shard_size, dtype=flat.dtype, device=flat.device)
        # the staging buffer is ours and dropped at land: it may be reduced in place
        self._work = comm.reduce_scatter(self._out, flat, self.group.axis, async_op=True, tag="grad",
                                         input_is_scratch=True)

    def land(self) -> None:
        """Wait for the reduce-scatter and add its result into the gradient shard (accumulating over
        backwards until zero_grad)."""
        self._work.wait()
        self.group.unreplicate()
        self.group.grad_shard += self._out
        if self.pool is not None:
            self.pool.give(self._base)
        self._base, self._flat, self._views, self._out, self._work = None, None, [], None, None
        self.ready = [False] * len(self.ready)


class LaunchOrder:
    """Reduce-scatters for a list of `GradStaging` (or ZeRO-1's `FullGrads`), launched in that
    fixed order on every rank.

    Backward completes groups in an order that can differ between ranks (and a
    group whose parameters got no gradient never completes), so a group is
    launched only when it and every group before it are complete; the rest go
    at the end of backward. The oldest launched group lands (waits, adds into
    its shard, frees its staging buffer) as soon as more than ``window`` are in
    flight: the full-size staging buffers alive at once stay bounded by the
    window plus the groups still filling, never the whole gradient.
    """

    def __init__(self, stagings: list[GradStaging], comm: Comm, window: int = 2) -> None:
        self.stagings, self.comm = stagings, comm
        self.window = window
        self.pool = StagingPool(keep=window + 1)
        for staging in stagings:
            staging.pool = self.pool
        self._next = 0
        self._in_flight: list[GradStaging] = []

    def unlaunched(self) -> list[GradStaging]:
        """The stagings not launched yet in this backward."""
        return self.stagings[self._next:]

    def launch_ready(self) -> None:
        while self._next < len(self.stagings) and self.stagings[self._next].complete:
            self.launch_next()

    def launch_next(self) -> None:
        """Launch the next staging in the order, complete or not (missing gradients count as zero)."""
        staging = self.stagings[self._next]
        staging.launch(self.comm)
        self._in_flight.append(staging)
        self._next += 1
        while len(self._in_flight) > self.window:
            self._in_flight.pop(0).land()

    def finish(self) -> None:
        """End of backward: launch what is left (missing gradients count as zero) and land everything."""
        while self._next < len(self.stagings):
            self.launch_next()
        for staging in self._in_flight:
            staging.land()
        self._in_flight, self._next = [], 0
