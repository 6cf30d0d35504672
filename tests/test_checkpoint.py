"""Sharded checkpoints: bitwise resume in new processes, resharding to another layout, consolidation
to a plain state dict, refusal of every kind of bad checkpoint with nothing loaded, a rank killed
in the middle of a save, and a rank killed under ``torchrun --max-restarts=1``.

Training is three AdamW steps (weight decay, gradient clipping that fires) on a tiny GPT with
dropout, so a resume that forgot an RNG stream, an optimizer moment, a step count or the loss
scale would not be bit-exact. Expert-parallel layouts (ep > 1) train the mixture-of-experts GPT.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import example, given, strategies as st

from minipar import Mesh, MixedPrecision, ShardedModule, checkpoint
from minipar.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig, gpt_loss
from minipar.testing import PoolSet, RankError

from conftest import ci_examples, close_all
from helpers import EPS, LR, WD, train_rows

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_NORM = 0.05  # below every gradient norm here: clipping always fires
FP16 = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32, init_scale=2.0**8, growth_interval=2)


def _cfg(**kw) -> dict:
    return {**dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.1, seed=3), **kw}


def _moe_cfg(**kw) -> dict:
    """The tiny GPT with mixture-of-experts MLPs (4 experts, top-2, both auxiliary losses on).

    Each rank routes its own tokens as one group, so a layout with another dp routes other groups,
    and an expert's capacity, ceil(capacity_factor * tokens * top_k / n_experts), changes with the
    group's size. With capacity_factor >= n_experts / top_k (= 2) every expert can take every token
    of its group, so no assignment is ever dropped, whatever the layout: a resharded run's drops
    cannot differ from the reference's. 8.0 leaves a wide margin."""
    return _cfg(**{**dict(n_experts=4, top_k=2, capacity_factor=8.0, aux_loss_coef=0.1, z_loss_coef=0.01), **kw})


def _model(cfg: dict) -> GPT:
    """The single-process model of ``cfg``: an MoE GPT when it names experts."""
    return MoEGPT(MoEGPTConfig(**cfg)) if "n_experts" in cfg else GPT(GPTConfig(**cfg))


def _build(layout: dict, strategy: str, cfg: dict, precision=None, optimizer=torch.optim.AdamW, **opt_kwargs):
    mesh = Mesh(**layout)
    extra = dict(schedule="1f1b", microbatches=2) if layout.get("pp", 1) > 1 else {}
    if precision is not None:
        extra["mixed_precision"] = precision
    # ShardedModule shards an MoE GPT's experts over ep itself (MoELayer.shard_experts).
    model = ShardedModule(_model(cfg), mesh=mesh, strategy=strategy, bucket_cap_mb=1e-3, **extra)
    opt_kwargs = opt_kwargs or dict(lr=LR, weight_decay=WD, eps=EPS)
    return mesh, model, model.build_optimizer(optimizer, **opt_kwargs)


def _steps(mesh, model, opt, data: torch.Tensor, start: int, stop: int) -> tuple[list, list]:
    """Steps [start, stop) on this rank's rows of the global batch data[s]; (losses, gradient norms)."""
    return train_rows(model, opt, data[start:stop], MAX_NORM)


def _data(seed: int, global_batch: int, steps: int = 6) -> torch.Tensor:
    return torch.randint(0, 16, (steps, global_batch, 9), generator=torch.Generator().manual_seed(seed))


# -- bitwise resume ------------------------------------------------------------------------------------

def _uninterrupted_and_save(ctx, layout, strategy, cfg, precision, data, path):
    """Six steps in one go, then (same processes, fresh model) three steps and a checkpoint."""
    out = []
    for save_after in (None, 3):
        torch.manual_seed(1000 + ctx.rank)  # the dropout stream, as a job would seed it
        mesh, model, opt = _build(layout, strategy, cfg, precision)
        losses, norms = _steps(mesh, model, opt, data, 0, save_after or 6)
        if save_after:
            checkpoint.save(path, model, opt, extra_state={"step": save_after, "rank": ctx.rank})
        out.append((losses, norms, {k: v.cpu() for k, v in model.full_state_dict().items()}))
        mesh.destroy()
    return out


