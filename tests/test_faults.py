"""Faults under last round's features (issue 29, point 4): a file system that refuses or fills, a rank
killed in the middle of a step or a save, a worker whose step fails, and NaN/inf in the loss. Each
case ends in an error on every rank that says what to do, or in correct behaviour; never in a hang,
an abort deep in a collective, a silently wrong model, or a lost or torn checkpoint.

* Killed ranks (SIGKILL, as tests/test_checkpoint.py does; the pool reports the dead rank as a
  `RankError`): in the middle of an offloaded step (optimizer state and zero3 parameters in files),
  and in the middle of a save under context parallelism and under HSDP. Afterwards `find_latest`
  names the last complete checkpoint, and new processes that load it into new models and train on
  end with the parameters of a run that was never interrupted: bit for bit under the same layout,
  at fp32 tolerances under another.
* File systems: a full disk, a refused or read-only directory and a failing read, injected by
  replacing ``torch.save``, ``os.mkdir``, ``open`` or the offload files' system-call wrappers
  (``minipar.data_parallel.disk._pread_into``/``_pwrite``) on one rank (the tests run as root, which no
  permission bit stops).
* NaN/inf in one rank's loss: every rank agrees. With fp16 loss scaling the step is skipped on every
  rank and the scale halves (the parameters stay as they were, and the next step trains); in fp32
  every rank ends with the NaN parameters one process would have, bitwise the same everywhere.
* A user's code that fails on some ranks only: a parameter server's worker whose step raises (every
  rank stops at once); a pipeline stage that fails mid-step (a loss function on the last stage, a
  forward on the first, with 2 and 4 stages): every stage stops at once, naming the failed stage and
  its error (`minipar.pipeline.abort`).
* Checkpoints across schedules and layouts (an interleaved pipeline into ZB-V, ZB-H1 into context
  parallelism; cp and HSDP into plain data parallelism after the kills above).

Bad configurations and inputs are in tests/test_bad_inputs.py.
"""

from __future__ import annotations

import builtins
import errno
import math
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from minipar import (Mesh, MixedPrecision, Offload, OffloadError, OneBitAdam, ParameterServer,
                     ShardedModule, checkpoint)
from minipar.data_parallel import disk as disk_module
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.testing import RankError

from helpers import EPS, LR, WD, train_rows

CFG = dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.0, seed=3)
MAX_NORM = 0.05  # below every gradient norm here: clipping always fires
FP16 = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32, init_scale=2.0**8)
CHUNK_MB = 100 * 4 / 2**20  # 100 fp32 elements per chunk of the nvme step: a step writes many


def _data(steps: int, rows: int = 4, seed: int = 0) -> torch.Tensor:
    """(steps, global batch, seq + 1) token ids."""
    return torch.randint(0, 16, (steps, rows, 9), generator=torch.Generator().manual_seed(seed))


def _build(sizes: dict, options: dict, seed: int = 3, **cfg):
    """The tiny GPT (``cfg`` changing CFG) wrapped over ``Mesh(**sizes)``, and its AdamW."""
    mesh = Mesh(**sizes)
    model = ShardedModule(GPT(GPTConfig(**{**CFG, "seed": seed, **cfg})), mesh=mesh, **options)
    return mesh, model, model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().cpu() for k, v in model.full_state_dict().items()}


def _offload(path) -> Offload:
    return Offload(optimizer="nvme", params="nvme", path=path, chunk_mb=CHUNK_MB)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _eio(*args, **kwargs):
    raise OSError(errno.EIO, os.strerror(errno.EIO))


def _erofs(*args, **kwargs):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS))


# -- a rank killed mid-step or mid-save, then a resume that equals the uninterrupted run -----------------

