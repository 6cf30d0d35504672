"""Sharded checkpoints: every rank writes its own shard, any layout reads them back.

    from minipar import checkpoint
    checkpoint.save(root / "step_00000100", model, opt, extra_state={"step": 100})
    extra = checkpoint.load(checkpoint.find_latest(root), model, opt)   # same or another layout
    state_dict = checkpoint.consolidate(path)                           # no processes needed

What a checkpoint is. A directory holding one ``rank{r:05d}.pt`` per rank and
a ``manifest.json``. The files are layout-free: each parameter is stored
under its *single-process* name (``layers.3.attn.q_proj.weight``, whatever
the pipeline stage or tensor-parallel layer that held it), as pieces::

    piece = (chunks, lo, hi, values)
    chunks: [(dim, index, count), ...]  the tensor-/expert-parallel cut: local = full.chunk(count, dim)[index]...
    lo, hi: the element range of that local tensor this rank's optimizer steps (all of it under
            DDP; this rank's ZeRO shard under ZeRO)

with the optimizer's per-element state (Adam's ``exp_avg``, ``exp_avg_sq``)
cut the same way and its scalar state (``step``) per parameter. Exactly one
rank writes each element: replicas (DDP ranks, tensor-parallel ranks holding
a replicated norm, the last pipeline stage's copy of a tied embedding) leave
it to the first of them. Loading assembles each parameter the new layout
needs from the pieces, then cuts this rank's part out of it, so a
checkpoint saved under one (dp, tp, pp, ep, ZeRO stage) loads under another.
Each rank file also carries the rank's RNG states (torch, CUDA, Python,
NumPy, the tensor-parallel dropout streams), the loss scaler, the optimizer's
hyperparameters and the caller's ``extra_state``.

Never torn. Every rank writes into ``.<name>.tmp`` next to the target; rank 0
writes the manifest (each file's size and sha256, the layout, every parameter
name and shape) last, then renames the directory into place and points
``<root>/latest`` at it (each step an atomic rename). A crash at any moment
leaves either the new checkpoint complete or the previous one untouched.

Never trusted. Loading refuses, with the reason, on every rank and before
changing anything: a directory without a manifest (a save that did not
finish), a file whose size or checksum differs from the manifest (truncated,
corrupted), a checkpoint of another model (names or shapes differ) or
optimizer, and a file that is not plain tensors: every file is read with
``torch.load(weights_only=True)``, so no code in a checkpoint ever runs.

Collectives go through ``mesh.comm``; every rank runs the same ones in the
same order, and each phase ends with an agreement (`_agree`) so that a
failure on one rank becomes a ValueError on all of them, not a hang.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

FORMAT, VERSION = "minipar-checkpoint", 1
MANIFEST, LATEST = "manifest.json", "latest"

__all__ = ["save", "load", "consolidate", "find_latest", "step_path", "CheckpointError"]


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


# -- this rank's view of the model ------------------------------------------------------------------

@dataclass
class _Slot:
    """One parameter as this rank holds it, and where its optimizer steps it."""

    name: str               # the single-process name
    param: nn.Parameter     # this rank's (tensor-/expert-parallel local) parameter
    full_shape: tuple
    chunks: list            # [(dim, index, count), ...] from the full tensor to ``param``
    lo: int                 # [lo, hi): the elements of ``param`` (flattened) the optimizer steps here
    hi: int
    owner: torch.Tensor     # the tensor the optimizer steps: ``param`` (DDP) or a ZeRO master shard
    at: int                 # where element ``lo`` sits in ``owner`` (flattened)
    writes: bool            # this rank is the one that saves these elements


def _global_names(model) -> tuple[dict[int, str], dict[str, str]]:
    """({id(parameter or buffer): single-process name}, {alias: name}) for this rank's module.

    A pipeline stage's ``layers.k`` is the model's ``layers.(offset + k)``; the last stage's copy of
    a tied embedding is the model's ``wte.weight``, whose alias ``lm_head.weight`` the single-process
    state dict also lists.
    """
    module, pp = model.module, model.mesh.pp > 1
    names: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for key, t in module.state_dict(keep_vars=True).items():
        name = key
        if pp and key.startswith("layers."):
            _, idx, rest = key.split(".", 2)
            name = f"layers.{int(idx) + module.layer_offset}.{rest}"
        if pp and module.tied and key == "lm_head.weight":
            name = "wte.weight"
            aliases["lm_head.weight"] = "wte.weight"
        if id(t) in names:
            aliases[name] = names[id(t)]
        else:
            names[id(t)] = name
    if pp and module.tied and module.first:
        aliases["lm_head.weight"] = "wte.weight"
    return names, aliases


def _slots(model) -> list[_Slot]:
    from .sharded_optim import ShardedState

    mesh, strategy = model.mesh, model.strategy
    names, _ = _global_names(model)
    shard_of: dict[int, tuple] = {}  # id(param) -> (master, at, lo, hi) under ZeRO
    if isinstance(strategy, ShardedState):
        for g in strategy.groups:
            lay, off = g.layout, 0
            for p in lay.params:
                a, b = max(off, lay.lo), min(off + p.numel(), lay.lo + lay.real_len)
                shard_of[id(p)] = (g.master, a - lay.lo, a - off, b - off) if a < b else (g.master, 0, 0, 0)
                off += p.numel()
    tied_copy = model.module.tied_weight() if mesh.pp > 1 and model.module.last and not model.module.first \
        else None
    out = []
    for p in model.module.parameters():
        chunks, full = [], list(p.shape)
        if getattr(p, "tensor_parallel", False) and mesh.tp > 1:
            chunks.append((p.tensor_parallel_dim, mesh.tp_rank, mesh.tp))
            full[p.tensor_parallel_dim] *= mesh.tp
        expert = getattr(p, "expert_parallel", False)
        if expert and mesh.ep > 1:
            chunks.append((0, mesh.ep_rank, mesh.ep))
            full[0] *= mesh.ep
        if id(p) in shard_of:  # ZeRO: each data-parallel rank steps (and writes) its own range
            owner, at, lo, hi = shard_of[id(p)]
            first_replica = True
        else:
            owner, at, lo, hi = p, 0, 0, p.numel()
            first_replica = (mesh.edp_rank if expert else mesh.dp_rank) == 0
        replicated_over_tp = not getattr(p, "tensor_parallel", False) and mesh.tp_rank != 0
        writes = first_replica and not replicated_over_tp and p is not tied_copy and hi > lo
        out.append(_Slot(names[id(p)], p, tuple(full), chunks, lo, hi, owner, at, writes))
    return out


def _optimizer_of(optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # a ShardedOptimizer wraps a torch optimizer


def _split_state(state: dict, owner: torch.Tensor) -> tuple[dict, dict]:
    """(per-element state tensors, scalar state) of one optimizer entry: a tensor shaped like the
    stepped tensor is per element (exp_avg...), anything else (step, counters) is scalar."""
    per_elem = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0 and v.shape == owner.shape}
    return per_elem, {k: v for k, v in state.items() if k not in per_elem}


# -- agreement ---------------------------------------------------------------------------------------

def _agree(mesh, what: str, error: str | None, payload: Any = None) -> list[Any]:
    """Every rank's ``payload`` (one collective); CheckpointError on every rank if any rank had an error."""
    everyone = mesh.comm.all_gather_object((error, payload), mesh.world, tag="checkpoint")
    failed = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
    if failed:
        lines = "\n".join(f"  rank {r}: {e}" for r, e in failed)
        raise CheckpointError(f"{what} failed; nothing was changed:\n{lines}")
    return [p for _, p in everyone]