def _resume(ctx, layout, strategy, cfg, precision, data, path):
    mesh, model, opt = _build(layout, strategy, cfg, precision)
    extra = checkpoint.load(path, model, opt)
    losses, norms = _steps(mesh, model, opt, data, extra["step"], 6)
    state = {k: v.cpu() for k, v in model.full_state_dict().items()}
    mesh.destroy()
    return extra, losses, norms, state


RESUME_LAYOUTS = [
    (2, {}, "ddp", None), (2, {}, "zero1", FP16), (2, {}, "zero2", None), (2, {}, "zero3", None),
    (4, {"tp": 2}, "zero3", None), (2, {"pp": 2}, "ddp", None), (4, {"tp": 2, "pp": 2}, "ddp", None),
    (2, {"dp": 2, "ep": 2}, "ddp", None),  # the MoE GPT (an ep layout), 2 experts per rank
    (4, {"dp": 4, "ep": 2}, "zero2", None),  # the MoE GPT under ZeRO: experts sharded over edp (2 ranks)
]
if os.environ.get("HYPOTHESIS_PROFILE") == "long":  # eight new processes: about 30 s on two cores
    RESUME_LAYOUTS.append((8, {"dp": 2, "tp": 2, "pp": 2}, "ddp", None))


@pytest.fixture(scope="module")
def resume_pools(pools):
    """Rank processes for the resumes, one pool per world size for this module, apart from the
    session's pools: no layout's training or save ever runs in them. (A pool per layout would start
    28 processes instead of 14 for the same proof: what a resume needs and the checkpoint forgot, an
    RNG stream, a moment, a step count, the loss scale, is not in these processes either way: an
    earlier layout's resume here leaves other values, which fail the bitwise comparison just as a
    new process's defaults do.)"""
    ps = PoolSet(pools.backend, pools.timeout)
    yield ps
    close_all(ps)


@pytest.mark.parametrize("world, layout, strategy, precision", RESUME_LAYOUTS,
                         ids=[f"{s}-w{w}-{'x'.join(f'{k}{v}' for k, v in l.items()) or 'dp'}{'-fp16' if p else ''}"
                              for w, l, s, p in RESUME_LAYOUTS])
def test_resume_in_new_processes_is_bitwise(pools, resume_pools, tmp_path, world, layout, strategy, precision):
    """3 steps, save, *new processes* (that never ran this training), load, 3 steps == 6
    uninterrupted steps, bit for bit: losses, gradient norms and every parameter (so also the
    optimizer moments, step counts, the fp16 loss scale and every rank's dropout streams, which all
    feed those)."""
    cfg, path = (_moe_cfg() if layout.get("ep", 1) > 1 else _cfg()), tmp_path / "ckpt"
    data = _data(7, 4)
    runs = pools.run(world, _uninterrupted_and_save, layout, strategy, cfg, precision, data, path)
    resumed = resume_pools.run(world, _resume, layout, strategy, cfg, precision, data, path)
    for rank, ((full_losses, full_norms, full_state), _), (extra, losses, norms, state) in \
            zip(range(world), runs, resumed):
        assert extra == {"step": 3, "rank": rank}  # each rank's own extra_state
        assert min(full_norms) > MAX_NORM
        assert losses == full_losses[3:], (rank, losses, full_losses)
        assert norms == full_norms[3:]
        assert state.keys() == full_state.keys()
        for k in state:
            assert torch.equal(state[k], full_state[k]), f"rank {rank}: {k} differs after resuming"


# -- resharding ----------------------------------------------------------------------------------------

def _train_and_save(ctx, layout, strategy, cfg, data, path):
    mesh, model, opt = _build(layout, strategy, cfg)
    losses, _ = _steps(mesh, model, opt, data, 0, 3)
    checkpoint.save(path, model, opt, extra_state={"step": 3})
    mesh.destroy()
    return losses


