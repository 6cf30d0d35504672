"""Multi-rank test harness: a pool of rank processes that run functions on demand.

A `RankPool` starts ``world_size`` processes once (spawned, one thread each),
initialises torch.distributed among them (gloo on CPU; nccl with one GPU per
rank when asked for and available, MINIPAR_TEST_BACKEND=nccl; gloo ranks
sharing the GPUs with MINIPAR_TEST_DEVICE=cuda), then waits for work. ``pool.run(fn, *args)``
sends ``fn`` to every rank, calls ``fn(ctx, *args)`` there with a `RankContext`,
and returns the list of every rank's result. Sending a function costs a pickle
and a queue round trip -- milliseconds -- so hypothesis can run many examples
against one pool.

Failures never stall the caller:

* an exception on any rank raises `RankError` naming the rank, with its traceback;
* a rank that does not answer within ``timeout`` seconds (a hang, e.g. a
  collective some rank never reached), or that dies, raises `RankError` too,
  and the pool is killed and restarted before its next use.

``fn`` must be picklable by reference: a module-level function of an importable
module (test modules are: the children inherit ``sys.path``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

# After one rank fails, the others get this long to report before they are
# presumed stuck in a collective the failed rank will never join.
_GRACE_S = 5.0


@dataclass(frozen=True)
class RankContext:
    """What a function running on a rank is told about its process."""

    rank: int
    world_size: int
    backend: str
    device: str  # "cpu", or "cuda:<gpu>" (nccl, or gloo with MINIPAR_TEST_DEVICE=cuda)


class RankError(RuntimeError):
    """One or more ranks failed, hung or died; the message has each rank's story."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, timeout_s: float, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = "cpu"
    if backend == "nccl" or os.environ.get("MINIPAR_TEST_DEVICE") == "cuda":
        # nccl: one GPU per rank. gloo with MINIPAR_TEST_DEVICE=cuda: the ranks share the GPUs (nccl
        # refuses two ranks on one GPU), and Mesh() computes there too (MINIPAR_DEVICE, minipar.core.mesh).
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{rank % torch.cuda.device_count()}"
        os.environ["MINIPAR_DEVICE"] = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s + 30))
    ctx = RankContext(rank, world_size, backend, device)
    results.put(pickle.dumps(("ready", rank, True, None)))
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, payload = item
        try:
            fn, args, kwargs = pickle.loads(payload)
            value = fn(ctx, *args, **kwargs)
            out = (task_id, rank, True, value if device == "cpu" else _to_host(value))
        except BaseException:  # report everything, KeyboardInterrupt included: the parent decides
            out = (task_id, rank, False, traceback.format_exc())
        try:
            results.put(pickle.dumps(out))
        except Exception:
            results.put(pickle.dumps((task_id, rank, False, "result could not be pickled:\n" + traceback.format_exc())))
        fn = args = kwargs = value = out = None  # the task's objects go now, not when the next task replaces them
        try:  # after the answer: freeing a group may wait for work a failed task left pending
            _free_task_groups(dist)
        except Exception:  # noqa: BLE001 -- a group that cannot be freed costs threads, not correctness
            traceback.print_exc()
    dist.destroy_process_group()


def _to_host(result: Any) -> Any:
    """A result with its tensors copied to the CPU: the caller compares them with references it
    computed there, whichever device the ranks used."""
    import torch
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: t.cpu() if torch.is_tensor(t) else t, result)


def _free_task_groups(dist) -> None:
    """Destroy every process group a task left behind (all but the world).

    A test that builds a `Mesh` and never calls ``destroy()`` (most do not: the
    function returns and its objects are garbage) would otherwise leave each of
    its groups registered with torch, and so alive, in the reused rank process:
    per gloo group a transport loop thread and two worker threads. Thousands of
    them accumulated over a session woke each other ~190,000 times a second and
    took two thirds of the machine in the kernel. Destroying a gloo group is
    local to the rank (no collective), so the ranks need not agree on the order;
    the group's threads stop when its last reference goes, with the task's
    objects (strategies hold nothing in cycles through tensors: see
    ``minipar.data_parallel.buckets.owner``).
    """
    registry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    if registry is None:  # torch moved its registry: leave the groups (slower, never wrong)
        return
    for pg in list(registry):
        if pg is not dist.group.WORLD:
            dist.destroy_process_group(pg)