def _layout(model) -> dict:
    m = model.mesh
    return {"world": m.world_size, "dp": m.dp, "tp": m.tp, "pp": m.pp, "ep": m.ep, "strategy": model.strategy_name}


def _plain(obj: Any, where: str = "extra_state") -> None:
    """Raise ValueError unless ``obj`` is made of what ``torch.load(weights_only=True)`` reads back."""
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor, torch.dtype, torch.device)):
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _plain(v, f"{where}[{i}]")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            _plain(k, f"{where} key")
            _plain(v, f"{where}[{k!r}]")
        return
    raise ValueError(f"{where} is a {type(obj).__name__}; a checkpoint holds only tensors, numbers, strings, "
                     "None and lists/tuples/dicts of them (it is read with weights_only=True)")


# -- RNG ---------------------------------------------------------------------------------------------

def _rng_state(model) -> dict:
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if model.mesh.device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(model.mesh.device)
    tp_random = getattr(model.module, "tp_random", None)
    if tp_random is not None:
        out["tp_streams"] = dict(tp_random.states)
    try:
        import numpy as np
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    except ImportError:
        pass
    return out


def _set_rng_state(model, rng: dict, own_rank: bool) -> None:
    """Restore ``rng``; the device and tensor-parallel streams only when it is this rank's own."""
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "numpy" in rng:
        import numpy as np
        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if own_rank and "cuda" in rng and model.mesh.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], model.mesh.device)
    tp_random = getattr(model.module, "tp_random", None)
    if own_rank and tp_random is not None and "tp_streams" in rng:
        tp_random.states = dict(rng["tp_streams"])