def _load_and_train(ctx, layout, strategy, cfg, data, path):
    mesh, model, opt = _build(layout, strategy, cfg)
    step = checkpoint.load(path, model, opt)["step"]
    losses, _ = _steps(mesh, model, opt, data, step, 6)
    state = {k: v.cpu() for k, v in model.full_state_dict().items()}
    mesh.destroy()
    return losses, state


def _reference(cfg: dict, data: torch.Tensor, groups: tuple[int, int] = (1, 1)):
    """The single-process run: (losses of 6 steps, state dict after 3, state dict after 6).

    An MoE GPT routes the batch of steps 0-2 as ``groups[0]`` groups and that of steps 3-5 as
    ``groups[1]``: the data-parallel sizes of the layouts that saved and loaded, whose ranks each
    route their own share (the load-balancing loss is a mean over groups of a per-group product)."""
    model = _model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses, after3 = [], None
    for s in range(data.shape[0]):
        x = data[s]
        for block in model.layers:
            if hasattr(block.mlp, "route_groups"):
                block.mlp.route_groups = groups[s >= 3]
        loss = gpt_loss(model(x[:, :-1]), x[:, 1:])
        assert not isinstance(model, MoEGPT) or model.moe_stats()["dropped"] == 0  # the setup _moe_cfg promises
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if s == 2:
            after3 = {k: v.clone() for k, v in model.state_dict().items()}
    return losses, after3, model.state_dict()


LAYOUTS = [
    (1, {}, "ddp"), (2, {}, "zero2"), (4, {}, "zero3"), (4, {"tp": 2}, "ddp"), (4, {"tp": 2}, "zero1"),
    (2, {"pp": 2}, "ddp"), (4, {"pp": 2, "tp": 2}, "ddp"), (4, {"pp": 2, "dp": 2}, "ddp"), (2, {"tp": 2}, "zero3"),
    (4, {"dp_shard": 2}, "zero3"), (4, {"dp_shard": 2}, "zero2"),  # HSDP: replicas of a shard save it once
    (4, {"cp": 2}, "zero3"), (4, {"cp": 2, "tp": 2}, "zero1"),  # ring attention: cp ranks save nothing twice
]


@example(source=LAYOUTS[2], target=LAYOUTS[4], tie=True, seed=0)   # zero3 at dp=4 -> tp=2 x dp=2 (zero1)
@example(source=LAYOUTS[6], target=LAYOUTS[1], tie=True, seed=1)   # pp x tp -> zero2
@example(source=LAYOUTS[1], target=LAYOUTS[0], tie=False, seed=0)  # zero2 -> one process: one master, many params
@example(source=LAYOUTS[9], target=LAYOUTS[10], tie=True, seed=2)  # HSDP zero3 -> HSDP zero2
@example(source=LAYOUTS[11], target=LAYOUTS[3], tie=True, seed=3)  # cp x zero3 (over dp x cp) -> tp
@example(source=LAYOUTS[6], target=LAYOUTS[12], tie=False, seed=4)  # pp x tp -> cp x tp, zero1
@example(source=LAYOUTS[7], target=LAYOUTS[8], tie=False, seed=5)   # pp x dp -> zero3 over tp=2 on 2 ranks
@example(source=LAYOUTS[5], target=LAYOUTS[9], tie=True, seed=6)    # pp alone -> HSDP zero3
# With these eight every layout is saved from or loaded into in every run; under ci 3 drawn pairs
# follow (ci_examples), under long hundreds.
@ci_examples(3)
@given(source=st.sampled_from(LAYOUTS), target=st.sampled_from(LAYOUTS), tie=st.booleans(),
       seed=st.integers(0, 2**16))
