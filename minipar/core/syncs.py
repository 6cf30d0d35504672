"""Host syncs: the calls that make the host wait for the device, counted on any machine.

A GPU runs what the host queued, while the host goes on queueing: a training
step is fast when the host stays ahead. A call that needs a value computed on
the device stops the host until the device has finished everything queued
before it, so the next kernels start late. Such calls are reading a value
(``item``, ``tolist``, ``bool(t)``, ``int(t)``, ``numpy``), and operations whose
*result shape* depends on values (``nonzero``, boolean-mask indexing,
``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``).

On a CPU nothing waits, but the code makes the same calls: `count_host_syncs`
records them as they are made, with where they were made from, so a test on a
CPU can assert that a training step would make none on a GPU. On a GPU,
``torch.cuda.set_sync_debug_mode("warn")`` is the device's own view of the same
thing (the GPU report uses both). Two kinds of call are not counted: those made
by Triton's interpreter (which runs kernels on CPU tensors, standing in for a
GPU launch), and reads of tensors that live on the host in every run, which
the counter cannot tell from the CPU tensors that stand for device tensors in a
CPU test: those the caller names (``host_tensors``, e.g. a non-fused
optimizer's step counts), and those read through `read_on_host` by code that
has just checked where the tensor is.

    with count_host_syncs(host_tensors=steps) as syncs:
        loss = model.train_step(x, y, loss_fn); opt.step()
    assert not syncs.calls, syncs.report()
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter, defaultdict
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.__complex__}
_VALUE_SHAPED = {torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere, torch.masked_select,
                 torch.Tensor.masked_select, torch.unique, torch.Tensor.unique, torch.unique_consecutive,
                 torch.Tensor.unique_consecutive, torch.equal, torch.allclose, torch.Tensor.allclose,
                 torch.bincount, torch.Tensor.bincount}  # bincount: its length is max(input) + 1, read back
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
_REPEAT = {torch.repeat_interleave, torch.Tensor.repeat_interleave}
_THIS_FILE = os.path.abspath(__file__)
_SKIP_DIRS = (os.sep + "torch" + os.sep, os.sep + "triton" + os.sep)


class HostSyncs(TorchFunctionMode):
    """The counting mode; use it through `count_host_syncs`."""

    def __init__(self, host_tensors: Iterable[torch.Tensor] = (), device_only: bool = False) -> None:
        super().__init__()
        self._host = {t.untyped_storage().data_ptr() for t in host_tensors if t.numel()}
        self.device_only = device_only
        self.calls: Counter = Counter()  # (what, where) -> count

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = self._syncs(func, args, kwargs)
        if what is not None:
            where = _caller()
            if where is not None:  # None: Triton's interpreter, not the code under test
                self.calls[(what, where)] += 1
        return func(*args, **kwargs)

    def _syncs(self, func, args, kwargs) -> str | None:
        if self.device_only and not any(torch.is_tensor(a) and a.device.type != "cpu"
                                        for a in (*args, *kwargs.values())):
            return None  # a run on a GPU: a CPU tensor is host memory, reading it waits for nothing
        if func in _READS or func in _VALUE_SHAPED:
            if func in _READS and args and torch.is_tensor(args[0]) and self._on_host(args[0]):
                return None
            return getattr(func, "__name__", str(func))
        if func in _INDEXING and len(args) > 1 and _has_mask(args[1]):
            return "indexing with a boolean mask"
        if func in _REPEAT and kwargs.get("output_size") is None:
            repeats = kwargs.get("repeats", args[1] if len(args) > 1 else args[0] if args else None)
            if torch.is_tensor(repeats):
                return "repeat_interleave without output_size"
        return None

    def _on_host(self, t: torch.Tensor) -> bool:
        return t.numel() > 0 and t.untyped_storage().data_ptr() in self._host

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def report(self) -> str:
        """One line per call site: count, what, where."""
        return "\n".join(f"{n} x {what} at {where}" for (what, where), n in self.calls.most_common()) or "no host syncs"


def _has_mask(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(torch.is_tensor(p) and p.dtype == torch.bool for p in parts)


def _caller() -> str | None:
    """``file:line function`` of the first frame outside torch and this file; None when Triton's
    interpreter is on the stack (it reads CPU tensors to emulate a kernel launch)."""
    frame, found = sys._getframe(2), None
    while frame is not None:
        path = frame.f_code.co_filename
        if os.sep + "triton" + os.sep in path:
            return None
        if found is None and not any(d in path for d in _SKIP_DIRS) and os.path.abspath(path) != _THIS_FILE:
            found = f"{os.path.relpath(path) if not path.startswith('<') else path}:{frame.f_lineno} " \
                    f"{frame.f_code.co_name}"
        frame = frame.f_back
    return found or "<torch>"


def to_device(tree: Any, device: torch.device) -> Any:
    """Every tensor of ``tree`` (a tensor, or tuples/lists/dicts of them) on ``device``, without waiting
    for it: a copy from pageable host memory waits for the device's queue to drain, one from pinned
    memory does not (so a host batch is pinned first; pinning is host work).

    Views of one host tensor (a batch and its shifted targets, ``x[:, :-1]`` and ``x[:, 1:]``) travel
    as one copy of the span of memory they cover and are rebuilt as the same views on the device
    (`by_span`): a view that is not contiguous would otherwise be copied through a pageable staging
    tensor, which waits for the device."""
    if device.type == "cuda":
        leaves, spec = tree_flatten(tree)
        return tree_unflatten(by_span(leaves, lambda t: t.pin_memory().to(device, non_blocking=True)), spec)

    def move(t: Any) -> Any:
        return t.to(device) if torch.is_tensor(t) and t.device != device else t
    return tree_map(move, tree)


def by_span(leaves: list, copy: Callable[[torch.Tensor], torch.Tensor]) -> list:
    """``leaves`` with each CPU tensor replaced by its image under ``copy``, a function that moves a
    *contiguous* tensor. Tensors that view one storage in one dtype share a single copy of the span
    they cover (then ``as_strided`` views of it), when that span is at most twice their elements (a
    small slice of a large tensor is copied alone, made contiguous first). Leaves that are not CPU
    tensors, empty tensors and tensors that require grad pass through ``copy`` alone or unchanged."""
    out = list(leaves)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, t in enumerate(leaves):
        if torch.is_tensor(t) and t.device.type == "cpu":
            if t.numel() == 0 or t.requires_grad:
                out[i] = copy(t.contiguous())
            else:
                groups[(t.untyped_storage().data_ptr(), t.dtype)].append(i)
    for (_, dtype), members in groups.items():
        views = [leaves[i] for i in members]
        lo = min(v.storage_offset() for v in views)
        hi = max(v.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(v.shape, v.stride())) for v in views)
        if hi - lo > 2 * sum(v.numel() for v in views):
            for i, v in zip(members, views):
                out[i] = copy(v.contiguous())
            continue
        span = torch.empty(0, dtype=dtype).set_(views[0].untyped_storage(), lo, (hi - lo,), (1,))
        moved = copy(span)
        for i, v in zip(members, views):
            out[i] = moved.as_strided(v.shape, v.stride(), v.storage_offset() - lo)
    return out


def read_on_host(t: torch.Tensor) -> list:
    """``t.tolist()`` for a tensor on the CPU in every run (ValueError otherwise), never counted."""
    if t.device.type != "cpu":
        raise ValueError(f"read_on_host: the tensor is on {t.device}; reading it waits for the device")
    with torch._C.DisableTorchFunction():  # the counting mode is a torch-function mode
        return t.tolist()


@contextlib.contextmanager
def count_host_syncs(host_tensors: Iterable[torch.Tensor] = (), device_only: bool = False) -> Iterator[HostSyncs]:
    """Count, inside the block, the calls that would make the host wait for a GPU (module docstring).

    ``host_tensors``: tensors that live on the host by design even in a GPU run (reading them is
    free), e.g. the ``step`` counts of a non-fused torch optimizer. ``device_only``: in a run on a
    GPU, count only calls on tensors that are not on the CPU (on a CPU test, every tensor stands
    for a device one: leave it off)."""
    mode = HostSyncs(host_tensors, device_only)
    with mode:
        yield mode


# Operators that only make a new view or read metadata: no kernel runs for them on a GPU.
_NO_KERNEL = {"view", "t", "detach", "slice", "transpose", "unsqueeze", "squeeze", "_unsafe_view", "expand",
              "as_strided", "alias", "permute", "reshape", "select", "unbind", "split", "split_with_sizes", "chunk",
              "_reshape_alias", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty",
              "new_empty_strided", "set_", "view_as", "unflatten", "flatten", "narrow", "diagonal",
              "_local_scalar_dense", "is_pinned", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"}


class Launches(TorchDispatchMode):
    """The counting mode of `count_launches`: ``ops[name]`` is how often the operator ran."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


@contextlib.contextmanager
def count_launches() -> Iterator[Launches]:
    """Count, inside the block, the tensor operations that would each launch work on a GPU (every
    ATen operator below autograd that is not a view or a metadata read): the host's work per step,
    measured on any machine. Triton kernels called through ``minipar.kernels`` count as their custom
    operator, one each."""
    mode = Launches()
    with mode:
        yield mode
