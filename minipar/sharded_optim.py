"""What every ZeRO stage shares: fp32 master shards, the step on them, clipping, loss scaling.

A stage (``minipar.zero`` for 1 and 2, ``minipar.fsdp`` for 3) cuts the
parameters into flat groups (`minipar.flat.FlatLayout`) and hands this module
one `ShardGroup` per group:

* ``shard``: this rank's slice of the parameters in the compute dtype, padded
  to ``shard_size`` (a view into the full flat parameters for stages 1 and 2,
  the only copy for stage 3);
* ``master``: the fp32 real part of that slice, the tensor the optimizer
  steps. When the compute dtype is fp32 and nothing is offloaded it *is* the
  shard (a view), so no second copy exists;
* ``grad_shard``: this rank's slice of the data-parallel mean gradient, in the
  reduce dtype.

A step: make sure the gradients are reduced (stage 1 reduces now, 2 and 3
already did in backward), divide out the loss scale, agree on overflow across
all ranks, step the masters, copy them into the compute shards, and let the
stage spread the new parameters (stages 1 and 2 all-gather them).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn

from . import kernels
from .comm import AxisGroup, Comm
from .flat import FlatLayout
from .precision import LossScaler, MixedPrecision

OFFLOAD_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


@dataclass
class ShardGroup:
    layout: FlatLayout
    shard: torch.Tensor               # (shard_size,), compute dtype
    master: nn.Parameter              # (real_len,), fp32, on the optimizer's device
    grad_shard: torch.Tensor | None   # (shard_size,), reduce dtype

    @property
    def real_grad(self) -> torch.Tensor:
        return self.grad_shard[: self.layout.real_len]


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

    def add(self, i: int, grad: torch.Tensor, divisor: int) -> None:
        """Stage ``grad / divisor`` (the sum over ranks of grad / N is the mean): one pass over it."""
        claim(self.ready, i)
        self._buffer()
        divide_into(self._views[i], grad, divisor)

    def launch(self, comm: Comm, axis: AxisGroup) -> None:
        flat = self._buffer()
        for view, ready in zip(self._views, self.ready):
            if not ready:
                view.zero_()  # a parameter that got no gradient contributes zero
        flat[self.group.layout.numel:].zero_()  # and so does the padding
        self._out = torch.empty(self.group.layout.shard_size, dtype=flat.dtype, device=flat.device)
        # the staging buffer is ours and dropped at land: it may be reduced in place
        self._work = comm.reduce_scatter(self._out, flat, axis, async_op=True, tag="grad", input_is_scratch=True)

    def land(self) -> None:
        """Wait for the reduce-scatter and add its result into the gradient shard (accumulating over
        backwards until zero_grad)."""
        self._work.wait()
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

    def __init__(self, stagings: list[GradStaging], comm: Comm, axis: AxisGroup, window: int = 2) -> None:
        self.stagings, self.comm, self.axis = stagings, comm, axis
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
            self._launch_next()

    def _launch_next(self) -> None:
        staging = self.stagings[self._next]
        staging.launch(self.comm, self.axis)
        self._in_flight.append(staging)
        self._next += 1
        while len(self._in_flight) > self.window:
            self._in_flight.pop(0).land()

    def finish(self) -> None:
        """End of backward: launch what is left (missing gradients count as zero) and land everything."""
        while self._next < len(self.stagings):
            self._launch_next()
        for staging in self._in_flight:
            staging.land()
        self._in_flight, self._next = [], 0


def storage_bytes(tensors, seen: set[int]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped) not already in ``seen``."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]


def make_master(shard: torch.Tensor, real_fp32: torch.Tensor, offload: bool) -> nn.Parameter:
    """The optimizer's tensor: a view of ``shard`` when it can be, else an fp32 copy (on CPU if offloaded)."""
    n = real_fp32.numel()
    if shard.dtype == torch.float32 and not offload:
        return nn.Parameter(shard[:n], requires_grad=True)
    return nn.Parameter(real_fp32.detach().to("cpu" if offload else shard.device, torch.float32, copy=True))