# -- save --------------------------------------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@torch.no_grad()
def save(path: str | os.PathLike, model, optimizer, extra_state: Any = None) -> Path:
    """Write a checkpoint of ``model`` (a `ShardedModule`) and ``optimizer`` (from ``model.build_optimizer``)
    into the directory ``path``; call it on every rank. Returns ``path``.

    ``extra_state`` (this rank's: step counter, data position, scheduler state...) must be made of
    tensors, numbers, strings and containers of them. An existing checkpoint at ``path`` is replaced.
    """
    mesh, path = model.mesh, Path(path)
    error = None
    try:
        _plain(extra_state)
    except ValueError as e:
        error = str(e)
    paths = _agree(mesh, "checkpoint.save: the arguments check", error, str(path.resolve()))
    if len(set(paths)) > 1:
        raise CheckpointError(f"checkpoint.save was given different paths on different ranks: {sorted(set(paths))}; "
                              "pass the same directory on every rank")
    tmp = path.parent / f".{path.name}.tmp"
    error = None
    if mesh.rank == 0:  # a stale temporary directory is a save that died: start afresh
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as e:
            error = f"cannot create {tmp}: {e}"
    _agree(mesh, "checkpoint.save: creating the directory", error)

    slots = _slots(model)
    opt = _optimizer_of(optimizer)
    group_of = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
    pieces = {}
    for s in slots:
        if not s.writes:
            continue
        n = s.hi - s.lo
        per_elem, scalars = _split_state(opt.state.get(s.owner, {}), s.owner)
        pieces[s.name] = {"chunks": s.chunks, "lo": s.lo, "hi": s.hi,
                          "value": s.owner.detach().reshape(-1)[s.at:s.at + n].clone(),
                          "state": {k: v.reshape(-1)[s.at:s.at + n].clone() for k, v in per_elem.items()},
                          "scalars": scalars, "group": group_of.get(id(s.owner), 0)}
    names, aliases = _global_names(model)
    first_replica = mesh.dp_rank == 0 and mesh.tp_rank == 0
    buffers = {names[id(b)]: b.detach().clone() for b in model.module.buffers() if id(b) in names} \
        if first_replica else {}
    scaler = getattr(model.strategy, "scaler", None)
    payload = {"format": FORMAT, "version": VERSION, "rank": mesh.rank, "pieces": pieces, "buffers": buffers,
               "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
               "rng": _rng_state(model), "scaler": scaler.state_dict() if scaler is not None else None,
               "extra_state": extra_state}
    fname = f"rank{mesh.rank:05d}.pt"
    error, info = None, None
    try:
        with open(tmp / fname, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        info = {"file": fname, "sha256": _sha256(tmp / fname), "bytes": (tmp / fname).stat().st_size,
                "params": sorted(pieces), "buffers": sorted(buffers),
                "shapes": {s.name: list(s.full_shape) for s in slots},
                "buffer_shapes": {names[id(b)]: list(b.shape) for b in model.module.buffers() if id(b) in names},
                "aliases": aliases}
    except Exception as e:  # noqa: BLE001 -- any failure must reach every rank, not hang them
        error = f"writing {tmp / fname}: {type(e).__name__}: {e}"
    infos = _agree(mesh, "checkpoint.save: writing the rank files", error, info)

    error = None
    if mesh.rank == 0:
        try:
            _publish(path, tmp, infos, model, opt)
        except Exception as e:  # noqa: BLE001
            error = f"publishing {path}: {type(e).__name__}: {e}"
    _agree(mesh, "checkpoint.save: publishing", error)
    return path


def _publish(path: Path, tmp: Path, infos: list[dict], model, opt) -> None:
    """Rank 0: manifest last, then the rename that makes the checkpoint exist, then the pointer."""
    params, buffers, aliases = {}, {}, {}
    for info in infos:
        for k, shape in info["shapes"].items():
            params.setdefault(k, shape)
        buffers.update(info["buffer_shapes"])
        aliases.update(info["aliases"])
    manifest = {"format": FORMAT, "version": VERSION, "layout": _layout(model),
                "optimizer": type(opt).__name__, "params": params, "buffers": buffers, "aliases": aliases,
                "files": {i["file"]: {k: i[k] for k in ("sha256", "bytes", "params", "buffers")} for i in infos}}
    _write_json(tmp / MANIFEST, manifest)
    _fsync_dir(tmp)
    old = path.parent / f".{path.name}.old"
    if path.exists():  # replacing: move the old one aside first, so a crash leaves one complete copy
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)
    pointer = path.parent / LATEST
    tmp_pointer = path.parent / f".{LATEST}.tmp"
    tmp_pointer.write_text(path.name + "\n")
    os.replace(tmp_pointer, pointer)
    _fsync_dir(path.parent)


