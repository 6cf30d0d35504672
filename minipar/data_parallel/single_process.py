"""Single-process data parallelism: one process, one replica of the model per device, one thread each.

The teaching contrast to DDP (`minipar.data_parallel.ddp`). ``DataParallel(module, devices=[...])`` runs every
forward in four phases, all in the calling process:

1. **replicate** -- every parameter is broadcast from ``devices[0]`` (where the module lives) to
   each device, and a throw-away copy of the module tree is built around those copies;
2. **scatter**   -- every tensor argument is split along dim 0, one slice per replica;
3. **parallel forward** -- replica ``i`` runs on its slice in its own thread;
4. **gather**    -- the outputs are concatenated along dim 0 on ``devices[0]``.

The user computes the loss on the gathered output and calls ``backward()`` as usual. Replication
and gathering are autograd functions, so the backward runs the conjugates in reverse order:

====================  ==========================================  ==========================================
phase                 forward                                     backward
====================  ==========================================  ==========================================
`_Broadcast`          w -> (w_0, ..., w_{k-1}), w_i = w on dev i   dw = sum_i dw_i, on devices[0]
`_Scatter`            x -> (x_0, ..., x_{k-1}), rows split          dx = cat_i dx_i, on x's device
`_Gather`             (y_0, ..., y_{k-1}) -> y = cat_i y_i         dy_i = rows of dy, on y_i's device
====================  ==========================================  ==========================================

Broadcast's backward is where the gradients of the k replicas are *summed*, on one device, after
the whole backward has finished (autograd runs a node once all its inputs are ready): the
reduction does not overlap the backward, unlike DDP's bucketed all-reduce.

Why the gradient equals the single-process one: the loss is a function of the gathered output,
which is exactly the single-process output (each row is computed by one replica with the same
weights). The chain rule through gather sends each replica the rows of dL/dy it produced, and
through broadcast sums the replicas' contributions, dL/dw = sum_i dL/dw_i -- the same sum that one
process computes over all rows, only in a different order (equal up to floating-point rounding).

On CPU, ``devices`` may repeat: ``["cpu"] * 3`` means three replicas in three threads of this
process. Nothing is copied then (a replica's weights are views of the module's), but the module
tree is still rebuilt every step, the threads share one Python interpreter (the GIL: only
PyTorch's C++ kernels run in parallel), and the *backward* of every replica runs in the one
thread that called ``backward()``: autograd keeps one worker thread per device, and all CPU
"devices" are one device. On CUDA the backward of each replica runs on its device's worker.

Buffers (e.g. BatchNorm's running statistics): replica 0 uses the module's own buffer tensors, the
others get copies that are dropped after the step. So in-place updates made on replica 0 persist
and the others' are lost: after a train-mode step, BatchNorm's running mean and variance are those
of the first slice alone (as in ``torch.nn.DataParallel``). In train mode each replica also
normalises with its own slice's statistics, so BatchNorm's output differs from the single-process
run (which normalises over the whole batch); in eval mode it is equal.
"""

from __future__ import annotations

import threading
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map


class ReplicaError(RuntimeError):
    """A replica raised during the parallel forward; the message names it and has its traceback."""


