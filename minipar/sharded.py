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
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from . import kernels
from .checks import agree_on_model, broadcast_initial_state, check_batch
from .context_parallel.context import ContextParallel, check_form
from .fp8 import apply_fp8, check_fp8
from .full_state import full_tensors
from .loss_check import check_loss, vocab_parallel, vocab_split_head
from .data_parallel.join import Join
from .core.mesh import Mesh
from .moe.expert_parallel import apply_experts, check_experts
from .moe.balance import update_expert_bias
from .moe.layer import moe_layers
from .data_parallel.offload import agree as agree_offload, check_path
from .recompute import checkpoint_modules, select_checkpointed
from .pipeline.cut import PipelineCut
from .pipeline.step import PipelineConfig
from .data_parallel.layout_check import check_data_parallel
from .data_parallel.precision import FP32
from .config import build_strategy, resolve_configs
from .data_parallel.strategy import DataParallelConfig, strategy_entry
from .core.syncs import to_device
from .step import OneStage
from .tensor_parallel.model_plan import plan_for
from .tensor_parallel import TensorParallelConfig, check_plan, parallelize, vocab_parallel_cross_entropy

class ShardedModule(nn.Module):
    """Wrap ``module`` for training over ``mesh``: tensor parallelism on the tp axis (when tp > 1),
    pipeline stages (pp > 1), experts over ep, then a data-parallel strategy on dp.

    Args:
        module: the model, as built for one process; moved to ``mesh.device``.
        mesh: the process mesh; default: ``Mesh()`` over the initialised world (all ranks data-parallel).
        strategy: "ddp", "zero1", "zero2", "zero3" (= "fsdp"), or a `DataParallelConfig` with the
            strategy's options (bucket size, mixed precision, offload, zero3 wrap policy and resharding).
        tensor_parallel: a `TensorParallelConfig` (plan, sequence parallelism), used when tp > 1.
        pipeline: a `PipelineConfig` (schedule: gpipe, 1f1b, interleaved_1f1b, zb_h1, zb_v, dualpipe_v;
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
        if not any(True for _ in module.parameters()):
            raise ValueError(f"{type(module).__name__} has no parameters: there is nothing to train or "
                             "synchronise; wrap the module that owns the parameters")
        mesh = mesh if mesh is not None else Mesh()
        sp = tp_config.sequence_parallel
        reshard = dp_config.reshard_after_forward
        if reshard is None:  # a pipeline runs each unit m times per step: keep it gathered
            reshard = mesh.pp == 1

        # Each family checks its part on every rank before any collective (ValueError saying the fix).
        cut = PipelineCut(module, mesh, pp_config, sequence_parallel=sp, frees_gathered=dp_config.zero3 and reshard) \
            if mesh.pp > 1 else None
        recomputed = select_checkpointed(module, activation_checkpointing) if activation_checkpointing is not False else []
        check_data_parallel(module, mesh, dp_config, recomputed)
        policy = dp_config.mixed_precision or FP32
        if policy.fp8 is not None:  # whole weights here; apply_fp8 checks their tp shards below
            check_fp8(module, policy.fp8, zero3="params" in strategy_entry(dp_config.strategy).shards)
        experts = check_experts(module, mesh)
        plan = plan_for(module, mesh.tp, tp_config) if mesh.tp > 1 else None
        if plan is not None:
            check_plan(module, plan, mesh.tp)  # patterns, styles, sizes, ties
        self._split_head = vocab_split_head(module, plan)  # an LM head whose logits stay split over tp
        self.context = ContextParallel(module, mesh, context_parallel) if mesh.cp > 1 else None
        offload_path_error = check_path(dp_config.offload)  # missing or unwritable: agreed just below

        # The first collectives: a model, layout or plan that differs between ranks fails here, on
        # every rank, instead of hanging in the first forward; then every rank starts from rank 0's weights.
        agree_on_model(mesh, module, {"strategy": dp_config, "reshard": reshard, "tensor_parallel": tp_config,
                                      "pipeline": pp_config, "activation_checkpointing": activation_checkpointing,
                                      "context_parallel": context_parallel})
        if dp_config.offload is not None and dp_config.offload.nvme:  # (the same on every rank: agreed above)
            agree_offload(mesh, "the offload path check", offload_path_error)
        broadcast_initial_state(module, mesh)
        self.batch_rules = BatchRules.of(module, mesh, self.context, sp, cut.runner.microbatches if cut else 1)

        # Then each family applies its part, in order: the pipeline keeps this rank's stage, tensor
        # parallelism shards it, experts spread over ep, recomputation wraps blocks, and the
        # data-parallel strategy takes whatever parameters this rank now holds.
        if cut is not None:
            cut.runner.connect()
            module, plan = cut.stage(module, plan)
        self.module = module.to(mesh.device)
        if plan is not None:
            parallelize(self.module, mesh, plan, sequence_parallel=sp, dropout_seed=tp_config.dropout_seed,
                        async_comm=tp_config.async_comm)
        if cut is not None:  # the last stage's tied LM head says whose copy it is (norms, checkpoints)
            cut.mark_replicas(self.module)
        self._moe_sequence_parallel = apply_experts(self.module, mesh, sp) if experts else False
        if policy.fp8 is not None:  # after tensor parallelism (its plan takes plain Linears), before the strategy
            apply_fp8(self.module, policy.fp8)
        self.checkpointed = checkpoint_modules(self.module, activation_checkpointing, mesh.device) \
            if activation_checkpointing is not False else []
        self.strategy = build_strategy(dp_config, self.module, mesh, reshard)
        self.mesh, self.pipeline, self.strategy_name = mesh, cut.runner if cut is not None else None, dp_config.strategy
        self.runner = self.pipeline or OneStage(mesh)  # the step, at pp = 1 or under the schedule (`minipar.step`)
        # floating inputs meet parameters of the compute dtype
        self._cast_inputs_to = policy.param_dtype if policy.param_dtype != torch.float32 else None
        self._join: Join | None = None

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
        check_loss(loss_fn, self._split_head, self.mesh.tp)  # a plain cross-entropy on split logits
        if loss_fn is None and active == 1 and (self.pipeline is not None or self.context is not None or self.mesh.tp > 1):
            raise ValueError("train_step without a loss_fn has the model compute its own loss from the whole "
                             "model's forward, which pipeline, tensor and context parallelism split: pass a "
                             "loss_fn (e.g. model.cross_entropy)")
        flags = check_batch(self.mesh, inputs, targets, active=active, **self.batch_rules.check_batch_args())
        inputs, targets = to_device((inputs, targets), self.mesh.device)  # a host batch: checked there, for free
        if self.context is not None:  # each cp rank keeps its tokens; the loss is weighted to stay the mean
            inputs, targets, loss_fn = self.context.split(inputs, targets, loss_fn)
        factor = 1.0
        if self._join is not None:  # uneven data (`minipar.data_parallel.join`): None once no rank trains any more
            if not any(f == 1 for f in flags):
                return None
            self._join.record("train_step", inputs, targets, loss_fn)
            factor = Join.loss_factor(flags, self.mesh.group("dp").ranks, active)
        return self.runner.step(self, inputs, targets, loss_fn, factor)

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
        """The optimizer to step: ``optimizer_cls`` over the parameters this rank updates, always a
        ``torch.optim.Optimizer`` (every ``torch.optim.lr_scheduler`` works on it).

        ``args``: the parameters or parameter groups as torch takes them (default: every parameter,
        one group); ``kwargs``: the optimizer's defaults. Under DDP a plain ``optimizer_cls`` over
        the module's parameters; under ZeRO a `ShardedOptimizer` over this rank's pieces of its fp32
        master shards, with groups mirroring the ones given (docs/optimizer.md). A plain torch
        optimizer over a ZeRO model's parameters is refused at its first step.
        """
        return self.strategy.build_optimizer(optimizer_cls, *args, **kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by the norm of the whole model's gradient (`minipar.core.grad_norm`: every shard,
        padding excluded, tensor-parallel and expert pieces summed, stages summed, the tied weight
        once); returns that norm, equal on every rank (except after `minipar.OneBitAdam`'s warm-up,
        where gradients are no longer reduced and each rank clips its own by its local norm)."""
        if self._join is not None:
            self._join.record("clip", max_norm, norm_type)
        return self.strategy.clip_grad_norm_(max_norm, norm_type)

    @vocab_parallel
    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                      label_smoothing: float = 0.0) -> torch.Tensor:
        """Mean token cross-entropy for this layout: vocab-parallel when tp > 1 (the logits stay split).

        logits: (..., vocab) or (..., vocab / tp); targets: (...).
        """
        whole = self.batch_rules.vocab_size is not None and logits.shape[-1] == self.batch_rules.vocab_size
        if self.mesh.tp > 1 and not whole:  # a split head's logits: (..., vocab / tp)
            return vocab_parallel_cross_entropy(logits, targets, self.mesh.comm, self.mesh.group("tp"),
                                                ignore_index=ignore_index, label_smoothing=label_smoothing)
        # whole logits: one process's, or a gathered head's (a Hugging Face model's own plan gathers lm_head)
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

    def update_expert_bias(self) -> None:
        """After ``opt.step()``, on every rank: MoE layers balanced by bias (``balance="bias"``) move
        their expert bias by the load counted over the data-parallel x expert-parallel group since
        the last call (`minipar.moe.balance`); a collective over that group, nothing for other layers."""
        update_expert_bias(self.module)

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