# -- reading -----------------------------------------------------------------------------------------

def _read_manifest(path: Path) -> dict:
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


def _read_file(path: Path, fname: str, manifest: dict) -> dict:
    """One rank file, after its checksum matched; read as plain tensors only."""
    f = path / fname
    if _sha256(f) != manifest["files"][fname]["sha256"]:
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


def _assemble(name: str, shape: list, pieces: list[dict], get) -> torch.Tensor:
    """The full tensor ``name`` from its pieces; ``get(piece)`` picks the values (parameter or a state)."""
    full = torch.empty(shape, dtype=get(pieces[0]).dtype)
    count = torch.zeros(shape, dtype=torch.int32)
    by_cut: dict[tuple, list[dict]] = defaultdict(list)
    for pc in pieces:
        by_cut[tuple(tuple(c) for c in pc["chunks"])].append(pc)
    for cut, same_cut in by_cut.items():
        view, seen = full, count
        for d, i, n in cut:
            if not (0 <= d < view.dim() and 0 <= i < n and view.shape[d] % n == 0):
                raise CheckpointError(f"{name}: piece cut {cut} does not fit the shape {tuple(shape)}")
            view, seen = view.chunk(n, d)[i], seen.chunk(n, d)[i]
        local, local_seen = view.clone().reshape(-1), torch.zeros(view.numel(), dtype=torch.int32)
        for pc in same_cut:
            values = get(pc)
            if not (0 <= pc["lo"] <= pc["hi"] <= local.numel()) or values.numel() != pc["hi"] - pc["lo"]:
                raise CheckpointError(f"{name}: a piece's range [{pc['lo']}, {pc['hi']}) does not fit its values")
            local[pc["lo"]:pc["hi"]] = values
            local_seen[pc["lo"]:pc["hi"]] += 1
        view.copy_(local.view(view.shape))
        seen += local_seen.view(seen.shape)
    if not bool((count == 1).all()):
        raise CheckpointError(f"{name}: the checkpoint's pieces cover {int((count > 0).sum())} of {full.numel()} "
                              f"elements ({int((count > 1).sum())} more than once): it is incomplete or inconsistent")
    return full