class DataParallel(nn.Module):
    """Replicate ``module`` on ``devices`` every step, split the batch along dim 0, run the replicas in
    threads, and gather the outputs along dim 0 on ``devices[0]``.

    ``module`` must live on ``devices[0]`` and stays at ``.module``: train it, step its optimizer and
    save it as usual. ``devices``: CUDA devices (``"cuda:0"``, ``1``, ``torch.device``) or CPU
    "devices" (``"cpu"``, repeated once per replica). ``forward(*args, **kwargs)``: every tensor
    argument with a batch dimension (nested in tuples, lists and dicts too) is split along dim 0
    into ``len(devices)`` slices of sizes differing by at most one (the last replicas get fewer
    rows; a batch smaller than the device count uses fewer replicas); other arguments are passed
    to every replica unchanged. Returns the replicas' outputs (a tensor, or tuples/lists/dicts of
    them) concatenated along dim 0 on ``devices[0]``.
    """

    def __init__(self, module: nn.Module, devices: Sequence[str | int | torch.device]) -> None:
        super().__init__()
        gpus = [d for d in devices if isinstance(d, int) or torch.device(d).type == "cuda"]
        if gpus and not torch.cuda.is_available():
            raise ValueError(f"devices={list(devices)!r} name a GPU, but torch sees none; use CPU replicas, e.g. "
                             "devices=['cpu', 'cpu'] (two threads of this process)")
        self.devices = [_as_device(d) for d in devices]
        if not self.devices:
            raise ValueError("DataParallel needs at least one device: pass e.g. devices=['cpu', 'cpu'] "
                             "(two CPU replicas in two threads) or devices=[0, 1] (two GPUs)")
        if len({d.type for d in self.devices}) > 1:
            raise ValueError(f"devices {self.devices} mix device types; use only CUDA devices or only 'cpu'")
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.device != self.devices[0]:
                raise ValueError(f"{name} is on {t.device}, but the module must live on the first device "
                                 f"{self.devices[0]}: call module.to({str(self.devices[0])!r}) first")
        self.module = module
        self.profile: DataParallelProfile | None = None  # set by profiling()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._phase("scatter"):
            slices = scatter(args, kwargs, self.devices, self.profile)
        devices = self.devices[:len(slices)]
        with self._phase("replicate"):
            replicas = replicate(self.module, devices, self.profile)
        with self._phase("forward"):
            outputs = parallel_apply(replicas, slices, devices)
        with self._phase("gather"):
            return gather(outputs, self.devices[0], self.profile)

    @contextmanager
    def profiling(self) -> Iterator[DataParallelProfile]:
        """Time and count bytes per phase while inside: forward phases, and the backward
        phases reached by ``backward()`` calls made inside too."""
        self.profile = DataParallelProfile()
        try:
            yield self.profile
        finally:
            self.profile = None

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        if self.profile is None:
            yield
            return
        _sync(self.devices)
        t0 = time.perf_counter()
        yield
        _sync(self.devices)
        self.profile.add(name, time.perf_counter() - t0)


@dataclass
class DataParallelProfile:
    """Seconds and bytes per phase, summed over the steps profiled.

    ``bytes_copied[phase]``: bytes a phase wrote to a device other than the source's (a replica's
    weights, a slice, an output, a gradient), plus the gathered output (concatenation always
    copies) and the gradient sum (k gradients read, one written: counted as the k-1 added).
    """

    seconds: dict[str, float] = field(default_factory=dict)
    bytes_copied: dict[str, int] = field(default_factory=dict)

    def add(self, phase: str, seconds: float = 0.0, nbytes: int = 0) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        self.bytes_copied[phase] = self.bytes_copied.get(phase, 0) + nbytes


# -- the conjugate pairs -----------------------------------------------------------------------------


class _Broadcast(torch.autograd.Function):
    """w_i = w on devices[i] (a view where the device is w's own);  dw = sum_i dw_i on w's device.

    forward(devices, profile, *weights) -> k * n outputs, replica-major: w_0 of every weight, then w_1 ...
    """

    @staticmethod
    def forward(ctx, devices, profile, *weights):
        ctx.n, ctx.profile, ctx.sources = len(weights), profile, [w.device for w in weights]
        ctx.set_materialize_grads(False)  # a weight no replica used gets no gradient, as in one process
        out = [_to(w, d, profile, "replicate") for d in devices for w in weights]
        return tuple(out)

    @staticmethod
    def backward(ctx, *replica_grads):
        t0 = time.perf_counter()
        sums, nbytes = [], 0
        for j in range(ctx.n):
            parts = [g for g in replica_grads[j::ctx.n] if g is not None]
            if not parts:
                sums.append(None)
                continue
            total = parts[0].to(ctx.sources[j], copy=len(parts) > 1)  # a buffer of our own to add into
            for g in parts[1:]:
                total += g.to(total.device)
                nbytes += g.numel() * g.element_size()
            sums.append(total)
        if ctx.profile is not None:
            ctx.profile.add("reduce (backward)", time.perf_counter() - t0, nbytes)
        return (None, None, *sums)


class _Scatter(torch.autograd.Function):
    """x_i = rows [s_i, s_i + n_i) of x, on devices[i];  dx = cat_i dx_i on x's device.

    forward(sizes, devices, profile, x (B, ...)) -> k tensors (n_i, ...), sum_i n_i = B.
    """

    @staticmethod
    def forward(ctx, sizes, devices, profile, x):
        ctx.device = x.device
        return tuple(_to(piece, d, profile, "scatter") for piece, d in zip(x.split(sizes), devices))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, torch.cat([g.to(ctx.device) for g in grads]))


