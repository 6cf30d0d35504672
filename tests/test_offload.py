"""Offload (`minipar.data_parallel.offload`): optimizer state and zero3 parameter shards in host memory or files.

Offloading moves state, never arithmetic, so the proof is bitwise: every layout below trains
exactly as the same run without offload (which the ZeRO tests prove equal to one process), in
fp32 and in bf16. In the same runs the device/host/disk bytes equal `offload_bytes.offload_state_bytes`
and the bytes moved per step equal `offload_bytes.offload_traffic`. Then: checkpoints with offloaded
state, the chunked step's bounded reads, and every way a disk can fail.
"""

from __future__ import annotations

import copy
import errno
import os
from pathlib import Path

import pytest
import torch

import minipar.data_parallel.disk as disk_module
import minipar.data_parallel.offload as offload_module
from minipar import Mesh, MixedPrecision, Offload, OffloadError, ShardedModule, checkpoint
from minipar.plan import formulas as F
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.data_parallel.offload import check_path
from minipar.plan.offload_bytes import offload_state_bytes, offload_traffic

from helpers import EPS, LR, WD, batches

CFG = dict(vocab_size=23, block_size=8, n_layer=3, n_head=3, n_embd=9, bias=True, seed=3)  # 3,445 parameters
PRECISION = {"fp32": None, "bf16": MixedPrecision(param_dtype=torch.bfloat16)}
CHUNK = 100  # elements per chunk of the nvme step: a group takes several, the last one short
MAX_NORM = 0.3  # below every step's gradient norm: clipping fires


