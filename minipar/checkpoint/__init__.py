"""Sharded checkpoints: every rank writes its own shard, any layout reads them back.

    from minipar import checkpoint
    checkpoint.save(root / "step_00000100", model, opt, extra_state={"step": 100})
    path = checkpoint.find_latest(root)                                 # None: nothing saved yet
    extra = checkpoint.load(path, model, opt) if path is not None else {"step": 0}  # any layout
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
name and shape) last, then renames the directory into place (an existing one
moved aside first) and points ``<root>/latest`` at it (each step an atomic
rename). ``latest`` only ever holds a final name; a crash between the two
renames of a replace leaves that name missing for a moment, and `find_latest`,
`load` and the next save first complete the save (its files were all written)
or roll it back. So `find_latest` returns a complete checkpoint, the previous
one or the new one (the sequence: ``files.py``'s docstring).

Never trusted. Loading refuses, with the reason, on every rank and before
changing anything: a directory without a manifest (a save that did not
finish), a file whose size or checksum differs from the manifest (truncated,
corrupted: every file is checked, also those this layout does not read,
each by one rank), a checkpoint of another model (names or shapes differ)
or optimizer, and a file that is not plain tensors: every file is read with
``torch.load(weights_only=True)``, so no code in a checkpoint ever runs.

Collectives go through ``mesh.comm``; every rank runs the same ones in the
same order, and each phase ends with an agreement (`_agree`) so that a
failure on one rank becomes a ValueError on all of them, not a hang.

Said, not silent: `save` and `load` print one line on rank 0, what they wrote or read
and how long it took ("checkpoint: saved step 120: 3 files, 48.2 MB, 0.41 s -> ckpt/step_120");
``report=False`` silences it.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from .files import (FORMAT, VERSION, CheckpointError, begin, check_plain, check_sums, find_latest, publish, recover,
                    read_manifest, read_rank_file, sha256_of, step_path, temporary)
from .rng import rng_state, set_rng_state
from .pieces import (Slot, agreed, assemble_full, cut_local, global_names, layout_of, missing_or_different,
                     optimizer_of, slots_of, split_state)

__all__ = ["save", "load", "consolidate", "find_latest", "step_path", "CheckpointError"]


# -- agreement ---------------------------------------------------------------------------------------

_SAVE_FIX = " (find_latest still returns the checkpoint saved before): free space or make the directory writable, " \
    "then save again"  # what a save that failed in the file system says to do


def _agree(mesh, what: str, error: str | None, payload: Any = None, fix: str = "") -> list[Any]:
    """Every rank's ``payload`` (one collective); CheckpointError on every rank if any rank had an error."""
    everyone = mesh.comm.all_gather_object((error, payload), mesh.world, tag="checkpoint")
    failed = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
    if failed:
        lines = "\n".join(f"  rank {r}: {e}" for r, e in failed)
        raise CheckpointError(f"{what} failed; nothing was changed{fix}:\n{lines}")
    return [p for _, p in everyone]


# -- save --------------------------------------------------------------------------------------------

