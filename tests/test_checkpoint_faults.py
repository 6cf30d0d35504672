"""Checkpoints that cannot be lost: a crash at every point of a save, a corrupted file that no rank
of the loading layout reads, and resuming when nothing was saved yet.

The crash tests make each filesystem change a save makes (``os.rename``, ``os.replace``,
``shutil.rmtree``) a crash point: the change at that point raises instead of happening (a removal
first deletes one file: a crash interrupts it half-way), and nothing after it runs, which is what a
killed process leaves. After each crash they check the invariant of ``minipar/checkpoint/files.py``:
every directory under a final (not dot-prefixed) name is complete (its manifest, every file it
lists at the listed size and sha256), and ``find_latest(root)`` returns a complete checkpoint, the
one it returned before the save began or the new one.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import pathlib
import shutil

import pytest
import torch

from minipar import Mesh, ShardedModule, checkpoint
from minipar.checkpoint import files
from minipar.models import GPT, GPTConfig

from helpers import EPS, LR, WD, train_rows


class _Crash(Exception):
    """The process died here."""


@contextlib.contextmanager
def _crash_at(point: int | None):
    """Crash at the ``point``-th filesystem change (counting from 0) made inside the block; yields the
    list of changes seen (name, path), so a caller knows when ``point`` was past the last one."""
    seen: list[tuple[str, str]] = []
    real = {"rename": os.rename, "replace": os.replace, "rmtree": shutil.rmtree}

    def change(name):
        def run(target, *args, **kwargs):
            seen.append((name, str(target)))
            if len(seen) - 1 == point:
                if name == "rmtree" and os.path.isdir(target):  # half-way: its first file is gone
                    first = sorted(p for p in pathlib.Path(target).rglob("*") if p.is_file())[:1]
                    for p in first:
                        p.unlink()
                raise _Crash(f"crashed at {name} {target}")
            return real[name](target, *args, **kwargs)
        return run

    os.rename, os.replace, shutil.rmtree = change("rename"), change("replace"), change("rmtree")
    try:
        yield seen
    finally:
        os.rename, os.replace, shutil.rmtree = real["rename"], real["replace"], real["rmtree"]


def _complete(d: pathlib.Path) -> bool:
    """``d`` has its manifest and every file it lists, at the listed size and sha256."""
    try:
        manifest = json.loads((d / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return all((d / f).is_file() and (d / f).stat().st_size == info["bytes"]
               and hashlib.sha256((d / f).read_bytes()).hexdigest() == info["sha256"]
               for f, info in manifest["files"].items())


# -- every crash point of the publishing sequence, at the file level ----------------------------------

def _save_files(path: pathlib.Path, tag: str) -> None:
    """What a save of two ranks does to the files, with ``tag`` as their contents: rank 0 begins,
    each rank writes its file into the temporary directory, rank 0 publishes."""
    tmp, infos = files.begin(path), []
    for r in range(2):
        fname, data = f"rank{r:05d}.pt", f"{tag}\n{r}\n".encode() * 50
        (tmp / fname).write_bytes(data)
        infos.append({"file": fname, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                      "params": [], "buffers": [], "shapes": {}, "buffer_shapes": {}, "aliases": {}})
    files.publish(path, tmp, infos, {"world": 2}, "AdamW")


def _try_save(path: pathlib.Path, tag: str, point: int | None) -> bool:
    """Save, crashing at ``point``; True if it crashed."""
    with _crash_at(point):
        try:
            _save_files(path, tag)
        except _Crash:
            return True
    return False


def _latest_tag(root: pathlib.Path) -> str | None:
    """The invariant, checked: every final name complete, ``latest`` holding a final name (before and
    after recovery), and the tag of what find_latest returns: a complete directory under a final name,
    the one ``latest`` names once find_latest has recovered what a crash left."""
    for d in root.iterdir():
        assert not d.is_dir() or d.name.startswith(".") or _complete(d), f"{d.name}: final name, incomplete"
    pointed = files._pointed(root)
    assert pointed is None or not pointed.startswith("."), f"latest names a hidden directory: {pointed}"
    latest = checkpoint.find_latest(root)
    if latest is None:
        return None
    assert _complete(latest), f"find_latest returned {latest.name}, which is incomplete"
    assert not latest.name.startswith("."), f"find_latest returned a hidden directory: {latest.name}"
    pointed = files._pointed(root)
    assert pointed is None or pointed == latest.name or not (root / pointed).exists(), (pointed, latest.name)
    return (latest / "rank00000.pt").read_text().split("\n")[0]


SCENARIOS = {  # name: (the checkpoints saved before, in order, and the name saved to)
    "first save": ([], "step_1"),
    "a new name": (["step_1"], "step_2"),
    "replace the only one": (["step_1"], "step_1"),
    "replace the latest": (["step_1", "step_2"], "step_2"),
    "replace an older one": (["step_1", "step_2"], "step_1"),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_crash_at_any_point_of_a_save_leaves_a_complete_latest(tmp_path, monkeypatch, scenario):
    """For every crash point k of a save, then every crash point j of the retry a restart makes:
    after each crash every final name is complete and find_latest returns a complete checkpoint,
    the one before the save or the new one; a save that runs through leaves no hidden leftovers."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # the crash is simulated: durability is not the point
    before, target = SCENARIOS[scenario]
    for k in itertools.count():
        root = tmp_path / f"k{k}"
        root.mkdir()
        for name in before:
            _save_files(root / name, name)
        previous = _latest_tag(root)
        assert previous == (before[-1] if before else None)
        crashed = _try_save(root / target, "new", k)
        after = _latest_tag(root)
        assert after in {previous, "new"}, (scenario, k, after)
        if not crashed:
            assert after == "new" and not [p for p in os.listdir(root) if p.startswith(".")], os.listdir(root)
            break
        for j in itertools.count():  # the restart saves the same name again, and may crash again
            again = tmp_path / f"k{k}-j{j}"
            shutil.copytree(root, again, symlinks=True)
            crashed_again = _try_save(again / target, "retry", j)
            assert _latest_tag(again) in {after, "retry"}, (scenario, k, j)
            _save_files(again / "step_9", "other")  # a save of another name finishes an interrupted replace
            assert _latest_tag(again) == "other"
            assert set(p for p in os.listdir(again) if p.startswith(".")) <= {f".{target}.tmp"}, os.listdir(again)
            _save_files(again / target, "last")
            assert _latest_tag(again) == "last" and not [p for p in os.listdir(again) if p.startswith(".")]
            if not crashed_again:
                break
        assert k < 20 and j < 20  # the sweeps ended: each save makes a handful of changes