def _kill_self(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def _die_while_saving(ctx, sizes, options, data, root, victim):
    """Step 0, save step_1, step 1, then the save of step_2, in which ``victim`` dies half-way
    through writing its rank file."""
    mesh, model, opt = _build(sizes, options)
    train_rows(model, opt, data[0:1], MAX_NORM)
    checkpoint.save(checkpoint.step_path(root, 1), model, opt, extra_state={"step": 1})
    train_rows(model, opt, data[1:2], MAX_NORM)
    if ctx.rank == victim:
        real_save = torch.save

        def save_half_then_die(obj, f, *args, **kwargs):
            real_save({"half": torch.zeros(1000)}, f)
            f.flush()
            _kill_self()
        torch.save = save_half_then_die
    checkpoint.save(checkpoint.step_path(root, 2), model, opt, extra_state={"step": 2})


def _die_in_an_offloaded_step(ctx, data, root, path):
    """Zero3 with optimizer state and parameters in files: step 0, save step_1, then step 1, whose
    optimizer step kills rank 1 at its first file write (the other rank is mid-step too)."""
    mesh, model, opt = _build({}, dict(strategy="zero3", offload=_offload(path)))
    train_rows(model, opt, data[0:1], MAX_NORM)
    checkpoint.save(checkpoint.step_path(root, 1), model, opt, extra_state={"step": 1})
    local = data.shape[1] // mesh.dp
    x = data[1, mesh.dp_rank * local:(mesh.dp_rank + 1) * local]
    model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy)
    model.clip_grad_norm_(MAX_NORM)
    if ctx.rank == 1:
        disk_module._pwrite = _kill_self
    opt.step()


def _straight_and_resumed(ctx, sizes, options, data, root, offload_path=None, n_layer=2):
    """The uninterrupted run over every step of ``data``, and a new model (other initial weights: all
    must come from the files) loaded from find_latest(root) that trains the remaining steps."""
    if offload_path is not None:
        options = dict(options, offload=_offload(Path(offload_path) / "straight"))
    mesh, model, opt = _build(sizes, options, n_layer=n_layer)
    train_rows(model, opt, data, MAX_NORM)
    straight = _state(model)
    mesh.destroy()
    if offload_path is not None:
        options = dict(options, offload=_offload(Path(offload_path) / "resumed"))
    mesh, model, opt = _build(sizes, options, seed=99, n_layer=n_layer)
    latest = checkpoint.find_latest(root)
    start = checkpoint.load(latest, model, opt)["step"]
    train_rows(model, opt, data[start:], MAX_NORM)
    resumed = _state(model)
    mesh.destroy()
    return latest.name, start, straight, resumed


# (name, world, mesh, options, the rank killed, a second layout to resume under: world, mesh, options)
SAVE_KILLS = [
    ("cp", 2, dict(cp=2), dict(strategy="zero2", context_parallel="ring"), 1, (2, {}, dict(strategy="ddp"))),
    ("HSDP", 4, dict(dp_shard=2), dict(strategy="zero3"), 2, (2, {}, dict(strategy="zero2"))),
]


@pytest.mark.parametrize("name, world, sizes, options, victim, elsewhere", SAVE_KILLS, ids=[c[0] for c in SAVE_KILLS])
def test_a_rank_killed_during_a_save_resumes_to_the_uninterrupted_run(pools, tmp_path, name, world, sizes, options,
                                                                     victim, elsewhere):
    """The victim is SIGKILLed half-way through its rank file of the second checkpoint: the first
    stays the latest, the torn one never appears under its name, and new processes resume from it
    to the uninterrupted run's parameters: bitwise under the same layout, at fp32 tolerances under
    another (dp=2 without cp or HSDP, another strategy: other summation orders)."""
    data = _data(3)
    with pytest.raises(RankError, match=f"rank {victim} died"):
        pools.run(world, _die_while_saving, sizes, options, data, tmp_path, victim, timeout=60)
    assert not (tmp_path / "step_00000002").exists()
    assert checkpoint.find_latest(tmp_path) == checkpoint.step_path(tmp_path, 1)
    for rank, (latest, start, straight, resumed) in enumerate(pools.run(world, _straight_and_resumed, sizes, options,
                                                                        data, tmp_path)):
        assert (latest, start) == ("step_00000001", 1), rank
        assert _equal(straight, resumed), f"rank {rank}: the resumed {name} run differs from the uninterrupted one"
    world2, sizes2, options2 = elsewhere
    for _, _, _, other in pools.run(world2, _straight_and_resumed, sizes2, options2, data, tmp_path):
        for k in straight:
            torch.testing.assert_close(other[k], straight[k], msg=lambda m: f"{k} resumed under {sizes2}: {m}")