def _cut(full: torch.Tensor, slot: _Slot) -> torch.Tensor:
    """This rank's elements [lo, hi) of its local part of ``full``."""
    for d, i, n in slot.chunks:
        full = full.chunk(n, d)[i]
    return full.reshape(-1)[slot.lo:slot.hi]


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _one(values: list, what: str) -> Any:
    """The single value all of ``values`` agree on."""
    if any(not _same(v, values[0]) for v in values[1:]):
        raise CheckpointError(f"{what} differs between parameters this layout keeps in one tensor "
                              f"({values[0]!r} vs another); this checkpoint cannot be resharded into it")
    return values[0]


def _missing_or_different(manifest: dict, params: dict, buffers: dict) -> str | None:
    problems = []
    for kind, mine, theirs in (("parameter", params, manifest["params"]), ("buffer", buffers, manifest["buffers"])):
        missing = sorted(set(mine) - set(theirs))
        extra = sorted(set(theirs) - set(mine))
        shapes = [f"{k} {tuple(theirs[k])} (model {tuple(mine[k])})" for k in sorted(set(mine) & set(theirs))
                  if list(theirs[k]) != list(mine[k])]
        for what, names in (("missing", missing), ("unexpected", extra), ("of another shape", shapes)):
            if names:
                problems.append(f"{len(names)} {kind}s {what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}")
    if problems:
        return "the checkpoint holds another model: " + "; ".join(problems)
    return None


# -- load --------------------------------------------------------------------------------------------

@torch.no_grad()
def load(path: str | os.PathLike, model, optimizer) -> Any:
    """Load the checkpoint at ``path`` into ``model`` and ``optimizer`` (built as for `save`, under
    any layout); call it on every rank. Returns this rank's ``extra_state`` (rank 0's when the
    layout changed).

    Under the layout it was saved with, every rank gets back its own RNG states; under another,
    every rank gets rank 0's torch/Python/NumPy states and the device and tensor-parallel dropout
    streams are left as they are (they are per rank). Raises `CheckpointError` (a ValueError) on
    every rank, having changed nothing, when the checkpoint is incomplete, corrupted, not plain
    tensor data, or of another model or optimizer.
    """
    mesh, path = model.mesh, Path(path)
    slots = _slots(model)
    names, _ = _global_names(model)
    my_params = {s.name: list(s.full_shape) for s in slots}
    my_buffers = {names[id(b)]: list(b.shape) for b in model.module.buffers() if id(b) in names}
    everyone = _agree(mesh, "checkpoint.load: the arguments check", None,
                      (str(path.resolve()), my_params, my_buffers))
    if len({p for p, _, _ in everyone}) > 1:
        raise CheckpointError(f"checkpoint.load was given different paths on different ranks: "
                              f"{sorted({p for p, _, _ in everyone})}; pass the same directory on every rank")
    all_params = {k: v for _, ps, _ in everyone for k, v in ps.items()}
    all_buffers = {k: v for _, _, bs in everyone for k, v in bs.items()}

    error, plan = None, None
    try:
        plan = _prepare(path, model, optimizer, slots, all_params, all_buffers)
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 -- anything unexpected is still a refusal on every rank
        error = f"{type(e).__name__}: {e}"
    _agree(mesh, f"checkpoint.load of {path}", error)
    return _apply(model, optimizer, plan)


