"""DDP: replicated parameters, gradients all-reduced in buckets during backward.

How a step goes:

1. Wrapping (after `ShardedModule` made every rank agree on the model and
   take world rank 0's weights, `minipar.checks`) lays the gradients out in flat buckets of about ``bucket_cap_mb``, in
   *reverse* registration order (the order backward produces them), one dtype
   per bucket. Each parameter's ``.grad`` becomes a view into its bucket, so
   the all-reduce needs no copy in or out.
2. Backward: a post-accumulate-grad hook on each parameter moves the fresh
   gradient into its bucket slot (a copy only when ``.grad`` was set to None,
   made for the whole bucket at once when it launches; afterwards autograd
   accumulates into the view in place) and counts the bucket down. A full
   bucket is divided by dp and all-reduced asynchronously while backward goes on. Buckets are launched strictly in bucket order, so
   every rank issues the same collectives in the same order even when ranks
   finish buckets in a different order.
3. End of backward (an autograd callback): buckets not yet launched -- they
   hold parameters this rank did not use -- are launched with zeros in those
   slots; a small all-reduce of the per-parameter "used" flags tells which
   parameters no rank used. Every handle is waited on before backward returns.
   A parameter no rank used keeps ``grad=None`` (as PyTorch DDP with
   ``find_unused_parameters=True``); one that only some ranks used gets the
   average, the others contributing zero.

The hooks, the launch order and the end-of-backward callback are shared with
ZeRO-1/2 (`minipar.data_parallel.buckets`); DDP's own parts are the bucket (a
persistent buffer, all-reduced) and the unused-parameter map.

``no_sync()``: hooks still accumulate into the buckets, nothing is launched;
the first backward outside the block all-reduces the accumulated sum once.

Expert parameters (placed ``expert``, from `minipar.moe.layer`) live in buckets
of their own, all-reduced over the ``edp`` group (the ranks holding the same
experts) but divided by the whole dp size: an expert's local gradient already
sums what every rank of its expert-parallel group sent it.

``grad_sync_off``: an optimizer that communicates itself (`minipar.data_parallel.onebit.OneBitAdam`, which
averages the compressed momentum instead of the gradient) sets it to True; from then on backward
keeps every gradient local (no bucket launched; ``.grad`` is this rank's own, moved into its bucket
view as under ``no_sync``: the gradients stay in the buffers ``memory_stats`` counts, not in a second
copy) and ``sync_grads`` does nothing. Such an optimizer class says so with ``binds_strategy = True``, and ``build_optimizer``
then passes it ``strategy=self``, the one way it can reach the strategy whose sync it turns off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..core.comm import AxisGroup, Comm
from .buckets import BucketHooks, bucket_params, claim
from ..core.grad_norm import GradPiece
from ..core.mesh import Mesh
from ..core.placement import placement_of
from .precision import LossScaler
from .strategy import GradState, Strategy, optimizer_state_tensors, register_strategy, storage_bytes


@dataclass
class Bucket:
    """A flat gradient buffer all-reduced as one; ``views[i]`` is ``params[i].grad``'s home.

    A bucket of `minipar.data_parallel.buckets`: the buffer persists and the gradients stay in it, so
    autograd accumulates into the views in place and the all-reduce needs no copy. A gradient that
    arrives in a tensor of its own (the first backward after ``zero_grad`` set ``.grad`` to None)
    waits in ``pending`` and is moved in at launch with the bucket's others, in one multi-tensor copy."""

    index: int
    first_slot: int  # params[i] is slot first_slot + i of the per-parameter "used" map
    params: list[nn.Parameter]
    flat: torch.Tensor
    group: AxisGroup
    divisor: int  # the gradient is averaged over this many data-parallel ranks
    views: list[torch.Tensor] = field(default_factory=list)
    ready: list[bool] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # ready, .grad not in its view yet
    work: object = None
    pool: object = None  # LaunchOrder hands out a staging pool; a persistent buffer needs none

    @property
    def complete(self) -> bool:
        return all(self.ready)

    def take(self, i: int) -> None:
        claim(self.ready, i)
        if not in_view(self.params[i], self.views[i]):
            self.pending.append(i)

    def launch(self, comm: Comm) -> None:
        for i, p in enumerate(self.params):
            if not self.ready[i] and p.grad is None:
                self.views[i].zero_()  # unused here this step: contribute zero, leave .grad alone for now
            elif not self.ready[i] and not in_view(p, self.views[i]):
                self.pending.append(i)  # accumulated under no_sync, or assigned by the user
        absorb_all([self.params[i] for i in self.pending], [self.views[i] for i in self.pending])
        self.pending.clear()
        if self.divisor != 1:
            self.flat.div_(self.divisor)  # sum of grad / dp = mean over data-parallel ranks
        self.work = comm.all_reduce(self.flat, self.group, async_op=True, tag="grad")

    def land(self) -> None:
        self.work.wait()
        self.work, self.ready = None, [False] * len(self.params)


def in_view(p: nn.Parameter, view: torch.Tensor) -> bool:
    """Whether ``p.grad`` already is its bucket view (autograd accumulated into it in place)."""
    return p.grad is view or p.grad.data_ptr() == view.data_ptr()


