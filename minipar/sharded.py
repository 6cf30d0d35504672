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
import fnmatch
import math
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from . import kernels
from .ddp import DataParallel
from .mesh import Mesh
from .moe import check_moe_config, moe_layers, shard_experts
from .fsdp import select_units
from .recompute import check_units, checkpoint_modules, select_checkpointed
from .pipeline import SCHEDULES, GPTStage, default_boundaries, resolve_boundaries, run_schedule, sync_tied_grads
from .precision import FP32, MixedPrecision
from .sharded_optim import ShardedOptimizer, ShardedState, optimizer_state_tensors, storage_bytes
from .tensor_parallel import clip_grad_norm_ as tp_clip_grad_norm_, parallelize, vocab_parallel_cross_entropy
from .zero import Zero1, Zero2

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")  # "fsdp" is another name for "zero3"


class ShardedModule(nn.Module):
    """Wrap ``module`` for training over ``mesh``: tensor parallelism on the tp axis (when tp > 1),
    then ``strategy`` on the data-parallel axis.

    Args:
        module: the model, as built for one process; moved to ``mesh.device``.
        mesh: the process mesh; default: ``Mesh()`` over the initialised world (all ranks data-parallel).
        strategy: one of ``STRATEGIES``: "ddp", "zero1", "zero2", "zero3" (= "fsdp").
        bucket_cap_mb: gradient bucket size for DDP, ZeRO-1 and ZeRO-2, in MiB (> 0).
        mixed_precision: a `MixedPrecision` policy (ZeRO stages); default fp32.
        cpu_offload: keep fp32 masters and optimizer state on the CPU and step there (ZeRO stages).
        wrap_policy: how zero3 cuts the model into units (see `minipar.fsdp.select_units`).
        reshard_after_forward: zero3 frees a unit's full parameters after its forward.
        tp_plan: the tensor-parallel plan; default ``module.tp_plan(tp, sequence_parallel)``.
        sequence_parallel: split activations along the sequence between tensor-parallel layers.
        schedule: the pipeline schedule when pp > 1: "1f1b" or "gpipe" (``minipar.pipeline.SCHEDULES``).
        microbatches: micro-batches per step when pp > 1; the batch must divide by it.
        pipeline_boundaries: where to cut the GPT into pp stages: pp block counts or pp + 1 cut points;
            default: balanced by parameter count (`minipar.pipeline.default_boundaries`).
        record_timeline: keep each stage's (action, start, end) of the last pipeline step in
            ``self.timeline`` (on a GPU this times with CUDA events and costs one host sync per step).
        activation_checkpointing: recompute chosen blocks in backward instead of keeping their
            activations: True (each nn.ModuleList entry: the transformer blocks), a tuple of module
            classes, or a callable(module) -> bool; dropout masks are replayed (`minipar.recompute`).

    Raises ValueError, on every rank and before any collective, for an unknown
    strategy, a non-positive bucket size or a module without parameters; and,
    after one small collective, when ranks were given different configurations.
    """

    def __init__(self, module: nn.Module, *, mesh: Mesh | None = None, strategy: str = "ddp",
                 bucket_cap_mb: float = 25.0, mixed_precision: MixedPrecision | None = None,
                 cpu_offload: bool = False, wrap_policy=None, reshard_after_forward: bool = True,
                 tp_plan: dict | None = None, sequence_parallel: bool = False,
                 schedule: str = "1f1b", microbatches: int = 1, pipeline_boundaries: Sequence[int] | None = None,
                 record_timeline: bool = False, activation_checkpointing: Any = False) -> None:
        super().__init__()
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be a number > 0 (MiB per gradient bucket; "
                             "PyTorch DDP uses 25)")
        if not any(True for _ in module.parameters()):
            raise ValueError(f"{type(module).__name__} has no parameters: there is nothing to train or "
                             "synchronise; wrap the module that owns the parameters")
        if strategy == "ddp" and (mixed_precision is not None or cpu_offload or wrap_policy is not None):
            raise ValueError("mixed_precision, cpu_offload and wrap_policy apply to the sharded strategies; "
                             "use strategy='zero1', 'zero2' or 'zero3' for them")
        if strategy in ("zero1", "zero2") and wrap_policy is not None:
            raise ValueError("wrap_policy chooses zero3 units; zero1/zero2 do not use it")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise ValueError("mixed_precision must be a minipar.MixedPrecision(param_dtype=..., reduce_dtype=...)")
        if mesh is None:
            mesh = Mesh()
        if mesh.pp > 1:
            if schedule not in SCHEDULES:
                raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
            if not isinstance(microbatches, int) or microbatches < 1:
                raise ValueError(f"microbatches={microbatches!r} must be a positive integer")
            if strategy not in ("ddp", "zero1", "zero2") or sequence_parallel or cpu_offload:
                raise ValueError("pipeline parallelism composes with strategy='ddp', 'zero1' or 'zero2' on the "
                                 "data-parallel axis and tp without sequence parallelism or CPU offload, for now")
            if not hasattr(module, "config") or not hasattr(module, "layers"):
                raise ValueError(f"pipeline stages are cut from a minipar.models.GPT; got {type(module).__name__}")
            boundaries = default_boundaries(module, mesh.pp) if pipeline_boundaries is None else \
                resolve_boundaries(pipeline_boundaries, module.config.n_layer, mesh.pp)  # bad cuts -> ValueError
        experts = moe_layers(module)
        if experts and strategy != "ddp":
            raise ValueError("mixture-of-experts layers train with strategy='ddp' (expert gradients reduced over "
                             "the edp group); the ZeRO stages do not shard expert parameters yet")
        if experts and sequence_parallel:
            raise ValueError("sequence parallelism with mixture-of-experts layers is not supported; "
                             "set sequence_parallel=False")
        if mesh.ep > 1 and not experts:
            raise ValueError(f"the mesh has ep={mesh.ep} but {type(module).__name__} has no MoE layers: "
                             "expert parallelism has nothing to split; build the mesh with ep=1")
        for layer in experts:  # experts not divisible by ep, on every rank before any collective
            check_moe_config(layer.n_experts, layer.top_k, layer.capacity_factor, mesh.ep)
        if strategy in ("zero3", "fsdp"):  # a wrap policy that matches nothing raises here
            units = [n for n, _ in select_units(module, wrap_policy)]
        if activation_checkpointing is not False:  # a policy that matches nothing, or cuts a zero3 unit
            chosen = select_checkpointed(module, activation_checkpointing)
            if strategy in ("zero3", "fsdp"):
                check_units(chosen, units)
        if mesh.tp > 1 and tp_plan is None and not hasattr(module, "tp_plan"):
            raise ValueError(f"the mesh has tp={mesh.tp} but {type(module).__name__} has no tp_plan(); pass "
                             "tp_plan={'module.pattern': 'colwise' | 'rowwise' | 'vocab', ...}")
        # One small collective that every rank reaches: a layout or plan that differs between ranks
        # fails here, on every rank, instead of hanging in the first forward.
        mesh.comm.check_same("the ShardedModule configuration", {
            "strategy": strategy, "bucket_cap_mb": bucket_cap_mb, "mixed_precision": repr(mixed_precision),
            "cpu_offload": cpu_offload, "wrap_policy": repr(wrap_policy), "reshard": reshard_after_forward,
            "tp_plan": repr(tp_plan), "sequence_parallel": sequence_parallel, "schedule": schedule,
            "microbatches": microbatches, "pipeline_boundaries": repr(pipeline_boundaries),
            "activation_checkpointing": activation_checkpointing if isinstance(activation_checkpointing, (bool, tuple))
            else getattr(activation_checkpointing, "__qualname__", repr(activation_checkpointing))}, mesh.world)
        self.mesh = mesh
        self.strategy_name = strategy
        self.schedule, self.microbatches = schedule, microbatches
        self.record_timeline = record_timeline
        self.timeline: list = []  # (action, start, end) of this stage's last step, when recorded
        plan = None
        if mesh.tp > 1:
            plan = tp_plan if tp_plan is not None else module.tp_plan(mesh.tp, sequence_parallel=sequence_parallel)
        if mesh.pp > 1:  # keep only this stage's pieces of the model
            v, c = module.wte.weight.shape
            self._tied_shape = (v // mesh.tp, c)  # this rank's piece of a tied embedding/head
            self._hidden = module.config.n_embd
            module = GPTStage(module, mesh.pp_rank, mesh.pp, boundaries)
            if plan is not None:  # a stage has only some of the modules the plan names
                names = [n for n, _ in module.named_modules() if n]
                plan = {k: v for k, v in plan.items() if any(fnmatch.fnmatchcase(n, k) for n in names)}
        self.module = module.to(mesh.device)
        if plan is not None:  # tensor parallelism first: the data-parallel strategy then sees this rank's shards
            parallelize(self.module, mesh, plan, sequence_parallel=sequence_parallel)
        if experts:  # this rank keeps its E / ep experts; tokens reach the others by all-to-all
            shard_experts(self.module, mesh)
        self.checkpointed = checkpoint_modules(self.module, activation_checkpointing, mesh.device) \
            if activation_checkpointing is not False else []
        policy = mixed_precision or FP32
        self._cast_inputs_to = policy.param_dtype if policy.param_dtype != torch.float32 else None
        self._ddp_optimizer: torch.optim.Optimizer | None = None
        if strategy == "ddp":
            self.strategy = DataParallel(self.module, mesh, bucket_cap_mb=bucket_cap_mb)
        elif strategy == "zero1":
            self.strategy = Zero1(self.module, mesh, policy, cpu_offload, bucket_cap_mb)
        elif strategy == "zero2":
            self.strategy = Zero2(self.module, mesh, policy, cpu_offload, bucket_cap_mb, local_accumulation=mesh.pp > 1)
        else:
            from .fsdp import Zero3
            self.strategy = Zero3(self.module, mesh, policy, cpu_offload, wrap_policy, reshard_after_forward)
        if mesh.pp > 1 and isinstance(self.strategy, ShardedState):  # one norm over all stages, tied copy once
            self.strategy.pp = mesh.group("pp")
            self.strategy.norm_skip = self.module.tied_weight() if self.module.tied and self.module.last else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._cast_inputs_to is not None:  # floating inputs meet parameters of the compute dtype
            dtype = self._cast_inputs_to
            args, kwargs = tree_map(lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t,
                                    (args, kwargs))
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
        if self.mesh.pp > 1:
            return self._pipeline_step(inputs, targets, loss_fn)
        loss = loss_fn(self(inputs), targets)
        scaler = getattr(self.strategy, "scaler", None)
        (loss * scaler.scale if scaler is not None and scaler.enabled else loss).backward()
        global_loss = loss.detach().float().reshape(1).clone()
        group = self.mesh.group("dp")
        self.mesh.comm.all_reduce(global_loss, group, tag="loss")
        return global_loss.div_(group.size)[0]

    def _pipeline_step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        mesh, m = self.mesh, self.microbatches
        if inputs.shape[0] % m:
            raise ValueError(f"a batch of {inputs.shape[0]} does not split into microbatches={m}; "
                             "use a batch size divisible by the micro-batch count")
        stage = self.module
        for layer in moe_layers(stage):  # the loss is a mean over m micro-batches; so is the auxiliary loss
            layer.aux_scale = 1.0 / m
        act_shape = (inputs.shape[0] // m, inputs.shape[1], self._hidden)
        actions = SCHEDULES[self.schedule](mesh.pp, m)[mesh.pp_rank]
        self.timeline = [] if self.record_timeline else self.timeline
        scaler = getattr(self.strategy, "scaler", None)
        scale = scaler.scale if scaler is not None and scaler.enabled else None
        stage_loss = loss_fn if scale is None else (lambda out, y: loss_fn(out, y) * scale)  # fp16: scaled backward
        # A tied gradient left from an earlier step without zero_grad was summed over the stages then
        # (and may have been clipped or unscaled since): remember it as it is now, to sum only what is new.
        w, zero = stage.tied_weight(), isinstance(self.strategy, (Zero1, Zero2))
        tied_before = None
        if w is not None and zero and self.strategy.tied_summed:
            self.strategy.reduce_grads()
            tied_before = self.strategy.grad_piece(w).clone()
        elif w is not None and not zero and w.grad is not None:
            tied_before = w.grad.clone()
        loss, self.peak_live_activations = run_schedule(stage, actions, mesh, list(inputs.chunk(m)) if stage.first else None,
                            list(targets.chunk(m)) if stage.last else None, stage_loss, act_shape,
                            next(stage.parameters()).dtype, no_sync=self.strategy.no_sync,
                            timeline=self.timeline if self.record_timeline else None)
        if zero:  # their gradients are already in the dp shards
            self._sync_tied_grad_shards(tied_before)
        else:  # DDP: the averaged p.grad
            sync_tied_grads(stage, mesh, self._tied_shape, already_summed=tied_before)
        # Every rank reports the global loss: the last stage's, then the mean over data-parallel ranks.
        loss = loss.float().reshape(1) if scale is None else loss.float().reshape(1) / scale
        mesh.comm.all_reduce(loss, mesh.group("pp"), tag="loss")
        mesh.comm.all_reduce(loss, mesh.group("dp"), tag="loss")
        return loss.div_(mesh.dp)[0]

    @torch.no_grad()
    def _sync_tied_grad_shards(self, before: torch.Tensor | None) -> None:
        """ZeRO-1/2 reduced the gradients into shards during the last backward, cut differently on the
        first and last stage: assemble the tied weight's reduced gradient over dp, sum it over pp
        (middle stages add zeros), and write each rank's piece back into its shard.

        ``before``: this rank's piece as the step found it, when an earlier step without zero_grad
        since had summed it already (identical on both stages): only what came since is summed (else
        the earlier steps would count twice)."""
        stage, st = self.module, self.strategy
        if not stage.tied:
            return
        w = stage.tied_weight()
        if w is None:
            full = torch.zeros(self._tied_shape, dtype=st.policy.grad_dtype, device=self.mesh.device)
            self.mesh.comm.all_reduce(full, self.mesh.group("pp"), tag="tied_grad")
            return
        st.reduce_grads()
        piece = st.grad_piece(w)
        if before is not None:
            piece.sub_(before)
        full = st.full_grad_of(w)
        self.mesh.comm.all_reduce(full, self.mesh.group("pp"), tag="tied_grad")
        st.set_grad_of(w, full)
        if before is not None:
            piece.add_(before)
        st.tied_summed = True

    def build_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any):
        """The optimizer to step: ``optimizer_cls`` over the parameters this rank updates.

        Under DDP a plain ``optimizer_cls`` over the module's parameters; under
        ZeRO a `ShardedOptimizer` over this rank's fp32 master shards.
        """
        if isinstance(self.strategy, ShardedState):
            return ShardedOptimizer(self.strategy, optimizer_cls, **kwargs)
        self._ddp_optimizer = optimizer_cls(self.module.parameters(), **kwargs)  # memory_stats counts its state
        return self._ddp_optimizer

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their global norm (over every shard, padding excluded); returns the norm."""
        if isinstance(self.strategy, ShardedState):
            return self.strategy.clip_grad_norm_(max_norm, norm_type)
        if self.mesh.pp > 1 or self.mesh.ep > 1:
            return self._split_clip(max_norm, norm_type)
        if self.mesh.tp > 1:  # shards summed over tp, replicated parameters counted once
            return tp_clip_grad_norm_(self.module, self.mesh, max_norm, norm_type)
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm, norm_type)

    @torch.no_grad()
    def _split_clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """One norm over the whole model when its parameters are split: tensor-parallel shards
        summed over tp, experts over ep, stages over pp, replicated parameters once; the tied
        weight, whose gradient the first and last pipeline stage share, counted once."""
        inf = math.isinf(float(norm_type))
        skip = self.module.tied_weight() if self.mesh.pp > 1 and self.module.last else None
        parts = torch.zeros(3, device=self.mesh.device)  # [split over tp, split over ep, replicated]
        for p in self.module.parameters():
            if p.grad is None or p is skip:
                continue
            g = p.grad.float().abs()
            i = 0 if getattr(p, "tensor_parallel", False) else 1 if getattr(p, "expert_parallel", False) else 2
            parts[i] = torch.maximum(parts[i], g.max()) if inf else parts[i] + g.pow(norm_type).sum()
        op = "max" if inf else "sum"
        split = parts[:2].clone()
        self.mesh.comm.all_reduce(split[:1], self.mesh.group("tp"), op=op, tag="grad_norm")
        self.mesh.comm.all_reduce(split[1:], self.mesh.group("ep"), op=op, tag="grad_norm")
        local = split.max().reshape(1).maximum(parts[2:]) if inf else split.sum().reshape(1) + parts[2:]
        self.mesh.comm.all_reduce(local, self.mesh.group("pp"), op=op, tag="grad_norm")
        total = local[0] if inf else local[0].pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
        return total

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
        # stages hold different layers; dp ranks route different tokens; tp ranks route the same ones
        self.mesh.comm.all_reduce(part, self.mesh.group("pp"), tag="moe_stats")
        self.mesh.comm.all_reduce(part, self.mesh.group("dp"), tag="moe_stats")
        aux, z, n, dropped = part.tolist()
        return {"aux": aux / n, "z": z / n, "dropped": int(dropped)} if n else {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, and under ZeRO also what the optimizer's ``zero_grad`` clears: the
        gradient shards and ZeRO-1's buckets, which hold the gradients outside ``p.grad``."""
        super().zero_grad(set_to_none)
        if isinstance(self.strategy, ShardedState):
            self.strategy.zero_grad()

    def memory_stats(self) -> dict[str, int]:
        """{"params", "grads", "optimizer"}: bytes of persistent state this rank holds (no transient buffers)."""
        if isinstance(self.strategy, ShardedState):
            return self.strategy.memory_stats()
        ps = list(self.module.parameters())
        opt = self._ddp_optimizer  # DDP: the state of the optimizer build_optimizer made
        return {"params": sum(p.numel() * p.element_size() for p in ps),
                "grads": sum(b.flat.numel() * b.flat.element_size() for b in self.strategy.buckets),
                "optimizer": storage_bytes(optimizer_state_tensors(opt) if opt is not None else [], set())}

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The wrapped module's state dict with full tensors (fp32 masters under ZeRO, tensor-parallel
        shards gathered), on every rank, under the original module's names."""
        full = self.strategy.full_params() if isinstance(self.strategy, ShardedState) else {}
        out = {}
        for k, v in self.module.state_dict(keep_vars=True).items():
            t = (full[id(v)] if id(v) in full else v.detach()).clone()
            if getattr(v, "expert_parallel", False) and self.mesh.ep > 1:  # experts split over ep, dim 0
                parts = torch.empty((self.mesh.ep,) + tuple(t.shape), dtype=t.dtype, device=t.device)
                self.mesh.comm.all_gather(parts, t.unsqueeze(0), self.mesh.group("ep"), tag="state_dict")
                t = torch.cat(parts.unbind(0), dim=0)
            if getattr(v, "tensor_parallel", False) and self.mesh.tp > 1:
                parts = torch.empty((self.mesh.tp,) + tuple(t.shape), dtype=t.dtype, device=t.device)
                self.mesh.comm.all_gather(parts, t.unsqueeze(0), self.mesh.group("tp"), tag="state_dict")
                t = torch.cat(parts.unbind(0), dim=v.tensor_parallel_dim)
            out[k] = t
        if self.mesh.pp > 1:  # every stage's pieces, under the single-process names
            stages = self.mesh.comm.all_gather_object(self.module.global_names(out), self.mesh.group("pp"),
                                                      tag="state_dict")
            out = {k: v for part in stages for k, v in part.items()}
        return out