class ShardedState:
    """Base of the ZeRO stages: the groups, the loss scale, and the optimizer-facing steps."""

    stage: int

    def __init__(self, comm: Comm, group: AxisGroup, world: AxisGroup, tp: AxisGroup, policy: MixedPrecision,
                 offload: bool) -> None:
        self.comm, self.group, self.world, self.tp = comm, group, world, tp
        self.policy, self.offload = policy, offload
        self.scaler = LossScaler(policy.init_scale, policy.growth_interval, policy.uses_loss_scaling)
        self.groups: list[ShardGroup] = []
        # Under pipeline parallelism (set by ShardedModule): the norm is summed over the stages, and
        # the tied weight, whose gradient the first and last stage share, is counted on one of them.
        self.pp: AxisGroup | None = None
        self.norm_skip: nn.Parameter | None = None
        # A pipeline step summed the tied weight's gradient over the stages since zero_grad: the next
        # step must sum only what it adds (see ShardedModule._pipeline_step).
        self.tied_summed = False
        self.optimizer: ShardedOptimizer | None = None
        self._unscaled = False
        self._found_inf = False
        self._shards_written = False  # the fused step wrote the compute shards already

    # Stages override these two.
    def reduce_grads(self) -> None:
        """Make every group's grad_shard hold the reduced gradient (stage 1 communicates here)."""

    def spread_params(self) -> None:
        """After the masters were written into the shards: make full parameters current (stages 1, 2)."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accepted for symmetry with DDP; changes nothing under ZeRO-2 and ZeRO-3.

        They exist not to hold the full gradient, so every backward
        reduce-scatters its gradients and they accumulate in this rank's
        gradient shard. (ZeRO-1, which keeps the full gradient, overrides this:
        its ``no_sync`` sends nothing.)
        """
        yield

    # -- gradients -------------------------------------------------------------

    def unscale_(self) -> bool:
        """Reduce, divide out the loss scale, and agree on overflow across every rank. Idempotent per step."""
        if not self._unscaled:
            self.reduce_grads()
            found = torch.zeros(1, device=self.groups[0].shard.device)
            if self.scaler.enabled:
                for g in self.groups:  # one pass: divide out the scale, flag inf/nan (padding is zero)
                    kernels.scale_cast_(g.grad_shard, g.grad_shard, 1.0 / self.scaler.scale, found)
                # Any rank's overflow skips the step everywhere, so the scales stay equal.
                self.comm.all_reduce(found, self.world, op="max", tag="overflow")
            self._found_inf = bool(found.item()) if self.scaler.enabled else False
            self._unscaled = True
        return self._found_inf

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of the whole (unsharded, unpadded) gradient; returns that norm on every rank.

        Under tensor parallelism the pieces of tp-sharded parameters are summed
        over tp as well, replicated parameters counted once; under pipeline
        parallelism over the stages, ``norm_skip`` (the last stage's copy of a
        tied weight) left out.
        """
        self.unscale_()
        inf = math.isinf(float(norm_type))
        device = self.groups[0].shard.device
        parts = torch.zeros(2, dtype=torch.float32, device=device)  # [tp-sharded, tp-replicated]
        for g in self.groups:
            for p, a, b in g.layout.local_pieces():
                if p is self.norm_skip:
                    continue
                piece = g.grad_shard[a:b].float().abs()
                i = 0 if getattr(p, "tensor_parallel", False) else 1
                parts[i] = torch.maximum(parts[i], piece.max()) if inf else parts[i] + piece.pow(norm_type).sum()
        op = "max" if inf else "sum"
        self.comm.all_reduce(parts, self.group, op=op, tag="grad_norm")
        sharded = parts[:1].clone()
        self.comm.all_reduce(sharded, self.tp, op=op, tag="grad_norm")
        local = torch.maximum(sharded, parts[1:]) if inf else sharded + parts[1:]
        if self.pp is not None:
            self.comm.all_reduce(local, self.pp, op=op, tag="grad_norm")
        total = local[0] if inf else local[0].pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch.nn.utils.clip_grad_norm_
        for g in self.groups:
            g.real_grad.mul_(coef.to(g.grad_shard.dtype))  # not the padding: a nan norm must not stick there
        return total

    # -- the step --------------------------------------------------------------

    def prepare_step(self) -> bool:
        """Gradients into the masters; True if the step must be skipped (overflow on some rank)."""
        if self.unscale_():
            return True
        for g in self.groups:
            grad = g.real_grad
            if grad.dtype != torch.float32 or grad.device != g.master.device:
                grad = grad.to(g.master.device, torch.float32)
            g.master.grad = grad
        return False

    def can_fuse(self, optimizer: torch.optim.Optimizer) -> bool:
        """The fused AdamW kernel can step ``optimizer`` over the masters: Adam/AdamW that it
        supports, masters on a device where the dispatch rule picks Triton, gradients beside them."""
        return kernels.adamw_supports(optimizer) and all(
            kernels.use_triton(g.master) and g.grad_shard.device == g.master.device for g in self.groups)

    @torch.no_grad()
    def fused_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """One pass per group (``minipar.kernels.adamw``): read the reduced gradient in its own dtype
        (no fp32 copy), update master and moments, write the compute-dtype shard. False: skipped
        (overflow on some rank)."""
        if self.unscale_():
            return False
        grads, outs = {}, {}
        for g in self.groups:
            grads[id(g.master)] = g.real_grad
            if g.master.data_ptr() != g.shard.data_ptr():
                outs[id(g.master)] = g.shard[:g.layout.real_len]
        kernels.fused_step(optimizer, outs, grads)
        self._shards_written = True
        return True

    @torch.no_grad()
    def finish_step(self, skipped: bool) -> None:
        self.scaler.update(skipped)
        self._unscaled = False
        for g in self.groups:
            g.master.grad = None  # an fp32 copy of the gradient shard, needed only inside the step
        written, self._shards_written = self._shards_written, False
        if skipped:
            return
        for g in self.groups:
            n = g.layout.real_len
            if g.master.data_ptr() != g.shard.data_ptr() and not written:
                g.shard[:n].copy_(g.master)
        self.spread_params()

    def zero_grad(self) -> None:
        for g in self.groups:
            g.master.grad = None
            if g.grad_shard is not None:
                g.grad_shard.zero_()
        self._unscaled = False
        self.tied_summed = False

    # -- accounting ------------------------------------------------------------

    def memory_stats(self) -> dict[str, int]:
        """Bytes of persistent state this rank holds: parameters, gradients, optimizer (masters + state)."""
        seen: set[int] = set()
        params = storage_bytes(self.param_tensors(), seen)
        grads = storage_bytes(self.grad_tensors(), seen)
        opt_tensors = [g.master for g in self.groups]
        if self.optimizer is not None:
            opt_tensors += optimizer_state_tensors(self.optimizer.optimizer)
        return {"params": params, "grads": grads, "optimizer": storage_bytes(opt_tensors, seen)}

    def param_tensors(self) -> list[torch.Tensor]:
        return [g.shard for g in self.groups]

    def full_params(self) -> dict[int, torch.Tensor]:
        """{id(parameter): its full fp32 value}, gathered from every rank's master shard."""
        return self._gather([g.master for g in self.groups])

    def full_grads(self) -> dict[int, torch.Tensor]:
        """{id(parameter): its full reduced gradient in fp32} (before the step; for tests and debugging)."""
        self.reduce_grads()
        return self._gather([g.real_grad for g in self.groups])

    @torch.no_grad()
    def _gather(self, real_parts: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        for g, real in zip(self.groups, real_parts):
            lay = g.layout
            mine = torch.zeros(lay.shard_size, dtype=torch.float32, device=g.shard.device)
            mine[: lay.real_len].copy_(real)
            full = torch.empty(lay.padded, dtype=torch.float32, device=g.shard.device)
            self.comm.all_gather(full, mine, self.group, tag="state_dict")
            for p, view in zip(lay.params, lay.views(full)):
                out[id(p)] = view
        return out

    def grad_tensors(self) -> list[torch.Tensor]:
        return [g.grad_shard for g in self.groups]

    def layout_signature(self) -> tuple:
        return (self.stage, tuple(g.layout.signature() for g in self.groups))


class ShardedOptimizer:
    """What ``build_optimizer`` returns under ZeRO: a torch optimizer over this rank's fp32 master shards.

    Any ``torch.optim`` class whose state is per element (Adam, AdamW, SGD with
    momentum, ...) gives the same result as over the full parameters, since
    each element is updated from its own gradient and state alone.
    """

    def __init__(self, state: ShardedState, optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> None:
        if state.offload and not issubclass(optimizer_cls, OFFLOAD_OPTIMIZERS):
            names = ", ".join(f"torch.optim.{c.__name__}" for c in OFFLOAD_OPTIMIZERS)
            raise ValueError(f"cpu_offload=True supports {names}; got {optimizer_cls.__name__}. "
                             "Use one of those, or cpu_offload=False")
        self.state = state
        self.optimizer = optimizer_cls([g.master for g in state.groups], **kwargs)
        state.optimizer = self

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def step(self) -> bool:
        """One optimizer step; returns False when it was skipped for a non-finite gradient.

        Adam/AdamW on a GPU (or under the Triton interpreter) step through the fused
        kernel; everything else through the torch optimizer. Both keep torch's state format.
        """
        if self.state.can_fuse(self.optimizer):
            stepped = self.state.fused_step(self.optimizer)
        else:
            stepped = not self.state.prepare_step()
            if stepped:
                self.optimizer.step()
        self.state.finish_step(not stepped)
        return stepped

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.state.zero_grad()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.state.scaler.state_dict(),
                "layout": self.state.layout_signature()}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict["layout"] != self.state.layout_signature():
            raise ValueError("this optimizer state was saved under another sharding layout (stage, world size, "
                             "bucket size or model); load it into a ShardedModule built the same way")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.state.scaler.load_state_dict(state_dict["scaler"])