def test_reshard_to_any_layout(pools, tmp_path_factory, source, target, tie, seed):
    """Saved under one (dp, tp, pp, ZeRO stage), loaded under another: the losses of the next three
    steps and the final parameters are the single-process run's (fp32 tolerance); the checkpoint
    consolidates into a state dict the plain GPT loads strictly, equal to the reference's."""
    cfg = _cfg(dropout=0.0, tie_weights=tie, seed=seed)  # dropout streams are per rank: not portable
    data = _data(seed + 1, 4)
    path = tmp_path_factory.mktemp("reshard") / "ckpt"
    ref_losses, ref_after3, ref_final = _reference(cfg, data)
    (w1, l1, s1), (w2, l2, s2) = source, target
    first = pools.run(w1, _train_and_save, l1, s1, cfg, data, path)[0]
    torch.testing.assert_close(torch.tensor(first), torch.tensor(ref_losses[:3]))
    consolidated = checkpoint.consolidate(path)
    GPT(GPTConfig(**cfg)).load_state_dict(consolidated)  # strict: every key, no extra
    for k, v in ref_after3.items():
        torch.testing.assert_close(consolidated[k], v, msg=lambda m: f"consolidated {k}: {m}")
    for losses, state in pools.run(w2, _load_and_train, l2, s2, cfg, data, path):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[3:]))
        for k, v in ref_final.items():
            torch.testing.assert_close(state[k], v, msg=lambda m: f"{k} after resharding {source} -> {target}: {m}")


MOE_RESHARDS = [((2, {"dp": 2, "ep": 2}, "ddp"), (1, {}, "ddp")),
                ((2, {"dp": 2, "ep": 2}, "ddp"), (2, {"dp": 2, "ep": 1}, "ddp")),
                ((4, {"dp": 4, "ep": 2}, "zero3"), (2, {"dp": 2, "ep": 1}, "zero1"))]


@pytest.mark.parametrize("source, target", MOE_RESHARDS,
                         ids=["ep2-to-one-process", "ep2-to-dp2-ep1", "zero3-dp4-ep2-to-zero1-dp2"])
def test_reshard_expert_parallel_moe(pools, tmp_path, source, target):
    """The MoE GPT saved at ep=2 (each rank holding 2 of the 4 experts of each layer) and loaded
    with every expert on every rank: the losses of the next three steps and the final parameters
    are the single-process run's (fp32 tolerance); the checkpoint consolidates into a state dict
    the plain MoE GPT loads strictly, equal to the reference's."""
    cfg = _moe_cfg(dropout=0.0, seed=5)  # dropout streams are per rank: not portable
    data = _data(6, 4)
    path = tmp_path / "ckpt"
    (w1, l1, s1), (w2, l2, s2) = source, target
    groups = (l1.get("dp", w1), l2.get("dp", w2))
    ref_losses, ref_after3, ref_final = _reference(cfg, data, groups)
    first = pools.run(w1, _train_and_save, l1, s1, cfg, data, path)[0]
    torch.testing.assert_close(torch.tensor(first), torch.tensor(ref_losses[:3]))
    consolidated = checkpoint.consolidate(path)
    _model(cfg).load_state_dict(consolidated)  # strict: every key (the full expert stacks), no extra
    for k, v in ref_after3.items():
        torch.testing.assert_close(consolidated[k], v, msg=lambda m: f"consolidated {k}: {m}")
    for losses, state in pools.run(w2, _load_and_train, l2, s2, cfg, data, path):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[3:]))
        for k, v in ref_final.items():
            torch.testing.assert_close(state[k], v, msg=lambda m: f"{k} after resharding {source} -> {target}: {m}")


# -- bad checkpoints -----------------------------------------------------------------------------------

def _save_one_step(ctx, cfg, data, path, optimizer=torch.optim.AdamW, **opt_kwargs):
    mesh, model, opt = _build({}, "zero2", cfg, None, optimizer, **opt_kwargs)
    _steps(mesh, model, opt, data, 0, 1)
    checkpoint.save(path, model, opt, extra_state={"step": 1})
    mesh.destroy()


def _snapshot(model, opt) -> dict:
    state = {k: v.clone() for k, v in model.full_state_dict().items()}
    inner = opt.optimizer.state
    moments = [v.clone() for st in inner.values() for v in st.values() if torch.is_tensor(v)]
    return {"params": state, "optimizer": moments, "rng": torch.get_rng_state()}


