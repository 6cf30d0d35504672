"""`ShardedModule`: the one front door. Wrap a model, pick a strategy, train.

    mesh = minipar.init()                       # under torchrun
    model = ShardedModule(GPT(cfg), mesh=mesh, strategy="ddp")
    opt = model.build_optimizer(torch.optim.AdamW, lr=3e-4)
    loss = model.train_step(x, y, gpt_loss)     # global-batch loss on every rank
    opt.step(); opt.zero_grad()

The wrapper adds no behaviour of its own to forward: arguments, keyword
arguments and outputs of the wrapped module pass through unchanged. Each
strategy lives in its own module (`minipar.ddp`, ...); this file only checks
the configuration and dispatches.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn as nn

from .ddp import DataParallel
from .mesh import Mesh

STRATEGIES = ("ddp",)


class ShardedModule(nn.Module):
    """Wrap ``module`` for data-parallel training over ``mesh``.

    Args:
        module: the model, as built for one process; moved to ``mesh.device``.
        mesh: the process mesh; default: ``Mesh()`` over the initialised world (all ranks data-parallel).
        strategy: one of ``STRATEGIES``.
        bucket_cap_mb: gradient bucket size for DDP, in MiB (> 0).

    Raises ValueError, on every rank and before any collective, for an unknown
    strategy, a non-positive bucket size or a module without parameters; and,
    after one small collective, when ranks were given different configurations.
    """

    def __init__(self, module: nn.Module, *, mesh: Mesh | None = None, strategy: str = "ddp",
                 bucket_cap_mb: float = 25.0) -> None:
        super().__init__()
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be a number > 0 (MiB per gradient bucket; "
                             "PyTorch DDP uses 25)")
        if not any(True for _ in module.parameters()):
            raise ValueError(f"{type(module).__name__} has no parameters: there is nothing to train or "
                             "synchronise; wrap the module that owns the parameters")
        if mesh is None:
            mesh = Mesh()
        if mesh.tp != 1 or mesh.pp != 1:
            raise ValueError(f"{mesh!r}: tensor and pipeline parallelism are not available yet; "
                             "build the mesh with tp=1 and pp=1")
        self.mesh = mesh
        self.strategy_name = strategy
        self.module = module.to(mesh.device)
        self.strategy = DataParallel(self.module, mesh, bucket_cap_mb=bucket_cap_mb)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Gradient accumulation: backward inside the block does not communicate."""
        return self.strategy.no_sync()

    def train_step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """Forward, loss, backward with gradient sync. Returns the global-batch loss, equal on every rank.

        The global loss is the mean of the data-parallel ranks' losses: the
        loss of the global batch when every rank holds the same number of samples.
        The optimizer step is left to the caller.
        """
        loss = loss_fn(self(inputs), targets)
        loss.backward()
        global_loss = loss.detach().float().reshape(1).clone()
        group = self.mesh.group("dp")
        self.mesh.comm.all_reduce(global_loss, group, tag="loss")
        return global_loss.div_(group.size)[0]

    def build_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any) -> torch.optim.Optimizer:
        """The optimizer to step: ``optimizer_cls`` over the parameters this rank updates."""
        return self.strategy.build_optimizer(optimizer_cls, **kwargs)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The wrapped module's state dict with full tensors, on every rank."""
        return self.strategy.full_state_dict()