def absorb(p: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``p.grad`` the bucket view, moving a freshly allocated gradient into it."""
    if not in_view(p, view):
        view.copy_(p.grad)
        p.grad = view


def absorb_all(params: list[nn.Parameter], views: list[torch.Tensor]) -> None:
    """Make each ``p.grad`` its bucket view, moving the gradients into the views in one multi-tensor copy."""
    if params:
        torch._foreach_copy_(views, [p.grad for p in params])
        for p, view in zip(params, views):
            p.grad = view


class DDP(BucketHooks, Strategy):
    """The DDP strategy behind ``ShardedModule(..., strategy="ddp")``."""

    local_accumulation = True  # no_sync accumulates in the buckets; sync_grads all-reduces the sum

    def __init__(self, module: nn.Module, mesh: Mesh, bucket_cap_mb: float = 25.0) -> None:
        self.module = module
        self.mesh = mesh
        self.comm: Comm = mesh.comm
        self.group: AxisGroup = mesh.group(mesh.grad_axis)  # dp, or dp x cp: same parameters, other tokens
        self.bucket_cap_bytes = max(1, int(bucket_cap_mb * 2**20))

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        dense = [p for _, p in named if not placement_of(p).expert]
        experts = [p for _, p in named if placement_of(p).expert]
        self.buckets = self._build_buckets(dense[::-1], self.group, self.group.size)
        if experts:
            edp = mesh.group("edp")
            self.buckets += self._build_buckets(experts[::-1], edp, self.group.size, first=len(self.buckets))
        self.scaler = LossScaler(1.0, 1, enabled=False)  # fp32 only: nothing to scale
        self.optimizer: torch.optim.Optimizer | None = None
        n = sum(len(b.params) for b in self.buckets)
        self._used = [0] * n           # per parameter slot: got a gradient since the last sync
        self.grad_sync_off = False  # set by an optimizer that communicates itself (1-bit Adam, after its warm-up)
        self._hook_buckets(self.comm, window=None)  # persistent buffers: nothing to bound

    # -- setup -------------------------------------------------------------

    def _build_buckets(self, params: list[nn.Parameter], group: AxisGroup, divisor: int,
                       first: int = 0) -> list[Bucket]:
        groups = bucket_params(params, self.bucket_cap_bytes)
        buckets, slot = [], sum(len(b.params) for b in getattr(self, "buckets", []))
        for idx, ps in enumerate(groups, start=first):
            flat = torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
            views = [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in ps]), ps)]
            buckets.append(Bucket(idx, slot, ps, flat, group, divisor, views, [False] * len(ps)))
            slot += len(ps)
        return buckets

    # -- backward ----------------------------------------------------------

    def _keeps_local(self, bucket: Bucket, i: int) -> bool:
        if self.grad_sync_off:  # the optimizer communicates (the momentum): this rank's gradient stays its own,
            absorb(bucket.params[i], bucket.views[i])  # in the persistent buffer, as under no_sync
            return True
        self._used[bucket.first_slot + i] = 1
        if self._sync:
            return False  # take() moves it into the bucket
        absorb(bucket.params[i], bucket.views[i])  # no_sync: accumulate in the bucket, in place
        self.grad_state = GradState.LOCAL
        return True

    def _finish_backward(self) -> None:
        self.order.launch_rest()
        used_t = torch.tensor(self._used, dtype=torch.int32, device=self.buckets[0].flat.device)
        used_work = self.comm.all_reduce(used_t, self.group, async_op=True, tag="unused_map")
        self.order.land_all()
        used_work.wait()
        # Reading the map is a host sync on a GPU: only pay it when this rank has a parameter
        # without a gradient, the only case where the map decides anything.
        locally_unused = [(b, i) for b in self.buckets for i, p in enumerate(b.params) if p.grad is None]
        if locally_unused:
            used = used_t.tolist()
            for b, i in locally_unused:
                if used[b.first_slot + i] > 0:
                    b.params[i].grad = b.views[i]  # used on another rank: receives the average
        self._used = [0] * len(self._used)
        self.grad_state = GradState.REDUCED

    # -- public ------------------------------------------------------------

    def sync_grads(self) -> None:
        """All-reduce what no_sync backwards accumulated, if anything (as a synchronising backward's end)."""
        if self.grad_state is GradState.LOCAL:
            self._finish_backward()

    def grad_pieces(self) -> list[GradPiece]:
        return [GradPiece(p, p.grad) for b in self.buckets for p in b.params if p.grad is not None]

    def full_grads(self) -> dict[int, torch.Tensor]:
        self.sync_grads()
        return {id(p): p.grad for b in self.buckets for p in b.params if p.grad is not None}

    def build_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], params=None, **kwargs):
        """A plain ``optimizer_cls`` over ``params`` (the module's parameters or parameter groups, as torch
        takes them; default: all of them), memory_stats counting its state; one with ``binds_strategy``
        (1-bit Adam) also gets ``strategy=self``, to take over the gradient sync."""
        if getattr(optimizer_cls, "binds_strategy", False):
            kwargs = {**kwargs, "strategy": self}
        self.optimizer = optimizer_cls(self.module.parameters() if params is None else params, **kwargs)
        return self.optimizer

    def zero_grad(self) -> None:
        self.grad_state = GradState.EMPTY  # the module's zero_grad dropped what no_sync accumulated

    def memory_stats(self) -> dict[str, int]:
        ps = list(self.module.parameters())
        state = optimizer_state_tensors(self.optimizer) if self.optimizer is not None else []
        return {"params": sum(p.numel() * p.element_size() for p in ps),
                "grads": sum(b.flat.numel() * b.flat.element_size() for b in self.buckets),
                "optimizer": storage_bytes(state, set())}


register_strategy("ddp", lambda module, mesh, config, reshard_after_forward: DDP(module, mesh, config.bucket_cap_mb),
                  options=("bucket_cap_mb",), shards=())
