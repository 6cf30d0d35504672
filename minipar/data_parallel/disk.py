"""The offload files (`minipar.data_parallel.offload`, "nvme"): fixed-size flat arrays, one file per tensor, read by
element range on a reader thread and written on a writer thread, every byte counted.

A read waits for every write submitted before it, so it never sees stale data; writes are
bounded by the caller (`DiskFiles.wait_writes(keep=...)`); a failed write is reported by
`wait_writes` as `OffloadError`. Files go through two system-call wrappers, `_pwrite` and
`_pread_into`, which the tests replace to make a disk fail.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import tempfile
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch


class OffloadError(RuntimeError):
    """A disk read or write of the offloaded state failed (raised on every rank, after the step)."""


class OffloadTraffic:
    """Bytes moved by offloading since construction, by kind (read it before and after a step)."""

    KINDS = ("to_device", "to_host", "disk_read", "disk_write")

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(self.KINDS, 0)

    def add(self, kind: str, n: int) -> None:
        self.bytes[kind] += int(n)

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes)


def host_empty(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer for data on its way to or from ``device`` (pinned when that is a GPU, so the
    copy can run asynchronously)."""
    return torch.empty(n, dtype=dtype, pin_memory=device.type == "cuda")


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place (any dtype, bf16 included)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


# The two system calls the files go through (tests replace them to make a disk fail).
def _pwrite(fd: int, data: memoryview, offset: int) -> int:
    return os.pwrite(fd, data, offset)


def _pread_into(fd: int, data: memoryview, offset: int) -> int:
    return os.preadv(fd, [data], offset)


class DiskFiles:
    """This rank's offload files: fixed-size flat arrays, read and written by element range on two
    background threads (one reading ahead, one writing behind), every byte counted."""

    def __init__(self, root: str | os.PathLike, rank: int, traffic: OffloadTraffic) -> None:
        self.root = Path(root)
        # A folder of its own per model and rank: two models offloading to one path never share files.
        self.dir = Path(tempfile.mkdtemp(prefix=f"minipar-offload-rank{rank:05d}-", dir=self.root))
        self.traffic = traffic
        self._files: dict[str, tuple[int, torch.dtype, int]] = {}  # name -> (fd, dtype, numel)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="minipar-offload-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="minipar-offload-write")
        self._writes: deque[tuple[str, Future]] = deque()
        self._failed_read: str | None = None  # a read whose caller could not raise alone (`read_failed`)
        # The files are scratch space (checkpoints are the durable copy): gone with the model.
        self._finalizer = weakref.finalize(self, _remove_files, self.dir, self._files)

    def create(self, name: str, values: torch.Tensor) -> None:
        """A file holding ``values`` (flat), its whole size reserved now: a full disk fails here."""
        path = self.dir / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._files[name] = (fd, values.dtype, values.numel())
        nbytes = values.numel() * values.element_size()
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            free = shutil.disk_usage(self.dir).free
            raise OSError(e.errno, f"cannot reserve {nbytes} bytes for {path}: {os.strerror(e.errno)} "
                                   f"({free} bytes free under {self.root})") from e
        self._write_now(name, 0, values.detach().to("cpu").contiguous())

    def nbytes(self) -> int:
        return sum(n * torch.empty(0, dtype=d).element_size() for _, d, n in self._files.values())

    def read(self, name: str, lo: int, n: int, device: torch.device) -> Future:
        """Elements [lo, lo + n) of ``name`` into a new host buffer, read on the reader thread after
        every write submitted before (a read never sees stale data)."""
        _, dtype, _ = self._files[name]
        self.traffic.add("disk_read", n * torch.empty(0, dtype=dtype).element_size())
        waits = [f for _, f in self._writes]
        out = host_empty(n, dtype, device)

        def job() -> torch.Tensor:
            wait(waits)  # (a failed write is reported by wait_writes, not by the reads after it)
            self._read_now(name, lo, out)
            return out
        return self._reader.submit(job)

    def write(self, name: str, lo: int, values: torch.Tensor) -> None:
        """Write ``values`` at element ``lo`` of ``name`` on the writer thread (``values`` is kept
        alive until then; the caller must not change it)."""
        values = values.detach().to("cpu").contiguous()
        self.traffic.add("disk_write", values.numel() * values.element_size())
        self._writes.append((name, self._writer.submit(self._write_now, name, lo, values)))

    def read_failed(self, what: str) -> None:
        """Record a read that failed where this rank could not raise alone (inside zero3's all-gather,
        which every rank must join): the next `wait_writes`, at the end of the step, raises it, and the
        strategy agrees on it there, so every rank raises together."""
        self._failed_read = self._failed_read or what

    def wait_writes(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` writes are in flight; raise `OffloadError` for a failed one (or
        a failed read `read_failed` recorded)."""
        if self._failed_read is not None:
            what, self._failed_read = self._failed_read, None
            self.abandon()
            raise OffloadError(f"{what}; the step's state is incomplete: load the last checkpoint (it is untouched) "
                               "after fixing the disk")
        while len(self._writes) > keep:
            name, f = self._writes.popleft()
            try:
                f.result()
            except OSError as e:
                self.abandon()
                raise OffloadError(f"writing the offloaded {name} to {self.dir / name} failed: {e}; "
                                   "the step's state is incomplete: load the last checkpoint "
                                   "(it is untouched) after freeing space or fixing the disk") from e

    def abandon(self) -> None:
        for _, f in self._writes:
            f.cancel()
        self._writes.clear()

    def close(self) -> None:
        """Stop the threads and remove this rank's files and folder (nothing else under the path)."""
        self.abandon()
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self._finalizer()

    def _write_now(self, name: str, lo: int, values: torch.Tensor) -> None:
        fd, dtype, numel = self._files[name]
        assert values.dtype == dtype and lo + values.numel() <= numel, (name, values.dtype, lo, values.numel())
        view, offset = _bytes_of(values), lo * values.element_size()
        while len(view):
            done = _pwrite(fd, view, offset)
            if done <= 0:
                raise OSError(errno.EIO, f"wrote nothing to {self.dir / name}")
            view, offset = view[done:], offset + done

    def _read_now(self, name: str, lo: int, out: torch.Tensor) -> None:
        fd, _, _ = self._files[name]
        view, offset = _bytes_of(out), lo * out.element_size()
        while len(view):
            done = _pread_into(fd, view, offset)
            if done <= 0:
                raise OSError(errno.EIO, f"{self.dir / name} ended early (read {offset} bytes)")
            view, offset = view[done:], offset + done


def _remove_files(folder: Path, files: dict) -> None:
    for name, (fd, _, _) in list(files.items()):
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(folder / name)
    files.clear()
    with contextlib.suppress(OSError):
        folder.rmdir()