def test_a_rank_killed_during_an_offloaded_step_resumes_to_the_uninterrupted_run(pools, tmp_path):
    """Rank 1 is SIGKILLed at its first file write of an nvme optimizer step (its offload files, and
    rank 0's, then hold a mix of two steps). The checkpoint saved before is the latest; new processes
    with new offload files resume from it to the uninterrupted run's parameters, bit for bit."""
    data = _data(3)
    (tmp_path / "offload").mkdir()
    with pytest.raises(RankError, match="rank 1 died"):
        pools.run(2, _die_in_an_offloaded_step, data, tmp_path / "ck", tmp_path / "offload", timeout=60)
    assert checkpoint.find_latest(tmp_path / "ck") == checkpoint.step_path(tmp_path / "ck", 1)
    (tmp_path / "offload" / "straight").mkdir()
    (tmp_path / "offload" / "resumed").mkdir()
    for rank, (latest, start, straight, resumed) in enumerate(pools.run(
            2, _straight_and_resumed, {}, dict(strategy="zero3"), data, tmp_path / "ck", tmp_path / "offload")):
        assert (latest, start) == ("step_00000001", 1), rank
        assert _equal(straight, resumed), f"rank {rank}: the resumed offloaded run differs from the uninterrupted one"


def _save_after_one_step(ctx, sizes, options, n_layer, data, root):
    mesh, model, opt = _build(sizes, options, n_layer=n_layer)
    train_rows(model, opt, data[0:1], MAX_NORM)
    checkpoint.save(checkpoint.step_path(root, 1), model, opt, extra_state={"step": 1})
    mesh.destroy()


PP = dict(pp=2)
CROSS = [  # (name, saved under: mesh, options; loaded under: mesh, options), all on 2 ranks, 4 blocks
    ("interleaved 1F1B -> zb_v", PP, dict(strategy="zero1", schedule="interleaved_1f1b", microbatches=2),
     PP, dict(strategy="zero3", schedule="zb_v", microbatches=2)),
    ("zb_h1 -> cp", PP, dict(strategy="zero3", schedule="zb_h1", microbatches=2),
     dict(cp=2), dict(strategy="zero2", context_parallel="ulysses")),
]


@pytest.mark.parametrize("name, sizes, options, sizes2, options2", CROSS, ids=[c[0] for c in CROSS])
def test_a_checkpoint_resumes_under_another_schedule_or_layout(pools, tmp_path, name, sizes, options, sizes2,
                                                               options2):
    """Saved after one step under one pipeline schedule (its model chunks placed another way) and
    loaded into a new model under another schedule or under context parallelism: two more steps
    there equal three steps under the loading layout, at fp32 tolerances (the first step's
    summation order was the saving layout's)."""
    data = _data(3)
    pools.run(2, _save_after_one_step, sizes, options, 4, data, tmp_path)
    for _, _, straight, resumed in pools.run(2, _straight_and_resumed, sizes2, options2, data, tmp_path, n_layer=4):
        for k in straight:
            torch.testing.assert_close(resumed[k], straight[k], msg=lambda m: f"{name}: {k}: {m}")


# -- a parameter server's worker whose step fails -------------------------------------------------------

def _ps_worker_fails(ctx, mode: str, servers: int):
    """The last worker's second batch has a token id outside the vocabulary: its forward raises. Then
    a new ParameterServer on the same ranks trains a step: nothing of the failed run is left in flight."""
    def run(bad: bool):
        ps = ParameterServer(GPT(GPTConfig(**CFG)), Mesh(), torch.optim.SGD, servers=servers, mode=mode, lr=0.1)
        try:
            if ps.is_server:
                ps.serve()
                return "served"
            for step in range(3):
                x = _data(1, 2, seed=ctx.rank * 10 + step)[0]
                if bad and ctx.rank == ctx.world_size - 1 and step == 1:
                    x[0, 3] = 99
                ps.train_step(x[:, :-1], x[:, 1:], gpt_loss)
            ps.finish()
            return "finished"
        except (RuntimeError, IndexError) as e:
            return f"{type(e).__name__}: {e}"
    return run(bad=True), run(bad=False)