def _try_bad(ctx, cfg, data, paths):
    """Load each bad checkpoint into a trained model: each must raise, and change nothing."""
    mesh, model, opt = _build({}, "zero2", cfg)
    _steps(mesh, model, opt, data, 0, 2)
    before = _snapshot(model, opt)
    messages = {}
    for what, path in paths.items():
        with pytest.raises(checkpoint.CheckpointError) as info:
            checkpoint.load(path, model, opt)
        messages[what] = str(info.value)
        after = _snapshot(model, opt)
        for k, v in before["params"].items():
            assert torch.equal(after["params"][k], v), f"{what}: {k} changed by a refused load"
        assert all(torch.equal(a, b) for a, b in zip(after["optimizer"], before["optimizer"])), what
        assert torch.equal(after["rng"], before["rng"]), what
    mesh.destroy()
    return messages


class _RunsCode:
    """Unpickling this calls os.system: what a malicious checkpoint would do."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rewrite(path: pathlib.Path, fname: str, data: bytes) -> None:
    """Replace a rank file *and* fix up the manifest, as an attacker (or a confused tool) would."""
    import hashlib
    (path / fname).write_bytes(data)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][fname].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_bad_checkpoints_are_refused_and_nothing_is_loaded(pools, tmp_path):
    """Torn (no manifest), truncated, corrupted (one flipped byte), another model's, another
    optimizer's, and a file whose unpickling would run code: each raises CheckpointError with the
    reason, on every rank, before any parameter, optimizer state or RNG state changes."""
    cfg, data = _cfg(), _data(3, 4)
    good = tmp_path / "good"
    pools.run(2, _save_one_step, cfg, data, good)
    bad = {}
    for what in ("torn", "truncated", "corrupted", "code"):
        bad[what] = tmp_path / what
        shutil.copytree(good, bad[what])
    (bad["torn"] / "manifest.json").unlink()
    f = bad["truncated"] / "rank00001.pt"
    f.write_bytes(f.read_bytes()[:-100])
    f = bad["corrupted"] / "rank00000.pt"
    blob = bytearray(f.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    f.write_bytes(bytes(blob))
    marker = tmp_path / "code_ran"
    payload = torch.load(good / "rank00001.pt", weights_only=True)
    payload["extra_state"] = _RunsCode(marker)
    buf = __import__("io").BytesIO()
    torch.save(payload, buf)
    _rewrite(bad["code"], "rank00001.pt", buf.getvalue())
    bad["other_model"] = tmp_path / "other_model"
    pools.run(2, _save_one_step, _cfg(n_embd=12, n_layer=3), data, bad["other_model"])
    bad["other_optimizer"] = tmp_path / "other_optimizer"  # the same model, trained with SGD (momentum state)
    pools.run(2, _save_one_step, cfg, data, bad["other_optimizer"], torch.optim.SGD, lr=LR, momentum=0.9)

    for rank_messages in pools.run(2, _try_bad, cfg, data, bad):
        assert "no manifest.json: its save did not finish" in rank_messages["torn"]
        assert "bytes but the manifest says" in rank_messages["truncated"] and "truncated" in rank_messages["truncated"]
        assert "sha256 differs from the manifest's" in rank_messages["corrupted"]
        assert "refused to unpickle it (weights_only=True)" in rank_messages["code"]
        assert "holds another model" in rank_messages["other_model"] and "of another shape" in \
            rank_messages["other_model"] and "parameters unexpected: layers.2." in rank_messages["other_model"]
        assert "the checkpoint's optimizer is SGD, this one is AdamW" in rank_messages["other_optimizer"]
    assert not marker.exists(), "loading a checkpoint ran code from it"


def _bad_extra_state(ctx, cfg, path):
    mesh, model, opt = _build({}, "ddp", cfg)
    extra = {"step": 1, "fn": print} if ctx.rank == 1 else {"step": 1}  # only one rank is wrong
    with pytest.raises(ValueError) as info:
        checkpoint.save(path, model, opt, extra_state=extra)
    mesh.destroy()
    return str(info.value)


def test_unsavable_extra_state_fails_on_every_rank(pools, tmp_path):
    """A builtin function in one rank's extra_state: every rank raises (none hangs) and says why."""
    for msg in pools.run(2, _bad_extra_state, _cfg(), tmp_path / "x"):
        assert "rank 1: extra_state['fn'] is a builtin_function_or_method" in msg
    assert not (tmp_path / "x").exists()


