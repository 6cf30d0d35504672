"""`ShardedOptimizer`: what ``build_optimizer`` returns under ZeRO, a ``torch.optim.Optimizer`` over this
rank's fp32 master shards (`minipar.data_parallel.sharded_state.ShardedState` holds them), with the step
routed through the fused kernel, the chunked step over files (offload "nvme"), or the torch optimizer.

It is a torch optimizer in every way a training loop touches one: ``isinstance(opt, torch.optim.Optimizer)``,
``param_groups`` (the user's groups, in order, with their options: `minipar.data_parallel.master_pieces`),
``state``, ``defaults``, ``step``, ``zero_grad``, ``state_dict``/``load_state_dict`` and the step hooks. So any
``torch.optim.lr_scheduler`` drives it: a scheduler writes ``param_groups[i]["lr"]``, and every step path reads
the groups afresh. Those three attributes *are* the inner torch optimizer's (properties, not copies: torch's
``load_state_dict`` replaces its lists, and a copy would go stale).

A step with no gradient (nothing since ``zero_grad``, or before any backward) changes nothing, as torch's
step over parameters whose ``grad`` is None: ZeRO's gradient shards hold zeros then, which weight decay and
momentum would otherwise turn into an update.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Callable

import torch

from .. import kernels
from .master_pieces import Piece, split_masters, user_groups
from .offload import OFFLOAD_OPTIMIZERS, OffloadError, agree

_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
               "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
               "_optimizer_load_state_dict_post_hooks")


class ShardedOptimizer(torch.optim.Optimizer):
    """What ``build_optimizer`` returns under ZeRO: ``optimizer_cls`` over this rank's pieces of its fp32 master shards.

    Any ``torch.optim`` class whose state is per element (Adam, AdamW, SGD with
    momentum, ...) gives the same result as over the full parameters, since
    each element is updated from its own gradient and state alone.
    """

    def __init__(self, shards: "ShardedState", optimizer_cls: type[torch.optim.Optimizer], params: Any = None,
                 **kwargs: Any) -> None:
        if shards.offload is not None and not issubclass(optimizer_cls, OFFLOAD_OPTIMIZERS):
            names = ", ".join(f"torch.optim.{c.__name__}" for c in OFFLOAD_OPTIMIZERS)
            raise ValueError(f"optimizer offload (cpu_offload=True or offload=Offload(...)) supports {names}; got "
                             f"{optimizer_cls.__name__}. Use one of those, or no offload")
        if getattr(optimizer_cls, "binds_strategy", False):
            # An optimizer that takes over DDP's sync (1-bit Adam) refuses to be built without it, in its own
            # words: let it, before any collective (the same on every rank).
            optimizer_cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
            raise ValueError(f"{optimizer_cls.__name__} takes over DDP's gradient synchronisation: use strategy='ddp'")
        error = None
        try:
            requested = user_groups([p for g in shards.groups for p in g.layout.params] if params is None else params)
            per_group = split_masters(shards.groups, requested, shards.param_names)
        except ValueError as e:  # (a pipeline stage's groups may be wrong on its ranks alone)
            error = str(e)
        _agree_on_groups(shards, error)
        self.shards = shards
        self.pieces: list[Piece] = [pc for pcs in per_group for pc in pcs]
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [pc.param for pc in pcs]}
                  for g, pcs in zip(requested, per_group)]
        self.optimizer = optimizer_cls(groups, **kwargs)
        # torch.optim.Optimizer.__init__ would build groups of its own; what it sets besides is set here.
        for name in _HOOK_DICTS:
            setattr(self, name, OrderedDict())
        self._patch_step_function()  # step runs the global and registered step hooks, as any optimizer's
        shards.optimizer = self
        if shards.nvme is not None:  # the per-element state gets its files: on every rank, or all raise
            error = None
            try:
                shards.nvme.build(self.optimizer, self.pieces)
            except Exception as e:  # noqa: BLE001 -- one rank's failure must reach every rank, not hang them
                error = f"reserving the optimizer state's files under {shards.offload.path}: {e}; free space " \
                        "there or offload to 'cpu'"
            agree(shards.mesh, "build_optimizer with Offload(optimizer='nvme')", error)

    # The inner optimizer's own, live (see the module docstring).
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict) -> None:
        raise ValueError("a sharded optimizer steps every parameter of the model from the start: give all "
                         "parameter groups to model.build_optimizer(cls, [{'params': ...}, ...], lr=...)")

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> bool:
        """One optimizer step; returns False when it was skipped (no gradient since ``zero_grad``, or a
        non-finite one on some rank). ``closure``, if given, is called first (with gradients enabled).

        Adam/AdamW on a GPU (or under the Triton interpreter) step through the fused
        kernel; everything else through the torch optimizer. Both keep torch's state format.
        """
        if closure is not None:
            with torch.enable_grad():
                closure()
        shards = self.shards
        if not shards.has_grads:  # (the same on every rank: backward is collective under ZeRO)
            return False
        if shards.unscale_():
            stepped = False
        elif shards.nvme is not None:
            stepped = self._nvme_step()
        elif self._can_fuse():
            stepped = self._fused_step()
        else:
            stepped = self._torch_step()
        shards.finish_step(not stepped)
        return stepped

    def _can_fuse(self) -> bool:
        """The fused AdamW kernel can step the pieces: Adam/AdamW that it supports, masters on a device
        where the dispatch rule picks Triton, gradients beside them (never under offload: its step runs
        on the host, where the transfers are counted)."""
        groups = self.shards.groups
        return self.shards.offload is None and kernels.adamw_supports(self.optimizer) and all(
            kernels.use_triton(g.master) and g.grad_shard.device == g.master.device for g in groups)

    def _fused_step(self) -> bool:
        """One pass per piece (``minipar.kernels.adamw``), with its group's hyperparameters: read the
        reduced gradient in its own dtype (no fp32 copy), update master and moments, write the
        compute-dtype shard."""
        grads, outs = {}, {}
        for pc in self.pieces:
            g = self.shards.groups[pc.index]
            grads[id(pc.param)] = g.real_grad[pc.lo:pc.hi]
            if not self.shards.master_is_shard(g):
                outs[id(pc.param)] = g.shard[pc.lo:pc.hi]
        kernels.fused_step(self.optimizer, outs, grads)
        self.shards.shards_written = True
        return True

    def _torch_step(self) -> bool:
        """The torch optimizer over the pieces, each given its slice of the fp32 gradient shard."""
        shards = self.shards
        grads = []
        for g in shards.groups:
            grad = g.real_grad
            if shards.offload is not None:  # the gradient shard goes to the host, where the masters are
                shards.traffic.add("to_host", grad.numel() * grad.element_size())
            grads.append(grad.to(g.master.device, torch.float32) if grad.dtype != torch.float32
                         or grad.device != g.master.device else grad)
        for pc in self.pieces:
            pc.param.grad = grads[pc.index][pc.lo:pc.hi]
        try:
            self.optimizer.step()
        finally:
            for pc in self.pieces:
                pc.param.grad = None  # an fp32 copy of the gradient shard, needed only inside the step
        return True

    def _nvme_step(self) -> bool:
        """The step with the optimizer state in files (`minipar.data_parallel.offload.NvmeOptimizer`):
        chunk by chunk, each new chunk written into the compute shards."""
        shards = self.shards
        try:
            write = lambda i, lo, values: shards.homes.write_shard(shards.groups[i], i, lo, values)  # noqa: E731
            shards.nvme.step([g.real_grad for g in shards.groups], write, shards.traffic)
        except OffloadError as e:
            shards.disk_error = str(e)  # raised on every rank by finish_step, which every rank reaches
        shards.shards_written = True
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients wherever ZeRO keeps them (its shards are zeroed either way)."""
        self.shards.zero_grad()

    def state_dict(self) -> dict:
        with self.shards.offloaded_state():
            optimizer = self.optimizer.state_dict()
            if self.shards.nvme is not None:  # its per-element tensors leave memory with the block
                optimizer = copy.deepcopy(optimizer)
        return {"optimizer": optimizer, "scaler": self.shards.scaler.state_dict(),
                "layout": self.shards.layout_signature()}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict["layout"] != self.shards.layout_signature():
            raise ValueError("this optimizer state was saved under another sharding layout (stage, world size, "
                             "bucket size or model); load it into a ShardedModule built the same way, or go "
                             "through minipar.checkpoint, which reshards")
        with self.shards.offloaded_state(write_back=True):
            self.optimizer.load_state_dict(state_dict["optimizer"])
        self.shards.scaler.load_state_dict(state_dict["scaler"])

    def __repr__(self) -> str:
        return f"ShardedOptimizer(zero{self.shards.stage}, {self.optimizer!r})"


def _agree_on_groups(shards: "ShardedState", error: str | None) -> None:
    """ValueError on every rank when the parameter groups were refused on any (one small collective,
    so that no rank goes on to train while another has raised)."""
    errors = shards.comm.all_gather_object(error, shards.world, tag="build_optimizer")
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    if len(failed) == len(errors) and len({e for _, e in failed}) == 1:
        raise ValueError(failed[0][1])
    raise ValueError("build_optimizer refused the parameter groups on some ranks:\n"
                     + "\n".join(f"  rank {r}: {e}" for r, e in failed))
