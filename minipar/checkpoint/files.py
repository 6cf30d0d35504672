"""The files of a checkpoint: atomic writes, checksums, and reads that run no code.

Layout on disk: ``<root>/step_00000100/`` holding ``rank{r:05d}.pt`` per rank
and ``manifest.json`` (format, layout, every parameter's name and shape, each
file's size and sha256), written last; ``<root>/latest`` names the newest
complete directory. Rank files are read with ``torch.load(weights_only=True)``
after their checksum matched.

The invariant: at every instant, `find_latest(root)` returns a complete
checkpoint -- the one it returned before a save began, or the new one -- and
every directory under a final (not dot-prefixed) name is complete. A crash at
any step below leaves a state that satisfies it, and the next save finishes or
discards what the crash left. Saving to ``<root>/X`` (each step an atomic
rename, each followed by an fsync of the directory):

  `begin` (rank 0)  if ``latest`` names ``.X'.tmp`` of some X' (a replace
                    that crashed after step 2), finish that replace (3-5);
                    remove a stale ``.X.tmp`` and ``.X.old``; create ``.X.tmp``.
  every rank        writes and fsyncs its ``rank{r:05d}.pt`` into ``.X.tmp``.
  `publish` (rank 0)
    1. ``manifest.json`` into ``.X.tmp``, last: from here ``.X.tmp`` is complete.
    2. only if X exists (a replace): point ``latest`` at ``.X.tmp``. The new
       checkpoint is the latest *before* the old one moves, so no instant has
       ``latest`` naming a directory that is being moved away.
    3. only if X exists: rename X to ``.X.old``.
    4. rename ``.X.tmp`` to X. ``latest`` still names ``.X.tmp``, now gone:
       `find_latest` then returns X (a ``.X.tmp`` that ``latest`` names only
       ever disappears by this rename).
    5. remove ``.X.old``, then point ``latest`` at X (in this order: while
       ``latest`` names ``.X.tmp`` the next `begin` finishes the job, so a
       crash in the removal leaves no old copy behind for good).

Without step 2 (moving the old one aside first, as minipar once did) a crash
between 3 and 4 left ``latest`` naming nothing and both checkpoints under
hidden names, and a restart began from scratch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

FORMAT, VERSION = "minipar-checkpoint", 1
MANIFEST, LATEST = "manifest.json", "latest"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (incomplete, corrupted, of another model); nothing was loaded."""


def step_path(root: str | os.PathLike, step: int) -> Path:
    """``root/step_{step:08d}``: names that sort by step, as `find_latest`'s fallback scan expects."""
    return Path(root) / f"step_{step:08d}"


def find_latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root``, or None when nothing was saved there yet (or
    ``root`` does not exist): resume with ``path = find_latest(root); if path is not None: load(path, ...)``.

    It is the directory ``root/latest`` names (or, if that is a ``.X.tmp`` renamed since, X: step 4
    of a replace), else (a crash before the pointer was first written) the last complete one by name."""
    root = Path(root)
    name = _pointed(root)
    if name is not None:
        for candidate in (name, _final_name(name)):
            if candidate is not None and (root / candidate / MANIFEST).is_file():
                return root / candidate
    complete = sorted(d for d in root.iterdir() if not d.name.startswith(".") and (d / MANIFEST).is_file()) \
        if root.is_dir() else []
    return complete[-1] if complete else None


def temporary(path: Path) -> Path:
    """Where a save of ``path`` writes: ``.name.tmp`` beside it (a hidden name: never a checkpoint by itself)."""
    return path.parent / f".{path.name}.tmp"


def _final_name(name: str) -> str | None:
    """X for ``.X.tmp``; None for any other name."""
    return name[1:-4] if name.startswith(".") and name.endswith(".tmp") and len(name) > 5 else None


def _pointed(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or None
    except OSError:
        return None


def check_plain(obj: Any, where: str = "extra_state") -> None:
    """Raise ValueError unless ``obj`` is made of what ``torch.load(weights_only=True)`` reads back."""
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor, torch.dtype, torch.device)):
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            check_plain(k, f"{where} key")
            check_plain(v, f"{where}[{k!r}]")
        return
    raise ValueError(f"{where} is a {type(obj).__name__}; a checkpoint holds only tensors, numbers, strings, "
                     "None and lists/tuples/dicts of them (it is read with weights_only=True)")


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_json(path: Path, obj: Any) -> None:
    _write_atomic(path, json.dumps(obj, indent=1))


def begin(path: Path) -> Path:
    """Rank 0, before any rank writes: an empty temporary directory for a save of ``path`` (see the
    module docstring). A replace that crashed half-way is finished first, so that removing a stale
    ``.X.tmp`` can never remove the checkpoint ``latest`` names."""
    tmp = temporary(path)
    _finish_interrupted(path.parent)
    shutil.rmtree(tmp, ignore_errors=True)  # a save that died before its manifest: start afresh
    shutil.rmtree(_aside(path), ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish(path: Path, tmp: Path, infos: list[dict], layout: dict, optimizer_name: str) -> None:
    """Rank 0, once every rank's file is in ``tmp``: steps 1-5 of the module docstring."""
    params, buffers, aliases = {}, {}, {}
    for info in infos:
        for k, shape in info["shapes"].items():
            params.setdefault(k, shape)
        buffers.update(info["buffer_shapes"])
        aliases.update(info["aliases"])
    manifest = {"format": FORMAT, "version": VERSION, "layout": layout,
                "optimizer": optimizer_name, "params": params, "buffers": buffers, "aliases": aliases,
                "files": {i["file"]: {k: i[k] for k in ("sha256", "bytes", "params", "buffers")} for i in infos}}
    write_json(tmp / MANIFEST, manifest)  # 1: the checkpoint is complete, under its temporary name
    if os.path.lexists(path):
        _point(path.parent, tmp.name)  # 2: the new one is the latest before the old one moves
    _move_into_place(tmp, path)  # 3, 4
    _drop_old_and_point(path)  # 5