# -- a rank killed while saving --------------------------------------------------------------------------

def _die_while_saving(ctx, cfg, data, root):
    torch.manual_seed(5 + ctx.rank)
    mesh, model, opt = _build({}, "zero3", cfg)
    _steps(mesh, model, opt, data, 0, 1)
    checkpoint.save(checkpoint.step_path(root, 1), model, opt, extra_state={"step": 1})
    _steps(mesh, model, opt, data, 1, 2)
    if ctx.rank == 1:
        real_save = torch.save

        def save_half_then_die(obj, f, *args, **kwargs):
            real_save({"half": torch.zeros(1000)}, f)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save = save_half_then_die
    checkpoint.save(checkpoint.step_path(root, 2), model, opt, extra_state={"step": 2})


def _state_after_one_step(ctx, cfg, data):
    torch.manual_seed(5 + ctx.rank)
    mesh, model, opt = _build({}, "zero3", cfg)
    _steps(mesh, model, opt, data, 0, 1)
    state = {k: v.cpu() for k, v in model.full_state_dict().items()}
    mesh.destroy()
    return state


def _load_then_save(ctx, cfg, root):
    mesh, model, opt = _build({}, "zero3", cfg)
    latest = checkpoint.find_latest(root)
    extra = checkpoint.load(latest, model, opt)
    state = {k: v.cpu() for k, v in model.full_state_dict().items()}
    checkpoint.save(checkpoint.step_path(root, 2), model, opt, extra_state={"step": 2})  # the retry works
    mesh.destroy()
    return latest.name, extra, state


def test_rank_killed_during_save_leaves_previous_checkpoint(pools, tmp_path):
    """Rank 1 is SIGKILLed half-way through writing its file of the second checkpoint: the first
    stays the latest, complete and loadable (equal to a fresh one-step run), the torn one never
    appears under its name, and saving it again afterwards succeeds."""
    cfg, data = _cfg(), _data(11, 4)
    with pytest.raises(RankError, match="rank 1 died"):
        pools.run(2, _die_while_saving, cfg, data, tmp_path)
    assert (tmp_path / ".step_00000002.tmp").is_dir() and not (tmp_path / "step_00000002").exists()
    assert checkpoint.find_latest(tmp_path) == checkpoint.step_path(tmp_path, 1)
    expected = pools.run(2, _state_after_one_step, cfg, data)[0]
    consolidated = checkpoint.consolidate(checkpoint.step_path(tmp_path, 1))
    for rank_result in pools.run(2, _load_then_save, cfg, tmp_path):
        name, extra, state = rank_result
        assert name == "step_00000001" and extra == {"step": 1}
        for k, v in expected.items():
            assert torch.equal(state[k], v) and torch.equal(consolidated[k], v), k
    assert checkpoint.find_latest(tmp_path) == checkpoint.step_path(tmp_path, 2)
    assert not (tmp_path / ".step_00000002.tmp").exists()


# -- elastic restart under torchrun ----------------------------------------------------------------------

JOB = ["--steps", "12", "--n-embd", "32", "--seq", "16", "--vocab", "64", "--batch", "4", "--checkpoint-every", "2"]


def _torchrun(*extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", *extra,
            str(ROOT / "benchmarks" / "gpt_tp_pp.py"), *JOB]


def _worker_pid(parent: int, rank: int) -> int | None:
    """The pid of torchrun's worker process with RANK=rank (a child of ``parent``), via /proc."""
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in env:
            return int(entry.name)
    return None


@contextlib.contextmanager
def _job(cmd: list[str]):
    """``cmd`` in a session of its own, killed with all its workers if the test fails or times out
    (killing torchrun alone would leave its workers running and loading the machine)."""
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        yield job
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