def _prepare(path: Path, model, optimizer, slots: list[_Slot], all_params: dict, all_buffers: dict) -> dict:
    """Everything ``load`` will write, computed without touching the model: any error is raised here."""
    mesh = model.mesh
    manifest = _read_manifest(path)
    problem = _missing_or_different(manifest, all_params, all_buffers)
    if problem:
        raise CheckpointError(problem)
    topt = _optimizer_of(optimizer) if optimizer is not None else None
    if topt is not None and manifest["optimizer"] != type(topt).__name__:
        raise CheckpointError(f"the checkpoint's optimizer is {manifest['optimizer']}, this one is "
                              f"{type(topt).__name__}: build the optimizer the checkpoint was saved with")
    same_layout = {k: v for k, v in manifest["layout"].items() if k != "strategy"} == \
        {k: v for k, v in _layout(model).items() if k != "strategy"}
    own = f"rank{mesh.rank if same_layout else 0:05d}.pt"
    names, _ = _global_names(model)
    my_buffers = {names[id(b)] for b in model.module.buffers() if id(b) in names}
    wanted = {s.name for s in slots if s.hi > s.lo}
    files = [f for f, info in manifest["files"].items()
             if f == own or wanted & set(info["params"]) or my_buffers & set(info["buffers"])]
    payloads = {f: _read_file(path, f, manifest) for f in files}
    pieces: dict[str, list[dict]] = defaultdict(list)
    buffers: dict[str, torch.Tensor] = {}
    for payload in payloads.values():
        for name, pc in payload["pieces"].items():
            pieces[name].append(pc)
        buffers.update(payload["buffers"])

    # Each parameter this rank holds: its values and optimizer state, assembled then cut.
    values, states = {}, {}
    for s in slots:
        if s.hi == s.lo:
            continue
        shape = manifest["params"][s.name]
        ps = pieces[s.name]
        if not ps:
            raise CheckpointError(f"{s.name}: no file holds it although the manifest lists it")
        values[id(s.param)] = _cut(_assemble(s.name, shape, ps, lambda pc: pc["value"]), s)
        keys = [sorted(pc["state"]) for pc in ps]
        keys = _one(keys, f"{s.name}: the optimizer state keys")
        per_elem = {k: _cut(_assemble(s.name, shape, ps, lambda pc, k=k: pc["state"][k]), s) for k in keys}
        scalars = _one([pc["scalars"] for pc in ps], f"{s.name}: the optimizer's scalar state")
        states[id(s.param)] = (per_elem, scalars, ps[0]["hyper"]) if keys or scalars else None

    # Per tensor the optimizer steps (a parameter, or a ZeRO master holding many): its new contents.
    owners: dict[int, list[_Slot]] = defaultdict(list)
    for s in slots:
        owners[id(s.owner)].append(s)
    new_owner, new_state, hyper_of = {}, {}, {}
    for group in owners.values():
        owner = group[0].owner
        flat = owner.detach().reshape(-1).clone()
        for s in group:
            if s.hi > s.lo:
                flat[s.at:s.at + s.hi - s.lo] = values[id(s.param)]
        new_owner[id(owner)] = (owner, flat)
        filled = [s for s in group if s.hi > s.lo]
        has = [states[id(s.param)] is not None for s in filled]
        if filled and any(has) and not all(has):
            raise CheckpointError(f"the optimizer has state for {[s.name for s, h in zip(filled, has) if h][:3]} but "
                                  f"not for {[s.name for s, h in zip(filled, has) if not h][:3]}, which this layout "
                                  "steps as one tensor; load this checkpoint under a DDP layout")
        if filled and all(has):
            keys = _one([sorted(states[id(s.param)][0]) for s in filled], "the optimizer state keys")
            state = {}
            for k in keys:
                t = torch.zeros(owner.numel(), dtype=states[id(filled[0].param)][0][k].dtype)
                for s in filled:
                    t[s.at:s.at + s.hi - s.lo] = states[id(s.param)][0][k]
                state[k] = t.view(owner.shape)
            # A copy per tensor: pieces read from one file share their scalar tensors (torch.load keeps
            # aliasing), and AdamW increments ``step`` in place, once per tensor it steps.
            scalars = _one([states[id(s.param)][1] for s in filled], "the optimizer's scalar state")
            state.update({k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()})
            new_state[id(owner)] = state
            hyper_of[id(owner)] = [states[id(s.param)][2] for s in filled]

    opt_sd = None
    if topt is not None:
        sd_state, groups, index = {}, [], 0
        for g in topt.param_groups:
            hyper = [h for p in g["params"] for h in hyper_of.get(id(p), []) if h is not None]
            merged = {k: v for k, v in g.items() if k != "params"}
            if hyper:
                merged.update(_one(hyper, "the optimizer hyperparameters (lr, betas, weight decay...)"))
            groups.append({**merged, "params": list(range(index, index + len(g["params"])))})
            for p in g["params"]:
                if id(p) in new_state:
                    sd_state[index] = new_state[id(p)]
                index += 1
        opt_sd = {"state": sd_state, "param_groups": groups}
    own_payload = payloads[own]
    return {"owners": list(new_owner.values()), "optimizer": opt_sd,
            "buffers": {b: buffers[names[id(b)]] for b in model.module.buffers() if id(b) in names},
            "rng": own_payload["rng"], "same_layout": same_layout, "scaler": own_payload["scaler"],
            "extra_state": own_payload["extra_state"]}


