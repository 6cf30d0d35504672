"""ZeRO-Offload and ZeRO-Infinity: the optimizer's state and ZeRO-3's parameter shards kept off the
compute device, in host memory ("cpu") or in files on a fast disk ("nvme").

    ShardedModule(model, strategy="zero3",
                  offload=minipar.Offload(optimizer="nvme", params="cpu", path="/local/nvme"))

What moves where, per rank (Φ: this rank's shard of the parameters)::

    optimizer="cpu"   fp32 masters and the optimizer's moments in host memory; each step the
                      gradient shard goes to the host, the optimizer steps there, and the new
                      compute-dtype shard comes back (zero1/2: before their all-gather).
    optimizer="nvme"  the same state in files under ``path``; the step walks it in chunks of
                      ``chunk_mb``: the next chunk is read by a background thread while this one
                      steps, and each stepped chunk is written by another thread behind it, so
                      host memory holds a few chunks, never the whole state.
    params="cpu"      (zero3) each unit's parameter shard lives in host memory and is copied to
                      the device just before its all-gather (the prefetch of the next unit
                      starts its copy too); the device holds shards only while gathering.
    params="nvme"     (zero3) the shard lives in a file; it is read ahead when the unit before it
                      is gathered, then copied to the device as above.

Parameter offload needs optimizer offload (the step runs where the masters are; keeping 12
bytes per element of optimizer state on the device while offloading 2-4 of parameters would
be backwards). Every byte moved is counted (`OffloadTraffic`: to the device, to the host, read
from and written to disk) and `minipar.plan.offload_bytes.offload_traffic` predicts it exactly.

The files: one per flat group and state (``g3.master``, ``g3.exp_avg``, ``g3.shard``...), under
``path/minipar-offload-rank00005-XXXX`` (one folder per model and rank), created at full size when the model is wrapped (a full disk
fails then, on every rank, with the space needed, before training starts), overwritten in place
afterwards, and removed with the model (they are scratch space: checkpoints are the durable copy,
and `minipar.checkpoint` saves and loads offloaded state like any other). A write that fails during a step (the disk died, or filled under a file that
grows) surfaces at the end of that step on every rank as `OffloadError`. The files are then a
mix of two steps (they are overwritten in place, chunk by chunk): load the last checkpoint, which
offloading never touches, into the same model or a new one. Offloading changes no arithmetic: the
chunked step runs the same torch optimizer on each chunk, so in fp32 a run is bitwise equal to
the same run without offload.
"""

from __future__ import annotations

import inspect
import math
import os
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from .disk import DiskFiles, OffloadError, OffloadTraffic, host_empty

# The optimizers whose per-element state offload knows how to move (and, under "nvme", to step in chunks).
OFFLOAD_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)

KINDS = (None, "cpu", "nvme")


