"""ZeRO-1 and ZeRO-2: shard the optimizer state (1) and the gradients too (2).

Parameters stay whole on every rank (in the compute dtype), laid out in flat
groups so that this rank's slice of each group is one contiguous shard. The
groups are gradient buckets, as in DDP: reverse registration order, about
``bucket_cap_mb`` each; this rank owns one shard of each and its optimizer
steps only those shards. After the step the updated shards are all-gathered
back into every rank's parameters.

ZeRO-1 (`Zero1`). The full gradient is kept, as the stage's memory formula
says (4Φ bytes in fp32), but in one persistent flat buffer per bucket rather
than in ``p.grad``, the way DDP's ``gradient_as_bucket_view`` keeps it: the
backward that synchronises moves each gradient into its bucket (divided by the
world size; ``p.grad`` is set back to None) and reduce-scatters a complete
bucket *in place*, overlapped with the rest of backward, so this rank's slice
of the buffer becomes its gradient shard with no further copy. Under
``no_sync`` nothing is sent: gradients accumulate in ``p.grad`` as in plain
PyTorch, and the next synchronising backward (or the step, if none comes)
moves and reduces their sum. A second synchronising backward before
``zero_grad`` adds on top of the shard (the rest of the buffer is zeroed
first, so only this rank's new gradients enter the other ranks' slices).
Gradients are read from the shards: change them through `clip_grad_norm_`.

ZeRO-2 (`Zero2`). As ZeRO-1, but the full gradient is never kept: each
parameter's gradient moves into its bucket's transient staging buffer as it
arrives, a complete bucket is reduce-scattered at once into the persistent
gradient shard, and at most two launched buckets wait to land before their staging
buffers are freed (`LaunchOrder`). Only the gradient shards persist, and they
accumulate over backwards until ``zero_grad``; since nothing else is kept,
every backward communicates, also inside ``no_sync``. A pipeline asks
``no_sync(local=True)``, which acts as ZeRO-1's: the
micro-batches accumulate in ``p.grad`` and ``sync_grads`` reduce-scatters once.

Per step both move what DDP moves: a reduce-scatter plus an all-gather of the
parameters is one all-reduce's worth of bytes on the wire.

A parameter that gets no gradient is given a zero gradient (as in DeepSpeed
and flat-parameter FSDP), so weight decay and momentum still move it, whereas
a plain torch optimizer would skip it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from .flat import FlatLayout, ShardGroup
from .buckets import BucketHooks, GradStaging, ShardBucket, bucket_params, claim, divide_all_into
from ..core.mesh import Mesh
from .offload import Offload
from .precision import FP32, MixedPrecision
from ..core.comm import AxisGroup, Comm
from .sharded_state import GradState, ShardedState, make_master
from .strategy import register_strategy


class _BucketedShards(BucketHooks, ShardedState):
    """Shared by stages 1 and 2: full flat parameters on every rank (shard = own slice), gradient
    buckets reduce-scattered in one fixed order during backward, shards all-gathered after the step."""

    stage: int

    def __init__(self, module: nn.Module, mesh: Mesh, policy: MixedPrecision, offload: Offload | None,
                 bucket_cap_mb: float) -> None:
        super().__init__(mesh, policy, offload)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        cap = max(1, int(bucket_cap_mb * 2**20))
        # Buckets in backward order, dense ones first, each over its shard axis (experts: edp).
        self._setup(mesh, [(bucket, axis) for params, axis in self.shard_axes([p for _, p in reversed(named)])
                           for bucket in bucket_params(params, cap)])
        self.buckets = self._make_buckets()
        self._hook_buckets(self.comm, window=2)  # at most two launched staging buffers wait to land
        self.finish_setup(module)  # (collective: every rank reserves its offload files, or all raise)

    def _keeps_local(self, bucket, i: int) -> bool:
        # A no_sync backward leaves gradients in p.grad that the shards do not hold; a synchronising
        # one reduces them all (hooks, then _add_unreported_grads), once its buckets have landed.
        self.grad_state = GradState.REDUCED if self._sync else GradState.LOCAL
        self.has_grads = True
        return not self._sync

    def _add_unreported_grads(self) -> None:
        """Into the buckets not launched yet: the gradients whose hook did not fire in this backward
        (parameters it did not use, whose p.grad comes from earlier no_sync backwards)."""
        for b in self.order.unlaunched():
            for i, p in enumerate(b.params):
                if not b.ready[i] and p.grad is not None:
                    b.take(i)

    @torch.no_grad()
    def reduce_shards(self) -> None:
        if self.grad_state in self.reduced_states:
            return
        self._add_unreported_grads()  # the step came after a no_sync backward (or none): reduce now
        self.order.finish()
        self.grad_state = GradState.REDUCED

    @torch.no_grad()
    def _finish_backward(self) -> None:
        self._add_unreported_grads()
        self.order.finish()

    def _make_buckets(self) -> list:
        raise NotImplementedError

    def _setup(self, mesh: Mesh, groups_of_params: list[tuple[list[nn.Parameter], AxisGroup]]) -> None:
        dtype = self.policy.param_dtype
        self.flat_params: list[torch.Tensor] = []
        for params, axis in groups_of_params:
            layout = FlatLayout.of(params, axis.size, axis.rank)
            full_fp32 = layout.flatten([p.detach() for p in params], torch.float32, mesh.device)
            flat = full_fp32 if dtype == torch.float32 else full_fp32.to(dtype)
            for p, view in zip(params, layout.views(flat)):
                p.data = view  # the module computes with views into the flat buffer
            shard = flat[layout.lo: layout.lo + layout.shard_size]
            real = full_fp32[layout.lo: layout.lo + layout.real_len]
            self.groups.append(self.shard_group(layout, shard, make_master(shard, real, self.offload), None, axis))
            self.flat_params.append(flat)

    @torch.no_grad()
    def spread_params(self) -> None:
        works = []
        for g, flat in zip(self.groups, self.flat_params):
            # In place: the shard is the output's own slice (comm.all_gather allows that alias).
            works.append(self.comm.all_gather(flat, g.shard, g.axis, async_op=True, tag="param"))
        for w in works:
            w.wait()

    def param_tensors(self) -> list[torch.Tensor]:
        return self.flat_params


class FullGrads(ShardBucket):
    """ZeRO-1's gradient bucket: a persistent flat buffer of the bucket's full gradient, reduce-
    scattered in place, so this rank's slice of it *is* the group's ``grad_shard``.

    It plays `GradStaging`'s part in `LaunchOrder` (add, launch, land). Contents:

    * after ``reset`` (zero_grad), "fresh": undefined. The gradients handed over overwrite their
      views at launch, all at once (`divide_all_into`); a parameter that got none is zeroed there.
    * after a reduce-scatter lands: this rank's slice holds the reduced mean, the rest this rank's
      stale input. Before anything is added again the rest is zeroed, so a further reduction adds
      only new gradients to every slice, and this rank's slice keeps what it held.

    The padding is zeroed at each fresh launch (a reduction of zeros keeps it so until zero_grad).
    """

    def __init__(self, group: ShardGroup, dtype: torch.dtype) -> None:
        lay = group.layout
        self.group = group
        self.flat = torch.zeros(lay.padded, dtype=dtype, device=group.shard.device)
        self._views = lay.views(self.flat)
        self._own = (lay.lo, lay.lo + lay.shard_size)
        group.grad_shard = self.flat[self._own[0]:self._own[1]]
        self.pool = None  # LaunchOrder hands out a staging pool; a persistent buffer needs none
        self.ready = [False] * len(lay.params)
        self.pending: list[tuple[int, torch.Tensor]] = []  # fresh: (index, gradient) to copy in at launch
        self._fresh, self._landed = True, False
        self._work = None

    def _begin(self) -> None:
        if self._landed:
            lo, hi = self._own
            self.flat[:lo].zero_()
            self.flat[hi:].zero_()
            self.group.unreplicate()
            self._landed = False

    def add(self, i: int, grad: torch.Tensor) -> None:
        """Add ``grad / divisor`` into parameter ``i``'s view (the sum over ranks is the mean)."""
        claim(self.ready, i)
        self._begin()
        if self._fresh:
            self.pending.append((i, grad))
        else:  # a second synchronising backward before zero_grad: rare, added one by one
            view = self._views[i]
            view.add_(grad.to(view.dtype) / self.group.divisor)

    def launch(self, comm: Comm) -> None:
        self._begin()
        if self._fresh:
            divide_all_into([self._views[i] for i, _ in self.pending], [g for _, g in self.pending],
                            self.group.divisor)
            self.pending.clear()
            for view, ready in zip(self._views, self.ready):
                if not ready:
                    view.zero_()  # a parameter that got no gradient contributes zero
            self.flat[self.group.layout.numel:].zero_()  # and so does the padding, whatever wrote it
            self._fresh = False
        # In place (this rank's slice is the output): NCCL reduces in place at the rank offset; gloo's
        # path all-reduces the whole buffer, which is ours to overwrite: its other slices are zeroed
        # before they are used again.
        self._work = comm.reduce_scatter(self.group.grad_shard, self.flat, self.group.axis, async_op=True, tag="grad",
                                         input_is_scratch=True)

    def land(self) -> None:
        """Wait for the reduce-scatter (its result replaced this rank's slice, which held its input)."""
        self._work.wait()
        self._work = None
        self._landed = True
        self.ready = [False] * len(self.ready)

    def reset(self) -> None:
        """zero_grad: the contents no longer matter; the next gradients overwrite them."""
        self._fresh, self._landed = True, False
        self.group.replicated = False