@pytest.mark.parametrize("mode, world, servers", [("sync", 4, 1), ("async", 4, 2)])
def test_a_parameter_server_worker_whose_step_fails_stops_every_rank(pools, mode, world, servers):
    """The failing worker raises its own error (IndexError); every server and the other workers raise
    a RuntimeError naming it, instead of waiting for its gradient forever (before: a hang, the pool's
    timeout). In async mode with two servers a worker may have been answered by one server before it
    heard of the failure: it tells that server it leaves. A new server on the same ranks then trains."""
    out = pools.run(world, _ps_worker_fails, mode, servers, timeout=60)
    last = world - 1
    for rank, (failed_run, next_run) in enumerate(out):
        if rank == last:
            assert failed_run.startswith("IndexError"), failed_run
        else:
            assert f"worker rank {last} failed in its step" in failed_run and "start again" in failed_run, \
                (rank, failed_run)
        assert next_run == ("served" if rank < servers else "finished"), (rank, next_run)


# -- a stage that fails in the middle of a pipeline step ----------------------------------------------------

# (layout, options, n_layer, what fails): a pp group of its own (dp beside it), so the unmatched messages a
# failed step leaves go with its mesh's groups and not into the world's channels the pool keeps
STAGE_FAULTS = {
    "loss on the last stage, 1f1b": (dict(pp=2), dict(microbatches=2), 2, "loss"),
    "first stage's second forward, zb_v": (dict(pp=2), dict(schedule="zb_v", microbatches=2), 4, "forward"),
    "loss on the last of 4 stages, interleaved": (dict(pp=4), dict(schedule="interleaved_1f1b", microbatches=4),
                                                  8, "loss"),
}
STAGE_FAULT_TIMEOUT_S = 60  # the mesh's: every stage must raise well before it


def _pipeline_stage_fails(ctx, case: str):
    sizes, options, n_layer, what = STAGE_FAULTS[case]
    mesh = Mesh(**sizes, timeout=STAGE_FAULT_TIMEOUT_S)
    model = ShardedModule(GPT(GPTConfig(**{**CFG, "n_layer": n_layer})), mesh=mesh, **options)
    loss_fn = gpt_loss
    if what == "loss":  # not a scalar: adding it to the step's loss fails, on the last stage only
        loss_fn = lambda out, y: out.sum(-1)  # noqa: E731
    elif mesh.pp_rank == 0:  # the first stage's second forward (of any chunk) fails
        calls = []

        def fail(module, args, out):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected: the first stage's second forward fails")
        model.module.register_forward_hook(fail)
    return two_steps_said(model, mesh, _data(1, rows=4)[0], loss_fn)


def two_steps_said(model, mesh, x, loss_fn):
    """Run the failing step, then a step the same model must refuse; return what each said with its
    seconds, this rank's stage, and the world's health after the mesh is gone (an all-reduce of ones)."""
    import time

    said = []
    for _ in range(2):
        start = time.perf_counter()
        try:
            model.train_step(x[:, :-1], x[:, 1:], loss_fn)
            said.append(("trained", 0.0))
        except Exception as e:
            said.append((f"{type(e).__name__}: {e}", time.perf_counter() - start))
    mesh.destroy()
    ones = torch.ones(1)
    dist.all_reduce(ones)
    return said, mesh.pp_rank, ones.item()