# -- a real save re-saving the latest path, crashed at each point on rank 0 ---------------------------

def _cfg() -> dict:
    return dict(vocab_size=16, block_size=6, n_layer=2, n_head=2, n_embd=8, dropout=0.0, seed=3)


def _build(layout: dict, strategy: str):
    mesh = Mesh(**layout)
    model = ShardedModule(GPT(GPTConfig(**_cfg())), mesh=mesh, strategy=strategy, bucket_cap_mb=1e-3)
    return mesh, model, model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)


def _data() -> torch.Tensor:
    return torch.randint(0, 16, (2, 4, 7), generator=torch.Generator().manual_seed(7))


def _resave_crashed(ctx, root: pathlib.Path, point: int):
    """Save ``root/ckpt`` after one step, then again after two with rank 0 crashing at ``point``
    (every rank then sees the save fail); then, in a fresh model as a restart would, load
    find_latest(root). Returns (whether it crashed, the name found, the step it holds)."""
    mesh, model, opt = _build({}, "ddp")
    train_rows(model, opt, _data()[:1], 1.0)
    checkpoint.save(root / "ckpt", model, opt, extra_state={"step": 1})
    train_rows(model, opt, _data()[1:], 1.0)
    crashed = False
    with _crash_at(point if ctx.rank == 0 else None):
        try:
            checkpoint.save(root / "ckpt", model, opt, extra_state={"step": 2})
        except checkpoint.CheckpointError as e:
            assert "_Crash" in str(e), e
            crashed = True
    mesh.destroy()
    mesh, model, opt = _build({}, "ddp")
    latest = checkpoint.find_latest(root)
    extra = checkpoint.load(latest, model, opt)
    mesh.destroy()
    return crashed, latest.name, extra["step"]


def test_resaving_the_latest_path_never_loses_it(pools, tmp_path):
    """``save(root/"ckpt")`` twice, the second crashing on rank 0 at each of its filesystem changes
    in turn: a restart always finds a complete checkpoint under the name ``ckpt`` and loads it, the
    first one or the second. (Once minipar moved the old directory aside first, and a crash there left
    nothing to resume from; later ``latest`` named the temporary ``.ckpt.tmp`` during a replace, and a
    save reusing that path could remove the only copy.) A save that runs through leaves ``ckpt``
    holding step 2 and nothing hidden."""
    for point in itertools.count():
        root = tmp_path / f"p{point}"
        results = pools.run(2, _resave_crashed, root, point)
        crashed, name, step = results[0]
        assert all(r == results[0] for r in results), results
        assert name == "ckpt" and step in {1, 2}, (point, name, step)  # never a hidden name
        if not crashed:
            assert (name, step) == ("ckpt", 2) and sorted(os.listdir(root)) == ["ckpt", "latest"]
            break
        assert point < 20