def _move_into_place(tmp: Path, path: Path) -> None:
    """Steps 3 and 4: the old ``path`` (if any) to ``.X.old``, then ``tmp`` to ``path``."""
    if os.path.lexists(path):
        shutil.rmtree(_aside(path), ignore_errors=True)  # never what latest names: garbage of a crash
        os.rename(path, _aside(path))
        fsync_dir(path.parent)
    os.rename(tmp, path)
    fsync_dir(path.parent)


def _drop_old_and_point(path: Path) -> None:
    """Step 5: remove the old one, *then* point ``latest`` at ``path``: a crash in the removal leaves
    ``latest`` naming ``.X.tmp``, so the next save (of any name) finishes it and no old copy is left."""
    shutil.rmtree(_aside(path), ignore_errors=True)
    _point(path.parent, path.name)


def _finish_interrupted(root: Path) -> None:
    """If ``latest`` names ``.X.tmp`` (a replace of X crashed after step 2), do steps 3-5 of it."""
    name = _pointed(root)
    final = _final_name(name) if name is not None else None
    if final is None:
        return
    tmp, path = root / name, root / final
    if (tmp / MANIFEST).is_file():
        _move_into_place(tmp, path)
    if (path / MANIFEST).is_file():
        _drop_old_and_point(path)


def _aside(path: Path) -> Path:
    """Where a replace moves the old ``path``: ``.X.old``, a name `latest` never holds."""
    return path.parent / f".{path.name}.old"


def _point(root: Path, name: str) -> None:
    _write_atomic(root / LATEST, name + "\n")


def _write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never a part: write beside it, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_manifest(path: Path) -> dict:
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory")
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(f"{path} has no {MANIFEST}: its save did not finish (a torn checkpoint); "
                              "find_latest(root) returns the newest complete one")
    try:
        manifest = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}): the checkpoint is corrupted") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{file} is not a {FORMAT} version {VERSION} manifest")
    for fname, info in manifest["files"].items():  # cheap: every file there, at its size
        f = path / fname
        if not f.is_file():
            raise CheckpointError(f"{f} is missing: the checkpoint is incomplete")
        if f.stat().st_size != info["bytes"]:
            raise CheckpointError(f"{f} has {f.stat().st_size} bytes but the manifest says {info['bytes']}: "
                                  "the file is truncated or was replaced")
    return manifest


def check_sums(path: Path, manifest: dict, fnames: list[str]) -> None:
    """CheckpointError unless each file of ``fnames`` has the sha256 the manifest gives it."""
    for fname in fnames:
        if sha256_of(path / fname) != manifest["files"][fname]["sha256"]:
            raise CheckpointError(f"{path / fname}: sha256 differs from the manifest's: the file is corrupted")


def read_rank_file(path: Path, fname: str, manifest: dict) -> dict:
    """One rank file, after its checksum matched; read as plain tensors only."""
    check_sums(path, manifest, [fname])
    f = path / fname
    try:
        payload = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- an unpickling error of any kind is a refusal
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{f} is not plain tensor data; refused to unpickle it (weights_only=True): "
                              f"{type(e).__name__}: {reason}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{f} is not a {FORMAT} rank file")
    for piece in payload["pieces"].values():  # each piece remembers its optimizer's hyperparameters
        piece["hyper"] = payload["param_groups"][piece["group"]] if payload["param_groups"] else None
    return payload