@pytest.mark.parametrize("case", list(STAGE_FAULTS))
def test_a_stage_that_fails_mid_step_stops_every_stage_at_once(pools, case):
    """A stage raises in the middle of a schedule (a user's loss function on the last stage, a forward
    on the first): that stage raises its own error, and every other stage a PipelineAborted naming
    the failed stage, the action and the original error, within seconds (the mesh's timeout is 60 s:
    before, they waited for it and then named only their own receive). Stages that do not neighbour
    the failed one (4 stages) hear of it through the ones between. The same model then refuses
    another step on every rank (its channels hold the failed step's messages); the world still works."""
    sizes, options, n_layer, what = STAGE_FAULTS[case]
    world = 2 * sizes["pp"]
    if pools.backend_for(world) == "nccl":
        pytest.skip("over NCCL a receive is not read for the failure marker (it would wait for the GPU at every "
                    "receive): the stages end in NCCL's timeout (minipar.pipeline.abort)")
    failed_stage = sizes["pp"] - 1 if what == "loss" else 0
    original = "RuntimeError" if what == "forward" else "RuntimeError: output with shape"
    for rank, (said, stage, healthy) in enumerate(pools.run(world, _pipeline_stage_fails, case, timeout=120)):
        (first, first_s), (second, _) = said
        if stage == failed_stage:
            assert first.startswith(original) and "PipelineAborted" not in first, (rank, first)
        else:
            assert first.startswith("PipelineAborted: ") and f"pipeline stage {failed_stage} " in first, (rank, first)
            assert "failed at F" in first and original in first, (rank, first)
        assert first_s < STAGE_FAULT_TIMEOUT_S / 4, f"rank {rank} raised after {first_s:.1f} s: {first}"
        assert second.startswith("ValueError: an earlier step stopped midway"), (rank, second)
        assert healthy == world, rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_failure_marker_reads_back_and_an_activation_is_no_marker(dtype):
    """The marker has the receive's shape and dtype and carries the failure in words (cut to what fits);
    activations, and what is not read (NCCL) or too small to hold a marker, read as no failure."""
    from minipar.pipeline.abort import marker, read_marker

    like = torch.randn(2, 8, 8).to(dtype)
    sent = marker(like, "pipeline stage 1 (rank 3) failed at F0: RuntimeError: boom")
    assert sent.shape == like.shape and sent.dtype == dtype
    assert read_marker(sent, readable=True) == "pipeline stage 1 (rank 3) failed at F0: RuntimeError: boom"
    assert read_marker(sent, readable=False) is None
    assert read_marker(like, readable=True) is None
    long = marker(like, "x" * 10_000)  # cut to the message's bytes
    assert read_marker(long, readable=True) == "x" * (like.numel() * like.element_size() - 16)
    assert marker(torch.zeros(2, dtype=dtype), "too small") is None
    assert read_marker(torch.zeros(2, dtype=dtype), readable=True) is None


def test_markers_replace_the_first_remaining_send_to_each_peer_and_channel():
    """Per (peer, group) only the first remaining send is replaced (the message that peer waits for
    next on that channel); the peer that told us is not told back; other actions send nothing."""
    from minipar.core.mesh import AxisGroup
    from minipar.pipeline import Action
    from minipar.pipeline.abort import read_marker, send_markers

    act, grad = AxisGroup("pp", (0, 1, 2), 1), AxisGroup("pp_twin", (0, 1, 2), 1)
    routes = {"SEND_ACT": (2, act), "SEND_GRAD": (0, grad)}
    remaining = [Action("F", 1), Action("SEND_ACT", 1), Action("B", 0), Action("SEND_GRAD", 0),
                 Action("SEND_ACT", 2), Action("SEND_GRAD", 1)]
    sent = []

    def send(t, peer, group, async_op, tag):
        sent.append((peer, group.name, tag, read_marker(t, readable=True)))
        return "handle"
    kept = send_markers(remaining, lambda a: routes.get(a.kind), torch.zeros(4, 8), "stage 1 failed", send)
    assert sent == [(2, "pp", "pp_abort", "stage 1 failed"), (0, "pp_twin", "pp_abort", "stage 1 failed")]
    assert [h for h, _ in kept] == ["handle", "handle"]
    sent.clear()
    send_markers(remaining, lambda a: routes.get(a.kind), torch.zeros(4, 8), "stage 2 failed", send, skip=2)
    assert sent == [(0, "pp_twin", "pp_abort", "stage 2 failed")]


# -- file systems that refuse, fill or fail --------------------------------------------------------------

def _checkpoint_fs_fault(ctx, sizes, options, n_layer, root, fault, victim):
    """Save step_1; then save step_2 (or, for "read", load step_1) with ``fault`` on ``victim``.
    Returns the error, what find_latest names, whether the model is unchanged, and whether the
    retry, once the fault is gone, saved step_2 with the model's parameters and made it the latest."""
    mesh, model, opt = _build(sizes, options, n_layer=n_layer)
    data = _data(2)
    train_rows(model, opt, data[0:1], MAX_NORM)
    checkpoint.save(checkpoint.step_path(root, 1), model, opt, extra_state={"step": 1})
    train_rows(model, opt, data[1:2], MAX_NORM)
    before = _state(model)
    real = dict(save=torch.save, mkdir=os.mkdir, open=builtins.open)
    if ctx.rank == victim:
        if fault == "full":
            torch.save = _enospc
        elif fault == "read-only":
            os.mkdir = _erofs
        elif fault == "read":
            builtins.open = lambda f, mode="r", *a, **k: (
                _eio() if str(f).endswith(f"rank{victim:05d}.pt") and "r" in mode else real["open"](f, mode, *a, **k))
    try:
        if fault == "read":
            checkpoint.load(checkpoint.step_path(root, 1), model, opt)
        else:
            checkpoint.save(checkpoint.step_path(root, 2), model, opt, extra_state={"step": 2})
        error = None
    except checkpoint.CheckpointError as e:
        error = str(e)
    finally:
        torch.save, os.mkdir, builtins.open = real["save"], real["mkdir"], real["open"]
    unchanged = _equal(before, _state(model))
    latest = checkpoint.find_latest(root).name
    checkpoint.save(checkpoint.step_path(root, 2), model, opt, extra_state={"step": 2})  # the retry
    retried = _equal(checkpoint.consolidate(checkpoint.step_path(root, 2)), before) and \
        checkpoint.find_latest(root).name == "step_00000002"
    mesh.destroy()
    return error, latest, unchanged, retried


