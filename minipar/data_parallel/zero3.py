"""ZeRO-3 / FSDP: parameters, gradients and optimizer state all sharded, per unit.

The model is cut into *units* by a wrap policy (by default each entry of an
``nn.ModuleList``: the transformer blocks), plus the root unit for what is
left. Each unit's parameters are one flat group; a rank keeps only its shard.
A unit is in one of three states, and these short methods move it:

    SHARDED --unshard()--> (GATHERING, async) --> FULL --reshard()--> SHARDED

* ``_pre_forward``: unshard this unit (or wait for its prefetch) and start
  gathering the next unit in forward order.
* ``_post_forward``: reshard (``reshard_after_forward``, not for the root,
  whose parameters backward needs at once) and hook the outputs so that the
  unit's backward starts with ``_pre_backward``.
* ``_pre_backward``: unshard again, prefetch the unit whose backward comes next.
* ``_post_backward`` (when every parameter of the unit has its gradient):
  reshard and reduce-scatter the unit's gradients into this rank's gradient
  shard (in one fixed unit order; at most two in flight before the oldest
  lands and frees its staging buffer, `LaunchOrder`); the end-of-backward
  callback launches what is left and waits.

"Full" parameters live in one flat buffer per unit, its storage resized to zero
when resharded: the parameters stay views of it, so autograd's saved tensors see
the gathered values again after the next unshard. Per step (reshard after
forward) a unit is gathered twice, its gradient reduce-scattered once: 1.5x DDP.

Under a pipeline (``local_accumulation``, set by `ShardedModule` when pp > 1)
every micro-batch's backward runs under ``no_sync``: gradients accumulate in
``p.grad`` and ``sync_grads`` reduce-scatters each unit once per step. With
``reshard_after_forward=False`` (the default there) a unit gathered by the
step's first forward stays gathered until then: one all-gather per unit per
step. With ``True`` each micro-batch gathers a unit for its forward and again
for its backward (2m all-gathers per step, less memory held between them).

With ``MixedPrecision(fp8=Float8Config(all_gather=True))`` a unit's FP8 layers'
weights form a flat group of their own that travels as e4m3 bytes and their
amaxes (`minipar.fp8.gather`: half of bf16's bytes, the same products); the
gradients' reduce-scatter stays in the reduce dtype.

A parameter shared between units (tied weights) is placed in the root unit,
which stays gathered through forward and backward, so every user sees it.
Like ZeRO-1/2, a parameter without a gradient gets a zero gradient.

Units that only some ranks run (a branch on the data, a head only some ranks'
losses use). Gathers and reduce-scatters go to twin groups of the shard axes,
and before each one the ranks exchange what they are about to do; when they
differ they take turns (`minipar.data_parallel.unit_turns`): a rank may gather a unit it
never runs, but each gather happens once, as when every rank runs every unit,
and such a backward's reduce-scatters wait for its end, where every rank sends
them in the fixed order, zeros for the units it did not run: the same bytes, no
overlap with backward for that step. With expert parameters (sharded over edp
as well) such steps are refused with a ValueError on every rank; with
``unit_check=False`` (no exchange) every rank must run the same units in the
same order.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .flat import FlatLayout
from .buckets import EndOfBackward, GradStaging, LaunchOrder, adopt, owner
from ..fp8.gather import fp8_gather_of, fp8_weights, split_fp8
from ..core.mesh import Mesh
from .precision import FP32, MixedPrecision
from .offload import Offload
from .sharded_state import GradState, ShardedState, make_master
from .strategy import register_strategy
from .unit_turns import UnitTurns
from .zero3_unit import Part, Unit, UnitState, following
from ..core.units import assign_params, select_units


class Zero3(ShardedState):
    """ZeRO-3: every piece of model state sharded; full parameters exist only around their use."""

    stage = 3

    def __init__(self, module: nn.Module, mesh: Mesh, policy: MixedPrecision, offload: Offload | None,
                 wrap_policy: Any = None, reshard_after_forward: bool = True, unit_check: bool = True) -> None:
        super().__init__(mesh, policy, offload)
        unit_modules = select_units(module, wrap_policy)
        self.reshard_after_forward = reshard_after_forward
        self.units: list[Unit] = []
        owned = assign_params(module, unit_modules)
        axes = {id(p): axis for ps, axis in self.shard_axes([p for ps in owned for p in ps]) for p in ps}
        # Float8Config(all_gather=True): a unit's FP8 weights are a flat group of their own, gathered in FP8
        self._fp8_layers = fp8_weights(module) if policy.fp8 is not None and policy.fp8.all_gather else {}
        for (name, m), params in zip(unit_modules + [("<root>", module)], owned):
            if params:
                parts = [self._make_part(ps, axis, mesh.device)
                         for axis in dict.fromkeys(axes[id(p)] for p in params)
                         for ps in split_fp8([p for p in params if axes[id(p)] is axis], self._fp8_layers)]
                self.units.append(Unit(name, m, parts, is_root=m is module))
        self.groups = [part.group for u in self.units for part in u.parts]
        for i, part in enumerate(part for u in self.units for part in u.parts):
            part.index = i
        self._reads: dict = {}  # params="nvme": shard reads started ahead of their gather, by group
        # Reduce-scatters launch in this fixed order on every rank (backward runs units in reverse).
        self._rs_order = [u for u in reversed(self.units) if not u.is_root] + [u for u in self.units if u.is_root]
        stagings = [(u, part) for u in self._rs_order for part in u.parts]
        self.order = LaunchOrder([part.grads for _, part in stagings], self.comm, before_launch=self._check_reduce)
        # ZeRO-3's gathers and reduce-scatters go to twins of the shard axes, each agreed on first
        # (`UnitTurns`: rank-dependent execution is served or refused on every rank, never a hang or a
        # mixed model). Every rank creates every twin (creating groups is collective).
        axes = (mesh.shard_axis, "edp")
        self._twin = {a: mesh.twin(a) for a in axes}
        for _, part in stagings:
            part.grads.axis = self._twin[part.group.axis.name]
        self._staging_axes = [part.group.axis.name for _, part in stagings]
        cpu = None if dist.get_backend() == "gloo" else "gloo"
        marks = [f"gathers unit {u.name!r}" for u in self.units]
        marks += [f"reduce-scatters the gradients of unit {u.name!r}" for u, _ in stagings]
        # Units that only some ranks run are served where one shard axis has more than one rank.
        live = [a for a in dict.fromkeys(part.group.axis.name for u in self.units for part in u.parts)
                if mesh.group(a).size > 1]
        self.turns = UnitTurns(mesh, marks, {a: mesh.twin(a, cpu) for a in axes}, len(self.units), live,
                               gather=lambda k: self._gather_unit(self.units[k], async_op=False)) if unit_check else None
        self._fwd_order: list[Unit] = []
        self._last_fwd_order: list[Unit] = []
        self.end_of_backward = EndOfBackward(self._finish_backward)
        self._hooks = []
        for k, u in enumerate(self.units):
            if not u.is_root:
                self._hooks.append(u.module.register_forward_pre_hook(self._forward_pre_hook(u)))
                self._hooks.append(u.module.register_forward_hook(self._forward_hook(u)))
            for j, part in enumerate(u.parts):
                for i, p in enumerate(part.group.layout.params):
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(k, j, i)))
                    adopt(p, self)
        self._hooks.append(module.register_forward_pre_hook(self._root_pre_forward))
        self._hooks.append(module.register_forward_hook(self._root_post_forward))
        self._root = next((u for u in self.units if u.is_root), None)
        self.finish_setup(module)  # (collective: every rank reserves its offload files, or all raise)

    def _make_part(self, params: list[nn.Parameter], axis, device) -> Part:
        lay = FlatLayout.of(params, axis.size, axis.rank)
        full_fp32 = lay.flatten([p.detach() for p in params], torch.float32, device)
        shard = full_fp32[lay.lo: lay.lo + lay.shard_size].to(self.policy.param_dtype, copy=True)
        master = make_master(shard, full_fp32[lay.lo: lay.lo + lay.real_len], self.offload)
        grad_shard = torch.zeros(lay.shard_size, dtype=self.policy.grad_dtype, device=device)
        full = torch.empty(lay.padded, dtype=self.policy.param_dtype, device=device)
        for p, view in zip(params, lay.views(full)):
            p.data = view
        full.untyped_storage().resize_(0)
        group = self.shard_group(lay, shard, master, grad_shard, axis)
        fp8 = fp8_gather_of(params, self._fp8_layers, lay, self.policy.fp8.scaling) if self._fp8_layers else None
        return Part(group, full, GradStaging(group, self.policy.grad_dtype), fp8=fp8)

    # -- the unit state machine --------------------------------------------------

    @torch.no_grad()
    def unshard(self, u: Unit, async_op: bool = False) -> None:
        if u.state is UnitState.GATHERING and not async_op:
            self._land(u)
            u.state = UnitState.FULL
        if u.state is not UnitState.SHARDED:
            return
        if self.turns is not None:  # (this rank may first take part in the gathers of other ranks' units)
            self.turns.before_gather(self.units.index(u), [part.group.axis.name for part in u.parts])
        self._gather_unit(u, async_op)

    def _gather_unit(self, u: Unit, async_op: bool) -> None:
        """All-gather ``u``'s parameters into its full buffers (again, if it was gathered already)."""
        self._land(u)
        for part in u.parts:
            nbytes = part.full.numel() * part.full.element_size()
            if part.full.untyped_storage().nbytes() != nbytes:
                part.full.untyped_storage().resize_(nbytes)
            shard = self.homes.to_device(part.group, part.index, self._reads)  # (brought in when offloaded)
            group = self._twin[part.group.axis.name]
            if part.fp8 is not None:  # e4m3 bytes and their amaxes, dequantised on landing
                u.works.append(part.fp8.gather(self.comm, part.full, shard, group))
            else:
                u.works.append(self.comm.all_gather(part.full, shard, group, async_op=True, tag="param"))
        if async_op:
            u.state = UnitState.GATHERING
        else:
            self._land(u)
            u.state = UnitState.FULL

    @staticmethod
    def _land(u: Unit) -> None:
        for work in u.works:
            work.wait()
        u.works = []

    def reshard(self, u: Unit) -> None:
        self._land(u)
        for part in u.parts:
            part.full.untyped_storage().resize_(0)
        u.state = UnitState.SHARDED

    # -- forward -------------------------------------------------------------------

    def _root_pre_forward(self, module, args) -> None:
        if self.turns is not None:
            self.turns.start("forward")
        self._last_fwd_order, self._fwd_order = self._fwd_order or self._last_fwd_order, []
        if self._root is not None:
            self.unshard(self._root)
        if self._last_fwd_order:
            self.unshard(self._last_fwd_order[0], async_op=True)

    def _root_post_forward(self, module, args, output) -> None:
        if self.turns is not None:
            self.turns.end_phase(UnitTurns.END_OF_FORWARD)
            if self.turns.diverged and self.reshard_after_forward:  # units gathered for other ranks' turns
                for u in self.units:
                    if not u.is_root and u.state is not UnitState.SHARDED:
                        self.reshard(u)
            self.turns.start("backward")
        if self._root is not None:
            self._hook_outputs(self._root, output)

    def _forward_pre_hook(self, u: Unit) -> Callable:
        def pre_forward(module, args) -> None:
            self.unshard(u)
            self._fwd_order.append(u)
            nxt = following(self._last_fwd_order, u)
            if nxt is not None:
                self.unshard(nxt, async_op=True)  # prefetch: overlaps the next unit's gather with this compute
                self._read_ahead(following(self._last_fwd_order, nxt))
        return pre_forward

    def _read_ahead(self, u: Unit | None) -> None:
        """params="nvme": start reading ``u``'s shards from disk (the unit after the one prefetched)."""
        if u is None or self.homes.params != "nvme" or u.state is not UnitState.SHARDED:
            return
        for part in u.parts:
            if part.index not in self._reads:
                self._reads[part.index] = self.homes.read(part.group, part.index)

    def _forward_hook(self, u: Unit) -> Callable:
        def post_forward(module, args, output) -> None:
            if self.reshard_after_forward:
                self.reshard(u)
            self._hook_outputs(u, output)
        return post_forward

    def _hook_outputs(self, u: Unit, output) -> None:
        if not torch.is_grad_enabled():
            return
        for t in tree_flatten(output)[0]:
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(lambda grad, u=u: self._pre_backward(u) or grad)

    # -- backward ------------------------------------------------------------------

    def _pre_backward(self, u: Unit) -> None:
        self.end_of_backward.arm()
        if u.backward_started:
            return
        u.backward_started = True
        self.unshard(u)
        backward_order = list(reversed(self._fwd_order))
        prev = following(backward_order, u)
        if prev is not None and not prev.is_root:
            self.unshard(prev, async_op=True)
            self._read_ahead(following(backward_order, prev))

    def _grad_hook(self, k: int, j: int, i: int) -> Callable:
        """Parameter i of part j of unit k: held by index and the strategy weakly, since whatever the
        hook holds lives as long as the parameter (a cycle through a tensor is never collected:
        `buckets.owner`)."""
        strategy = weakref.ref(self)

        def hook(p: nn.Parameter) -> None:
            self = owner(strategy, p)
            if self is None:  # stale: the model was wrapped again
                return
            u, part = self.units[k], self.units[k].parts[j]
            self.end_of_backward.arm()
            self.has_grads = True
            u.received += 1
            if self._sync:
                part.grads.take(i)
                if self.grad_state is not GradState.LOCAL:  # else sync_grads reduces what no_sync left
                    self.grad_state = GradState.REDUCED  # once this backward's callback has landed them
            else:
                self.grad_state = GradState.LOCAL  # stays in p.grad until sync_grads
            if u.received == u.n_params:
                self._post_backward(u)
        return hook

    def _check_reduce(self, i: int) -> bool:
        """Before staging ``i``'s reduce-scatter: may it go out now (`UnitTurns.before_reduce`)?"""
        return self.turns is None or self.turns.before_reduce(i, self._staging_axes[i])

    def _post_backward(self, u: Unit) -> None:
        if not u.is_root and self._reshards_now():
            self.reshard(u)
        if self._sync:
            self.order.launch_ready()

    def _reshards_now(self) -> bool:
        """Reshard after this backward? Not when no_sync keeps units gathered for the next micro-batch."""
        return self._sync or self.reshard_after_forward

    @torch.no_grad()
    def _finish_backward(self) -> None:
        draining = contextlib.nullcontext()
        if self.turns is not None:
            self.turns.end_phase(UnitTurns.END_OF_BACKWARD)
            draining = self.turns.draining()  # every rank is here: what is left goes out in the fixed order
        if self._sync:
            with draining:
                self.order.finish()
        for u in self._rs_order:
            u.backward_started, u.received = False, 0
            if self._reshards_now():
                self.reshard(u)

    @torch.no_grad()
    def reduce_shards(self) -> None:
        """Reduce-scatter what no_sync backwards accumulated in ``p.grad``, unit by unit in the fixed
        order, then reshard every unit."""
        if self.grad_state is not GradState.LOCAL:
            return
        with self.turns.draining() if self.turns is not None else contextlib.nullcontext():
            for u in self._rs_order:  # every rank is here, and reduces every unit in the fixed order
                for part in u.parts:
                    for i, p in enumerate(part.grads.params):
                        if p.grad is not None:
                            part.grads.take(i)
                    self.order.launch_next()  # a parameter that got no gradient contributes zero
            self.order.finish()
        for u in self.units:
            self.reshard(u)
        self.grad_state = GradState.REDUCED

    def zero_grad(self) -> None:
        super().zero_grad()
        for g in self.groups:
            for p in g.layout.params:
                p.grad = None  # what no_sync accumulated is dropped too

    def spread_params(self) -> None:
        """Full parameters are gathered from the shards at their next use: drop any gathered now
        (and any shard read ahead from disk before the step wrote new values)."""
        self._reads.clear()
        for u in self.units:
            self.reshard(u)

    # -- accounting ------------------------------------------------------------------

    def unit_states(self) -> dict[str, str]:
        """{unit name: "sharded" | "gathering" | "full"}, for tests and debugging."""
        return {u.name: u.state.value for u in self.units}


register_strategy("zero3", lambda module, mesh, config, reshard: Zero3(
    module, mesh, config.mixed_precision or FP32, config.offload, config.wrap_policy, reshard, config.unit_check),
    options=("mixed_precision", "offload", "wrap_policy", "reshard_after_forward", "unit_check"),
    shards=("optimizer", "grads", "params"), aliases=("fsdp",))