@torch.no_grad()
def save(path: str | os.PathLike, model, optimizer, extra_state: Any = None, report: bool = True) -> Path:
    """Write a checkpoint of ``model`` (a `ShardedModule`) and ``optimizer`` (from ``model.build_optimizer``)
    into the directory ``path``; call it on every rank. Returns ``path``.

    ``extra_state`` (this rank's: step counter, data position, scheduler state...) must be made of
    tensors, numbers, strings and containers of them. An existing checkpoint at ``path`` is replaced.
    ``report``: rank 0 prints what it wrote and how long it took (`_report`); False is silent.
    """
    mesh, path, start = model.mesh, Path(path), time.perf_counter()
    error = None
    try:
        check_plain(extra_state)
    except ValueError as e:
        error = str(e)
    paths = _agree(mesh, "checkpoint.save: the arguments check", error, str(path.resolve()))
    if len(set(paths)) > 1:
        raise CheckpointError(f"checkpoint.save was given different paths on different ranks: {sorted(set(paths))}; "
                              "pass the same directory on every rank")
    tmp = temporary(path)
    error = None
    if mesh.rank == 0:
        try:
            begin(path)
        except Exception as e:  # noqa: BLE001 -- any failure must reach every rank, not hang them
            error = f"cannot create {tmp}: {type(e).__name__}: {e}"
    _agree(mesh, "checkpoint.save: creating the directory", error, fix=_SAVE_FIX)

    opt = optimizer_of(optimizer)
    group_of = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
    pieces = {}
    with model.strategy.offloaded_state():  # (optimizer state kept in files comes back for the copy)
        slots = slots_of(model)
        for s in slots:
            if not s.writes:
                continue
            n = s.hi - s.lo
            per_elem, scalars = split_state(opt.state.get(s.owner, {}), s.owner)
            pieces[s.name] = {"chunks": s.chunks, "lo": s.lo, "hi": s.hi,
                              "value": s.owner.detach().reshape(-1)[s.at:s.at + n].clone(),
                              "state": {k: v.reshape(-1)[s.at:s.at + n].clone() for k, v in per_elem.items()},
                              "scalars": {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()},
                              "group": group_of.get(id(s.owner), 0)}
    names, aliases = global_names(model)
    first_replica = mesh.dp_rank == 0 and mesh.cp_rank == 0 and mesh.tp_rank == 0
    buffers = {names[id(b)]: b.detach().clone() for b in model.module.buffers() if id(b) in names} \
        if first_replica else {}
    scaler = model.strategy.scaler
    payload = {"format": FORMAT, "version": VERSION, "rank": mesh.rank, "pieces": pieces, "buffers": buffers,
               "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
               "rng": rng_state(model), "scaler": scaler.state_dict() if scaler is not None else None,
               "extra_state": extra_state, "optimizer_rank_state": getattr(opt, "rank_state", lambda: None)()}
    fname = f"rank{mesh.rank:05d}.pt"
    error, info = None, None
    try:
        with open(tmp / fname, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        info = {"file": fname, "sha256": sha256_of(tmp / fname), "bytes": (tmp / fname).stat().st_size,
                "params": sorted(pieces), "buffers": sorted(buffers),
                "shapes": {s.name: list(s.full_shape) for s in slots},
                "buffer_shapes": {names[id(b)]: list(b.shape) for b in model.module.buffers() if id(b) in names},
                "aliases": aliases}
    except Exception as e:  # noqa: BLE001 -- any failure must reach every rank, not hang them
        error = f"writing {tmp / fname}: {type(e).__name__}: {e}"
    infos = _agree(mesh, "checkpoint.save: writing the rank files", error, info, fix=_SAVE_FIX)

    error = None
    if mesh.rank == 0:
        try:
            publish(path, tmp, infos, layout_of(model), type(opt).__name__)
        except Exception as e:  # noqa: BLE001
            error = f"publishing {path}: {type(e).__name__}: {e}"
    _agree(mesh, "checkpoint.save: publishing", error, fix=_SAVE_FIX)
    if report and mesh.rank == 0:
        _report("saved", extra_state, len(infos) + 1, sum(i["bytes"] for i in infos), start, f"-> {path}")
    return path


def _report(what: str, extra_state: Any, files: int, nbytes: int, start: float, where: str) -> None:
    """One line, e.g. "checkpoint: saved step 120: 3 files, 48.2 MB, 0.41 s -> ckpt/step_120" (the step
    when ``extra_state`` is a dict with an integer "step"; the files counted with the manifest)."""
    step = extra_state.get("step") if isinstance(extra_state, dict) else None
    label = f"step {step}: " if isinstance(step, int) and not isinstance(step, bool) else ""
    print(f"checkpoint: {what} {label}{files} files, {nbytes / 1e6:.1f} MB, {time.perf_counter() - start:.2f} s "
          f"{where}", flush=True)


# -- load --------------------------------------------------------------------------------------------

@torch.no_grad()
def load(path: str | os.PathLike | None, model, optimizer, report: bool = True) -> Any:
    """Load the checkpoint at ``path`` into ``model`` and ``optimizer`` (built as for `save`, under
    any layout); call it on every rank. Returns this rank's ``extra_state`` (rank 0's when the
    layout changed).

    Under the layout it was saved with, every rank gets back its own RNG states; under another,
    every rank gets rank 0's torch/Python/NumPy states and the device and tensor-parallel dropout
    streams are left as they are (they are per rank). Raises `CheckpointError` (a ValueError) on
    every rank, having changed nothing, when the checkpoint is incomplete, corrupted, not plain
    tensor data, or of another model or optimizer, and when ``path`` is None (what `find_latest`
    returns when nothing was saved yet: check for it to start fresh). ``report``: rank 0 prints the
    checkpoint's size, the time the load took and whether it was resharded; False is silent.
    """
    mesh, path, start = model.mesh, (Path(path) if path is not None else None), time.perf_counter()
    slots = slots_of(model)
    names, _ = global_names(model)
    my_params = {s.name: list(s.full_shape) for s in slots}
    my_buffers = {names[id(b)]: list(b.shape) for b in model.module.buffers() if id(b) in names}
    error = None if path is not None else (
        "there is no checkpoint to load: the path is None, which is what find_latest(root) returns when "
        "nothing was saved under root yet; to start fresh then, load only when there is one: "
        "`path = checkpoint.find_latest(root)` and `if path is not None: checkpoint.load(path, model, opt)`")
    everyone = _agree(mesh, "checkpoint.load: the arguments check", error,
                      (str(path.resolve()) if path is not None else None, my_params, my_buffers))
    if len({p for p, _, _ in everyone}) > 1:
        raise CheckpointError(f"checkpoint.load was given different paths on different ranks: "
                              f"{sorted({p for p, _, _ in everyone})}; pass the same directory on every rank")
    all_params = {k: v for _, ps, _ in everyone for k, v in ps.items()}
    all_buffers = {k: v for _, _, bs in everyone for k, v in bs.items()}

    error, plan = None, None
    # Optimizer state kept in files (offload "nvme") is in memory for the block, written back after.
    with model.strategy.offloaded_state(write_back=True):
        try:
            plan = _prepare(path, model, optimizer, slots, all_params, all_buffers)
        except CheckpointError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 -- anything unexpected is still a refusal on every rank
            error = f"{type(e).__name__}: {e}" + ("; fix the file system and load again" if isinstance(e, OSError) else "")
        _agree(mesh, f"checkpoint.load of {path}", error)
        extra_state = _apply(model, optimizer, plan)
    if report and mesh.rank == 0:
        _report("loaded", extra_state, plan["files"], plan["bytes"], start,
                f"<- {path}" + ("" if plan["same_layout"] else " (resharded from another layout)"))
    return extra_state


def _prepare(path: Path, model, optimizer, slots: list[Slot], all_params: dict, all_buffers: dict) -> dict:
    """Everything ``load`` will write, computed without touching the model: any error is raised here."""
    mesh = model.mesh
    recover(path.parent)  # a save that a crash interrupted between its renames: completed or rolled back
    manifest = read_manifest(path)
    problem = missing_or_different(manifest, all_params, all_buffers)
    if problem:
        raise CheckpointError(problem)
    topt = optimizer_of(optimizer) if optimizer is not None else None
    if topt is not None and manifest["optimizer"] != type(topt).__name__:
        raise CheckpointError(f"the checkpoint's optimizer is {manifest['optimizer']}, this one is "
                              f"{type(topt).__name__}: build the optimizer the checkpoint was saved with")
    same_layout = {k: v for k, v in manifest["layout"].items() if k != "strategy"} == \
        {k: v for k, v in layout_of(model).items() if k != "strategy"}
    own = f"rank{mesh.rank if same_layout else 0:05d}.pt"
    names, _ = global_names(model)
    my_buffers = {names[id(b)] for b in model.module.buffers() if id(b) in names}
    wanted = {s.name for s in slots if s.hi > s.lo}
    files = [f for f, info in manifest["files"].items()
             if f == own or wanted & set(info["params"]) or my_buffers & set(info["buffers"])]
    # Every file is checksummed by someone, also those no rank reads (a corrupted one is a bad
    # checkpoint all the same): each rank its share, besides the files it reads (checked as read).
    share = sorted(manifest["files"])[mesh.rank::mesh.world_size]
    check_sums(path, manifest, [f for f in share if f not in files])
    payloads = {f: read_rank_file(path, f, manifest) for f in files}
    if payloads[own].get("optimizer_rank_state") is not None and (not same_layout or topt is None):
        raise CheckpointError(f"the checkpoint holds per-rank {manifest['optimizer']} state (1-bit Adam's error "
                              "feedback): load it with that optimizer under the layout it was saved with")
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
        values[id(s.param)] = cut_local(assemble_full(s.name, shape, ps, lambda pc: pc["value"]), s)
        keys = [sorted(pc["state"]) for pc in ps]
        keys = agreed(keys, f"{s.name}: the optimizer state keys")
        per_elem = {k: cut_local(assemble_full(s.name, shape, ps, lambda pc, k=k: pc["state"][k]), s) for k in keys}
        scalars = agreed([pc["scalars"] for pc in ps], f"{s.name}: the optimizer's scalar state")
        group = agreed([pc["group"] for pc in ps], f"{s.name}: the optimizer's parameter group")
        states[id(s.param)] = (per_elem, scalars, ps[0]["hyper"], group) if keys or scalars else None

    # Per tensor the optimizer steps (a parameter, or a ZeRO master holding many): its new contents.
    owners: dict[int, list[Slot]] = defaultdict(list)
    for s in slots:
        owners[id(s.owner)].append(s)
    new_owner, new_state, hyper_of, group_of = {}, {}, {}, {}
    for group in owners.values():
        owner, filled = group[0].owner, [s for s in group if s.hi > s.lo]
        flat = owner.detach().reshape(-1).clone()
        for s in filled:
            flat[s.at:s.at + s.hi - s.lo] = values[id(s.param)]
        if filled:  # (a master named only by parameters it holds nothing of may overlap pieces that are written)
            new_owner[id(owner)] = (owner, flat)
        has = [states[id(s.param)] is not None for s in filled]
        if filled and any(has) and not all(has):
            raise CheckpointError(f"the optimizer has state for {[s.name for s, h in zip(filled, has) if h][:3]} but "
                                  f"not for {[s.name for s, h in zip(filled, has) if not h][:3]}, which this layout "
                                  "steps as one tensor; load this checkpoint under a DDP layout")
        if filled and all(has):
            keys = agreed([sorted(states[id(s.param)][0]) for s in filled], "the optimizer state keys")
            state = {}
            for k in keys:
                t = torch.zeros(owner.numel(), dtype=states[id(filled[0].param)][0][k].dtype)
                for s in filled:
                    t[s.at:s.at + s.hi - s.lo] = states[id(s.param)][0][k]
                state[k] = t.view(owner.shape)
            # A copy per tensor: pieces read from one file share their scalar tensors (torch.load keeps
            # aliasing), and AdamW increments ``step`` in place, once per tensor it steps.
            scalars = agreed([states[id(s.param)][1] for s in filled], "the optimizer's scalar state")
            state.update({k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()})
            new_state[id(owner)] = state
            hyper_of[id(owner)] = [states[id(s.param)][2] for s in filled]
            group_of[id(owner)] = (filled[0].name, [states[id(s.param)][3] for s in filled])

    opt_sd = None
    if topt is not None:
        sd_state, groups, index = {}, [], 0
        saved_groups = len(payloads[own]["param_groups"]) if payloads[own]["param_groups"] else 1
        for gi, g in enumerate(topt.param_groups):
            # As torch's load_state_dict: the same parameter groups, the checkpoint's hyperparameters.
            for p in g["params"]:
                name, saved = group_of.get(id(p), (None, [gi]))
                if len(topt.param_groups) != saved_groups or any(k != gi for k in saved):
                    raise CheckpointError(
                        f"the checkpoint's optimizer has {saved_groups} parameter group(s) and {name} in group "
                        f"{saved[0]}; this one has {len(topt.param_groups)} and {name} in group {gi}: build the "
                        "optimizer with the parameter groups the checkpoint was saved with")
            hyper = [h for p in g["params"] for h in hyper_of.get(id(p), []) if h is not None]
            merged = {k: v for k, v in g.items() if k != "params"}
            if hyper:
                merged.update(agreed(hyper, "the optimizer hyperparameters (lr, betas, weight decay...)"))
            groups.append({**merged, "params": list(range(index, index + len(g["params"])))})
            for p in g["params"]:
                if id(p) in new_state:
                    sd_state[index] = new_state[id(p)]
                index += 1
        opt_sd = {"state": sd_state, "param_groups": groups}
    own_payload = payloads[own]
    return {"owners": list(new_owner.values()), "optimizer": opt_sd, "files": len(manifest["files"]) + 1,
            "bytes": sum(info["bytes"] for info in manifest["files"].values()),
            "buffers": {b: buffers[names[id(b)]] for b in model.module.buffers() if id(b) in names},
            "rng": own_payload["rng"], "same_layout": same_layout, "scaler": own_payload["scaler"],
            "extra_state": own_payload["extra_state"], "rank_state": own_payload.get("optimizer_rank_state")}


def _apply(model, optimizer, plan: dict) -> Any:
    """Write what `_prepare` computed. The only collective: ZeRO-1/2 all-gather the new parameters."""
    for owner, flat in plan["owners"]:
        owner.detach().view(-1).copy_(flat)
    for b, value in plan["buffers"].items():
        b.copy_(value)
    model.strategy.refresh_params()  # the compute parameters follow what the optimizer steps
    if plan["scaler"] is not None and model.strategy.scaler.enabled:
        model.strategy.scaler.load_state_dict(plan["scaler"])
    if optimizer is not None and plan["optimizer"] is not None:
        optimizer_of(optimizer).load_state_dict(plan["optimizer"])
        if plan["rank_state"] is not None:
            optimizer_of(optimizer).load_rank_state(plan["rank_state"])
    set_rng_state(model, plan["rng"], plan["same_layout"])
    return plan["extra_state"]


def consolidate(path: str | os.PathLike | None) -> dict[str, torch.Tensor]:
    """One plain state dict of the whole model (single-process names, full tensors, tied weights under
    both names), from any layout's checkpoint, without processes: ``GPT(cfg).load_state_dict(it)``."""
    if path is None:
        raise CheckpointError("consolidate(None): there is no checkpoint (find_latest(root) returns None "
                              "when nothing was saved under root)")
    path = Path(path)
    manifest = read_manifest(path)
    pieces: dict[str, list[dict]] = defaultdict(list)
    buffers: dict[str, torch.Tensor] = {}
    for fname in manifest["files"]:
        payload = read_rank_file(path, fname, manifest)
        for name, pc in payload["pieces"].items():
            pieces[name].append(pc)
        buffers.update(payload["buffers"])
    out = {name: assemble_full(name, shape, pieces[name], lambda pc: pc["value"])
           for name, shape in manifest["params"].items()}
    for name in manifest["buffers"]:
        if name not in buffers:
            raise CheckpointError(f"buffer {name} is listed in the manifest but no file holds it")
        out[name] = buffers[name]
    for alias, name in manifest["aliases"].items():
        out[alias] = out[name]
    return out
