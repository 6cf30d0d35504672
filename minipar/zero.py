"""ZeRO-1 and ZeRO-2: shard the optimizer state (1) and the gradients too (2).

Parameters stay whole on every rank (in the compute dtype), laid out in flat
groups so that this rank's slice of each group is one contiguous shard.

ZeRO-1 (`Zero1`). One flat group per dtype: each rank owns one contiguous
shard of all parameters. Backward is plain local autograd: ``p.grad`` holds
this rank's full local gradient, accumulating over any number of backwards
(``no_sync`` changes nothing: nothing is sent during backward). At the step,
each group's gradient is reduce-scattered, so a rank receives the mean
gradient of its own shard only; its optimizer steps that shard; the updated
shards are all-gathered back into every rank's parameters.

ZeRO-2 (`Zero2`). Groups are buckets, as in DDP (reverse registration order,
about ``bucket_cap_mb``); this rank owns one shard of each. During backward
a full bucket is reduce-scattered at once, overlapped with the rest of
backward, and its staging buffer is dropped when that finishes: no rank ever
keeps the full gradient, only its gradient shards (which accumulate over
backwards until ``zero_grad``). Because the full gradient is never kept,
every backward communicates, also inside ``no_sync``.

Per step both move what DDP moves: a reduce-scatter plus an all-gather of the
parameters is one all-reduce's worth of bytes on the wire.

A parameter that gets no gradient is given a zero gradient (as in DeepSpeed
and flat-parameter FSDP), so weight decay and momentum still move it, whereas
a plain torch optimizer would skip it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .ddp import broadcast_from_rank0, bucket_params, signature
from .flat import FlatLayout
from .mesh import Mesh
from .precision import MixedPrecision
from .sharded_optim import GradStaging, ShardedState, ShardGroup, make_master


class _ReplicatedParams(ShardedState):
    """Full flat parameters on every rank; shard = own slice. Shared by stages 1 and 2."""

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
            # All-gather from a copy: the input would otherwise alias the output's own slice.
            works.append(self.comm.all_gather(flat, g.shard.clone(), self.group, async_op=True, tag="param"))
        for w in works:
            w.wait()

    def param_tensors(self) -> list[torch.Tensor]:
        return self.flat_params


class Zero1(_ReplicatedParams):
    """ZeRO-1: optimizer state sharded; gradients reduce-scattered at the step."""

    stage = 1

    def __init__(self, module: nn.Module, mesh: Mesh, policy: MixedPrecision, offload: bool) -> None:
        super().__init__(mesh.comm, mesh.group("dp"), mesh.world, mesh.group("tp"), policy, offload)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.comm.check_same("the zero1 configuration", {"policy": repr(policy), "offload": offload,
                                                        "parameters": signature(named)}, self.group)
        broadcast_from_rank0(module, self.comm, self.group)
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for _, p in named:
            by_dtype.setdefault(p.dtype, []).append(p)
        self._setup(module, mesh, list(by_dtype.values()), grad_shards=False)
        self._reduced = False

    @torch.no_grad()
    def reduce_grads(self) -> None:
        if self._reduced:
            return
        pending = []
        for g in self.groups:
            lay = g.layout
            # Parameters without a gradient contribute zeros (the flatten buffer starts at zero).
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in lay.params]
            full = lay.flatten(grads, self.policy.grad_dtype, g.shard.device)
            full.div_(self.group.size)
            g.grad_shard = torch.empty(lay.shard_size, dtype=full.dtype, device=full.device)
            pending.append(self.comm.reduce_scatter(g.grad_shard, full, self.group, async_op=True, tag="grad"))
        for w in pending:
            w.wait()
        self._reduced = True

    def finish_step(self, skipped: bool) -> None:
        super().finish_step(skipped)
        for g in self.groups:
            g.grad_shard = None  # the reduced shard lives only from reduce_grads to the end of the step
        self._reduced = False

    def zero_grad(self) -> None:
        super().zero_grad()
        for g in self.groups:
            g.grad_shard = None
            for p in g.layout.params:
                p.grad = None
        self._reduced = False

    def grad_tensors(self) -> list[torch.Tensor]:
        return [p.grad for g in self.groups for p in g.layout.params] + [g.grad_shard for g in self.groups]


class Zero2(_ReplicatedParams):
    """ZeRO-2: optimizer state and gradients sharded; buckets reduce-scattered during backward."""

    stage = 2

    def __init__(self, module: nn.Module, mesh: Mesh, policy: MixedPrecision, offload: bool,
                 bucket_cap_mb: float) -> None:
        super().__init__(mesh.comm, mesh.group("dp"), mesh.world, mesh.group("tp"), policy, offload)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.comm.check_same("the zero2 configuration", {"policy": repr(policy), "offload": offload,
                                                        "bucket_cap_mb": bucket_cap_mb,
                                                        "parameters": signature(named)}, self.group)
        broadcast_from_rank0(module, self.comm, self.group)
        cap = max(1, int(bucket_cap_mb * 2**20))
        self._setup(module, mesh, bucket_params([p for _, p in reversed(named)], cap), grad_shards=True)
        self.buckets = [GradStaging(g, policy.grad_dtype) for g in self.groups]
        self._next_launch = 0
        self._callback_queued = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(b, i))
                       for b in self.buckets for i, p in enumerate(b.group.layout.params)]

    def _make_hook(self, b: GradStaging, i: int):
        def hook(p: nn.Parameter) -> None:
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            b.add(i, p.grad)
            p.grad = None  # the full gradient lives only in the bucket until it is reduce-scattered
            while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].complete:
                self._launch_next()  # in bucket order, on every rank alike
        return hook

    @torch.no_grad()
    def full_grad_of(self, param: nn.Parameter) -> torch.Tensor:
        """``param``'s whole reduced gradient, assembled from the ranks' shards (an all-reduce over dp
        of disjoint pieces). For the tied weight, whose gradient two pipeline stages must sum."""
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
        raise KeyError("parameter not managed by this ZeRO-2 state")

    def _launch_next(self) -> None:
        self.buckets[self._next_launch].launch(self.comm, self.group)
        self._next_launch += 1

    @torch.no_grad()
    def _finish_backward(self) -> None:
        while self._next_launch < len(self.buckets):
            self._launch_next()
        for b in self.buckets:
            b.land()
        self._next_launch = 0
        self._callback_queued = False