@dataclass(frozen=True)
class BatchRules:
    """What `minipar.checks.check_batch` checks a batch against under this layout: the vocabulary and
    block size of the model's config, how many pieces the sequence is cut into (context parallelism's
    chunks, sequence parallelism's tp slices) and by whom, the pipeline's micro-batches, and whether the
    inputs must be token ids alone (a pipeline's stages pass nothing else between them)."""
    vocab_size: int | None
    block_size: int | None
    seq_shards: int
    seq_shards_why: str
    microbatches: int
    ids_only_why: str

    @classmethod
    def of(cls, module: nn.Module, mesh: Mesh, context: ContextParallel | None, sequence_parallel: bool,
           microbatches: int) -> "BatchRules":
        config = getattr(module, "config", None)
        block_size = next((getattr(config, k) for k in ("block_size", "max_position_embeddings", "n_positions")
                           if isinstance(getattr(config, k, None), int)), None)
        sp = mesh.tp if sequence_parallel else 1  # each tp rank holds a slice of (its cp rank's) sequence
        cp = context.seq_multiple if context is not None else 1
        why = " and ".join(([f"{cp} chunks for context_parallel={context.form!r} at cp={mesh.cp}"] if cp > 1 else [])
                           + ([f"tp={mesh.tp} shards for sequence parallelism"] if sp > 1 else []))
        return cls(getattr(config, "vocab_size", None), block_size, math.lcm(cp, mesh.cp * sp), why, microbatches,
                   f"pipeline parallelism (pp={mesh.pp})" if mesh.pp > 1 else "")

    def check_batch_args(self) -> dict:
        return {"vocab_size": self.vocab_size, "block_size": self.block_size, "microbatches": self.microbatches,
                "seq_shards": self.seq_shards, "seq_shards_why": self.seq_shards_why, "ids_only_why": self.ids_only_why}