def _train(ctx, strategy, precision, opt_where, params_where, root, steps, accum=2, chunk=CHUNK, save=None):
    """``steps`` clipped AdamW steps of ``accum`` micro-batches (no_sync on all but the last) on this
    rank's rows; returns losses, norms, the full parameters, memory_stats and each step's traffic."""
    mesh = Mesh()
    off = None
    if opt_where is not None:
        path = None
        if "nvme" in (opt_where, params_where):
            path = Path(root) / f"run-{opt_where}-{params_where}"
            path.mkdir(exist_ok=True)
        off = Offload(optimizer=opt_where, params=params_where, path=path, chunk_mb=chunk * 4 / 2**20)
    model = ShardedModule(GPT(GPTConfig(**CFG)), mesh=mesh, strategy=strategy, bucket_cap_mb=2e-3,
                          mixed_precision=PRECISION[precision], offload=off)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    data = batches(7, steps, accum, mesh.dp, 2, 7, CFG["vocab_size"])
    rows = slice(2 * mesh.dp_rank, 2 * mesh.dp_rank + 2)
    losses, norms, traffic = [], [], []
    for s in range(steps):
        before = model.strategy.offload_traffic()
        total = 0.0
        for a in range(accum):
            x = data[s, a, rows]
            with (model.no_sync() if a < accum - 1 else torch.enable_grad()):
                total += model.train_step(x[:, :-1], x[:, 1:], lambda o, y: gpt_loss(o, y) / accum).item()
        norms.append(model.clip_grad_norm_(MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        after = model.strategy.offload_traffic()
        traffic.append({k: after[k] - before[k] for k in after})
        losses.append(total)
        if save is not None and s == save[1] - 1:
            checkpoint.save(save[0], model, opt)
    ps = F.ParamSet.of(model.module)
    out = dict(losses=losses, norms=norms, memory=model.memory_stats(), traffic=traffic,
               params={k: v.clone() for k, v in model.full_state_dict().items()},
               ps=([t.numel() for t in ps.tensors], ps.expert, ps.units, ps.has_root), dp_rank=mesh.dp_rank,
               files=sorted(p.name for p in Path(root).rglob("*") if p.is_file()) if root else [])
    mesh.destroy()
    return out


def _paramset(out) -> F.ParamSet:
    numels, expert, units, has_root = out["ps"]
    return F.ParamSet([torch.empty(n, device="meta") for n in numels], expert, units, has_root)


CASES = [  # (world, strategy, precision, optimizer, params)
    (2, "zero1", "fp32", "cpu", None),
    (2, "zero1", "bf16", "nvme", None),
    (3, "zero2", "fp32", "nvme", None),
    (2, "zero2", "bf16", "cpu", None),
    (2, "zero3", "fp32", "nvme", "nvme"),
    (3, "zero3", "fp32", "cpu", "cpu"),
    (2, "zero3", "bf16", "nvme", "cpu"),
    (2, "zero3", "fp32", "cpu", "nvme"),
    (3, "zero3", "bf16", "cpu", None),
]


@pytest.mark.parametrize("world, strategy, precision, opt_where, params_where", CASES)
def test_offload_changes_nothing_but_where_state_lives(pools, tmp_path, world, strategy, precision, opt_where,
                                                        params_where):
    """Bitwise equal to the same run without offload (losses, clipped norms, parameters after 3
    steps of 2 accumulated micro-batches); memory_stats() and every step's counted transfers equal
    the formulas; the nvme step went through several chunks per group."""
    steps = 3
    plain = pools.run(world, _train, strategy, precision, None, None, None, steps)
    runs = pools.run(world, _train, strategy, precision, opt_where, params_where, str(tmp_path), steps)
    pb = 2 if precision == "bf16" else 4
    for base, out in zip(plain, runs):
        assert out["losses"] == base["losses"] and out["norms"] == base["norms"]
        assert min(out["norms"]) > MAX_NORM  # clipping fired every step
        assert out["params"].keys() == base["params"].keys()
        for k in base["params"]:
            assert torch.equal(out["params"][k], base["params"][k]), k
        ps = _paramset(out)
        dp = F.DataParallelShape(strategy, world, param=pb, bucket_cap_mb=2e-3, rank=out["dp_rank"])
        assert out["memory"] == offload_state_bytes(ps, dp, opt_where, params_where), out["memory"]
        assert out["memory"]["optimizer"] == 0 and out["memory"]["host"] > 0
        assert out["memory"]["params"] == (0 if params_where else base["memory"]["params"])
        assert out["memory"]["grads"] == base["memory"]["grads"]
        for s, moved in enumerate(out["traffic"]):
            assert moved == offload_traffic(ps, dp, opt_where, params_where, backwards=2, first_step=s == 0), \
                (s, moved)
        if opt_where == "nvme":
            groups = F.flat_groups(ps, dp)
            assert max(g.layout.real_len for g in groups) > 2 * CHUNK  # the step really is chunked
    if "nvme" in (opt_where, params_where):
        assert any(f.endswith(".master") or f.endswith(".shard") for f in runs[0]["files"]), runs[0]["files"]


def test_offload_formulas_at_scale():
    """The closed form: a 7B model's AdamW state over 64 ranks, ZeRO-3, bf16 compute."""
    ps = F.ParamSet.of_sizes([[(7_000_000_000 // 32, False)]] * 32, [])
    dp = F.DataParallelShape("zero3", 64, param=2)
    none = F.state_bytes(ps, dp)
    full = offload_state_bytes(ps, dp, "nvme", "nvme")
    assert full["params"] == 0 and full["optimizer"] == 0 and full["grads"] == none["grads"]
    assert full["disk"] == none["params"] + none["optimizer"] - 4 * len(F.flat_groups(ps, dp))
    cpu = offload_state_bytes(ps, dp, "cpu", None)
    assert cpu["host"] == none["optimizer"] and cpu["params"] == none["params"]


# -- checkpoints -------------------------------------------------------------------------------


def _resume(ctx, ckpt, opt_where, params_where, root, steps):
    """A fresh zero3 model (offloaded as given), the checkpoint loaded, then ``steps`` more steps on
    the data a run of save_step + steps steps would have seen after the save."""
    mesh = Mesh()
    off = None
    if opt_where is not None:
        path = Path(root) / f"resume-{opt_where}-{params_where}"
        path.mkdir(exist_ok=True)
        off = Offload(optimizer=opt_where, params=params_where, path=path if "nvme" in (opt_where, params_where)
                      else None, chunk_mb=CHUNK * 4 / 2**20)
    model = ShardedModule(GPT(GPTConfig(**{**CFG, "seed": 99})), mesh=mesh, strategy="zero3", offload=off)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    checkpoint.load(ckpt, model, opt)
    loaded = {k: v.clone() for k, v in model.full_state_dict().items()}
    data = batches(7, 2 + steps, 2, mesh.dp, 2, 7, CFG["vocab_size"])
    rows = slice(2 * mesh.dp_rank, 2 * mesh.dp_rank + 2)
    for s in range(2, 2 + steps):
        for a in range(2):
            x = data[s, a, rows]
            with (model.no_sync() if a == 0 else torch.enable_grad()):
                model.train_step(x[:, :-1], x[:, 1:], lambda o, y: gpt_loss(o, y) / 2)
        model.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
    out = dict(loaded=loaded, params={k: v.clone() for k, v in model.full_state_dict().items()})
    mesh.destroy()
    return out


def test_checkpoints_save_and_load_offloaded_state(pools, tmp_path):
    """A zero3 run with everything in files saves a checkpoint after 2 of 4 steps. Loaded into a
    fresh offloaded model (other files) and into one without offload, each continues to the very
    parameters the uninterrupted run reached (so the moments and step counters came back too)."""
    ckpt = tmp_path / "ckpt"
    full = pools.run(2, _train, "zero3", "fp32", "nvme", "nvme", str(tmp_path), 4, 2, CHUNK, (str(ckpt), 2))
    for where in [("nvme", "nvme"), (None, None)]:
        resumed = pools.run(2, _resume, str(ckpt), *where, str(tmp_path), 2)
        for a, b in zip(full, resumed):
            for k in a["params"]:
                assert torch.equal(a["params"][k], b["params"][k]), (where, k)
        assert any(not torch.equal(resumed[0]["loaded"][k], full[0]["params"][k]) for k in full[0]["params"])


# -- disks that fail ---------------------------------------------------------------------------


def _setup_on_a_full_disk(ctx, root, which):
    """Rank 1's disk cannot hold the files named ``which`` (the masters and shards reserved when the
    model is wrapped, or the moments reserved by build_optimizer): every rank must raise."""
    (Path(root) / "keep.txt").write_text("saved before") if ctx.rank == 0 else None
    mesh = Mesh()
    real = os.posix_fallocate
    names = {}

    def full(fd, offset, n):
        if which in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, offset, n)
    if ctx.rank == 1:
        disk_module.os.posix_fallocate = full
    try:
        model = ShardedModule(GPT(GPTConfig(**CFG)), mesh=mesh, strategy="zero3",
                              offload=Offload(optimizer="nvme", params="nvme", path=root))
        names["built"] = True
        model.build_optimizer(torch.optim.AdamW, lr=LR)
        error = None
    except ValueError as e:
        error = str(e)
    finally:
        disk_module.os.posix_fallocate = real
    mesh.destroy()
    return error, names


@pytest.mark.parametrize("which", [".master", ".exp_avg"])
def test_a_full_disk_at_setup_fails_on_every_rank_and_leaves_nothing_behind(pools, tmp_path, which):
    """When the model is wrapped (masters, shards) or the optimizer built (moments): a ValueError on
    every rank naming rank 1, and after a failed wrap no rank's files remain; what the directory
    held before is untouched."""
    out = pools.run(2, _setup_on_a_full_disk, str(tmp_path), which)
    for e, names in out:
        assert e is not None and "rank 1" in e and "No space left on device" in e and "free space" in e, e
        assert names.get("built", False) == (which == ".exp_avg")
    if which == ".master":
        assert not list(tmp_path.glob("minipar-offload-rank*"))  # every rank removed what it began
    assert (tmp_path / "keep.txt").read_text() == "saved before"  # what was there is untouched


def _step_on_a_full_disk(ctx, root, ckpt):
    """Save a checkpoint after one step, then make rank 1's writes fail in the next step."""
    mesh = Mesh()
    path = Path(root) / "run"
    path.mkdir(exist_ok=True)
    model = ShardedModule(GPT(GPTConfig(**CFG)), mesh=mesh, strategy="zero2",
                          offload=Offload(optimizer="nvme", path=path, chunk_mb=CHUNK * 4 / 2**20))
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    x = batches(1, 2, 1, mesh.dp, 2, 7, CFG["vocab_size"])[:, 0, 2 * mesh.dp_rank:2 * mesh.dp_rank + 2]
    model.train_step(x[0, :, :-1], x[0, :, 1:], gpt_loss)
    opt.step()
    opt.zero_grad()
    checkpoint.save(ckpt, model, opt)
    saved = {k: v.clone() for k, v in model.full_state_dict().items()}
    real = disk_module._pwrite

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if ctx.rank == 1:
        disk_module._pwrite = full
    error = None
    try:
        model.train_step(x[1, :, :-1], x[1, :, 1:], gpt_loss)
        opt.step()
    except OffloadError as e:
        error = str(e)
    finally:
        disk_module._pwrite = real
    opt.zero_grad()
    checkpoint.load(ckpt, model, opt)  # what the error says to do, into the same model
    recovered = {k: v.clone() for k, v in model.full_state_dict().items()}
    mesh.destroy()
    return error, saved, recovered


def test_a_disk_that_fills_during_a_step_fails_on_every_rank_and_the_checkpoint_survives(pools, tmp_path):
    """OffloadError on every rank (naming rank 1 and the file), at the end of the step, not a hang;
    the checkpoint saved before loads into a fresh run with the parameters it had."""
    ckpt = tmp_path / "ckpt"
    out = pools.run(2, _step_on_a_full_disk, str(tmp_path), str(ckpt))
    for error, saved, recovered in out:
        assert error is not None and "rank 1" in error and "No space left on device" in error and ".master" in error
        assert "load the last checkpoint" in error
        for k in saved:  # the failed model itself is whole again
            assert torch.equal(saved[k], recovered[k]), k
    resumed = pools.run(2, _resume, str(ckpt), None, None, str(tmp_path), 0)
    for (_, saved, _), r in zip(out, resumed):
        for k in saved:
            assert torch.equal(saved[k], r["loaded"][k]), k


def _two_models_one_path(ctx, root):
    """Model A trains a step; model B is built on the same path; A's state must not change, also
    through a full state dict taken inside a write-back block (nested offloaded_state)."""
    mesh = Mesh()
    off = Offload(optimizer="nvme", params="nvme", path=root, chunk_mb=CHUNK * 4 / 2**20)
    a = ShardedModule(GPT(GPTConfig(**CFG)), mesh=mesh, strategy="zero3", offload=off)
    opt = a.build_optimizer(torch.optim.AdamW, lr=LR)
    x = batches(1, 1, 1, mesh.dp, 2, 7, CFG["vocab_size"])[0, 0, 2 * mesh.dp_rank:2 * mesh.dp_rank + 2]
    a.train_step(x[:, :-1], x[:, 1:], gpt_loss)
    opt.step()
    before = {k: v.clone() for k, v in a.full_state_dict().items()}
    sd = copy.deepcopy(opt.state_dict())
    b = ShardedModule(GPT(GPTConfig(**{**CFG, "seed": 5})), mesh=mesh, strategy="zero3", offload=off)
    b.build_optimizer(torch.optim.AdamW, lr=LR)
    with a.strategy.offloaded_state(write_back=True):
        inside = {k: v.clone() for k, v in a.full_state_dict().items()}
    after = {k: v.clone() for k, v in a.full_state_dict().items()}
    opt.load_state_dict(sd)  # an nvme optimizer state dict round trip
    sd_again = opt.state_dict()
    same_sd = all(torch.equal(sd["optimizer"]["state"][i][k], sd_again["optimizer"]["state"][i][k])
                  for i in sd["optimizer"]["state"] for k in sd["optimizer"]["state"][i])
    mesh.destroy()
    return before, inside, after, same_sd, len(sd["optimizer"]["state"])


def test_two_models_on_one_path_keep_their_own_files(pools, tmp_path):
    for before, inside, after, same_sd, n_states in pools.run(2, _two_models_one_path, str(tmp_path)):
        for k in before:
            assert torch.equal(before[k], inside[k]) and torch.equal(before[k], after[k]), k
        assert same_sd and n_states > 0


def _path_check_differs(ctx, root):
    """Rank 1 cannot write the path (os.access says so), rank 0 can: both must raise."""
    mesh = Mesh()
    real = offload_module.os.access
    if ctx.rank == 1:
        offload_module.os.access = lambda p, mode: False
    try:
        ShardedModule(GPT(GPTConfig(**CFG)), mesh=mesh, strategy="zero2",
                      offload=Offload(optimizer="nvme", path=root))
        error = None
    except ValueError as e:
        error = str(e)
    finally:
        offload_module.os.access = real
    mesh.destroy()
    return error


def test_a_path_one_rank_cannot_write_fails_on_every_rank(pools, tmp_path):
    for e in pools.run(2, _path_check_differs, str(tmp_path)):
        assert e is not None and "rank 1" in e and "not writable" in e and "rank 0" not in e, e


def test_offload_options_are_checked():
    d = os.getcwd()
    for bad, match in [(dict(params="cpu"), "needs optimizer='cpu' or 'nvme'"),
                       (dict(optimizer="nvme"), "needs path="),
                       (dict(optimizer="cpu", path=d), "used only by 'nvme'"),
                       (dict(optimizer="disk"), "choose None, 'cpu' or 'nvme'"),
                       (dict(optimizer="cpu", chunk_mb=0), "chunk_mb")]:
        with pytest.raises(ValueError, match=match):
            Offload(**bad)
    from minipar import DataParallelConfig
    with pytest.raises(ValueError, match="offloads zero3's parameter shards"):
        DataParallelConfig("zero2", offload=Offload(optimizer="cpu", params="cpu"))
    with pytest.raises(ValueError, match="not both"):
        DataParallelConfig("zero3", cpu_offload=True, offload=Offload(optimizer="cpu"))
    with pytest.raises(ValueError, match="offload does not apply to strategy='ddp'"):
        DataParallelConfig("ddp", offload=Offload(optimizer="cpu"))
    assert DataParallelConfig("zero1", cpu_offload=True).offload == Offload(optimizer="cpu")
    assert "does not exist" in check_path(Offload(optimizer="nvme", path=os.path.join(d, "no-such-dir")))
    assert "not a directory" in check_path(Offload(optimizer="nvme", path=__file__))
    assert check_path(Offload(optimizer="nvme", path=d)) is None


def _chunk_sizes(ctx, root):
    """One nvme step's disk reads and writes, each at most a chunk; writes in flight stay few."""
    mesh = Mesh()
    model = ShardedModule(GPT(GPTConfig(**CFG)), mesh=mesh, strategy="zero2", bucket_cap_mb=1.0,
                          offload=Offload(optimizer="nvme", path=root, chunk_mb=CHUNK * 4 / 2**20))
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR)
    files = model.strategy.files
    sizes, in_flight = [], []
    read, write = files.read, files.write
    files.read = lambda name, lo, n, device: sizes.append(n) or read(name, lo, n, device)
    files.write = lambda name, lo, v: (sizes.append(v.numel()), write(name, lo, v), in_flight.append(len(files._writes)))
    x = batches(1, 2, 1, mesh.dp, 2, 7, CFG["vocab_size"])[:, 0, 2 * mesh.dp_rank:2 * mesh.dp_rank + 2]
    for s in range(2):  # the second step reads the moments too
        model.train_step(x[s, :, :-1], x[s, :, 1:], gpt_loss)
        opt.step()
        opt.zero_grad()
    real = model.strategy.groups[0].layout.real_len
    mesh.destroy()
    return sizes, max(in_flight), real


def test_the_nvme_step_holds_a_few_chunks_at_a_time(pools, tmp_path):
    """With one big group (1 MiB buckets: the whole model, ~1,700 elements a rank), every read and
    write of the step is at most a chunk and at most 3 chunks' writes (master + 2 moments) wait."""
    for sizes, in_flight, real in pools.run(2, _chunk_sizes, str(tmp_path)):
        assert real > 10 * CHUNK and max(sizes) == CHUNK and len(sizes) > 40, (real, sizes)
        assert in_flight <= 3 * 3, in_flight


# -- with the other axes -----------------------------------------------------------------------


def _train_layout(ctx, sizes, strategy, opt_where, params_where, root, options):
    """3 clipped AdamW steps of a tied GPT under the mesh ``sizes``; the full parameters and, per
    step, the bytes offloading moved and what the formula says for this rank's parameters."""
    mesh = Mesh(**sizes)
    off = None
    if opt_where is not None:
        path = Path(root) / f"layout-{opt_where}-{params_where}"
        path.mkdir(exist_ok=True)
        off = Offload(optimizer=opt_where, params=params_where, chunk_mb=CHUNK * 4 / 2**20,
                      path=path if "nvme" in (opt_where, params_where) else None)
    cfg = dict(CFG, n_layer=4, n_head=2, n_embd=8, vocab_size=16, tie_weights=True)
    model = ShardedModule(GPT(GPTConfig(**cfg)), mesh=mesh, strategy=strategy, offload=off, **options)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    data = batches(5, 3, 1, mesh.dp, 4, 8, cfg["vocab_size"])[:, 0]
    moved = []
    local = data.shape[1] // mesh.dp
    for s in range(3):
        before = model.strategy.offload_traffic()
        x = data[s, mesh.dp_rank * local:(mesh.dp_rank + 1) * local]
        model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy)
        model.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        after = model.strategy.offload_traffic()
        moved.append({k: after[k] - before[k] for k in after})
    ps = F.ParamSet.of(model.module)
    dp = F.DataParallelShape(strategy, mesh.dp, param=4, rank=mesh.dp_rank, reshard_after_forward=mesh.pp == 1)
    expected = [offload_traffic(ps, dp, opt_where, params_where, pipeline=mesh.pp > 1, first_step=s == 0)
                for s in range(3)] if opt_where else None
    out = dict(params={k: v.clone() for k, v in model.full_state_dict().items()}, moved=moved, expected=expected)
    mesh.destroy()
    return out


LAYOUTS = [  # (world, mesh sizes, strategy, optimizer, params, options)
    (4, dict(dp=2, pp=2), "zero3", "nvme", "nvme", dict(schedule="1f1b", microbatches=2)),
    (4, dict(dp=2, pp=2), "zero1", "cpu", None, dict(schedule="zb_h1", microbatches=2)),
    (4, dict(dp=2, tp=2), "zero2", "nvme", None, dict(sequence_parallel=True)),
    (4, dict(dp=2, tp=2), "zero3", "cpu", "cpu", {}),
]


@pytest.mark.parametrize("world, sizes, strategy, opt_where, params_where, options", LAYOUTS)
def test_offload_under_pipelines_and_tensor_parallelism(pools, tmp_path, world, sizes, strategy, opt_where,
                                                        params_where, options):
    """Offload composes: under pp (1F1B, the zero-bubble split backward) and tp (± sequence
    parallelism) the run is bitwise equal to the same layout without offload, and the bytes moved
    equal the formula (a pipeline's zero3 gathers each unit once per step)."""
    plain = pools.run(world, _train_layout, sizes, strategy, None, None, None, options)
    runs = pools.run(world, _train_layout, sizes, strategy, opt_where, params_where, str(tmp_path), options)
    for base, out in zip(plain, runs):
        for k in base["params"]:
            assert torch.equal(out["params"][k], base["params"][k]), k
        assert out["moved"] == out["expected"], (out["moved"], out["expected"])
