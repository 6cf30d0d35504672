"""ZeRO-1 and ZeRO-2: shard the optimizer state (1) and the gradients too (2).

Parameters stay whole on every rank (in the compute dtype), laid out in flat
groups so that this rank's slice of each group is one contiguous shard. The
groups are gradient buckets, as in DDP: reverse registration order, about
``bucket_cap_mb`` each; this rank owns one shard of each and its optimizer
steps only those shards. After the step the updated shards are all-gathered
back into every rank's parameters.

ZeRO-1 (`Zero1`). ``p.grad`` holds this rank's full local gradient, as in
plain PyTorch, accumulating over any number of backwards under ``no_sync``
(which sends nothing). The backward that synchronises reduce-scatters each
bucket as soon as it is complete, overlapped with the rest of backward, so a
rank receives the mean gradient of its own shards; the result *replaces* the
shards' contents, because ``p.grad`` already holds everything accumulated. A
step taken after a ``no_sync`` backward without a synchronising one reduces
then, from ``p.grad``. Gradients are read from the shards: change them
through `clip_grad_norm_`, not by writing ``p.grad`` after backward.

ZeRO-2 (`Zero2`). As ZeRO-1, but the full gradient is never kept: each
parameter's gradient moves into its bucket's staging buffer as it arrives
(``p.grad`` is set back to None), a complete bucket is reduce-scattered at
once, and at most two launched buckets wait to land before their staging
buffers are freed (`LaunchOrder`). Only the gradient shards persist, and they
accumulate over backwards until ``zero_grad``; since nothing else is kept,
every backward communicates, also inside ``no_sync``.

Per step both move what DDP moves: a reduce-scatter plus an all-gather of the
parameters is one all-reduce's worth of bytes on the wire.

A parameter that gets no gradient is given a zero gradient (as in DeepSpeed
and flat-parameter FSDP), so weight decay and momentum still move it, whereas
a plain torch optimizer would skip it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

from .ddp import broadcast_from_rank0, bucket_params, signature
from .flat import FlatLayout
from .mesh import Mesh
from .precision import MixedPrecision
from .sharded_optim import GradStaging, LaunchOrder, ShardedState, ShardGroup, make_master


class _BucketedShards(ShardedState):
    """Shared by stages 1 and 2: full flat parameters on every rank (shard = own slice), gradient
    buckets reduce-scattered in one fixed order during backward, shards all-gathered after the step."""

    stage: int
    keeps_full_grads: bool  # stage 1: p.grad stays; stage 2: it moves into the bucket and is freed

    def __init__(self, module: nn.Module, mesh: Mesh, policy: MixedPrecision, offload: bool,
                 bucket_cap_mb: float) -> None:
        super().__init__(mesh.comm, mesh.group("dp"), mesh.world, mesh.group("tp"), policy, offload)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.comm.check_same(f"the zero{self.stage} configuration", {
            "policy": repr(policy), "offload": offload, "bucket_cap_mb": bucket_cap_mb,
            "parameters": signature(named)}, self.group)
        broadcast_from_rank0(module, self.comm, self.group)
        cap = max(1, int(bucket_cap_mb * 2**20))
        # ZeRO-1's shards exist only from a synchronising backward to the end of the step.
        self._setup(module, mesh, bucket_params([p for _, p in reversed(named)], cap),
                    grad_shards=not self.keeps_full_grads)
        self.buckets = [GradStaging(g, policy.grad_dtype) for g in self.groups]
        self.order = LaunchOrder(self.buckets, self.comm, self.group, accumulate=not self.keeps_full_grads)
        self._callback_queued = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(b, i))
                       for b in self.buckets for i, p in enumerate(b.group.layout.params)]

    def _syncing(self) -> bool:
        return True

    def _make_hook(self, b: GradStaging, i: int):
        def hook(p: nn.Parameter) -> None:
            if not self._syncing():
                return
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            b.add(i, p.grad, self.group.size)
            if not self.keeps_full_grads:
                p.grad = None  # the full gradient lives only in the bucket until it is reduce-scattered
            self.order.launch_ready()  # in bucket order, on every rank alike
        return hook

    @torch.no_grad()
    def _finish_backward(self) -> None:
        if self.keeps_full_grads:
            self._add_unreported_grads()
        self.order.finish()
        self._callback_queued = False

    @torch.no_grad()
    def full_grad_of(self, param: nn.Parameter) -> torch.Tensor:
        """``param``'s whole reduced gradient, assembled from the ranks' shards (an all-reduce over dp
        of disjoint pieces). For the tied weight, whose gradient two pipeline stages must sum."""
        self.reduce_grads()
        g, (p_lo, p_hi), (a, b) = self._piece_of(param)
        full = torch.zeros(param.numel(), dtype=g.grad_shard.dtype, device=g.grad_shard.device)
        if a < b:
            full[a - p_lo:b - p_lo] = g.grad_shard[a - g.layout.lo:b - g.layout.lo]
        self.comm.all_reduce(full, self.group, tag="tied_grad")
        return full.view_as(param)

    @torch.no_grad()
    def set_grad_of(self, param: nn.Parameter, full: torch.Tensor) -> None:
        """Overwrite this rank's piece of ``param``'s gradient shard from the whole gradient ``full``."""
        g, (p_lo, _), (a, b) = self._piece_of(param)
        if a < b:
            g.grad_shard[a - g.layout.lo:b - g.layout.lo] = full.reshape(-1)[a - p_lo:b - p_lo]

    def _piece_of(self, param: nn.Parameter):
        for g in self.groups:
            if any(p is param for p in g.layout.params):
                p_lo, p_hi = g.layout.span(param)
                return g, (p_lo, p_hi), (max(p_lo, g.layout.lo), min(p_hi, g.layout.lo + g.layout.real_len))
        raise KeyError(f"parameter not managed by this ZeRO-{self.stage} state")

    def _setup(self, module: nn.Module, mesh: Mesh, groups_of_params: list[list[nn.Parameter]],
               grad_shards: bool) -> None:
        dtype = self.policy.param_dtype
        self.flat_params: list[torch.Tensor] = []
        for params in groups_of_params:
            layout = FlatLayout.of(params, self.group.size, self.group.rank)
            full_fp32 = layout.flatten([p.detach() for p in params], torch.float32, mesh.device)
            flat = full_fp32 if dtype == torch.float32 else full_fp32.to(dtype)
            for p, view in zip(params, layout.views(flat)):
                p.data = view  # the module computes with views into the flat buffer
            shard = flat[layout.lo: layout.lo + layout.shard_size]
            real = full_fp32[layout.lo: layout.lo + layout.real_len]
            grad_shard = torch.zeros(layout.shard_size, dtype=self.policy.grad_dtype, device=mesh.device) \
                if grad_shards else None
            self.groups.append(ShardGroup(layout, shard, make_master(shard, real, self.offload), grad_shard))
            self.flat_params.append(flat)

    @torch.no_grad()
    def spread_params(self) -> None:
        works = []
        for g, flat in zip(self.groups, self.flat_params):
            # In place: the shard is the output's own slice (comm.all_gather allows that alias).
            works.append(self.comm.all_gather(flat, g.shard, self.group, async_op=True, tag="param"))
        for w in works:
            w.wait()

    def param_tensors(self) -> list[torch.Tensor]:
        return self.flat_params


class Zero1(_BucketedShards):
    """ZeRO-1: optimizer state sharded; the synchronising backward reduce-scatters ``p.grad``."""

    stage = 1
    keeps_full_grads = True

    def __init__(self, module: nn.Module, mesh: Mesh, policy: MixedPrecision, offload: bool,
                 bucket_cap_mb: float = 25.0) -> None:
        self._sync = True
        self._shards_current = False  # the shards hold the reduced sum of what p.grad holds now
        super().__init__(module, mesh, policy, offload, bucket_cap_mb)

    def _syncing(self) -> bool:
        if not self._sync:
            self._shards_current = False  # p.grad now holds more than the shards were reduced from
        elif not self._shards_current:
            self._allocate_shards()
            self._shards_current = True   # once this backward's buckets have landed
        return self._sync

    def _add_unreported_grads(self) -> None:
        """Into the buckets not launched yet: the gradients whose hook did not fire in this backward
        (parameters it did not use, whose p.grad comes from earlier no_sync backwards)."""
        for b in self.order.unlaunched():
            for i, p in enumerate(b.group.layout.params):
                if not b.ready[i] and p.grad is not None:
                    b.add(i, p.grad, self.group.size)

    def _allocate_shards(self) -> None:
        for g in self.groups:
            if g.grad_shard is None:
                g.grad_shard = torch.empty(g.layout.shard_size, dtype=self.policy.grad_dtype, device=g.shard.device)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate in ``p.grad`` without communicating; the next synchronising backward (or the
        step, if none comes) reduce-scatters the sum."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @torch.no_grad()
    def reduce_grads(self) -> None:
        if self._shards_current:
            return
        self._allocate_shards()  # the step came after a no_sync backward: reduce p.grad now
        self._add_unreported_grads()
        self.order.finish()
        self._shards_current = True

    def finish_step(self, skipped: bool) -> None:
        super().finish_step(skipped)
        self._free_shards()

    def zero_grad(self) -> None:
        super().zero_grad()
        for g in self.groups:
            for p in g.layout.params:
                p.grad = None
        self._free_shards()

    def _free_shards(self) -> None:
        for g in self.groups:
            g.grad_shard = None  # the reduced shards live only until the step has used them
        self._shards_current = False

    def grad_tensors(self) -> list[torch.Tensor]:
        return [p.grad for g in self.groups for p in g.layout.params] + [g.grad_shard for g in self.groups]


class Zero2(_BucketedShards):
    """ZeRO-2: optimizer state and gradients sharded; every backward reduce-scatters its buckets."""

    stage = 2
    keeps_full_grads = False