class Zero1(_BucketedShards):
    """ZeRO-1: optimizer state sharded; the full gradient kept in flat buckets, reduce-scattered in place."""

    stage = 1
    local_accumulation = True
    reduced_states = (GradState.REDUCED, GradState.UNSCALED)  # fresh buckets hold no defined values

    def _make_buckets(self) -> list[FullGrads]:
        return [FullGrads(g, self.policy.grad_dtype) for g in self.groups]

    def zero_grad(self) -> None:
        # No pass over memory: the buckets become "fresh" (the next gradients overwrite them), and
        # nothing reads a shard before sync_grads has filled it again.
        for b in self.buckets:
            b.reset()
            b.group.master.grad = None
            for p in b.group.layout.params:
                p.grad = None
        self.grad_state = GradState.EMPTY
        self.has_grads = False

    def grad_tensors(self) -> list[torch.Tensor]:
        return [p.grad for g in self.groups for p in g.layout.params] + [b.flat for b in self.buckets]


class Zero2(_BucketedShards):
    """ZeRO-2: optimizer state and gradients sharded; every backward reduce-scatters its buckets."""

    stage = 2

    def zero_grad(self) -> None:
        super().zero_grad()
        for g in self.groups:
            for p in g.layout.params:
                p.grad = None  # what no_sync accumulated is dropped too

    def _make_buckets(self) -> list[GradStaging]:
        for g in self.groups:
            g.grad_shard = torch.zeros(g.layout.shard_size, dtype=self.policy.grad_dtype, device=g.shard.device)
        return [GradStaging(g, self.policy.grad_dtype) for g in self.groups]


def _build(stage: type) -> Callable:
    def build(module: nn.Module, mesh: Mesh, config, reshard_after_forward: bool) -> _BucketedShards:
        return stage(module, mesh, config.mixed_precision or FP32, config.offload, config.bucket_cap_mb)
    return build


register_strategy("zero1", _build(Zero1), options=("bucket_cap_mb", "mixed_precision", "offload"),
                  shards=("optimizer",))
register_strategy("zero2", _build(Zero2), options=("bucket_cap_mb", "mixed_precision", "offload"),
                  shards=("optimizer", "grads"))