class _Gather(torch.autograd.Function):
    """y = cat_i y_i along dim 0 on the target device;  dy_i = the rows of dy that y_i produced, on y_i's device.

    forward(target, profile, *ys (n_i, ...)) -> (sum_i n_i, ...).
    """

    @staticmethod
    def forward(ctx, target, profile, *ys):
        ctx.sizes, ctx.devices, ctx.profile = [y.shape[0] for y in ys], [y.device for y in ys], profile
        out = torch.cat([y.to(target) for y in ys])
        if profile is not None:
            profile.add("gather", nbytes=out.numel() * out.element_size())
        return out

    @staticmethod
    def backward(ctx, dy):
        t0 = time.perf_counter()
        grads = [_to(g, d, ctx.profile, "gather (backward)") for g, d in zip(dy.split(ctx.sizes), ctx.devices)]
        if ctx.profile is not None:
            ctx.profile.add("gather (backward)", time.perf_counter() - t0)
        return (None, None, *grads)


# -- the four phases ---------------------------------------------------------------------------------


def replicate(module: nn.Module, devices: list[torch.device],
              profile: DataParallelProfile | None = None) -> list[nn.Module]:
    """One throw-away copy of ``module``'s tree per device, its weights broadcast through `_Broadcast`.

    A replica's submodules are shallow copies (same class, same plain attributes and hooks) whose
    parameter, buffer and child tables are its own. A weight shared by several submodules (a tied
    embedding) is broadcast once, so each replica shares its copy the same way. Under no_grad, or
    for a parameter that needs no gradient, the copies are plain. Buffers: replica 0 gets the
    module's own tensors (its in-place updates persist), the others copies.
    """
    params = list(dict.fromkeys(p for m in module.modules() for p in m._parameters.values() if p is not None))
    trained = [p for p in params if p.requires_grad and torch.is_grad_enabled()]
    buffers = list(dict.fromkeys(b for m in module.modules() for b in m._buffers.values() if b is not None))
    copies: list[dict[int, torch.Tensor]] = [{} for _ in devices]  # per replica: id(original) -> its copy
    if trained:
        flat = _Broadcast.apply(devices, profile, *trained)
        for i in range(len(devices)):
            copies[i].update((id(p), flat[i * len(trained) + j]) for j, p in enumerate(trained))
    for i, device in enumerate(devices):
        for p in params:
            if id(p) not in copies[i]:
                copies[i][id(p)] = _to(p.detach(), device, profile, "replicate")
        for b in buffers:
            # replica 0 keeps the module's own buffer; the others copy it, so no two threads update one tensor
            copies[i][id(b)] = b if i == 0 else _to(b, device, profile, "replicate", copy=True)
    return [_copy_tree(module, copies[i], {}) for i in range(len(devices))]