# (fault, feature, world, mesh, options, the rank it strikes, what the error names)
FS_FAULTS = [
    ("full", "HSDP", 4, dict(dp_shard=2), dict(strategy="zero2"), 3, "No space left on device"),
    ("read-only", "cp", 2, dict(cp=2), dict(strategy="zero3", context_parallel="ulysses"), 0, "Read-only file system"),
    ("read", "interleaved pipeline", 2, dict(pp=2), dict(strategy="zero1", schedule="interleaved_1f1b",
                                                         microbatches=2, pipeline_boundaries=[1, 1, 1, 1]), 1,
     "Input/output error"),
]


@pytest.mark.parametrize("fault, feature, world, sizes, options, victim, why", FS_FAULTS,
                         ids=[f"{c[0]} under {c[1]}" for c in FS_FAULTS])
def test_a_file_system_fault_in_a_checkpoint_is_an_error_on_every_rank(pools, tmp_path, fault, feature, world, sizes,
                                                                        options, victim, why):
    """A full disk while a rank writes its file (HSDP), a read-only file system where rank 0 creates
    the directory (cp), a failing read of one rank's file while loading (an interleaved pipeline): a
    CheckpointError on every rank naming the rank, the cause and what to do; the model unchanged, the
    previous checkpoint still the latest, and a retry once the fault is gone succeeds."""
    out = pools.run(world, _checkpoint_fs_fault, sizes, options, 4 if "pp" in sizes else 2, tmp_path, fault, victim)
    for rank, (error, latest, unchanged, retried) in enumerate(out):
        assert error is not None and f"rank {victim}" in error and why in error, (rank, error)
        assert "nothing was changed" in error, (rank, error)
        fix = "fix the file system and load again" if fault == "read" else \
            "free space or make the directory writable, then save again"
        assert fix in error, (rank, error)
        assert latest == "step_00000001" and unchanged and retried, (rank, latest, unchanged, retried)


def _offload_read_fails(ctx, data, root, path, where):
    """Zero3 with its optimizer state and parameters in files: step 0 and a checkpoint, then step 1
    with rank 1's disk reads failing (``where``: "step", or "save": a save of the model). Then, as the
    error says, load the checkpoint and train steps 1 and 2 again; beside it, the uninterrupted run."""
    mesh, model, opt = _build({}, dict(strategy="zero3", offload=_offload(Path(path) / "a")))
    train_rows(model, opt, data[0:1], MAX_NORM)
    checkpoint.save(checkpoint.step_path(root, 1), model, opt, extra_state={"step": 1})
    real = disk_module._pread_into
    if ctx.rank == 1:
        disk_module._pread_into = _eio
    try:
        if where == "step":
            train_rows(model, opt, data[1:2], MAX_NORM)
        else:
            checkpoint.save(checkpoint.step_path(root, 2), model, opt, extra_state={"step": 2})
        error = None
    except OffloadError as e:
        error = str(e)
    finally:
        disk_module._pread_into = real
    model.zero_grad()
    latest = checkpoint.find_latest(root)
    checkpoint.load(latest, model, opt)
    train_rows(model, opt, data[1:], MAX_NORM)
    recovered = _state(model)
    mesh.destroy()
    mesh, model, opt = _build({}, dict(strategy="zero3", offload=_offload(Path(path) / "b")))
    train_rows(model, opt, data, MAX_NORM)
    straight = _state(model)
    mesh.destroy()
    return error, latest.name, recovered, straight


