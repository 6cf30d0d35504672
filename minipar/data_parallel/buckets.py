"""Gradient buckets, one home for DDP, ZeRO-1, ZeRO-2 (and ZeRO-3's units).

A *bucket* is a group of parameters whose gradients travel in one collective.
Every kind answers the same four calls:

    take(i)       move parameter i's ``.grad`` into the bucket (once per backward)
    complete      every parameter has handed its gradient over
    launch(comm)  start the collective (a parameter that gave nothing contributes zeros)
    land()        wait for it and put the result where the strategy keeps gradients

DDP's `minipar.data_parallel.ddp.Bucket` all-reduces a persistent flat buffer that ``p.grad``
views; ZeRO-1's `minipar.data_parallel.zero12.FullGrads` reduce-scatters a persistent buffer
in place; ZeRO-2's buckets and ZeRO-3's units stage the gradient in a
transient buffer (`GradStaging`) and reduce-scatter it into a shard.

`LaunchOrder` launches a strategy's buckets in one fixed order on every rank
and bounds how many are in flight; `BucketHooks` is the backward side shared
by DDP and ZeRO-1/2: a post-accumulate-grad hook per parameter hands the
gradient to its bucket and launches what is ready, and one end-of-backward
callback (`EndOfBackward`, also ZeRO-3's) launches the rest and waits.
`StagingPool` recycles the transient buffers.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.nn as nn

from ..core.comm import Comm
from .flat import ShardGroup


class EndOfBackward:
    """Runs ``fn`` once when the running backward pass ends.

    Any hook may call ``arm()``; the first call of a backward queues ``fn`` with autograd's engine
    (it runs after every gradient of this backward is computed, before ``backward()`` returns)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn, self.armed = fn, False

    def arm(self) -> None:
        if not self.armed:
            self.armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self.armed = False
        self.fn()


def adopt(p: nn.Parameter, strategy: Any) -> None:
    """Record ``strategy`` as the one that now syncs ``p``'s gradient (weakly: see `owner`)."""
    p.minipar_strategy = weakref.ref(strategy)


def owner(ref: weakref.ref, p: nn.Parameter) -> Any:
    """The strategy behind a parameter hook's weak reference, or None when the hook is stale.

    Hooks on parameters hold their strategy weakly. A parameter keeps its hooks
    as long as it lives and a strategy keeps its parameters, so a strong
    reference back would close a cycle through a tensor, which Python's
    collector does not break (torch does not traverse the hooks of a tensor
    that C++ also holds): every model wrapped in a process would outlive its
    last reference, with its process groups and their threads. When the
    strategy is gone, its hook is stale if another, living strategy has
    adopted the parameter since (the model was wrapped again) and does
    nothing; otherwise a gradient arrived on a model trained without its
    wrapper, which would silently skip synchronisation, and it raises.
    """
    obj = ref()
    if obj is not None:
        return obj
    current = getattr(p, "minipar_strategy", None)
    if current is not None and current() is not None:
        return None
    raise RuntimeError("a gradient reached a parameter whose minipar strategy no longer exists: keep the "
                       "ShardedModule (or its optimizer) alive for as long as you train the model it wraps")


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
        raise RuntimeError("a parameter received its gradient twice in one backward; data-parallel "
                           "strategies reduce each gradient once per backward")
    ready[i] = True


def divide_all_into(views: list[torch.Tensor], grads: list[torch.Tensor], divisor: int) -> None:
    """views[i] <- grads[i] / divisor, for a bucket's gradients at once: one multi-tensor copy (cast to
    the views' reduce dtype first, so the divide is in that dtype, not the gradient's lower one) and,
    unless ``divisor`` is 1, one multi-tensor divide, where a loop would launch two kernels per
    parameter (on a GPU, ~400 launches a step for a 24-layer GPT). The roundings are a per-tensor
    ``view.copy_(grad).div_(divisor)``'s (one, by the divide, when the copy widens)."""
    if not views:
        return
    torch._foreach_copy_(views, grads)
    if divisor != 1:
        torch._foreach_div_(views, divisor)


