"""The process mesh: the rank grid and one process group per parallel axis.

Layout. The world is a grid of shape ``(pp, dp, cp, tp)``, tensor-parallel fastest::

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

so the ranks of one tensor-parallel group are adjacent and, with tp up to the
GPUs per node, stay inside a node (TP is the chattiest axis); context
parallelism (cp ranks hold different tokens of the same sequences) comes next.
The ``dp_cp`` group joins the ranks that hold the same parameters and different
tokens (every dp and cp rank of one tp rank and stage): gradients are reduced
over it, and the sharded strategies shard over it. Expert
parallelism splits the data-parallel axis: ``dp_rank = edp_rank * ep + ep_rank``,
so an expert-parallel group is ``ep`` neighbouring data-parallel ranks and the
``edp`` group joins the ranks that hold the same experts. HSDP splits it the
same way: ``dp_rank = replicate_rank * dp_shard + shard_rank``, so a
``dp_shard`` group is ``dp_shard`` neighbouring data-parallel ranks (sharded
strategies shard over it) and a ``dp_replicate`` group joins the ranks that
hold the same shard (they all-reduce it once per step). Without HSDP
(``dp_shard = dp``) the dp_shard group is the dp group and dp_replicate has one rank.
Under context parallelism the cp ranks hold other tokens of the same
parameters, so ``edp`` and ``dp_shard`` take them in (edp x cp, dp_shard x cp,
cp fastest): experts' gradients are averaged, and HSDP shards, over them too;
``ep`` and ``dp_replicate`` stay within one cp rank.

Example, world 8, ``Mesh(dp=2, tp=2, pp=2)``::

    grid[pp, dp, tp]      tp groups: {0,1} {2,3} {4,5} {6,7}
    pp=0: [[0, 1],        dp groups: {0,2} {1,3} {4,6} {5,7}
           [2, 3]]        pp groups: {0,4} {1,5} {2,6} {3,7}
    pp=1: [[4, 5],
           [6, 7]]

A Mesh is an ordinary object: build as many as you like over one initialised
world (tests do), pass it explicitly, call `destroy()` to free its groups.
"""

from __future__ import annotations

import gc
import math
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from .comm import AxisGroup, Comm

AXES = ("dp", "tp", "pp", "ep", "edp", "dp_shard", "dp_replicate", "cp", "dp_cp")