@pytest.mark.parametrize("where", ["step", "save"])
def test_a_failing_disk_read_under_offload_is_an_error_on_every_rank(pools, tmp_path, where):
    """Rank 1's offload files cannot be read (EIO). In a step (zero3 reads a parameter shard for its
    all-gather, which every rank must join): before, rank 1 raised inside the gather and rank 0 waited
    there forever; now the gather goes on, with NaN for the unreadable shard, and the step ends in an
    OffloadError on every rank. In a save: an OffloadError on every rank, nothing saved. Either way
    the checkpoint saved before is the latest, and loading it (what the error says to do) and
    training on gives the uninterrupted run's parameters, bit for bit."""
    (tmp_path / "off" / "a").mkdir(parents=True)
    (tmp_path / "off" / "b").mkdir()
    out = pools.run(2, _offload_read_fails, _data(3), tmp_path / "ck", tmp_path / "off", where, timeout=60)
    for rank, (error, latest, recovered, straight) in enumerate(out):
        assert error is not None and "rank 1" in error and "Input/output error" in error, (rank, error)
        if where == "step":
            assert "load the last checkpoint" in error, (rank, error)
        assert latest == "step_00000001", (rank, latest)
        assert _equal(recovered, straight), rank


# -- NaN and inf in the loss ----------------------------------------------------------------------------

def _non_finite_loss(ctx, sizes, options, bad_rank, value, n_layer=2, onebit=False):
    """Two steps; in the first, ``bad_rank`` multiplies its loss by ``value``. Per step: the loss, the
    gradient norm, the loss scale and whether the parameters were left as they were; and the
    parameters at the end."""
    mesh = Mesh(**sizes)
    model = ShardedModule(GPT(GPTConfig(**dict(CFG, n_layer=n_layer))), mesh=mesh, **options)
    opt = model.build_optimizer(OneBitAdam, lr=LR, freeze_step=1) if onebit else \
        model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    data = _data(3 if onebit else 2)
    local = data.shape[1] // mesh.dp
    steps = []
    for s in range(data.shape[0]):
        x = data[s, mesh.dp_rank * local:(mesh.dp_rank + 1) * local]
        bad = ctx.rank == bad_rank and s == data.shape[0] - 2
        loss_fn = (lambda out, y: model.cross_entropy(out, y) * value) if bad else model.cross_entropy
        before = _state(model)
        loss = model.train_step(x[:, :-1], x[:, 1:], loss_fn).item()
        norm = model.clip_grad_norm_(MAX_NORM).item()
        opt.step()
        opt.zero_grad()
        scaler = model.strategy.scaler
        steps.append((loss, norm, scaler.scale if scaler.enabled else None, _equal(before, _state(model))))
    out = steps, _state(model)
    mesh.destroy()
    return out


def _one_process_with_a_nan_loss() -> dict[str, torch.Tensor]:
    """The reference: one process, one AdamW step (clipped) on a loss that is NaN."""
    model = GPT(GPTConfig(**CFG))
    x = _data(1)[0]
    loss = gpt_loss(model(x[:, :-1]), x[:, 1:]) * math.nan
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# (feature, world, mesh, options, the rank whose loss goes bad, the value, n_layer)
SCALED = [
    ("HSDP", 4, dict(dp_shard=2), dict(strategy="zero2", mixed_precision=FP16), 3, math.inf, 2),
    ("interleaved pipeline", 2, dict(pp=2), dict(strategy="zero1", mixed_precision=FP16, schedule="interleaved_1f1b",
                                                 microbatches=2), 1, math.inf, 4),
    # (zb_v's V placement puts the last piece, and so the loss, on rank 0)
    ("zb_v pipeline", 2, dict(pp=2), dict(strategy="zero3", mixed_precision=FP16, schedule="zb_v", microbatches=2), 0,
     math.nan, 4),
    ("cp", 2, dict(cp=2), dict(strategy="zero3", mixed_precision=FP16, context_parallel="ring"), 1, math.inf, 2),
]


