"""The pipeline family's part of the front door: where the model is cut, checked before any
collective, and the cut itself (`PipelineCut`).

`ShardedModule` builds a `PipelineCut` on every rank before its first collective: a model it
cannot cut (`cut_check.check_spec`), more pieces than blocks, or a schedule that contradicts the
data-parallel strategy's resharding raises ValueError there. After the ranks agree, `stage` keeps
this rank's pieces of the model and maps the tensor-parallel plan onto them.
"""

from __future__ import annotations

import fnmatch

import torch.nn as nn

from ..core.mesh import Mesh
from ..core.placement import place
from .cut_check import check_spec
from .spec import find, spec_for
from .stage import Stage, default_boundaries, resolve_boundaries
from .step import Pipeline, PipelineConfig


class PipelineCut:
    """This rank's stage of ``module`` at ``mesh.pp`` > 1, and the runner (`Pipeline`) that drives it.

    ``frees_gathered``: the data-parallel strategy frees the parameters it gathered for a forward
    right after it (ZeRO-3 with reshard_after_forward); a schedule that computes weight gradients
    after the input backward (zb_h1, zb_v, dualpipe_v) would then find them gone, so it is refused.
    """

    def __init__(self, module: nn.Module, mesh: Mesh, config: PipelineConfig, *, sequence_parallel: bool,
                 frees_gathered: bool) -> None:
        self.spec = config.stage_spec or spec_for(module)
        check_spec(module, self.spec)
        n_blocks = len(find(module, self.spec.blocks))
        tied = find(module, self.spec.tied[0]) if self.spec.tied_in(module) else None
        # the tied weight crosses stages as this rank's tensor-parallel shard of its rows
        tied_shape = (tied.shape[0] // mesh.tp,) + tuple(tied.shape[1:]) if tied is not None else None
        self.runner = Pipeline(mesh, config, self.spec.hidden_size, tied_shape,
                               seq_divisor=mesh.tp if sequence_parallel else 1)
        pieces = mesh.pp * config.chunks
        if config.chunks > 1 and pieces > n_blocks:  # (one chunk: balanced_boundaries says it)
            raise ValueError(f"pp={mesh.pp} x {config.chunks} chunk(s) per rank ({config.schedule}) makes "
                             f"{pieces} pipeline pieces but the model has {n_blocks} blocks: every piece needs one; "
                             "use fewer stages or chunks")
        self.boundaries = default_boundaries(module, pieces, self.spec) if config.boundaries is None else \
            resolve_boundaries(config.boundaries, n_blocks, pieces)
        if self.runner.splits_backward and frees_gathered:
            raise ValueError(f"schedule={config.schedule!r} computes weight gradients (W) after the "
                             "backward that freed the gathered parameters with reshard_after_forward=True; "
                             "leave reshard_after_forward unset (False under a pipeline) or use '1f1b'")
        self.mesh, self.config = mesh, config

    def stage(self, module: nn.Module, plan: dict | None) -> tuple[Stage, dict | None]:
        """Keep this rank's pieces of ``module``; the plan's modules that the stage holds, under the
        stage's names (None stays None)."""
        stage = Stage(module, self.mesh.pp_rank, self.mesh.pp, self.boundaries, self.spec,
                      chunks=self.config.chunks, placement=self.config.placement)
        return stage, (stage_plan(plan, module, stage) if plan is not None else None)

    @staticmethod
    def mark_replicas(stage: Stage) -> None:
        """On a last stage that is not also the first, the tied weight (the LM head) is a replica of
        the first stage's embedding: their gradients are summed between the two (`sync_tied_grads`),
        so norms count it, and checkpoints save it, once, as the embedding. Called on the stage's
        final parameters (after tensor parallelism replaced its layers)."""
        if stage.tied and stage.last and not stage.first:
            place(stage.tied_weight(), replica_of=stage.spec.tied[0])


def stage_plan(plan: dict, whole: nn.Module, stage: nn.Module) -> dict:
    """``plan`` (patterns over ``whole``'s module names) as concrete names of the modules ``stage``
    holds, under the stage's names (its block ``k`` is the model's block ``offset + k``)."""
    names = [(n, stage.global_name(n)) for n, _ in stage.named_modules() if n]
    out = {}
    for pattern, style in plan.items():
        for n, global_name in names:
            if fnmatch.fnmatchcase(global_name, pattern):
                out[n] = style
    return out