@pytest.mark.skipif(not pathlib.Path("/proc/self/environ").exists(),
                    reason="finding torchrun's worker processes needs Linux /proc")
def test_sigkill_under_torchrun_resumes_to_the_same_parameters(tmp_path):
    """The main job with checkpoints every 2 of 12 steps; once the first checkpoint exists, rank 1
    is SIGKILLed. torchrun (--max-restarts=1) restarts every rank, they resume from the newest
    complete checkpoint, and the job ends with the parameters (bit for bit) and losses of a run
    that was never interrupted."""
    with _job(_torchrun() + ["--checkpoint-dir", str(tmp_path / "clean"), "--out", str(tmp_path / "o1")]) as clean:
        out, err = clean.communicate(timeout=300)
    assert clean.returncode == 0, out[-2000:] + err[-3000:]

    with _job(_torchrun("--max-restarts=1") + ["--checkpoint-dir", str(tmp_path / "killed"),
                                               "--out", str(tmp_path / "o2")]) as job:
        killed_at, deadline = None, time.monotonic() + 240
        while killed_at is None and time.monotonic() < deadline and job.poll() is None:
            latest = checkpoint.find_latest(tmp_path / "killed") if (tmp_path / "killed").is_dir() else None
            pid = _worker_pid(job.pid, 1) if latest is not None else None
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed_at = latest.name
            time.sleep(0.02)
        out, err = job.communicate(timeout=300)
    assert killed_at is not None, "the job ended before a rank could be killed\n" + out[-2000:]
    assert job.returncode == 0, out[-2000:] + err[-3000:]
    assert "resumed from" in out, out[-2000:]

    final = checkpoint.step_path(tmp_path / "clean", 12).name
    a = checkpoint.consolidate(tmp_path / "clean" / final)
    b = checkpoint.consolidate(tmp_path / "killed" / final)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after the restart (killed after {killed_at})"
    la = json.loads((tmp_path / "o1" / "gpt_tp_pp.json").read_text())["losses"]
    lb = json.loads((tmp_path / "o2" / "gpt_tp_pp.json").read_text())["losses"]
    assert la == lb


# -- parameter groups ------------------------------------------------------------------------------

def _two_groups(model, wd_second: float):
    """AdamW with the matrices decayed and the vectors (biases, norm weights) not: two groups."""
    params = list(model.module.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": wd_second}],
                             lr=LR, weight_decay=WD, eps=EPS)


def _param_groups(ctx, cfg, data, root, saved: int, loaded: int):
    mesh, model, _ = _build({}, "ddp", cfg)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS) if saved == 1 \
        else _two_groups(model, 0.0)
    _steps(mesh, model, opt, data, 0, 1)
    checkpoint.save(root, model, opt, extra_state={"step": 1})
    mesh.destroy()
    mesh, model, _ = _build({}, "ddp", cfg)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS) if loaded == 1 \
        else _two_groups(model, 0.5)  # another no-decay value: the checkpoint's must win, as in torch
    try:
        checkpoint.load(root, model, opt)
        out = [g["weight_decay"] for g in opt.param_groups]
    except checkpoint.CheckpointError as e:
        out = str(e)
    mesh.destroy()
    return out


@pytest.mark.parametrize("saved, loaded", [(1, 2), (2, 1), (2, 2)])
def test_parameter_groups_must_match_as_in_torch(pools, tmp_path, saved, loaded):
    """As torch's Optimizer.load_state_dict: the optimizer must have the parameter groups the
    checkpoint was saved with (else refused, on every rank: one group's weight decay silently
    becoming another's is how a resumed run drifts), and the checkpoint's hyperparameters win."""
    cfg, data = _cfg(), _data(7, 4)
    for out in pools.run(2, _param_groups, cfg, data, tmp_path / "ck", saved, loaded):
        if saved == loaded:
            assert out == [WD, 0.0], out
        else:
            assert isinstance(out, str) and f"has {saved} parameter group(s)" in out and \
                f"this one has {loaded}" in out, out