@pytest.mark.parametrize("feature, world, sizes, options, bad_rank, value, n_layer", SCALED, ids=[c[0] for c in SCALED])
def test_fp16_skips_a_non_finite_step_on_every_rank(pools, feature, world, sizes, options, bad_rank, value, n_layer):
    """One rank's loss is inf or NaN: every rank reports the non-finite loss, skips the step (the
    parameters unchanged) and halves the loss scale; the next step trains, finite, on every rank; the
    ranks end bitwise equal."""
    out = pools.run(world, _non_finite_loss, sizes, options, bad_rank, value, n_layer)
    for rank, (steps, final) in enumerate(out):
        (loss0, norm0, scale0, same0), (loss1, norm1, scale1, same1) = steps
        assert not math.isfinite(loss0) and not math.isfinite(norm0) and same0, (rank, steps[0])
        assert scale0 == scale1 == FP16.init_scale / 2, (rank, scale0, scale1)
        assert math.isfinite(loss1) and math.isfinite(norm1) and not same1, (rank, steps[1])
        assert _equal(final, out[0][1]), rank


def test_fp16_skips_a_non_finite_step_with_the_state_in_files(pools, tmp_path):
    """The same with zero3's optimizer state and parameters in files: the skipped step writes nothing."""
    (tmp_path / "off").mkdir()
    test_fp16_skips_a_non_finite_step_on_every_rank(
        pools, "offload", 2, {}, dict(strategy="zero3", mixed_precision=FP16, offload=_offload(tmp_path / "off")), 1,
        math.inf, 2)


UNSCALED = [
    ("ddp", 2, {}, dict(strategy="ddp"), False),
    ("cp", 2, dict(cp=2), dict(strategy="zero3", context_parallel="ulysses"), False),
    ("1-bit Adam after the freeze", 2, {}, dict(strategy="ddp"), True),
]


@pytest.mark.parametrize("feature, world, sizes, options, onebit", UNSCALED, ids=[c[0] for c in UNSCALED])
def test_fp32_with_a_nan_loss_does_what_one_process_does(pools, feature, world, sizes, options, onebit):
    """No loss scaling: one rank's NaN loss makes the global loss, the gradient norm and, after the
    step, every parameter NaN on every rank, as in one process (the same NaN elements as the
    reference's), the ranks bitwise alike; no rank hangs or raises. 1-bit Adam: a step after its
    warm-up, where the momentum, not the gradient, is exchanged (compressed), and each rank clips its
    own gradient by its own norm (documented): only rank 1's norm is NaN, the exchange spreads the NaN."""
    out = pools.run(world, _non_finite_loss, sizes, options, 1, math.nan, 2, onebit)
    reference = _one_process_with_a_nan_loss()
    for rank, (steps, final) in enumerate(out):
        loss, norm, scale, same = steps[-2]
        assert math.isnan(loss) and (math.isnan(norm) or onebit and rank != 1) and not same, (rank, steps[-2])
        for k, v in reference.items():
            assert torch.equal(final[k].isnan(), v.isnan()), (rank, k)
            torch.testing.assert_close(final[k], out[0][1][k], rtol=0, atol=0, equal_nan=True)


def _ps_nan(ctx):
    ps = ParameterServer(GPT(GPTConfig(**CFG)), Mesh(), torch.optim.AdamW, servers=1, lr=LR, max_norm=MAX_NORM)
    loss = None
    if ps.is_server:
        ps.serve()
    else:
        x = _data(1, 2, seed=ctx.rank)[0]
        nan_here = ctx.rank == ctx.world_size - 1
        loss = ps.train_step(x[:, :-1], x[:, 1:], (lambda o, y: gpt_loss(o, y) * math.nan) if nan_here else gpt_loss)
        loss = loss.item()
        ps.finish()
    state = {k: v.detach().clone() for k, v in ps.model.state_dict().items()}
    ps.mesh.destroy()
    return loss, state


def test_a_parameter_server_with_one_nan_worker_does_what_one_process_does(pools):
    """Sync mode: the mean of the workers' gradients is NaN, so the server's step makes every
    parameter NaN, and every rank (server and workers) holds those NaN parameters and reports a NaN
    loss, as one process on the global batch would; nobody hangs."""
    out = pools.run(4, _ps_nan)
    reference = _one_process_with_a_nan_loss()
    for rank, (loss, state) in enumerate(out):
        assert rank == 0 or math.isnan(loss), (rank, loss)
        for k, v in reference.items():
            assert torch.equal(state[k].isnan(), v.isnan()), (rank, k)
