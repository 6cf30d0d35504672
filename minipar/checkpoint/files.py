"""The files of a checkpoint: atomic writes, checksums, and reads that run no code.

Layout on disk: ``<root>/step_00000100/`` holding ``rank{r:05d}.pt`` per rank
and ``manifest.json`` (format, layout, every parameter's name and shape, each
file's size and sha256), written last; ``<root>/latest`` names the newest
complete directory, always by its final name. Rank files are read with
``torch.load(weights_only=True)`` after their checksum matched.

The invariant: at every instant, every directory under a final (not
dot-prefixed) name is complete, ``latest`` names a final name, and after
`recover` (which `find_latest`, `load` and every save run first) that name is
a complete directory: the checkpoint ``latest`` named before a save began, or
the new one. Saving to ``<root>/X`` (each step an atomic rename, each followed
by an fsync of the directory):

  `begin` (rank 0)  `recover`; remove a stale ``.X.tmp``, and every ``.Y.old``
                    whose Y is complete; create ``.X.tmp``.
  every rank        writes and fsyncs its ``rank{r:05d}.pt`` into ``.X.tmp``.
  `publish` (rank 0)
    1. ``manifest.json`` into ``.X.tmp``, last: from here ``.X.tmp`` is complete.
    2. only if X exists (a replace): rename X to ``.X.old``.
    3. rename ``.X.tmp`` to X.
    4. point ``latest`` at X.
    5. remove ``.X.old``.

A crash between 2 and 3 leaves X missing, possibly the very name ``latest``
holds. `recover` puts a directory back under every missing final name that a
crash left hidden: the new one when ``.X.tmp`` is complete (the save had
finished writing: it is completed), else the old one from ``.X.old`` (rolled
back). It never deletes anything (a reader may run it while a save is under
way, and completing a finished save early is what publish would do next), and
two processes running it at once each rename or find the rename done. Before
this, ``latest`` named ``.X.tmp`` during a replace; a later save reusing that
temporary path could remove the only complete copy. Such a pointer, left by a
crash of an earlier minipar, is finished by `recover` too.
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

    It is the directory ``root/latest`` names, after `recover` finished or rolled back a save that a
    crash interrupted; else (a crash before the pointer was first written) the last complete one by name."""
    root = Path(root)
    if not root.is_dir():
        return None
    recover(root)
    name = _pointed(root)
    if name is not None and _final_name(name) is None and _complete(root / name):
        return root / name
    complete = sorted(d for d in root.iterdir() if not d.name.startswith(".") and _complete(d))
    return complete[-1] if complete else None


def recover(root: Path) -> None:
    """Put back every final name that a crash between publish's renames left missing (module
    docstring): ``.X.tmp`` complete -> X (the save completed), else ``.X.old`` complete -> X (rolled
    back); and finish a replace that an earlier minipar left with ``latest`` naming ``.X.tmp``. Only
    renames; safe to run from several processes at once."""
    if not root.is_dir():
        return
    for hidden in sorted(d.name for d in root.iterdir() if d.name.startswith(".")):
        final = _final_name(hidden) or _old_name(hidden)
        if final is None or os.path.lexists(root / final):
            continue
        for source in (temporary(root / final), _aside(root / final)):  # the new one first
            if _complete(source) and _rename_if_there(source, root / final):
                break
    _finish_legacy_pointer(root)


def _complete(d: Path) -> bool:
    """``d`` holds its manifest and every file it lists, at the listed size (no checksums: cheap)."""
    try:
        read_manifest(d)
        return True
    except (CheckpointError, OSError, KeyError, TypeError):
        return False


def _rename_if_there(src: Path, dst: Path) -> bool:
    """``src`` to ``dst``; True when ``dst`` now exists, whoever renamed it (another process may have)."""
    try:
        os.rename(src, dst)
        fsync_dir(dst.parent)
    except FileNotFoundError:
        pass
    except OSError:
        if not os.path.lexists(dst):
            raise
    return os.path.lexists(dst)


def temporary(path: Path) -> Path:
    """Where a save of ``path`` writes: ``.name.tmp`` beside it (a hidden name: never a checkpoint by itself)."""
    return path.parent / f".{path.name}.tmp"


def _final_name(name: str) -> str | None:
    """X for ``.X.tmp``; None for any other name."""
    return name[1:-4] if name.startswith(".") and name.endswith(".tmp") and len(name) > 5 else None


def _old_name(name: str) -> str | None:
    """X for ``.X.old``; None for any other name."""
    return name[1:-4] if name.startswith(".") and name.endswith(".old") and len(name) > 5 else None


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
    module docstring). A save that a crash interrupted is completed or rolled back first, so that
    removing a stale ``.X.tmp`` never removes the only copy of a checkpoint."""
    root = path.parent
    root.mkdir(parents=True, exist_ok=True)
    recover(root)
    tmp = temporary(path)
    shutil.rmtree(tmp, ignore_errors=True)  # a save that died before its manifest: start afresh
    for d in list(root.iterdir()):  # an old copy left by a crash after its replacement was in place
        final = _old_name(d.name)
        if final is not None and _complete(root / final):
            shutil.rmtree(d, ignore_errors=True)
    tmp.mkdir()
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
    if os.path.lexists(path):  # 2: the old one aside (from here until 3, recover completes the save)
        os.rename(path, _aside(path))
        fsync_dir(path.parent)
    if not _rename_if_there(tmp, path):  # 3 (a reader's recover may have done it already)
        raise CheckpointError(f"{tmp} vanished before it was renamed to {path}")
    _point(path.parent, path.name)  # 4
    shutil.rmtree(_aside(path), ignore_errors=True)  # 5


def _finish_legacy_pointer(root: Path) -> None:
    """``latest`` naming ``.X.tmp``: a replace of X by an earlier minipar, crashed after it pointed
    there. Its steps were: the old X aside, ``.X.tmp`` to X, then ``latest`` to X; finish them."""
    name = _pointed(root)
    final = _final_name(name) if name is not None else None
    if final is None:
        return
    tmp, path = root / name, root / final
    if _complete(tmp):
        if os.path.lexists(path):
            shutil.rmtree(_aside(path), ignore_errors=True)
            os.rename(path, _aside(path))
        _rename_if_there(tmp, path)
    if _complete(path):
        _point(root, final)
        shutil.rmtree(_aside(path), ignore_errors=True)


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
        raise CheckpointError(f"{path} is not a checkpoint directory; pass one that checkpoint.save wrote: "
                              "find_latest(root) returns the newest complete one (None when there is none)")
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