def _apply(model, optimizer, plan: dict) -> Any:
    """Write what `_prepare` computed. The only collective: ZeRO-1/2 all-gather the new parameters."""
    from .sharded_optim import ShardedState

    for owner, flat in plan["owners"]:
        owner.detach().view(-1).copy_(flat)
    for b, value in plan["buffers"].items():
        b.copy_(value)
    strategy = model.strategy
    if isinstance(strategy, ShardedState):
        for g in strategy.groups:  # the compute-dtype shard follows the fp32 master, as after a step
            if g.master.data_ptr() != g.shard.data_ptr():
                g.shard[:g.layout.real_len].copy_(g.master)
        if strategy.stage == 3:
            for u in strategy.units:
                strategy.reshard(u)  # a unit left gathered would hold the old values
        else:
            strategy.spread_params()
        if plan["scaler"] is not None:
            strategy.scaler.load_state_dict(plan["scaler"])
    if optimizer is not None and plan["optimizer"] is not None:
        _optimizer_of(optimizer).load_state_dict(plan["optimizer"])
    _set_rng_state(model, plan["rng"], plan["same_layout"])
    return plan["extra_state"]


def consolidate(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """One plain state dict of the whole model (single-process names, full tensors, tied weights under
    both names), from any layout's checkpoint, without processes: ``GPT(cfg).load_state_dict(it)``."""
    path = Path(path)
    manifest = _read_manifest(path)
    pieces: dict[str, list[dict]] = defaultdict(list)
    buffers: dict[str, torch.Tensor] = {}
    for fname in manifest["files"]:
        payload = _read_file(path, fname, manifest)
        for name, pc in payload["pieces"].items():
            pieces[name].append(pc)
        buffers.update(payload["buffers"])
    out = {name: _assemble(name, shape, pieces[name], lambda pc: pc["value"])
           for name, shape in manifest["params"].items()}
    for name in manifest["buffers"]:
        if name not in buffers:
            raise CheckpointError(f"buffer {name} is listed in the manifest but no file holds it")
        out[name] = buffers[name]
    for alias, name in manifest["aliases"].items():
        out[alias] = out[name]
    return out