def test_a_crash_between_the_two_renames_is_completed_or_rolled_back(tmp_path, monkeypatch):
    """The window of a replace: ``ckpt`` renamed aside, the new one not yet in its place. With the new
    one complete, find_latest completes the save (and load reads it); with the new one torn (never
    so after its manifest, but a disk can lose it), it rolls back to the old one. ``latest`` names
    ``ckpt`` throughout, and a later save to the same path keeps a complete copy at every point."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    for torn in (False, True):
        root = tmp_path / f"torn{torn}"
        root.mkdir()
        _save_files(root / "ckpt", "old")
        tmp = files.begin(root / "ckpt")
        (tmp / "rank00000.pt").write_bytes(b"new\n")
        files.write_json(tmp / "manifest.json", {"format": files.FORMAT, "version": files.VERSION, "files": {
            "rank00000.pt": {"sha256": hashlib.sha256(b"new\n").hexdigest(), "bytes": 4, "params": [],
                             "buffers": []}}})
        os.rename(root / "ckpt", root / ".ckpt.old")  # publish's step 2, then the crash
        if torn:
            (tmp / "rank00000.pt").unlink()
        assert files._pointed(root) == "ckpt" and not (root / "ckpt").exists()
        assert _latest_tag(root) == ("old" if torn else "new")
        assert sorted(p for p in os.listdir(root) if not p.startswith(".")) == ["ckpt", "latest"]
        _save_files(root / "ckpt", "after")
        assert _latest_tag(root) == "after" and not [p for p in os.listdir(root) if p.startswith(".")]


# -- every file is verified, also those no rank reads -------------------------------------------------

def _save_ddp(ctx, path: pathlib.Path):
    mesh, model, opt = _build({}, "ddp")
    train_rows(model, opt, _data()[:1], 1.0)
    checkpoint.save(path, model, opt, extra_state={"step": 1})
    mesh.destroy()


def _moments(opt) -> list[torch.Tensor]:
    return [v.clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]


def _load_tp(ctx, path: pathlib.Path):
    """Load into tp=2 (another layout: both ranks read rank00000.pt only); the error, or None, and
    whether any parameter or optimizer state changed."""
    mesh, model, opt = _build({"tp": 2}, "ddp")
    train_rows(model, opt, _data()[:1], 1.0)
    params, moments = {k: v.clone() for k, v in model.full_state_dict().items()}, _moments(opt)
    error = None
    try:
        checkpoint.load(path, model, opt)
    except checkpoint.CheckpointError as e:
        error = str(e)
    changed = any(not torch.equal(v, params[k]) for k, v in model.full_state_dict().items()) or \
        any(not torch.equal(a, b) for a, b in zip(_moments(opt), moments))
    mesh.destroy()
    return error, changed


def test_a_corrupted_file_no_rank_reads_is_refused_on_every_rank(pools, tmp_path):
    """Saved under DDP over 2 ranks (rank 1's file holds no parameter: replicas leave them to rank
    0) and loaded under tp=2, which reads rank00000.pt only: one flipped byte in rank00001.pt (size
    unchanged) is refused with CheckpointError on every rank (rank 1 checksums it, the agreement
    tells rank 0) and nothing changes; the intact checkpoint loads."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    pools.run(2, _save_ddp, good)
    manifest = json.loads((good / "manifest.json").read_text())
    assert manifest["files"]["rank00001.pt"]["params"] == [] and manifest["files"]["rank00001.pt"]["buffers"] == []
    shutil.copytree(good, bad)
    f = bad / "rank00001.pt"
    blob = bytearray(f.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    f.write_bytes(bytes(blob))
    for error, changed in pools.run(2, _load_tp, bad):
        assert error is not None and "rank00001.pt: sha256 differs from the manifest's" in error, error
        assert not changed
    for error, _ in pools.run(2, _load_tp, good):
        assert error is None, error


# -- nothing saved yet -------------------------------------------------------------------------------

def _resume_or_start(ctx, root: pathlib.Path, mixed: bool):
    """The resume of docs/checkpoints.md: load find_latest(root) when there is one, else start at step 0; then
    what load(None) says (on one rank only when ``mixed``: the other passes a path)."""
    mesh, model, opt = _build({}, "ddp")
    path = checkpoint.find_latest(root)
    start = checkpoint.load(path, model, opt)["step"] if path is not None else 0
    given = None if (ctx.rank == 0 or not mixed) else root / "missing"
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(given, model, opt)
    mesh.destroy()
    return start, str(info.value)


@pytest.mark.parametrize("root_exists", [False, True])
def test_nothing_saved_yet(pools, tmp_path, root_exists):
    """find_latest of a missing or empty root is None, so ``if path is not None: load(path, ...)``
    starts fresh; load(None) is a CheckpointError that says so, on every rank (also when only one
    rank passes None: no rank hangs), not a TypeError; consolidate(None) too."""
    root = tmp_path / "run"
    if root_exists:
        root.mkdir()
    assert checkpoint.find_latest(root) is None
    for mixed in (False, True):
        for start, message in pools.run(2, _resume_or_start, root, mixed):
            assert start == 0
            assert "rank 0: there is no checkpoint to load: the path is None" in message, message
            assert "if path is not None: checkpoint.load(path, model, opt)" in message
    with pytest.raises(checkpoint.CheckpointError, match="nothing was saved"):
        checkpoint.consolidate(None)
