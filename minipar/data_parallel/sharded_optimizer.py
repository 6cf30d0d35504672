"""`ShardedOptimizer`: what ``build_optimizer`` returns under ZeRO, a torch optimizer over this
rank's fp32 master shards (`minipar.data_parallel.sharded_state.ShardedState` holds them), with the step routed
through the fused kernel, the chunked step over files (offload "nvme"), or the torch optimizer."""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .offload import OFFLOAD_OPTIMIZERS, agree


class ShardedOptimizer:
    """What ``build_optimizer`` returns under ZeRO: a torch optimizer over this rank's fp32 master shards.

    Any ``torch.optim`` class whose state is per element (Adam, AdamW, SGD with
    momentum, ...) gives the same result as over the full parameters, since
    each element is updated from its own gradient and state alone.
    """

    def __init__(self, state: "ShardedState", optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> None:
        if state.offload is not None and not issubclass(optimizer_cls, OFFLOAD_OPTIMIZERS):
            names = ", ".join(f"torch.optim.{c.__name__}" for c in OFFLOAD_OPTIMIZERS)
            raise ValueError(f"optimizer offload (cpu_offload=True or offload=Offload(...)) supports {names}; got "
                             f"{optimizer_cls.__name__}. Use one of those, or no offload")
        self.state = state
        self.optimizer = optimizer_cls([g.master for g in state.groups], **kwargs)
        state.optimizer = self
        if state.nvme is not None:  # the per-element state gets its files: on every rank, or all raise
            error = None
            try:
                state.nvme.build(self.optimizer)
            except Exception as e:  # noqa: BLE001 -- one rank's failure must reach every rank, not hang them
                error = f"reserving the optimizer state's files under {state.offload.path}: {e}; free space there " \
                        "or offload to 'cpu'"
            agree(state.mesh, "build_optimizer with Offload(optimizer='nvme')", error)
        self._step_hooks: OrderedDict[int, Any] = OrderedDict()  # weakly referenced by RemovableHandle

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def step(self) -> bool:
        """One optimizer step; returns False when it was skipped for a non-finite gradient.

        Adam/AdamW on a GPU (or under the Triton interpreter) step through the fused
        kernel; everything else through the torch optimizer. Both keep torch's state format.
        """
        if self.state.nvme is not None:
            stepped = self.state.nvme_step()
        elif self.state.can_fuse(self.optimizer):
            stepped = self.state.fused_step(self.optimizer)
        else:
            stepped = not self.state.prepare_step()
            if stepped:
                self.optimizer.step()
        self.state.finish_step(not stepped)
        for hook in list(self._step_hooks.values()):
            hook(self, (), {})
        return stepped

    def register_step_post_hook(self, hook) -> RemovableHandle:
        """As ``torch.optim.Optimizer``'s: ``hook(optimizer, args, kwargs)`` after every step."""
        handle = RemovableHandle(self._step_hooks)
        self._step_hooks[handle.id] = hook
        return handle

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.state.zero_grad()

    def state_dict(self) -> dict:
        with self.state.offloaded_state():
            optimizer = self.optimizer.state_dict()
            if self.state.nvme is not None:  # its per-element tensors leave memory with the block
                optimizer = copy.deepcopy(optimizer)
        return {"optimizer": optimizer, "scaler": self.state.scaler.state_dict(),
                "layout": self.state.layout_signature()}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict["layout"] != self.state.layout_signature():
            raise ValueError("this optimizer state was saved under another sharding layout (stage, world size, "
                             "bucket size or model); load it into a ShardedModule built the same way")
        with self.state.offloaded_state(write_back=True):
            self.optimizer.load_state_dict(state_dict["optimizer"])
        self.state.scaler.load_state_dict(state_dict["scaler"])