class RankPool:
    """``world_size`` rank processes, started once, running functions on demand."""

    def __init__(self, world_size: int, backend: str = "gloo", timeout: float = 120.0) -> None:
        self.world_size, self.backend, self.timeout = world_size, backend, timeout
        self._procs: list = []
        self._task_id = 0

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        port = _free_port()
        self._procs = [
            ctx.Process(target=_worker, daemon=True, name=f"minipar-rank{r}",
                        args=(r, self.world_size, port, self.backend, self.timeout, self._tasks[r], self._results))
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("ready", timeout=self.timeout)

    def close(self) -> None:
        """Stop the ranks; kill those that do not stop within a few seconds."""
        for q in getattr(self, "_tasks", []):
            try:
                q.put(None)
            except Exception:
                pass
        deadline = time.monotonic() + 2
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        self._procs = []

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    # -- running ---------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``fn(ctx, *args, **kwargs)`` on every rank; return the results in rank order."""
        if not self.alive:
            self._kill()
            self.start()
        self._task_id += 1
        payload = pickle.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put((self._task_id, payload))
        return self._collect(self._task_id, timeout=timeout or self.timeout)

    def _collect(self, task_id, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        ok: dict[int, Any] = {}
        failed: dict[int, str] = {}
        while len(ok) + len(failed) < self.world_size:
            now = time.monotonic()
            if now > deadline:
                break
            try:
                tid, rank, success, value = pickle.loads(self._results.get(timeout=min(0.2, deadline - now)))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in ok and r not in failed]
                for r in dead:
                    failed[r] = f"rank {r} died (exit code {self._procs[r].exitcode})"
                if failed:  # the rest may be waiting on a dead or failed rank: give them a little longer
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
                continue
            if tid != task_id:
                continue  # left over from an earlier, abandoned call
            if success:
                ok[rank] = value
            else:
                failed[rank] = value
                deadline = min(deadline, time.monotonic() + _GRACE_S)
        missing = [r for r in range(self.world_size) if r not in ok and r not in failed]
        if not failed and not missing:
            return [ok[r] for r in range(self.world_size)]
        if missing:
            self._kill()  # stuck ranks hold the process group hostage: restart before the next call
        parts = [f"--- rank {r} raised ---\n{failed[r]}" for r in sorted(failed)]
        if missing:
            why = "after another rank failed" if failed else f"within {timeout:.0f} s (a hang?)"
            parts.append(f"--- ranks {missing} did not answer {why}; the pool was restarted ---")
        what = "start" if task_id == "ready" else "run"
        raise RankError(f"{len(failed)} of {self.world_size} ranks failed to {what} "
                        f"(world size {self.world_size}, backend {self.backend}):\n" + "\n".join(parts))


class PoolSet:
    """One lazily started `RankPool` per world size, e.g. for a whole test session."""

    def __init__(self, backend: str | None = None, timeout: float | None = None) -> None:
        self.backend = backend or os.environ.get("MINIPAR_TEST_BACKEND", "gloo")
        self.timeout = timeout or float(os.environ.get("MINIPAR_TEST_TIMEOUT", "120"))
        self._pools: dict[int, RankPool] = {}
        self.fallbacks: dict[int, str] = {}  # world size -> why it runs on gloo although nccl was asked for

    def backend_for(self, world_size: int) -> str:
        """The backend a pool of ``world_size`` ranks gets: nccl needs one GPU per rank.

        When nccl was asked for but this machine has too few GPUs, the world runs on
        gloo (the CPU path still proves the algorithm) and the reason is printed to
        stderr, once per world size, and kept in ``fallbacks``.
        """
        if self.backend != "nccl":
            return self.backend
        import torch
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus >= world_size:
            return "nccl"
        if world_size not in self.fallbacks:
            why = (f"minipar.testing: nccl asked for (MINIPAR_TEST_BACKEND=nccl), but world size {world_size} needs "
                   f"{world_size} GPUs (one per rank) and this machine has {gpus}; "
                   f"world size {world_size} runs on gloo instead"
                   + (" (its ranks sharing the GPUs: MINIPAR_TEST_DEVICE=cuda)"
                      if os.environ.get("MINIPAR_TEST_DEVICE") == "cuda" else " (on the CPU)"))
            self.fallbacks[world_size] = why
            print(why, file=sys.stderr, flush=True)
        return "gloo"

    def __call__(self, world_size: int) -> RankPool:
        if world_size not in self._pools:
            self._pools[world_size] = RankPool(world_size, self.backend_for(world_size), self.timeout)
        return self._pools[world_size]

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return self(world_size).run(fn, *args, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