@dataclass(frozen=True)
class Offload:
    """Where the sharded strategies keep state off the device.

    optimizer: None, "cpu" or "nvme": the fp32 masters and optimizer state (zero1, zero2, zero3).
    params: None, "cpu" or "nvme": zero3's parameter shards between uses (needs ``optimizer``).
    path: the directory for "nvme" (must exist and be writable; each rank makes its own folder).
    chunk_mb: MiB of fp32 masters stepped at once under optimizer="nvme" (host memory holds about
    five chunks of masters and state at a time).
    """

    optimizer: str | None = None
    params: str | None = None
    path: str | os.PathLike | None = None
    chunk_mb: float = 64.0

    def __post_init__(self) -> None:
        for name in ("optimizer", "params"):
            if getattr(self, name) not in KINDS:
                raise ValueError(f"Offload({name}={getattr(self, name)!r}): choose None, 'cpu' or 'nvme'")
        if self.params is not None and self.optimizer is None:
            raise ValueError(f"Offload(params={self.params!r}) needs optimizer='cpu' or 'nvme' too: the step runs "
                             "where the fp32 masters are, and the optimizer state (12 bytes per parameter) is what "
                             "to move off the device first")
        if self.nvme and self.path is None:
            raise ValueError("Offload(..., 'nvme') needs path=: the directory (on a fast local disk) for the files")
        if not self.nvme and self.path is not None:
            raise ValueError(f"Offload(path={str(self.path)!r}) is used only by 'nvme'; drop path= or choose 'nvme'")
        cap = self.chunk_mb
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf:
            raise ValueError(f"Offload(chunk_mb={cap!r}) must be a finite number of MiB > 0")

    @property
    def nvme(self) -> bool:
        return "nvme" in (self.optimizer, self.params)

    @property
    def chunk_elems(self) -> int:
        return max(1, int(self.chunk_mb * 2**20) // 4)


def check_path(offload: Offload | None) -> str | None:
    """Why this rank cannot use ``offload.path`` (None: it can). Run before any collective; the
    answers are agreed with `agree` so that every rank raises together."""
    if offload is None or not offload.nvme:
        return None
    path = Path(offload.path)
    if not path.exists():
        return f"the offload path {str(path)!r} does not exist; create it (on a fast local disk) or pass another"
    if not path.is_dir():
        return f"the offload path {str(path)!r} is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"the offload path {str(path)!r} is not writable by this process; pass a directory it can write"
    return None


def agree(mesh, what: str, error: str | None) -> None:
    """ValueError on every rank when any rank had ``error`` (one small collective)."""
    errors = mesh.comm.all_gather_object(error, mesh.world, tag="offload")
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise ValueError(f"{what} failed:\n" + "\n".join(f"  rank {r}: {e}" for r, e in failed))


class ShardHomes:
    """Where a sharded strategy's compute shards and fp32 masters live under an `Offload` (None:
    on the device), and the moves between there and the device, each counted in ``traffic``.
    Group ``i``'s files are ``g{i}.shard`` and ``g{i}.master``."""

    def __init__(self, offload: Offload | None, device: torch.device, param_dtype: torch.dtype, rank: int) -> None:
        self.offload, self.device, self.param_dtype, self.rank = offload, device, param_dtype, rank
        self.params = offload.params if offload is not None else None
        self.traffic = OffloadTraffic()
        self.files: DiskFiles | None = None

    def place(self, groups: list) -> str | None:
        """Move each group's shard (params offload) and master (optimizer="nvme") to its home,
        reserving the files; why not, if that failed on this rank (its files then removed)."""
        off = self.offload
        try:
            if off.nvme:
                self.files = DiskFiles(off.path, self.rank, self.traffic)
            for i, g in enumerate(groups):
                if self.params == "cpu":
                    g.shard = host_empty(g.shard.numel(), g.shard.dtype, self.device).copy_(g.shard)
                elif self.params == "nvme":
                    self.files.create(f"g{i}.shard", g.shard)
                    g.shard = placeholder(g.shard.numel(), g.shard.dtype)
                if off.optimizer == "nvme":
                    self.files.create(f"g{i}.master", g.master.detach())
                    g.master.data = placeholder(g.master.numel())
        except Exception as e:  # noqa: BLE001 -- a full disk, a failed pinned allocation: every rank must hear
            if self.files is not None:
                self.files.close()  # removes only the files it made; nothing else under path is touched
            return f"offloading to {off.path}: {e}; free space there or offload to 'cpu'"
        return None

    def to_device(self, g, i: int, ahead: dict | None = None) -> torch.Tensor:
        """Group ``g``'s (number ``i``) compute shard on the device, for its all-gather: the shard
        itself, or a copy from the host or from its file (``ahead``: reads started earlier)."""
        if self.params is None:
            return g.shard
        host = g.shard
        if self.params == "nvme":
            read = (ahead or {}).pop(i, None) or self.read(g, i)
            try:
                host = read.result()
            except OSError as e:  # every rank must still join the gather: NaN in, OffloadError at the step's end
                self.files.read_failed(f"reading the offloaded parameter shard {self.files.dir / f'g{i}.shard'}: {e}")
                host = torch.full((g.shard.numel(),), math.nan, dtype=g.shard.dtype)
        self.traffic.add("to_device", host.numel() * host.element_size())
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        return out.copy_(host, non_blocking=host.is_pinned())

    def read(self, g, i: int) -> Future:
        """Start reading group ``i``'s shard from its file (params="nvme"): a future host buffer."""
        return self.files.read(f"g{i}.shard", 0, g.shard.numel(), self.device)

    def write_shard(self, g, i: int, lo: int, values: torch.Tensor) -> None:
        """New fp32 values of elements [lo, lo + len) of group ``i``'s real part into its compute
        shard, wherever the shard lives (device, host, or its file)."""
        if self.params == "nvme":
            self.files.write(f"g{i}.shard", lo, values.to(self.param_dtype))
            return
        if self.params is None and self.offload is not None:
            self.traffic.add("to_device", values.numel() * g.shard.element_size())  # host master -> device
        g.shard[lo:lo + values.numel()].copy_(values)


def placeholder(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of ``n`` elements with no storage behind it (its data lives in a file)."""
    t = torch.empty(n, dtype=dtype)
    t.untyped_storage().resize_(0)
    return t


class NvmeOptimizer:
    """The step over masters kept in files: the torch optimizer built over the (storage-less)
    pieces of the masters (`minipar.data_parallel.master_pieces`) keeps the parameter groups and
    hyperparameters; each chunk of each piece is stepped by a second instance of the same class
    over one chunk-sized parameter, with the piece's group's options, its state read from and
    written back to the files (one per master and state, a piece a range of it). Per-element
    optimizers only (Adam, AdamW, SGD), whose update of an element depends on that element alone:
    chunking changes nothing.

    Between steps ``optimizer.state[piece]`` holds the scalar state (Adam's ``step``); the
    per-element state is in the files, and `load` brings all of it back for checkpoints (`store` ends it).
    """

    def __init__(self, files: DiskFiles, masters: list[nn.Parameter], chunk_elems: int, device) -> None:
        self.files, self.masters, self.chunk, self.device = files, masters, chunk_elems, device
        self.keys: dict[str, torch.dtype] = {}   # per-element state, found by a probe step
        self.pieces: list = []                   # what the optimizer steps (`build`)
        self.stepped: list[bool] = []            # whether a piece's state files hold state yet
        self.optimizer: torch.optim.Optimizer | None = None
        self.depth = 0                           # nesting of load/store (only the outermost acts)
        self._proxy = nn.Parameter(torch.zeros(1))
        self._chunk_opt: torch.optim.Optimizer | None = None

    def build(self, optimizer: torch.optim.Optimizer, pieces: list) -> None:
        """Learn the per-element state of ``optimizer``'s class from one step on a one-element
        parameter, and reserve its files. ``pieces``: `Piece`s (param, index of its master, lo, hi)."""
        self.optimizer, self.pieces, self.stepped = optimizer, pieces, [False] * len(pieces)
        self.keys = {}
        for group in optimizer.param_groups:  # each group's options (momentum, amsgrad...) may add state
            probe = nn.Parameter(torch.zeros(1))
            probe.grad = torch.ones(1)
            opt = type(optimizer)([probe], **_constructor_kwargs(optimizer, group))
            opt.step()
            self.keys.update({k: v.dtype for k, v in opt.state[probe].items()
                              if torch.is_tensor(v) and v.dim() > 0 and v.shape == probe.shape})
        for gi, m in enumerate(self.masters):
            for k, dtype in self.keys.items():
                self.files.create(f"g{gi}.{k}", torch.zeros(m.numel(), dtype=dtype))
        self._chunk_opt = type(optimizer)([self._proxy], **_constructor_kwargs(optimizer))

    def step(self, grads: list[torch.Tensor], write_shard, traffic: OffloadTraffic) -> None:
        """Step every piece chunk by chunk: ``grads[i]`` (the reduced fp32-castable gradient of
        master i, anywhere) in, ``write_shard(i, lo, fp32 values)`` called with each new chunk."""
        opt, chunk_opt = self.optimizer, self._chunk_opt
        jobs = [(j, lo, min(lo + self.chunk, pc.hi)) for j, pc in enumerate(self.pieces)
                for lo in range(pc.lo, pc.hi, self.chunk)]
        reads = deque([self._read_chunk(*jobs[0])] if jobs else [])
        for n, (j, lo, hi) in enumerate(jobs):
            if n + 1 < len(jobs):  # read ahead: the next chunk loads while this one steps
                reads.append(self._read_chunk(*jobs[n + 1]))
            values = {k: _landed(f, self.files, k) for k, f in reads.popleft().items()}
            pc = self.pieces[j]
            group = next(g for g in opt.param_groups if any(p is pc.param for p in g["params"]))
            chunk_opt.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
            self._proxy.data = values.pop("master")
            grad = grads[pc.index][lo:hi]
            traffic.add("to_host", grad.numel() * grad.element_size())
            self._proxy.grad = grad.to("cpu", torch.float32, copy=True)
            scalars = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state.get(pc.param, {}).items()}
            chunk_opt.state[self._proxy] = {**scalars, **values} if self.stepped[j] else {}
            chunk_opt.step()
            new = chunk_opt.state.pop(self._proxy)
            self.files.write(f"g{pc.index}.master", lo, self._proxy.data)
            for k in self.keys:
                self.files.write(f"g{pc.index}.{k}", lo, new[k])
            write_shard(pc.index, lo, self._proxy.data)
            if hi == pc.hi:  # the piece's last chunk: its scalar state is the piece's
                opt.state[pc.param] = {k: v for k, v in new.items() if k not in self.keys}
                self.stepped[j] = True
            self.files.wait_writes(keep=2 * (1 + len(self.keys)))  # writes trail by two chunks at most
        self._proxy.data, self._proxy.grad = torch.zeros(1), None
        self.files.wait_writes()

    def _read_chunk(self, j: int, lo: int, hi: int) -> dict[str, Future]:
        gi = self.pieces[j].index
        names = ["master"] + (list(self.keys) if self.stepped[j] else [])
        return {k: self.files.read(f"g{gi}.{k}", lo, hi - lo, self.device) for k in names}

    def load(self) -> None:
        """The masters (their pieces viewing them) and the optimizer's per-element state into
        ordinary host tensors (for a checkpoint, a state dict, the full parameters), until `store`;
        the strategy's ``offloaded_state`` pairs the two and agrees on failures across ranks."""
        self.depth += 1
        self.files.wait_writes()
        cpu = torch.device("cpu")
        for gi, m in enumerate(self.masters):
            m.data = self.files.read(f"g{gi}.master", 0, m.numel(), cpu).result()
        for j, pc in enumerate(self.pieces):
            if pc.param is not self.masters[pc.index]:
                pc.param.data = self.masters[pc.index].data[pc.lo:pc.hi]
            if self.stepped[j]:
                self.optimizer.state[pc.param].update(
                    {k: self.files.read(f"g{pc.index}.{k}", pc.lo, pc.hi - pc.lo, cpu).result() for k in self.keys})

    def store(self, write_back: bool) -> None:
        """End `load`: with ``write_back``, what the tensors hold now goes to the files; then they
        leave memory (the scalar state stays)."""
        self.depth -= 1
        opt = self.optimizer
        try:
            if write_back:
                for gi, m in enumerate(self.masters):
                    self.files.write(f"g{gi}.master", 0, m.data)
                for j, pc in enumerate(self.pieces):
                    state = opt.state.get(pc.param, {})
                    for k in self.keys:
                        if k in state:
                            self.files.write(f"g{pc.index}.{k}", pc.lo, state[k])
                    self.stepped[j] = any(k in state for k in self.keys)
                self.files.wait_writes()
        finally:
            for pc in self.pieces:
                state = opt.state.get(pc.param, {})
                for k in self.keys:
                    state.pop(k, None)
                pc.param.data = placeholder(pc.param.numel())
            for m in self.masters:
                m.data = placeholder(m.numel())


def _landed(read: Future, files: DiskFiles, what: str) -> torch.Tensor:
    """A read's buffer; a failed write before it (reported first) or the read itself: OffloadError."""
    try:
        return read.result()
    except OSError as e:
        files.wait_writes()
        files.abandon()
        raise OffloadError(f"reading the offloaded {what} from {files.dir} failed: {e}") from e


def _constructor_kwargs(optimizer: torch.optim.Optimizer, group: dict | None = None) -> dict:
    """``optimizer``'s defaults (or ``group``'s options) that its class's constructor takes."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in (group or optimizer.defaults).items() if k in accepted and k != "params"}
