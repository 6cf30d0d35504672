"""The files of a checkpoint: atomic writes, checksums, and reads that run no code.

Layout on disk: ``<root>/step_00000100/`` holding ``rank{r:05d}.pt`` per rank
and ``manifest.json`` (format, layout, every parameter's name and shape, each
file's size and sha256), written last; ``<root>/latest`` names the newest
complete directory. Rank files are read with ``torch.load(weights_only=True)``
after their checksum matched.
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
    """The newest complete checkpoint under ``root``: the one ``root/latest`` names, else (a crash
    between the rename and the pointer update) the last complete directory by name; None if none."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if (target / MANIFEST).is_file():
            return target
    complete = sorted(d for d in root.iterdir() if not d.name.startswith(".") and (d / MANIFEST).is_file()) \
        if root.is_dir() else []
    return complete[-1] if complete else None


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
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def publish(path: Path, tmp: Path, infos: list[dict], layout: dict, optimizer_name: str) -> None:
    """Rank 0: manifest last, then the rename that makes the checkpoint exist, then the pointer."""
    params, buffers, aliases = {}, {}, {}
    for info in infos:
        for k, shape in info["shapes"].items():
            params.setdefault(k, shape)
        buffers.update(info["buffer_shapes"])
        aliases.update(info["aliases"])
    manifest = {"format": FORMAT, "version": VERSION, "layout": layout,
                "optimizer": optimizer_name, "params": params, "buffers": buffers, "aliases": aliases,
                "files": {i["file"]: {k: i[k] for k in ("sha256", "bytes", "params", "buffers")} for i in infos}}
    write_json(tmp / MANIFEST, manifest)
    fsync_dir(tmp)
    old = path.parent / f".{path.name}.old"
    if path.exists():  # replacing: move the old one aside first, so a crash leaves one complete copy
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)
    pointer = path.parent / LATEST
    tmp_pointer = path.parent / f".{LATEST}.tmp"
    tmp_pointer.write_text(path.name + "\n")
    os.replace(tmp_pointer, pointer)
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


def read_rank_file(path: Path, fname: str, manifest: dict) -> dict:
    """One rank file, after its checksum matched; read as plain tensors only."""
    f = path / fname
    if sha256_of(f) != manifest["files"][fname]["sha256"]:
        raise CheckpointError(f"{f}: sha256 differs from the manifest's: the file is corrupted")
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