class ShardBucket:
    """A bucket whose reduce-scatter lands in a `ShardGroup`'s gradient shard (subclasses set
    ``group``, ``ready`` and ``pending`` and define ``add``).

    A gradient handed over is kept in ``pending`` (its tensor, no copy) until the bucket launches,
    where all of them are copied in with `divide_all_into`: a bucket's worth of gradients is held a
    little longer, for two launches per bucket instead of two per parameter."""

    group: ShardGroup
    ready: list[bool]
    pending: list[tuple[int, torch.Tensor]]

    @property
    def params(self) -> list[nn.Parameter]:
        return self.group.layout.params

    @property
    def complete(self) -> bool:
        return all(self.ready)

    def add(self, i: int, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def take(self, i: int) -> None:
        """Move parameter ``i``'s gradient in (it is freed at once: the next layer's gradient reuses it)."""
        p = self.params[i]
        self.add(i, p.grad)
        p.grad = None


class GradStaging(ShardBucket):
    """One group's full local gradient, from its first piece until its reduce-scatter lands in the shard.

    ZeRO-1/2 keep one per bucket, ZeRO-3 one per unit. A staging buffer exists
    only between the first ``add`` and ``land`` (taken from and given back to
    ``pool`` when the owner sets one).
    """

    def __init__(self, group: ShardGroup, dtype: torch.dtype) -> None:
        self.group, self.dtype = group, dtype
        self.axis = group.axis  # where it is reduced (ZeRO-3: a twin of the shard axis)
        self.pool: StagingPool | None = None
        self.ready = [False] * len(group.layout.params)
        self.pending: list[tuple[int, torch.Tensor]] = []  # (index, gradient) handed over, not copied yet
        self._base: torch.Tensor | None = None  # the buffer taken, of which _flat is the first padded elements
        self._flat: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._out: torch.Tensor | None = None
        self._work = None

    def _buffer(self) -> torch.Tensor:
        if self._flat is None:  # contents undefined until added, or zeroed at launch
            # (the gradient shard's device: the parameter shard may be offloaded to the host)
            n, device = self.group.layout.padded, self.group.grad_shard.device
            self._base = self.pool.take(n, self.dtype, device) if self.pool is not None else \
                torch.empty(n, dtype=self.dtype, device=device)
            self._flat = self._base[:n]
            self._views = self.group.layout.views(self._flat)
        return self._flat

    def add(self, i: int, grad: torch.Tensor) -> None:
        """Hand ``grad`` over; at launch it is staged as ``grad / divisor`` (the sum over ranks of
        grad / N is the mean)."""
        claim(self.ready, i)
        self.pending.append((i, grad))

    def launch(self, comm: Comm) -> None:
        flat = self._buffer()
        divide_all_into([self._views[i] for i, _ in self.pending], [g for _, g in self.pending], self.group.divisor)
        self.pending.clear()
        for view, ready in zip(self._views, self.ready):
            if not ready:
                view.zero_()  # a parameter that got no gradient contributes zero
        flat[self.group.layout.numel:].zero_()  # and so does the padding
        self._out = torch.empty(self.group.layout.shard_size, dtype=flat.dtype, device=flat.device)
        # the staging buffer is ours and dropped at land: it may be reduced in place
        self._work = comm.reduce_scatter(self._out, flat, self.axis, async_op=True, tag="grad",
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

    def __init__(self, stagings: list, comm: Comm, window: int | None = 2,
                 before_launch: Callable[[int], bool] | None = None) -> None:
        self.stagings, self.comm = stagings, comm
        self.window = window
        # called with a staging's index just before its launch; False holds it (and those after it)
        # back until launch_rest (ZeRO-3 when the ranks' units differ: they all go out at the end)
        self.before_launch = before_launch
        self.pool = StagingPool(keep=(window or 0) + 1)
        for staging in stagings:
            staging.pool = self.pool
        self._next = 0
        self._in_flight: list[GradStaging] = []

    def unlaunched(self) -> list[GradStaging]:
        """The stagings not launched yet in this backward."""
        return self.stagings[self._next:]

    def launch_ready(self) -> None:
        while self._next < len(self.stagings) and self.stagings[self._next].complete:
            if not self.launch_next():
                break

    def launch_next(self) -> bool:
        """Launch the next staging in the order, complete or not (missing gradients count as zero);
        False when ``before_launch`` held it back."""
        staging = self.stagings[self._next]
        if self.before_launch is not None and self.before_launch(self._next) is False:
            return False
        staging.launch(self.comm)
        self._in_flight.append(staging)
        self._next += 1
        while self.window is not None and len(self._in_flight) > self.window:
            self._in_flight.pop(0).land()
        return True

    def launch_rest(self) -> None:
        """Launch what is left, complete or not (missing gradients count as zero)."""
        while self._next < len(self.stagings):
            if not self.launch_next():
                raise RuntimeError("a reduce-scatter was held back at the end of backward, where every rank "
                                   "launches the rest in order")

    def land_all(self) -> None:
        for staging in self._in_flight:
            staging.land()
        self._in_flight, self._next = [], 0

    def finish(self) -> None:
        """End of backward: launch what is left and land everything."""
        self.launch_rest()
        self.land_all()


class BucketHooks:
    """The backward side of DDP and ZeRO-1/2: hooks that hand each gradient to its bucket.

    The strategy sets ``buckets`` (in launch order) and calls `_hook_buckets`. In backward each
    parameter's post-accumulate-grad hook asks ``_keeps_local`` (True under ``no_sync``: the
    gradient stays where it is), else arms the end-of-backward callback, moves the gradient into
    its bucket and launches every bucket that is ready in order. ``_finish_backward`` (the
    strategy's) launches the rest and waits.
    """

    buckets: list
    order: LaunchOrder

    def _hook_buckets(self, comm: Comm, window: int | None) -> None:
        self.order = LaunchOrder(self.buckets, comm, window)
        self.end_of_backward = EndOfBackward(self._finish_backward)
        self._hooks = [p.register_post_accumulate_grad_hook(self._bucket_hook(k, i))
                       for k, b in enumerate(self.buckets) for i, p in enumerate(b.params)]
        for b in self.buckets:
            for p in b.params:
                adopt(p, self)

    def _bucket_hook(self, k: int, i: int) -> Callable[[nn.Parameter], None]:
        strategy = weakref.ref(self)  # nothing that holds the parameter: see `owner`

        def hook(p: nn.Parameter) -> None:
            self = owner(strategy, p)
            if self is None:  # stale: the model was wrapped again
                return
            bucket = self.buckets[k]
            if self._keeps_local(bucket, i):
                return
            self.end_of_backward.arm()
            bucket.take(i)
            self.order.launch_ready()  # in bucket order, on every rank alike
        return hook

    def _keeps_local(self, bucket, i: int) -> bool:
        raise NotImplementedError

    def _finish_backward(self) -> None:
        raise NotImplementedError

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def bucket_params(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Cut ``params`` (in the order given) into buckets, one dtype and device each.

    A bucket takes parameters while it holds fewer than ``cap_bytes``, so it
    closes with the parameter that reaches the cap (as PyTorch DDP fills its
    buckets). Closing *before* an overflowing parameter instead would strand
    each small bias in a bucket of its own, one collective apiece.
    """
    groups: list[list[nn.Parameter]] = []
    open_group: dict[tuple, tuple[int, int]] = {}  # (dtype, device) -> (index in groups, bytes)
    for p in params:
        key = (p.dtype, p.device)
        nbytes = p.numel() * p.element_size()
        if key in open_group and open_group[key][1] < cap_bytes:
            gi, used = open_group[key]
            groups[gi].append(p)
            open_group[key] = (gi, used + nbytes)
        else:
            groups.append([p])
            open_group[key] = (len(groups) - 1, nbytes)
    return groups
