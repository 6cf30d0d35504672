"""One training step: forward, loss, backward, gradient sync, and the loss every rank reports.

The front door holds one runner and calls ``runner.step(model, inputs, targets, loss_fn, factor)``
whatever the layout; there are two runners:

* `OneStage` (pp = 1): the whole (tensor-, expert-, context-parallel local) model on this rank,
  one forward and one backward; the strategy's hooks reduce gradients during that backward.
* `minipar.pipeline.step.Pipeline` (pp > 1): the schedule's micro-batches over the stages, every
  backward under ``no_sync``, then the tied weight's gradient summed over its two stages and the
  strategy's reduction, once.

What both share is here, so that it is written once:

* fp16 loss scaling (`loss_scale`): backward runs on ``loss * scale``; the reported loss is not scaled.
* the reported loss (`report_loss`): the mean over the data-parallel ranks that computed gradients
  (the grad axis: dp, or dp x cp, whose losses are weighted to average right) of each rank's loss;
  under a pipeline only the last stage holds one, so it is first summed over pp (the others add 0).
  Every rank returns the same value: the loss of the global batch when every rank holds the same
  number of samples.
* ``factor``: uneven data (`minipar.data_parallel.join`) weighs each rank's loss so the mean stays
  the global batch's; 1 otherwise.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .core.mesh import Mesh


def loss_scale(strategy) -> float | None:
    """The fp16 loss scale the backward multiplies by, or None (bf16, fp32: no scaling)."""
    return strategy.scaler.scale if strategy.scaler.enabled else None


def report_loss(local: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The global loss from this rank's unscaled ``local`` loss (0-d or one element), equal on every rank."""
    loss = local.detach().float().reshape(1).clone()
    if mesh.pp > 1:  # only the last stage holds a loss; the others add 0
        mesh.comm.all_reduce(loss, mesh.group("pp"), tag="loss")
    group = mesh.group(mesh.grad_axis)
    mesh.comm.all_reduce(loss, group, tag="loss")
    return loss.div_(group.size)[0]


class OneStage:
    """The pp = 1 step: ``model(inputs)`` (through the front door, which casts floating inputs to the
    compute dtype), the loss, and one backward; the strategy reduces gradients in its hooks."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def step(self, model, inputs: Any, targets: Any, loss_fn: Callable | None, factor: float = 1.0) -> torch.Tensor:
        if loss_fn is None:  # the model's own loss (minipar's GPT: the chunked head loss, no logits held)
            loss = own_loss(model(inputs, targets=targets))
        else:
            loss = loss_fn(logits_of(model(inputs)), targets)
        if factor != 1.0:
            loss = loss * factor
        scale = loss_scale(model.strategy)
        (loss * scale if scale is not None else loss).backward()
        return report_loss(loss, self.mesh)


def own_loss(output: Any) -> torch.Tensor:
    """The loss a model computed itself (``model(inputs, targets=targets)``): the output, or a Hugging
    Face output's ``.loss``; ValueError, the same on every rank, when it is not a scalar tensor."""
    loss = getattr(output, "loss", output)
    if not (torch.is_tensor(loss) and loss.dim() == 0):
        raise ValueError(f"train_step without a loss_fn needs a model whose forward(inputs, targets=targets) "
                         f"returns its loss (minipar's GPT does); this one returned {type(output).__name__}: "
                         "pass a loss_fn")
    return loss


def logits_of(output: Any) -> Any:
    """What ``loss_fn`` receives: the model's output, or the logits a Hugging Face output holds (a
    pipeline's last stage hands over logits too)."""
    logits = getattr(output, "logits", None)
    return logits if torch.is_tensor(logits) else output