class Mesh:
    """Rank grid of an initialised world; one `AxisGroup` per axis.

    Args:
        dp: data-parallel size (replicas given different samples); None means world_size // (tp * cp * pp).
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        ep: expert-parallel size; splits dp, so it must divide dp.
        cp: context-parallel size: the ranks of a cp group split each sequence (`minipar.context_parallel.context`).
        dp_shard: HSDP: the sharded strategies shard over groups of this many data-parallel ranks
            and replicate across the dp / dp_shard groups; it must divide dp. Default: dp (no HSDP).
        device: where this rank computes; default: cuda:LOCAL_RANK under nccl, else cpu.
        timeout: seconds (or a timedelta) a collective on this mesh's groups may wait before it fails
            with a `CollectiveError`; default torch's (`init` passes its own).

    Raises ValueError, on every rank and before any collective, when the sizes
    do not fit the world.
    """

    def __init__(self, dp: int | None = None, tp: int = 1, pp: int = 1, ep: int = 1,
                 device: torch.device | str | None = None, dp_shard: int | None = None,
                 timeout: float | timedelta | None = None, cp: int = 1) -> None:
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised: call minipar.init(...) "
                             "(it initialises from the torchrun environment), or "
                             "torch.distributed.init_process_group first")
        world_size, rank = dist.get_world_size(), dist.get_rank()
        dp, tp, pp, ep, dp_shard, cp = _check_sizes(world_size, dp, tp, pp, ep, dp_shard, cp)
        self.dp, self.tp, self.pp, self.ep, self.dp_shard, self.cp = dp, tp, pp, ep, dp_shard, cp
        self.dp_replicate = dp // dp_shard
        self.world_size, self.rank = world_size, rank
        self.grid = torch.arange(world_size).reshape(pp, dp, cp, tp)
        (pp_rank, dp_rank, cp_rank, tp_rank), = (self.grid == rank).nonzero().tolist()
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = pp_rank, dp_rank, cp_rank, tp_rank
        self.edp_rank, self.ep_rank = divmod(dp_rank, ep)
        self.replicate_rank, self.shard_rank = divmod(dp_rank, dp_shard)
        self.device = torch.device(device) if device is not None else _default_device()
        self.timeout = as_timeout(timeout) if timeout is not None else None  # of this mesh's groups
        self.comm = Comm()

        self._groups: dict[str, AxisGroup] = {}
        self._rank_lists: dict[str, list[list[int]]] = {}
        self._owned_pgs: list = []
        self._twins: dict[tuple, object] = {}  # process groups by (rank lists, backend)
        self.world = AxisGroup("world", tuple(range(world_size)), rank, dist.group.WORLD if world_size > 1 else None)
        # The first collective: every rank must have asked for the same layout.
        self.comm.check_same("Mesh(dp, tp, pp, ep, dp_shard, cp)", (dp, tp, pp, ep, dp_shard, cp), self.world)
        built: dict[tuple, AxisGroup] = {}  # two axes with the same groups (dp_shard = dp) share them
        for axis in AXES:
            self._groups[axis] = self._build_axis(axis, built)
        # The world again on gloo, for small host-side agreements (the batch check of a host batch)
        # that must not wait for the device: under nccl every collective reads back through the GPU.
        self.host_world = self.world
        if world_size > 1 and dist.get_backend() != "gloo":
            self.host_world = self.new_group("world", [list(range(world_size))], "gloo")

    # -- groups ----------------------------------------------------------------

    def _build_axis(self, axis: str, built: dict) -> AxisGroup:
        lists = self.rank_lists(axis)
        mine = next(r for r in lists if self.rank in r)
        size = len(mine)
        key = tuple(map(tuple, lists))
        if size == 1:
            return AxisGroup(axis, tuple(mine), 0, None)
        if size == self.world_size:
            return AxisGroup(axis, tuple(mine), mine.index(self.rank), dist.group.WORLD)
        if key in built:
            return AxisGroup(axis, tuple(mine), mine.index(self.rank), built[key].pg)
        built[key] = AxisGroup(axis, tuple(mine), mine.index(self.rank), self._new_groups(lists))
        return built[key]

    def new_group(self, name: str, lists: list[list[int]], backend: str | None = None) -> AxisGroup:
        """Groups of your own beyond the mesh's axes (a parameter server's servers and workers, ...):
        ``lists`` partition the world (every rank creates every group, in this order: a collective
        over the world); returns this rank's as an `AxisGroup` named ``name``, freed with the mesh.
        ``backend``: the groups' own (default: the world's).

        First the ranks agree (one small all-gather over the host world): lists or a backend that
        differ between ranks would create groups whose members are not what each rank asked for
        (torch pairs the i-th group every rank creates), so they raise ValueError on every rank, as
        do lists that do not partition the world; no group exists then. ``name`` is this rank's own
        label for its group and may differ (a parameter server's "servers" and "workers")."""
        lists = _rank_lists_of(lists)
        self.comm.check_same(f"Mesh.new_group({name!r}): the rank lists and backend", (lists, backend),
                             self.host_world, where=self.where)
        # Checked after the agreement (the same answer on every rank), before torch makes any group: an
        # empty list or a backend torch lacks fails inside torch's new_group, which then hangs the next one.
        if not isinstance(lists, list) or not all(lists) or \
                sorted(r for ranks in lists for r in ranks) != list(range(self.world_size)):
            raise ValueError(f"new_group({name!r}): {lists} must hold every rank of the world (0 to "
                             f"{self.world_size - 1}) exactly once, in lists of at least one rank")
        if backend is not None and (backend not in ("gloo", "nccl") or not dist.is_backend_available(backend)):
            raise ValueError(f"new_group({name!r}): backend={backend!r} is not in this torch build; use 'gloo' or "
                             "'nccl', or None (the world's)")
        mine = next(list(ranks) for ranks in lists if self.rank in ranks)
        pg = self._new_groups(lists, backend)
        return AxisGroup(name, tuple(mine), mine.index(self.rank), pg if len(mine) > 1 else None)

    def _new_groups(self, lists: list[list[int]], backend: str | None = None):
        """Create one process group per rank list (every rank creates every group, in the same
        order, as torch requires) and return this rank's."""
        pg_mine = None
        for ranks in lists:
            pg = dist.new_group(ranks, timeout=self.timeout, backend=backend)  # timeout None: torch's default
            if self.rank in ranks:
                pg_mine = pg
                self._owned_pgs.append(pg)
        return pg_mine

    def twin(self, axis: str, backend: str | None = None) -> AxisGroup:
        """A second process group over the same ranks as ``axis`` (on ``backend``, default the world's).

        ZeRO-3 gathers parameters on a twin so that the order of its gathers, checked unit by unit,
        is independent of the gradient reductions on the axis itself. Creating one is collective over
        the world: every rank asks for the same twins in the same order. Built once per mesh.
        """
        base = self.group(axis)
        if base.size == 1:
            return base
        lists = self.rank_lists(axis)
        key = (tuple(map(tuple, lists)), backend)  # axes with the same groups (edp = dp when ep = 1) share twins
        if key not in self._twins:
            self._twins[key] = self._new_groups(lists, backend)
        return AxisGroup(axis, base.ranks, base.rank, self._twins[key])

    def rank_lists(self, axis: str) -> list[list[int]]:
        """Every group of ``axis`` on this mesh, as lists of global ranks (`axis_rank_lists`); computed
        once per axis (the batch check asks every step)."""
        if axis not in self._rank_lists:
            self._rank_lists[axis] = axis_rank_lists(axis, dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep,
                                                     dp_shard=self.dp_shard, cp=self.cp)
        return [list(ranks) for ranks in self._rank_lists[axis]]

    @property
    def grad_axis(self) -> str:
        """The axis gradients are averaged over and the sharded strategies shard over: the ranks
        holding the same parameters and different tokens (dp, or dp x cp under context parallelism)."""
        return "dp" if self.cp == 1 else "dp_cp"

    @property
    def shard_axis(self) -> str:
        """The axis the sharded strategies shard dense parameters over: dp_shard under HSDP, else `grad_axis`."""
        return "dp_shard" if self.hsdp else self.grad_axis

    @property
    def hsdp(self) -> bool:
        """Data parallelism split into shard groups and replicas (dp_shard < dp)."""
        return self.dp_shard != self.dp

    def group(self, axis: str) -> AxisGroup:
        """This rank's group along ``axis`` (one of `AXES`)."""
        try:
            return self._groups[axis]
        except KeyError:
            raise ValueError(f"unknown mesh axis {axis!r}; the axes are {AXES}") from None

    def where(self, rank: int) -> str:
        """Rank ``rank``'s coordinates on the mesh, for messages: "pp 0, dp 1, tp 0" (and cp when cp > 1)."""
        (pp_rank, dp_rank, cp_rank, tp_rank), = (self.grid == rank).nonzero().tolist()
        return f"pp {pp_rank}, dp {dp_rank}" + (f", cp {cp_rank}" if self.cp > 1 else "") + f", tp {tp_rank}"

    def size(self, axis: str) -> int:
        return self.group(axis).size

    def destroy(self) -> None:
        """Free the process groups this mesh created (not the world)."""
        for pg in self._owned_pgs:
            dist.destroy_process_group(pg)
        self._owned_pgs.clear()
        self._twins.clear()

    def __repr__(self) -> str:
        hsdp = f", dp_shard={self.dp_shard}" if self.hsdp else ""
        cp = f", cp={self.cp}" if self.cp > 1 else ""
        return (f"Mesh(dp={self.dp}, tp={self.tp}, pp={self.pp}, ep={self.ep}{hsdp}{cp}; rank {self.rank}: "
                f"dp_rank={self.dp_rank}, tp_rank={self.tp_rank}, pp_rank={self.pp_rank}, "
                f"ep_rank={self.ep_rank}, device={self.device})")