def scatter(args: tuple, kwargs: dict, devices: list[torch.device],
            profile: DataParallelProfile | None = None) -> list[tuple[tuple, dict]]:
    """(args, kwargs) -> one (args, kwargs) per replica used: each tensor with a batch dimension split
    along dim 0 (sizes differ by at most one, the larger first; only min(B, k) replicas), the rest as is."""
    batch = [t.shape[0] for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t) and t.dim() > 0]
    if not batch:
        raise ValueError("DataParallel splits its inputs along dim 0, but no argument is a tensor with a "
                         "batch dimension")
    if len(set(batch)) > 1:
        raise ValueError(f"DataParallel splits every tensor argument along dim 0, but their sizes differ: {batch}")
    if batch[0] == 0:
        raise ValueError("DataParallel got an empty batch (dim 0 has size 0)")
    k = min(batch[0], len(devices))
    sizes = [batch[0] // k + (1 if i < batch[0] % k else 0) for i in range(k)]
    split = {}  # id(tensor) -> its k slices

    def piece(obj: Any, i: int) -> Any:
        if isinstance(obj, torch.Tensor) and obj.dim() > 0:
            if id(obj) not in split:
                split[id(obj)] = _Scatter.apply(sizes, devices[:k], profile, obj)
            return split[id(obj)][i]
        return obj

    return [tree_map(lambda o: piece(o, i), (args, kwargs)) for i in range(k)]


def parallel_apply(replicas: list[nn.Module], slices: list[tuple[tuple, dict]],
                   devices: list[torch.device]) -> list[Any]:
    """Run ``replicas[i](*args_i, **kwargs_i)`` in thread i (inline when there is one); return the outputs.

    Grad mode is per thread in PyTorch, so each thread inherits the caller's. If any replica raises,
    `ReplicaError` names the first that did, with its traceback, after all threads have finished.
    """
    outputs: list[Any] = [None] * len(replicas)
    failures: dict[int, BaseException] = {}
    grad_enabled = torch.is_grad_enabled()

    def run(i: int) -> None:
        try:
            with torch.set_grad_enabled(grad_enabled), _on(devices[i]):
                outputs[i] = replicas[i](*slices[i][0], **slices[i][1])
        except BaseException as e:  # reported in the caller's thread
            e.__dp_traceback__ = traceback.format_exc()
            failures[i] = e

    if len(replicas) == 1:
        run(0)
    else:
        threads = [threading.Thread(target=run, args=(i,), name=f"minipar-dp-replica{i}") for i in range(len(replicas))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if failures:
        i = min(failures)
        e = failures[i]
        raise ReplicaError(f"replica {i} of {len(replicas)} (on {devices[i]}) raised {type(e).__name__}: {e}\n"
                           f"--- replica {i}'s traceback ---\n{e.__dp_traceback__}") from e
    return outputs


def gather(outputs: list[Any], target: torch.device, profile: DataParallelProfile | None = None) -> Any:
    """The replicas' outputs -> one output: tensors concatenated along dim 0 on ``target`` (a 0-dim
    output becomes a vector of one value per replica), through tuples, lists and dicts alike."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        parts = [y if y.dim() > 0 else y.reshape(1) for y in outputs]
        return _Gather.apply(target, profile, *parts)
    if first is None:
        return None
    if isinstance(first, dict):
        return type(first)((key, gather([o[key] for o in outputs], target, profile)) for key in first)
    if isinstance(first, (tuple, list)):
        gathered = [gather(list(parts), target, profile) for parts in zip(*outputs)]
        return type(first)(*gathered) if hasattr(first, "_fields") else type(first)(gathered)
    raise TypeError(f"DataParallel gathers tensors (in tuples, lists and dicts); a replica returned a "
                    f"{type(first).__name__}")


# -- helpers -----------------------------------------------------------------------------------------


def _copy_tree(module: nn.Module, tensors: dict[int, torch.Tensor], memo: dict[int, nn.Module]) -> nn.Module:
    """A shallow copy of ``module`` and its children (each once: ``memo``) whose parameters and buffers
    are ``tensors[id(original)]``. A replica's parameters are not leaves: its ``parameters()`` are the
    broadcast copies, for reading; the optimizer steps the original module."""
    if id(module) in memo:
        return memo[id(module)]
    replica = module.__new__(type(module))
    replica.__dict__ = module.__dict__.copy()
    memo[id(module)] = replica
    replica._parameters = {k: None if p is None else tensors[id(p)] for k, p in module._parameters.items()}
    replica._buffers = {k: None if b is None else tensors[id(b)] for k, b in module._buffers.items()}
    replica._modules = {k: None if m is None else _copy_tree(m, tensors, memo) for k, m in module._modules.items()}
    return replica


def _to(t: torch.Tensor, device: torch.device, profile: DataParallelProfile | None, phase: str,
        copy: bool = False) -> torch.Tensor:
    """``t`` on ``device``: a view when it is there already (unless ``copy``); counts the bytes copied."""
    if t.device == device and not copy:
        return t.view_as(t)
    if profile is not None:
        profile.add(phase, nbytes=t.numel() * t.element_size())
    return t.to(device, copy=True)


def _as_device(d: str | int | torch.device) -> torch.device:
    device = torch.device(f"cuda:{d}" if isinstance(d, int) else d)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _on(device: torch.device):
    """The thread's current CUDA device set to ``device`` (a no-op for CPU): new tensors land there."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return nullcontext()


def _sync(devices: list[torch.device]) -> None:
    for d in dict.fromkeys(devices):
        if d.type == "cuda":
            torch.cuda.synchronize(d)
