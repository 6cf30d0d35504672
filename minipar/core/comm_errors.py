"""How the collective layer reports what went wrong: which collective, which ranks, which value.

`minipar.core.comm.Comm` records each collective it issues as "the call in
progress" (op, axis, ranks, tag, shape, dtype). `_named` wraps its methods so
that a failure -- a peer gone, a wait past the process group's timeout
(``minipar.init(timeout=...)``) -- is raised as a `CollectiveError` that names
that call, at the call or at ``wait()`` of its handle, instead of gloo's or
NCCL's bare message after a silent wait. `first_difference` says where two
ranks' descriptions of a configuration part ways (``Comm.check_same``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective that did not complete (it waited past the process group's timeout, or a peer
    failed), named from the collective layer's ledger: op, mesh axis, ranks, tag, shape."""


class _NamedWork:
    """An async handle whose ``wait`` reports a failure as the `CollectiveError` of its collective."""

    def __init__(self, work, what: Any, rank: int) -> None:
        self._work, self._what, self._rank = work, what, rank

    def wait(self, *args):
        try:
            return self._work.wait(*args)
        except RuntimeError as e:
            raise _collective_error(self._what, self._rank, e) from e

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _collective_error(what: Any, rank: int, cause: BaseException) -> CollectiveError:
    if isinstance(cause, CollectiveError):
        return cause
    if isinstance(what, tuple):
        op, group, tag, shape, dtype = what
        what = (f"{op} over {group.name!r} (ranks {list(group.ranks)}), tag {tag!r}, "
                f"shape {tuple(shape) if shape is not None else '-'}, {dtype}")
    return CollectiveError(f"rank {rank}: the collective {what} did not complete: {type(cause).__name__}: "
                           f"{str(cause).strip()[:500]}\n(a rank that never reached it, or reached another "
                           "collective first, is the usual cause; minipar.init(timeout=...) sets how long a "
                           "collective may wait)")


def _named(method):
    """A collective of `Comm` whose failure, now or at ``wait()``, names it (`CollectiveError`)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        self._current = None
        try:
            out = method(self, *args, **kwargs)
        except RuntimeError as e:
            raise _collective_error(self._current or method.__name__, _rank(), e) from e
        if out is not None and self._current is not None and hasattr(out, "wait"):
            return _NamedWork(out, self._current, _rank())
        return out
    return run


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def first_difference(a: Any, b: Any, at: str = "") -> str:
    """Where two descriptions (nested dicts, lists, scalars) first differ, and how."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return f"{at}[{k!r}]: present on only one of them"
            if a[k] != b[k]:
                return first_difference(a[k], b[k], f"{at}[{k!r}]")
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_difference(x, y, f"{at}[{i}]")
        if len(a) != len(b):
            return f"{at}: {len(a)} entries vs {len(b)}"
    return f"{at or 'the value'}: {a!r} vs {b!r}"
