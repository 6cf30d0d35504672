"""What every ZeRO stage shares: fp32 master shards, the step on them, loss scaling, and its answers
to the `minipar.data_parallel.strategy.Strategy` protocol (gradient pieces for the one norm, the optimizer, state).

A stage (``minipar.data_parallel.zero12`` for 1 and 2, ``minipar.data_parallel.zero3`` for 3) cuts the parameters into flat
groups (`minipar.data_parallel.flat.FlatLayout`) and hands this module one `ShardGroup` per group:

* ``shard``: this rank's slice of the parameters in the compute dtype, padded to ``shard_size``
  (a view into the full flat parameters for stages 1 and 2, the only copy for stage 3);
* ``master``: the fp32 real part of that slice, the tensor the optimizer steps. When the compute
  dtype is fp32 and nothing is offloaded it *is* the shard (a view): no second copy exists;
* ``grad_shard``: this rank's slice of the data-parallel mean gradient, in the reduce dtype.

A step: make sure the gradients are reduced (stage 1 reduces now, 2 and 3 already did in
backward), divide out the loss scale, agree on overflow across all ranks, step the masters, copy
them into the compute shards (wherever offload keeps them: `minipar.data_parallel.offload.ShardHomes`), and let
the stage spread the new parameters (stages 1 and 2 all-gather them). `ShardedOptimizer`
(`minipar.data_parallel.sharded_optimizer`) runs it, over pieces of the masters cut along the
user's parameter groups (`minipar.data_parallel.master_pieces`); without a gradient since
``zero_grad`` (``has_grads``) there is no step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn

from .. import kernels
from ..core.comm import AxisGroup
from .flat import FlatLayout, ShardGroup
from ..core.grad_norm import GradPiece
from ..core.mesh import Mesh
from .offload import DiskFiles, NvmeOptimizer, Offload, OffloadError, ShardHomes, agree
from .optimizer_guard import guard_params
from .sharded_optimizer import ShardedOptimizer
from ..core.placement import placement_of
from .precision import LossScaler, MixedPrecision
from .strategy import GradState, Strategy, optimizer_state_tensors, storage_bytes



def make_master(shard: torch.Tensor, real_fp32: torch.Tensor, offload: Offload | None) -> nn.Parameter:
    """The optimizer's tensor: a view of ``shard`` when it can be, else an fp32 copy (on the host
    when the optimizer is offloaded; "nvme" then moves it to its file)."""
    n = real_fp32.numel()
    offloaded = offload is not None and offload.optimizer is not None
    if shard.dtype == torch.float32 and not offloaded:
        return nn.Parameter(shard[:n], requires_grad=True)
    return nn.Parameter(real_fp32.detach().to("cpu" if offloaded else shard.device, torch.float32, copy=True))


class ShardedState(Strategy):
    """Base of the ZeRO stages: the groups, the loss scale, and the optimizer-facing steps."""

    stage: int
    local_accumulation = False  # no_sync accumulates in p.grad (stage 1; 2 and 3 under a pipeline)
    # States in which the shards hold every gradient: EMPTY too where zero_grad zeroes the shards
    # (stages 2 and 3); ZeRO-1's buckets are undefined until a reduction fills them.
    reduced_states = (GradState.EMPTY, GradState.REDUCED, GradState.UNSCALED)

    def __init__(self, mesh: Mesh, policy: MixedPrecision, offload: Offload | None) -> None:
        self.mesh, self.comm, self.world = mesh, mesh.comm, mesh.world
        self.group = mesh.group(mesh.grad_axis)
        self.policy, self.offload = policy, offload
        # Where the shards and masters live, and the moves between there and the device (`minipar.data_parallel.offload`).
        self.homes = ShardHomes(offload, mesh.device, policy.param_dtype, mesh.rank)
        self.traffic = self.homes.traffic
        self.files: DiskFiles | None = None
        self.nvme: NvmeOptimizer | None = None
        self.scaler = LossScaler(policy.init_scale, policy.growth_interval, policy.uses_loss_scaling)
        self.groups: list[ShardGroup] = []
        self._sync = True  # False inside no_sync with local accumulation
        self.grad_state = GradState.EMPTY
        self.optimizer: Any = None  # the `ShardedOptimizer`, once built
        self._found_inf = False
        self.shards_written = False  # the step wrote the compute shards already (fused, nvme)
        self.disk_error: str | None = None  # the nvme step's failure, raised on every rank by finish_step
        self.has_grads = False  # a backward since zero_grad gave gradients: else the step changes nothing
        self.param_names: dict[int, str] = {}  # id(param) -> its name in the wrapped module (messages)

    def shard_axes(self, params: list[nn.Parameter]) -> list[tuple[list[nn.Parameter], AxisGroup]]:
        """``params`` split by the axis their flat groups shard over, each kept in the order given:
        dense parameters over dp (dp_shard under HSDP), experts over edp (the replicas of the same
        experts). Replicas already start equal: `ShardedModule` gave every rank world rank 0's
        weights (`minipar.checks.broadcast_initial_state`)."""
        dense = [p for p in params if not placement_of(p).expert]
        experts = [p for p in params if placement_of(p).expert]
        out = [(dense, self.mesh.group(self.mesh.shard_axis))] if dense else []
        if experts:
            out.append((experts, self.mesh.group("edp")))
        return out

    def shard_group(self, layout: FlatLayout, shard: torch.Tensor, master: nn.Parameter,
                    grad_shard: torch.Tensor | None, axis: AxisGroup) -> ShardGroup:
        """A `ShardGroup` over ``axis``, averaged over the whole dp, with its HSDP replicas if any."""
        replicas = self.mesh.group("dp_replicate") if axis.name == "dp_shard" else None
        return ShardGroup(layout, shard, master, grad_shard, axis, self.mesh.size(self.mesh.grad_axis),
                          replicas if replicas is not None and replicas.size > 1 else None)

    # Stages override these two.
    def reduce_shards(self) -> None:
        """Make every group's grad_shard hold its shard group's reduced gradient of every backward
        so far (a stage with local accumulation communicates here)."""

    def spread_params(self) -> None:
        """After the masters were written into the shards: make full parameters current (stages 1, 2)."""

    @torch.no_grad()
    def sync_grads(self) -> None:
        """The reduced gradient in every grad_shard: the stage reduces within its shard groups, then
        (HSDP) each shard is all-reduced over its replicas, once per step whatever the micro-batches."""
        self.reduce_shards()
        works = []
        for g in self.groups:
            if g.replicas is not None and not g.replicated:
                works.append(self.comm.all_reduce(g.grad_shard, g.replicas, async_op=True, tag="grad"))
                g.replicated = True
        for w in works:
            w.wait()

    # -- gradients -------------------------------------------------------------

    def unscale_(self) -> bool:
        """Reduce, divide out the loss scale, and agree on overflow across every rank. Idempotent per step."""
        if self.grad_state is not GradState.UNSCALED:
            self.sync_grads()
            found = torch.zeros(1, device=self.groups[0].grad_shard.device)
            if self.scaler.enabled:
                for g in self.groups:  # one pass: divide out the scale, flag inf/nan (padding is zero)
                    kernels.scale_cast_(g.grad_shard, g.grad_shard, 1.0 / self.scaler.scale, found)
                # Any rank's overflow skips the step everywhere, so the scales stay equal.
                self.comm.all_reduce(found, self.world, op="max", tag="overflow")
            self._found_inf = bool(found.item()) if self.scaler.enabled else False
            self.grad_state = GradState.UNSCALED
        return self._found_inf

    def grad_pieces(self) -> list[GradPiece]:
        """This rank's slice of each parameter's reduced gradient (views into the gradient shards,
        padding excluded), a shard over the data-parallel axis."""
        self.sync_grads()
        return [GradPiece(p, g.grad_shard[a:b], g.axis.name) for g in self.groups
                for p, a, b in g.layout.local_pieces()]

    # -- the step (`ShardedOptimizer` runs it) ----------------------------------

    @torch.no_grad()
    def finish_step(self, skipped: bool) -> None:
        self.scaler.update(skipped)
        self.grad_state = GradState.REDUCED  # until zero_grad, the shards keep this step's gradients
        for g in self.groups:
            g.master.grad = None  # an fp32 copy of the gradient shard, needed only inside the step
        written, self.shards_written = self.shards_written, False
        if not skipped and not written:
            for i, g in enumerate(self.groups):
                if not self.master_is_shard(g):
                    self.homes.write_shard(g, i, 0, g.master.detach())
        if self.files is not None:
            self._agree_on_disk()
        if not skipped:
            self.spread_params()

    # -- offload (`minipar.data_parallel.offload`) --------------------------------------------------------

    def master_is_shard(self, g: ShardGroup) -> bool:
        """The fp32 master is a view of the compute shard (fp32, nothing offloaded): no copy to make."""
        return self.offload is None and g.master.data_ptr() == g.shard.data_ptr()

    def _agree_on_disk(self) -> None:
        """Every write of this step landed on every rank, or `OffloadError` on every rank."""
        error, self.disk_error = self.disk_error, None  # (the nvme step's, if it failed)
        self._agree_io(lambda: self.files.wait_writes() if error is None else _raise(OffloadError(error)),
                       "the offloaded state could not be read or written")

    def finish_setup(self, module: nn.Module) -> None:
        """Once the stage made its groups: refuse plain torch optimizers over the parameters
        (`minipar.data_parallel.optimizer_guard`), then send the masters (and zero3's shards) to their
        offload homes, reserving the files; ValueError on every rank if any rank cannot."""
        self.param_names = {id(p): n for n, p in module.named_parameters()}
        guard_params(self, [p for g in self.groups for p in g.layout.params], f"zero{self.stage}")
        off = self.offload
        if off is None:
            return
        error = self.homes.place(self.groups)
        self.files = self.homes.files
        if off.nvme:  # a disk can fail on one rank: all raise together (the same branch on every rank)
            try:
                agree(self.mesh, "Offload(...) setup", error)
            except ValueError:
                self.files.close()  # every rank removes what it began
                raise
        elif error is not None:
            raise ValueError(error)
        if off.optimizer == "nvme":
            self.nvme = NvmeOptimizer(self.files, [g.master for g in self.groups], off.chunk_elems, self.mesh.device)

    @contextlib.contextmanager
    def offloaded_state(self, write_back: bool = False) -> Iterator[None]:
        """A context in which every tensor the optimizer steps is an ordinary tensor with its
        state (checkpoints, state dicts, full parameters); a no-op unless optimizer="nvme". Every
        rank enters and leaves it together (its callers are collective), so a rank's failed read
        or write is agreed at each end: `OffloadError` on every rank, never a hang. Nested uses
        share the outermost one."""
        if self.nvme is None or self.nvme.depth > 0:
            yield
            return
        try:
            self._agree_io(self.nvme.load, "reading the offloaded state")
        except OffloadError:
            self.nvme.store(False)
            raise
        ok = False
        try:
            yield
            ok = True
        finally:
            if ok:
                self._agree_io(lambda: self.nvme.store(write_back), "writing the offloaded state back")
            else:
                self.nvme.store(False)

    def _agree_io(self, fn, what: str) -> None:
        """Run ``fn`` (disk work); `OffloadError` on every rank if it failed on any."""
        error = None
        try:
            fn()
        except (OSError, OffloadError) as e:
            error = f"{what}: {e}"
        errors = self.comm.all_gather_object(error, self.world, tag="offload")
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            raise OffloadError("\n".join(f"rank {r}: {e}" for r, e in failed))

    def offload_traffic(self) -> dict[str, int]:
        """Bytes offloading moved since construction: to_device, to_host, disk_read, disk_write."""
        return self.traffic.snapshot()

    def zero_grad(self) -> None:
        for g in self.groups:
            g.master.grad = None
            g.replicated = False
            if g.grad_shard is not None:
                g.grad_shard.zero_()
        self.grad_state = GradState.EMPTY
        self.has_grads = False

    def build_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], params: Any = None,
                        **kwargs: Any) -> ShardedOptimizer:
        """``optimizer_cls`` over this rank's pieces of the masters; ``params``: the model's parameters or
        parameter groups as torch takes them (default: one group of all), `ShardedOptimizer`."""
        return ShardedOptimizer(self, optimizer_cls, params, **kwargs)

    @torch.no_grad()
    def refresh_params(self) -> None:
        """The compute-dtype shards follow the fp32 masters (as after a step); then the stage makes
        full parameters current. Under optimizer="nvme", call it inside ``offloaded_state``."""
        for i, g in enumerate(self.groups):
            if not self.master_is_shard(g):
                self.homes.write_shard(g, i, 0, g.master.detach())
        if self.files is not None:
            self._agree_on_disk()  # before spread_params' all-gather: a rank's failed write raises everywhere
        self.spread_params()

    # -- accounting ------------------------------------------------------------

    def memory_stats(self) -> dict[str, int]:
        """Bytes of persistent state this rank holds: parameters, gradients, optimizer (masters + state)."""
        seen: set[int] = set()
        off = self.offload
        param_tensors, opt_tensors = self.param_tensors(), [g.master for g in self.groups]
        if self.optimizer is not None:
            opt_tensors += optimizer_state_tensors(self.optimizer.optimizer)
        host = []
        if off is not None and off.params is not None:
            host, param_tensors = param_tensors, []
        if off is not None and off.optimizer is not None:
            host, opt_tensors = host + opt_tensors, []
        out = {"params": storage_bytes(param_tensors, seen), "grads": storage_bytes(self.grad_tensors(), seen),
               "optimizer": storage_bytes(opt_tensors, seen)}
        if off is not None:  # what offloading keeps off the device (on a CPU run: apart from the compute tensors)
            out.update(host=storage_bytes(host, seen), disk=self.files.nbytes() if self.files is not None else 0)
        return out

    def param_tensors(self) -> list[torch.Tensor]:
        return [g.shard for g in self.groups]

    def full_params(self) -> dict[int, torch.Tensor]:
        """{id(parameter): its full fp32 value}, gathered from every rank's master shard."""
        with self.offloaded_state():
            return self._gather([g.master for g in self.groups])

    def full_grads(self) -> dict[int, torch.Tensor]:
        """{id(parameter): its full reduced gradient in fp32} (before the step; for tests and debugging)."""
        self.sync_grads()
        return self._gather([g.real_grad for g in self.groups])

    def stepped_ranges(self) -> dict[int, tuple[torch.Tensor, int, int, int, bool]]:
        """Each parameter's range in the tensor the optimizer steps: its master, or the piece of it
        that holds the parameter's group (`minipar.data_parallel.master_pieces`)."""
        pieces = [[] for _ in self.groups]
        for pc in self.optimizer.pieces if self.optimizer is not None else []:
            pieces[pc.index].append(pc)
        out = {}
        for i, g in enumerate(self.groups):
            lay, off = g.layout, 0
            primary = g.replicas is None or g.replicas.rank == 0
            for p in lay.params:
                a, b = max(off, lay.lo), min(off + p.numel(), lay.lo + lay.real_len)
                if a < b:
                    at = a - lay.lo
                    pc = next((pc for pc in pieces[i] if pc.lo <= at < pc.hi), None)
                    owner, at = (g.master, at) if pc is None else (pc.param, at - pc.lo)
                    out[id(p)] = (owner, at, a - off, b - off, primary)
                else:
                    out[id(p)] = (g.master, 0, 0, 0, primary)
                off += p.numel()
        return out

    @torch.no_grad()
    def _gather(self, real_parts: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        for g, real in zip(self.groups, real_parts):
            lay = g.layout
            mine = torch.zeros(lay.shard_size, dtype=torch.float32, device=self.mesh.device)
            mine[: lay.real_len].copy_(real)
            full = torch.empty(lay.padded, dtype=torch.float32, device=self.mesh.device)
            self.comm.all_gather(full, mine, g.axis, tag="state_dict")
            for p, view in zip(lay.params, lay.views(full)):
                out[id(p)] = view
        return out

    def grad_tensors(self) -> list[torch.Tensor]:
        return [g.grad_shard for g in self.groups]

    def layout_signature(self) -> tuple:
        return (self.stage, tuple(g.layout.signature() for g in self.groups))


def _raise(error: Exception) -> None:
    raise error
