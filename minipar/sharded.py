"""`ShardedModule`: the one front door. Wrap a model, pick a strategy, train.

    mesh = minipar.init()                       # under torchrun
    model = ShardedModule(GPT(cfg), mesh=mesh, strategy="ddp")
    opt = model.build_optimizer(torch.optim.AdamW, lr=3e-4)
    loss = model.train_step(x, y, gpt_loss)     # global-batch loss on every rank
    opt.step(); opt.zero_grad()

The wrapper adds no behaviour of its own to forward: arguments, keyword
arguments and outputs of the wrapped module pass through unchanged. Each
strategy lives in its own module (`minipar.data_parallel.ddp`, ...) and answers the
`minipar.data_parallel.strategy.Strategy` protocol; this file checks the configuration,
builds the layers (tensor parallelism, pipeline stage, experts, then the
data-parallel strategy) and asks the strategy only through that protocol.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from . import kernels
from .checks import agree_on_model, broadcast_initial_state, check_batch
from .context_parallel.context import ContextParallel, check_form
from .core.units import select_units
from .full_state import full_tensors
from .core.grad_norm import clip_
from .data_parallel.join import Join, scaled
from .core.mesh import Mesh
from .moe.layer import check_moe_config, moe_layers, shard_experts
from .data_parallel.offload import agree as agree_offload, check_path
from .recompute import check_units, checkpoint_modules, select_checkpointed
from .pipeline import Stage, default_boundaries, resolve_boundaries, spec_for
from .pipeline.cut_check import check_spec
from .pipeline.spec import find
from .pipeline.step import Pipeline, PipelineConfig
from .data_parallel.precision import FP32
from .config import build_strategy, resolve_configs
from .data_parallel.strategy import DataParallelConfig, Strategy
from .core.syncs import to_device
from .tensor_parallel.model_plan import plan_for
from .tensor_parallel import TensorParallelConfig, check_plan, mark_sequence_parallel, parallelize, vocab_parallel_cross_entropy

class ShardedModule(nn.Module):
    """Wrap ``module`` for training over ``mesh``: tensor parallelism on the tp axis (when tp > 1),
    pipeline stages (pp > 1), experts over ep, then a data-parallel strategy on dp.

    Args:
        module: the model, as built for one process; moved to ``mesh.device``.
        mesh: the process mesh; default: ``Mesh()`` over the initialised world (all ranks data-parallel).
        strategy: "ddp", "zero1", "zero2", "zero3" (= "fsdp"), or a `DataParallelConfig` with the
            strategy's options (bucket size, mixed precision, offload, zero3 wrap policy and resharding).
        tensor_parallel: a `TensorParallelConfig` (plan, sequence parallelism), used when tp > 1.
        pipeline: a `PipelineConfig` (schedule: gpipe, 1f1b, interleaved_1f1b, zb_h1, zb_v;
            micro-batches, virtual stages, boundaries, timeline), used when pp > 1.
        context_parallel: "ring" or "ulysses" (default ring) when the mesh has cp > 1: the cp ranks
            split each sequence (`minipar.context_parallel.context`); forward then takes this rank's tokens.
        activation_checkpointing: recompute chosen blocks in backward instead of keeping their
            activations: True (each nn.ModuleList entry: the transformer blocks), a tuple of module
            classes, or a callable(module) -> bool; dropout masks are replayed (`minipar.recompute`).
        **options: the configs' fields as flat keywords, as before the configs existed:
            bucket_cap_mb, mixed_precision, offload (a `minipar.Offload`: optimizer state to "cpu" or
            "nvme", zero3's parameters too; cpu_offload=True is Offload(optimizer="cpu")), wrap_policy,
            reshard_after_forward, unit_check (strategy);
            tp_plan, sequence_parallel, dropout_seed (tensor_parallel); schedule, microbatches,
            pipeline_boundaries, record_timeline, stage_spec, virtual_stages (pipeline).

    Raises ValueError, on every rank and before any collective, for an option a config refuses, a
    layout that cannot exist, or a module without parameters; and, after one small collective,
    when ranks were given different configurations.
    """

    def __init__(self, module: nn.Module, *, mesh: Mesh | None = None, strategy: str | DataParallelConfig = "ddp",
                 tensor_parallel: TensorParallelConfig | None = None, pipeline: PipelineConfig | None = None,
                 activation_checkpointing: Any = False, context_parallel: str | None = None,
                 **options: Any) -> None:
        super().__init__()
        dp_config, tp_config, pp_config = resolve_configs(strategy, tensor_parallel, pipeline, options)
        check_form(context_parallel)
        sequence_parallel = tp_config.sequence_parallel
        if not any(True for _ in module.parameters()):
            raise ValueError(f"{type(module).__name__} has no parameters: there is nothing to train or "
                             "synchronise; wrap the module that owns the parameters")
        if mesh is None:
            mesh = Mesh()
        reshard_after_forward = dp_config.reshard_after_forward
        if reshard_after_forward is None:  # a pipeline runs each unit m times per step: keep it gathered
            reshard_after_forward = mesh.pp == 1
        runner = None
        if mesh.pp > 1:  # a model we cannot cut, or bad cuts: ValueError before any collective
            spec = pp_config.stage_spec or spec_for(module)
            check_spec(module, spec)
            n_blocks = len(find(module, spec.blocks))
            tied = find(module, spec.tied[0]) if spec.tied_in(module) else None
            tied_shape = (tied.shape[0] // mesh.tp,) + tuple(tied.shape[1:]) if tied is not None else None
            runner = Pipeline(mesh, pp_config, spec.hidden_size, tied_shape,
                              seq_divisor=mesh.tp if sequence_parallel else 1)
            pieces = mesh.pp * pp_config.chunks
            if pp_config.chunks > 1 and pieces > n_blocks:  # (one chunk: balanced_boundaries says it)
                raise ValueError(f"pp={mesh.pp} x {pp_config.chunks} chunk(s) per rank ({pp_config.schedule}) makes "
                                 f"{pieces} pipeline pieces but the model has {n_blocks} blocks: every piece needs one; "
                                 "use fewer stages or chunks")
            boundaries = default_boundaries(module, pieces, spec) if pp_config.boundaries is None else \
                resolve_boundaries(pp_config.boundaries, n_blocks, pieces)
            if runner.splits_backward and dp_config.zero3 and reshard_after_forward:
                raise ValueError(f"schedule={pp_config.schedule!r} computes weight gradients (W) after the "
                                 "backward that freed the gathered parameters with reshard_after_forward=True; "
                                 "leave reshard_after_forward unset (False under a pipeline) or use '1f1b'")
        if mesh.hsdp and not dp_config.sharded:
            raise ValueError(f"the mesh has dp_shard={mesh.dp_shard} (HSDP) but DDP shards nothing; use "
                             "strategy='zero1', 'zero2' or 'zero3', or build the mesh without dp_shard")
        experts = moe_layers(module)
        if mesh.ep > 1 and not experts:
            raise ValueError(f"the mesh has ep={mesh.ep} but {type(module).__name__} has no MoE layers: "
                             "expert parallelism has nothing to split; build the mesh with ep=1")
        for layer in experts:  # experts not divisible by ep, on every rank before any collective
            check_moe_config(layer.n_experts, layer.top_k, layer.capacity_factor, mesh.ep)
        if dp_config.zero3:  # a wrap policy that matches nothing raises here
            units = [n for n, _ in select_units(module, dp_config.wrap_policy)]
        if activation_checkpointing is not False:  # a policy that matches nothing, or cuts a zero3 unit
            chosen = select_checkpointed(module, activation_checkpointing)
            if dp_config.zero3:
                check_units(chosen, units)
        plan = None  # the model's own plan checks its sizes against tp (heads, vocabulary) here
        if mesh.tp > 1:
            plan = plan_for(module, mesh.tp, tp_config)
            check_plan(module, plan, mesh.tp)  # patterns, styles, sizes, ties: before any collective
        # cp > 1: attention and positions switch to the split sequence (attention dropout, heads per
        # rank that Ulysses cannot split: ValueError here, before any collective)
        self.context = ContextParallel(module, mesh, context_parallel) if mesh.cp > 1 else None
        offload_path_error = check_path(dp_config.offload)  # missing or unwritable: agreed just below
        # The first collectives: a model, layout or plan that differs between ranks fails here, on
        # every rank, instead of hanging in the first forward; then every rank starts from rank 0's weights.
        agree_on_model(mesh, module, {"strategy": dp_config, "reshard": reshard_after_forward,
                                      "tensor_parallel": tp_config, "pipeline": pp_config,
                                      "activation_checkpointing": activation_checkpointing,
                                      "context_parallel": context_parallel})
        if dp_config.offload is not None and dp_config.offload.nvme:  # (the same on every rank: agreed above)
            agree_offload(mesh, "the offload path check", offload_path_error)
        broadcast_initial_state(module, mesh)
        if runner is not None:
            runner.connect()
        config = getattr(module, "config", None)  # what a batch is checked against (`minipar.checks`)
        self._vocab_size = getattr(config, "vocab_size", None)
        sp = mesh.tp if sequence_parallel else 1  # each tp rank holds a slice of (its cp rank's) sequence
        cp = self.context.seq_multiple if self.context is not None else 1
        self._seq_shards = math.lcm(cp, mesh.cp * sp)
        self._seq_shards_why = " and ".join(
            ([f"{cp} chunks for context_parallel={self.context.form!r} at cp={mesh.cp}"] if cp > 1 else [])
            + ([f"tp={mesh.tp} shards for sequence parallelism"] if sp > 1 else []))
        self._block_size = next((getattr(config, k) for k in ("block_size", "max_position_embeddings", "n_positions")
                                 if isinstance(getattr(config, k, None), int)), None)
        self.mesh = mesh
        self.strategy_name = dp_config.strategy
        self.pipeline = runner
        if mesh.pp > 1:  # keep only this stage's pieces of the model
            whole, module = module, Stage(module, mesh.pp_rank, mesh.pp, boundaries, spec,
                                          chunks=pp_config.chunks, placement=pp_config.placement)
            if plan is not None:  # the plan's modules that this stage holds, under the stage's names
                plan = stage_plan(plan, whole, module)
        self.module = module.to(mesh.device)
        if plan is not None:  # tensor parallelism first: the data-parallel strategy then sees this rank's shards
            parallelize(self.module, mesh, plan, sequence_parallel=sequence_parallel,
                        dropout_seed=tp_config.dropout_seed)
        self._moe_sequence_parallel = bool(experts) and sequence_parallel and mesh.tp > 1
        if experts:  # this rank keeps its E / ep experts; tokens reach the others by all-to-all
            shard_experts(self.module, mesh)
            if self._moe_sequence_parallel:  # each tp rank routes its own slice of the sequence
                for layer in moe_layers(self.module):
                    layer.sequence_shards = mesh.tp
                    for p in layer.parameters():
                        mark_sequence_parallel(p, mesh)
        self.checkpointed = checkpoint_modules(self.module, activation_checkpointing, mesh.device) \
            if activation_checkpointing is not False else []
        policy = dp_config.mixed_precision or FP32
        self._cast_inputs_to = policy.param_dtype if policy.param_dtype != torch.float32 else None
        self.strategy = build_strategy(dp_config, self.module, mesh, reshard_after_forward)
        self._join: Join | None = None
        if runner is not None:  # every micro-batch accumulates locally; the step syncs once (pipeline.step)
            self.strategy.local_accumulation = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is not None:  # this rank holds one stage: a direct call would be its forward alone
            raise ValueError("under pipeline parallelism a rank holds one stage, so calling the model runs that stage "
                             "alone; train with train_step, and evaluate a pp=1 copy of the model loaded from "
                             "full_state_dict()")
        if self._cast_inputs_to is not None:  # floating inputs meet parameters of the compute dtype
            dtype = self._cast_inputs_to
            args, kwargs = tree_map(lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t,
                                    (args, kwargs))
        return self.module(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Gradient accumulation: backward inside the block does not communicate."""
        return self.strategy.no_sync()

    def train_step(self, inputs: Any, targets: Any,
                   loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> torch.Tensor:
        """Forward, loss, backward with gradient sync. Returns the global-batch loss, equal on every rank.

        ``loss_fn(output, targets)`` gives the loss of the model's output (its ``.logits`` for a
        Hugging Face output). Without it the model computes its own loss, ``model(inputs,
        targets=targets)``: minipar's GPT then runs its LM head and the cross-entropy in row chunks
        (`minipar.kernels.linear_cross_entropy`), never holding the logits. That needs the whole
        model in each forward: with pipeline, tensor or context parallelism pass a ``loss_fn``.

        The batch is checked first, on every rank (`minipar.checks.check_batch`: ids and targets in
        the vocabulary, ``-100`` ignored; the sequence within the block size; the same shape on tp
        and pp peers), where it is given: a batch on the host is checked there and then copied to
        ``mesh.device`` (the step then never waits for the device, `minipar.core.syncs`). The global loss is the mean of the data-parallel ranks' losses: the
        loss of the global batch when every rank holds the same number of samples.
        The optimizer step is left to the caller. Under pipeline parallelism the
        batch is cut into micro-batches and run by the schedule (`minipar.pipeline.step`).
        """
        return self._train_step(inputs, targets, loss_fn)

    def _train_step(self, inputs: Any, targets: Any, loss_fn: Callable | None, active: int = 1) -> torch.Tensor | None:
        if loss_fn is None and active == 1 and (self.pipeline is not None or self.context is not None or self.mesh.tp > 1):
            raise ValueError("train_step without a loss_fn has the model compute its own loss from the whole "
                             "model's forward, which pipeline, tensor and context parallelism split: pass a "
                             "loss_fn (e.g. model.cross_entropy)")
        flags = check_batch(self.mesh, inputs, targets, self._vocab_size, self._block_size, active=active,
                            microbatches=self.pipeline.microbatches if self.pipeline is not None else 1,
                            seq_shards=self._seq_shards, seq_shards_why=self._seq_shards_why,
                            ids_only_why=f"pipeline parallelism (pp={self.mesh.pp})" if self.pipeline is not None else "")
        inputs, targets = to_device((inputs, targets), self.mesh.device)  # a host batch: checked there, for free
        if self.context is not None:  # each cp rank keeps its tokens; the loss is weighted to stay the mean
            inputs, targets, loss_fn = self.context.split(inputs, targets, loss_fn)
        factor = 1.0
        if self._join is not None:  # uneven data (`minipar.data_parallel.join`): None once no rank trains any more
            if not any(f == 1 for f in flags):
                return None
            self._join.record("train_step", inputs, targets, loss_fn)
            factor = Join.loss_factor(flags, self.mesh.group("dp").ranks, active)
        if self.pipeline is not None:
            return self.pipeline.step(self.module, self.strategy, inputs, targets,
                                      scaled(loss_fn, factor) if factor != 1.0 else loss_fn)
        if loss_fn is None:
            loss = own_loss(self(inputs, targets=targets))
        else:
            loss = loss_fn(logits_of(self(inputs)), targets)
        if factor != 1.0:
            loss = loss * factor
        scaler = self.strategy.scaler
        (loss * scaler.scale if scaler.enabled else loss).backward()
        global_loss = loss.detach().float().reshape(1).clone()
        group = self.mesh.group(self.mesh.grad_axis)  # cp ranks' losses are weighted to average right
        self.mesh.comm.all_reduce(global_loss, group, tag="loss")
        return global_loss.div_(group.size)[0]

    @property
    def timeline(self) -> list:
        """(action, start, end) of this stage's last pipeline step, when ``record_timeline``."""
        return self.pipeline.timeline if self.pipeline is not None else []

    @property
    def peak_live_activations(self) -> int:
        """The most micro-batches whose activations this stage held at once in the last step (with
        several chunks per rank: (micro-batch, chunk) pairs; under a split backward, held until W)."""
        return self.pipeline.peak_live_activations if self.pipeline is not None else 0

    @contextlib.contextmanager
    def join(self, optimizer) -> Iterator[None]:
        """Train on uneven data: a rank that leaves the block while others still train shadows their
        steps until all are done (`minipar.data_parallel.join`). ``optimizer``: the one ``build_optimizer`` gave."""
        if self._join is not None:
            raise ValueError("join() blocks do not nest")
        self._join = Join(self, optimizer)
        try:
            yield
            self._join.shadow()
        finally:
            self._join.close()  # also when the block raised: the optimizer keeps no hook of ours
            self._join = None

    def build_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], *args: Any, **kwargs: Any):
        """The optimizer to step: ``optimizer_cls`` over the parameters this rank updates.

        Under DDP a plain ``optimizer_cls`` over the module's parameters; under
        ZeRO a `ShardedOptimizer` over this rank's fp32 master shards.
        """
        return self.strategy.build_optimizer(optimizer_cls, *args, **kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by the norm of the whole model's gradient (`minipar.core.grad_norm`: every shard,
        padding excluded, tensor-parallel and expert pieces summed, stages summed, the tied weight
        once); returns that norm, equal on every rank (except after `minipar.OneBitAdam`'s warm-up,
        where gradients are no longer reduced and each rank clips its own by its local norm)."""
        if self._join is not None:
            self._join.record("clip", max_norm, norm_type)
        self.strategy.unscale_()  # reduced and, in fp16, the loss scale divided out
        last_tied_copy = self.module.tied_weight() if self.pipeline is not None and self.module.last \
            and not self.module.first else None
        return clip_(self.strategy.grad_pieces(), self.mesh, max_norm, norm_type, skip=last_tied_copy)

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                      label_smoothing: float = 0.0) -> torch.Tensor:
        """Mean token cross-entropy for this layout: vocab-parallel when tp > 1 (the logits stay split).

        logits: (..., vocab) or (..., vocab / tp); targets: (...).
        """
        if self.mesh.tp > 1:
            return vocab_parallel_cross_entropy(logits, targets, self.mesh.comm, self.mesh.group("tp"),
                                                ignore_index=ignore_index, label_smoothing=label_smoothing)
        return kernels.cross_entropy(logits, targets, ignore_index=ignore_index, label_smoothing=label_smoothing)

    @torch.no_grad()
    def moe_stats(self) -> dict[str, float]:
        """The mixture-of-experts figures of the last forward for the whole job, equal on every rank:
        auxiliary and z losses averaged over every MoE layer of every stage and data-parallel rank,
        dropped assignments summed over them. {} for a model without MoE layers."""
        layers = [m for m in moe_layers(self.module) if m.last_aux is not None]
        if not moe_layers(self.module) and self.mesh.pp == 1:
            return {}
        part = torch.tensor([sum(float(m.last_aux) for m in layers), sum(float(m.last_z) for m in layers),
                             float(len(layers)), float(sum(m.last_dropped for m in layers))],
                            dtype=torch.float64, device=self.mesh.device)
        # stages hold different layers; dp ranks route different tokens; tp ranks route the same ones,
        # or under sequence parallelism different slices of them
        self.mesh.comm.all_reduce(part, self.mesh.group("pp"), tag="moe_stats")
        self.mesh.comm.all_reduce(part, self.mesh.group("dp"), tag="moe_stats")
        if self._moe_sequence_parallel:  # the same on every stage, whether it holds MoE layers or not
            self.mesh.comm.all_reduce(part, self.mesh.group("tp"), tag="moe_stats")
        aux, z, n, dropped = part.tolist()
        return {"aux": aux / n, "z": z / n, "dropped": int(dropped)} if n else {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, and what the strategy keeps outside ``p.grad`` (ZeRO's gradient
        shards and ZeRO-1's buckets)."""
        super().zero_grad(set_to_none)
        self.strategy.zero_grad()

    def memory_stats(self) -> dict[str, int]:
        """{"params", "grads", "optimizer"}: bytes of persistent state this rank holds (no transient buffers)."""
        return self.strategy.memory_stats()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The wrapped module's state dict with full tensors (fp32 masters under ZeRO, tensor- and
        expert-parallel pieces gathered, every pipeline stage's), on every rank, under the
        single-process model's names (`minipar.full_state`)."""
        full = self.strategy.full_params()
        return full_tensors(self, lambda t: full.get(id(t), t))


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
