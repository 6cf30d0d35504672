"""One training step of a pipeline stage, with any data-parallel strategy beside it.

    1. the schedule's forwards and backwards (`run_schedule`), every backward under the
       strategy's ``no_sync``: the micro-batches' gradients accumulate locally;
    2. the tied embedding / head weight's *local* gradient summed over the first and last stage
       (`sync_tied_grads`; middle stages add zeros). A sum over pp and a mean over dp commute, so
       summing before the data-parallel reduction gives every strategy, sharded or not, one
       ordinary gradient to reduce: no strategy needs to know the weight is tied;
    3. ``strategy.sync_grads()``: the data-parallel reduction, once per step whatever m is;
    4. the loss every rank reports: the last stage's, summed over pp (the others add 0),
       averaged over dp.

The loss of the step is the mean over the batch's counted targets (those not -100), as one process
computes it on the whole batch: each micro-batch's loss (a mean over its own counted targets) is
weighted by its share of them times m (`token_weighted`), not simply averaged over the m micro-batches,
which would weigh a micro-batch with few counted targets as much as a full one. With no ignored
target the weight is exactly 1. A micro-batch none of whose targets counts gets weight 0 and a finite
loss (`minipar.context_parallel.context.finite_if_empty`), where its mean over no token would be NaN.

The cost of (1)-(3) against overlapping the reduction with the last
micro-batch's backward: the last backward's share of the step (1/m of the
backward work) is no longer hidden behind communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from ..context_parallel.context import counted, finite_if_empty
from ..core.mesh import Mesh
from ..moe.layer import moe_layers
from ..data_parallel.join import scaled
from ..step import loss_scale, report_loss
from .executor import run_schedule
from .schedule import SCHEDULES, Schedule, chunks_per_rank, placement_of
from .spec import StageSpec
from .stage import sync_tied_grads



@dataclass(frozen=True)
class PipelineConfig:
    """How `ShardedModule` runs pp > 1 stages (unused at pp = 1).

    schedule: one of `SCHEDULES`: "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v";
    microbatches: per step (the batch must divide by it); virtual_stages: model chunks per rank
    for interleaved_1f1b (default 2; zb_v and dualpipe_v have 2, the others 1); boundaries: where to
    cut the model into pp * chunks pieces (block counts or cut points; default: balanced by parameters);
    record_timeline: keep each stage's (action, start, end) of the last step; stage_spec: how to
    cut a model that `minipar.pipeline.spec_for` does not recognise.
    Raises ValueError for an unknown schedule, a micro-batch or chunk count that is not a positive
    integer, or a chunk count the schedule cannot run."""

    schedule: str = "1f1b"
    microbatches: int = 1
    boundaries: Sequence[int] | None = None
    record_timeline: bool = False
    stage_spec: StageSpec | None = None
    virtual_stages: int | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        for name in ("microbatches", "virtual_stages"):
            n = getattr(self, name)
            if (n is not None or name == "microbatches") and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(f"{name}={n!r} must be a positive integer")
        fixed = chunks_per_rank(self.schedule)
        if self.schedule != "interleaved_1f1b" and self.virtual_stages not in (None, fixed):
            raise ValueError(f"schedule {self.schedule!r} runs {fixed} model chunk(s) per rank, not "
                             f"virtual_stages={self.virtual_stages}; use schedule='interleaved_1f1b' for more")

    @property
    def chunks(self) -> int:
        """Model chunks per rank."""
        return chunks_per_rank(self.schedule, self.virtual_stages)

    @property
    def placement(self) -> str:
        return placement_of(self.schedule)

    def schedule_for(self, stages: int) -> Schedule:
        """The schedule's per-rank actions for ``stages`` ranks (ValueError when the micro-batch count
        does not suit it, e.g. interleaved_1f1b with m not a multiple of pp)."""
        return SCHEDULES[self.schedule](stages, self.microbatches, self.chunks)


class Pipeline:
    """The pipeline part of a `ShardedModule`: schedule, micro-batch count, and the step.

    hidden: the activation width between stages; tied_shape: this tp rank's piece of a tied
    embedding/head weight (what a middle stage adds zeros of)."""

    def __init__(self, mesh: Mesh, config: PipelineConfig, hidden: int, tied_shape: tuple,
                 seq_divisor: int = 1) -> None:
        self.mesh, self.config = mesh, config
        self.microbatches, self.record_timeline = config.microbatches, config.record_timeline
        # Every rank's actions, built once (a micro-batch count the schedule cannot run: ValueError
        # here, before any collective); a schedule with W actions splits the backward.
        self.actions = config.schedule_for(mesh.pp)
        self.splits_backward = any(a.kind == "W" for acts in self.actions for a in acts)
        self.hidden, self.tied_shape = hidden, tied_shape
        self.seq_divisor = seq_divisor  # sequence parallelism: activations between stages are sequence shards
        self.timeline: list = []  # (action, start, end) of this stage's last step, when recorded
        self.grad_group = None  # where gradients travel when activations and gradients share a pair (`connect`)
        self.peak_live_activations = 0
        self.failed: str | None = None  # the error that stopped a step midway (`minipar.pipeline.abort`)
        self.abandoned: list = []  # that step's sends still in flight, kept alive until they leave

    def connect(self) -> None:
        """Create what the schedule's messages need (collective over the world: call on every rank,
        after the configuration checks): with several chunks per rank, a group for the gradients."""
        if self.config.chunks > 1:
            self.grad_group = self.mesh.twin("pp")

    def step(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
             loss_fn: Callable[[Any, Any], torch.Tensor], factor: float = 1.0) -> torch.Tensor:
        """One step of this rank's stage (``model.module``) under ``model.strategy``: the runner's
        answer to `minipar.step` (what it shares with the pp = 1 step: loss scaling, the reported loss)."""
        mesh, m = self.mesh, self.microbatches
        stage, strategy = model.module, model.strategy
        if factor != 1.0:  # uneven data (`minipar.data_parallel.join`)
            loss_fn = scaled(loss_fn, factor)
        if self.failed is not None:  # the same on every stage: each raised in that step
            raise ValueError(f"an earlier step stopped midway ({self.failed}), leaving its messages in the "
                             "pipeline's channels; build a new Mesh and ShardedModule (from full_state_dict() or "
                             "a checkpoint) to train on")
        if inputs.shape[0] % m:
            raise ValueError(f"a batch of {inputs.shape[0]} does not split into microbatches={m}; "
                             "use a batch size divisible by the micro-batch count")
        if inputs.shape[1] % self.seq_divisor:
            raise ValueError(f"a sequence of {inputs.shape[1]} does not split into tp={self.seq_divisor} shards "
                             "for sequence parallelism; use a sequence length divisible by tp")
        for layer in moe_layers(stage):  # the loss is a mean over m micro-batches; so is the auxiliary loss
            layer.aux_scale = 1.0 / m
        act_shape = (inputs.shape[0] // m, inputs.shape[1] // self.seq_divisor, self.hidden)
        scale = loss_scale(strategy)
        if stage.last:
            loss_fn = token_weighted(loss_fn, targets, m)
        stage_loss = loss_fn if scale is None else (lambda out, y: loss_fn(out, y) * scale)  # fp16: scaled backward
        # What the tied weight's gradient held before this step (DDP keeps an earlier step's reduced
        # sum there until zero_grad; the others moved it into their shards): only what comes now is summed.
        w = stage.tied_weight()
        before = w.grad.clone() if w is not None and w.grad is not None else None
        self.timeline = [] if self.record_timeline else self.timeline
        with strategy.no_sync(local=True):  # every micro-batch accumulates in p.grad; one reduction per step
            try:  # a stage that fails tells the others at once; every stage raises (`minipar.pipeline.abort`)
                loss, self.peak_live_activations = run_schedule(
                    stage, self.actions, mesh, list(inputs.chunk(m)) if stage.first else None,
                    list(targets.chunk(m)) if stage.last else None, stage_loss, act_shape,
                    next(stage.parameters()).dtype, timeline=self.timeline if self.record_timeline else None,
                    grad_group=self.grad_group, abandoned=self.abandoned)
            except Exception as e:
                self.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                raise
        sync_tied_grads(stage, mesh, self.tied_shape, already_summed=before)
        strategy.sync_grads()
        return report_loss(loss if scale is None else loss.float() / scale, mesh)


def token_weighted(loss_fn: Callable[[Any, Any], torch.Tensor], targets: Any, m: int) -> Callable:
    """``loss_fn`` for one of the m micro-batches of ``targets``, weighted by m times its share of the
    batch's counted targets: the executor's sum of loss / m over the micro-batches is then the mean
    over every counted target of the batch, one process's loss. Targets that are not integer ids
    (nothing is ignored there) leave ``loss_fn`` as it is."""
    if not torch.is_tensor(targets) or targets.is_floating_point():
        return loss_fn
    total = counted(targets)
    some = total > 0

    def weighted(out, y):
        share = counted(y) * m / total.clamp(min=1.0)  # exactly 1 when nothing is ignored
        return loss_fn(out, finite_if_empty(y, some.to(y.device))) * share.to(y.device)
    return weighted
