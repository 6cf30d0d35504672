"""The two sides of the comparisons as runners, and PyTorch's own wrappers set up once for all of them.

A runner's ``step(x, y)`` trains one step on this rank's batch and returns the loss it sees (None on a
pipeline rank without the last stage): minipar's through ``ShardedModule.train_step``, PyTorch's through
DDP, FSDP2 (``fully_shard``) or ``torch.distributed.pipelining``.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from minipar import ShardedModule
from minipar.models import GPT, gpt_loss


def fsdp2(module: torch.nn.Module, units: list[torch.nn.Module], mesh, **kw) -> torch.nn.Module:
    """``fully_shard`` on each unit, then on the root (what holds the rest), as FSDP2 is meant to be used."""
    for unit in [*units, module]:
        fully_shard(unit, mesh=mesh, **kw)
    return module


def ddp(module: torch.nn.Module, device: torch.device, **kw) -> DistributedDataParallel:
    """PyTorch's DDP on this rank's device (its GPU named on CUDA)."""
    ids = [int(os.environ.get("LOCAL_RANK", 0))] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, **kw)


class Runner:
    """``loss(x, y)`` (forward and backward) then the optimizer's step: ``step`` returns the loss. As it
    stands, PyTorch's wrapped ``module`` (DDP, FSDP2 on any mesh) under ``gpt_loss``: this rank's loss."""

    def __init__(self, module: torch.nn.Module, opt_kwargs: dict) -> None:
        self.module, self.opt = module, torch.optim.AdamW(module.parameters(), **opt_kwargs)

    def loss(self, x, y) -> float:
        loss = gpt_loss(self.module(x), y)
        loss.backward()
        return loss.item()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        loss = self.loss(x, y)
        self.opt.step()
        self.opt.zero_grad()
        return loss


class MiniparRunner(Runner):
    """``ShardedModule(GPT(cfg), mesh=mesh, **layout)``: ``train_step`` gives the global-batch loss on every rank."""

    def __init__(self, cfg, mesh, opt_kwargs: dict, **layout) -> None:
        self.model = ShardedModule(GPT(cfg), mesh=mesh, **layout)
        self.opt = self.model.build_optimizer(torch.optim.AdamW, **opt_kwargs)

    def loss(self, x, y) -> float:
        return self.model.train_step(x, y, gpt_loss).item()


class PipelineRunner(Runner):
    """A ``torch.distributed.pipelining`` schedule over this rank's ``modules`` (first: it holds the
    first piece; last: the last): the mean micro-batch loss on the last, None elsewhere."""

    def __init__(self, schedule, modules: list[torch.nn.Module], first: bool, last: bool, opt_kwargs: dict,
                 **step_kw) -> None:
        self.schedule, self.first, self.last, self.step_kw = schedule, first, last, step_kw
        self.opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], **opt_kwargs)

    def loss(self, x, y) -> float | None:
        losses: list = []
        self.schedule.step(*((x,) if self.first else ()), **(dict(target=y, losses=losses) if self.last else {}),
                           **self.step_kw)
        return torch.stack([loss.detach() for loss in losses]).mean().item() if self.last else None