def init(dp: int | None = None, tp: int = 1, pp: int = 1, ep: int = 1, backend: str | None = None,
         dp_shard: int | None = None, timeout: float | timedelta = 600.0, cp: int = 1) -> Mesh:
    """Initialise torch.distributed if needed and return the `Mesh`.

    ``timeout`` (seconds, or a timedelta): how long a collective may wait for the other ranks before
    it fails with a `minipar.core.comm.CollectiveError` naming it (op, axis, ranks, tag, shape) instead of
    waiting on. It applies to the world and to every group of the mesh.

    Reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT); without it, starts a world of one. The backend is nccl when
    every local rank has its own GPU, else gloo; ``backend`` or the environment
    variable MINIPAR_BACKEND overrides. Under gloo ranks compute on the CPU, or on
    the GPUs with MINIPAR_DEVICE=cuda (local rank modulo the GPU count: several
    ranks may share one).
    """
    timeout = as_timeout(timeout)
    if not dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        backend = backend or os.environ.get("MINIPAR_BACKEND")
        if backend is None:
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            backend = "nccl" if gpus >= local_world else "gloo"
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend {backend!r} is not supported; use 'nccl' or 'gloo'")
        if backend == "nccl" or os.environ.get("MINIPAR_DEVICE") == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"backend {backend} with MINIPAR_DEVICE={os.environ.get('MINIPAR_DEVICE', 'unset')} "
                                 "needs a GPU and torch sees none; use MINIPAR_BACKEND=gloo and unset MINIPAR_DEVICE")
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(backend, store=_restart_store(), rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        elif "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return Mesh(dp=dp, tp=tp, pp=pp, ep=ep, dp_shard=dp_shard, timeout=timeout, cp=cp)


def _rank_lists_of(lists) -> list[list[int]] | str:
    """``lists`` as plain lists of ints (ranks given as numpy or tensor scalars compare equal to
    ints), or its repr when it is not a list of lists of integers: a stable, picklable description
    for the agreement in `Mesh.new_group` that never raises, so every rank reaches the agreement."""
    try:
        out = [[r.__index__() for r in ranks] for ranks in lists]
    except (TypeError, AttributeError):
        return repr(lists)
    return out


def as_timeout(timeout: float | timedelta) -> timedelta:
    """A collective timeout from seconds or a timedelta; ValueError unless finite and positive."""
    if isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout={timeout!r} must be a finite number of seconds > 0 (or a timedelta)")
    return timedelta(seconds=timeout)


def _restart_store() -> dist.Store:
    """torchrun's store, with a key prefix of its own for each restart round.

    torchrun (2.11 to 2.13) keeps one store for every round of an elastic job
    and its workers join it without a prefix, so after a restart gloo can read
    the addresses that the previous round's dead workers published and fail
    with "connection refused". Prefixing by the restart count keeps rounds apart.
    """
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timedelta(minutes=10))
    return dist.PrefixStore(f"minipar/restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def shutdown() -> None:
    """End a job cleanly: wait for every rank, then free every process group.

    Call it last, on every rank. The barrier keeps a rank from closing its
    connections while a peer still talks to it. Freeing the groups here, while
    the interpreter is fully alive, matters with gloo: a group kept alive by a
    reference cycle (a module's hooks hold the mesh) is otherwise freed during
    interpreter teardown, and its worker threads can abort the process after
    the job has finished. Callers should also drop their own references (return
    from ``main``) and ``gc.collect()`` before exiting.
    """
    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()


def axis_rank_lists(axis: str, *, dp: int, tp: int = 1, pp: int = 1, ep: int = 1,
                    dp_shard: int | None = None, cp: int = 1) -> list[list[int]]:
    """Every group of ``axis`` as a list of global ranks, in one fixed order (pure: no processes needed)."""
    g = torch.arange(pp * dp * cp * tp).reshape(pp, dp, cp, tp)
    if axis == "tp":
        return g.reshape(-1, tp).tolist()
    if axis == "cp":
        return g.permute(0, 1, 3, 2).reshape(-1, cp).tolist()
    if axis == "dp":
        return g.permute(0, 2, 3, 1).reshape(-1, dp).tolist()
    if axis == "dp_cp":
        return g.permute(0, 3, 1, 2).reshape(-1, dp * cp).tolist()
    if axis == "pp":
        return g.permute(1, 2, 3, 0).reshape(-1, pp).tolist()
    # dp_shard and edp hold different tokens of the same parameters: under context parallelism they
    # take in the cp ranks too (cp fastest, as in dp_cp), like the gradient axis dp_cp does.
    if axis in ("dp_shard", "dp_replicate"):
        shard = dp if dp_shard is None else dp_shard
        g5 = g.reshape(pp, dp // shard, shard, cp, tp)  # dp split into (replicate, shard), shard fastest
        if axis == "dp_shard":
            return g5.permute(0, 1, 4, 2, 3).reshape(-1, shard * cp).tolist()
        return g5.permute(0, 2, 3, 4, 1).reshape(-1, dp // shard).tolist()
    g5 = g.reshape(pp, dp // ep, ep, cp, tp)  # dp split into (edp, ep), ep fastest
    if axis == "ep":
        return g5.permute(0, 1, 3, 4, 2).reshape(-1, ep).tolist()
    if axis == "edp":
        return g5.permute(0, 2, 4, 1, 3).reshape(-1, (dp // ep) * cp).tolist()
    raise ValueError(f"unknown mesh axis {axis!r}; the axes are {AXES}")


def _default_device() -> torch.device:
    """cuda under nccl; under gloo the CPU, or the GPU when MINIPAR_DEVICE=cuda (gloo carries CUDA
    tensors too: several ranks can then share one GPU, which nccl refuses)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if os.environ.get("MINIPAR_DEVICE", "cpu") == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("MINIPAR_DEVICE=cuda, but torch sees no GPU here; unset it to compute on the CPU")
        return torch.device("cuda", torch.cuda.current_device())  # init set it from the local rank
    return torch.device("cpu")


def _check_sizes(world_size: int, dp, tp, pp, ep, dp_shard=None, cp=1) -> tuple[int, int, int, int, int, int]:
    given = (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp)) + ((("dp", dp),) if dp is not None else ()) + \
        ((("dp_shard", dp_shard),) if dp_shard is not None else ())
    for name, v in given:
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"mesh size {name}={v!r} must be a positive integer")
    if dp is None:
        if world_size % (tp * cp * pp):
            raise ValueError(f"tp * cp * pp = {tp} * {cp} * {pp} = {tp * cp * pp} does not divide the world size "
                             f"{world_size}; choose tp, cp and pp whose product divides {world_size}")
        dp = world_size // (tp * cp * pp)
    if dp * tp * cp * pp != world_size:
        raise ValueError(f"dp * tp * cp * pp = {dp} * {tp} * {cp} * {pp} = {dp * tp * cp * pp} but the world size "
                         f"is {world_size}; pass sizes whose product is {world_size} (or dp=None to infer it)")
    if dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp}: expert parallelism splits the data-parallel axis")
    if dp_shard is None:
        dp_shard = dp
    if dp % dp_shard:
        raise ValueError(f"dp_shard={dp_shard} must divide dp={dp}: HSDP splits the data-parallel ranks into "
                         f"shard groups of dp_shard and replicates across dp / dp_shard of them")
    return dp, tp, pp, ep, dp_shard, cp
