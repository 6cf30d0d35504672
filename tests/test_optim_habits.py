"""torch.optim habits under every data-parallel strategy, each proven equal to the single-process run.

What a user who knows PyTorch will do with the optimizer, and what each strategy must answer:

* a plain ``torch.optim.AdamW(model.parameters())``: trains under DDP; under ZeRO (whose gradients
  never stay in ``p.grad``) it raises ValueError on every rank at its first step, naming the fix,
  instead of training nothing;
* what ``build_optimizer`` returns is a ``torch.optim.Optimizer``, so an ``lr_scheduler`` drives it,
  and the lr it sets is the lr every step path uses: the torch optimizer over the master shards,
  the fused Triton AdamW kernel (run here under the Triton interpreter around the step), and the
  offloaded steps ("cpu", and "nvme" whose chunked step rebuilds each group's options);
* two parameter groups with their own weight decay and lr (norms and biases without decay, at
  twice the lr), whose parameters share flat shards under ZeRO;
* ``step()`` with no gradient (before the first backward, after ``zero_grad``) changes nothing.

The matrix: strategy (ddp, zero1, zero2, zero3, zero3 over HSDP) x how the optimizer is built
(plain or build_optimizer under DDP; torch, fused, cpu or nvme step under ZeRO) x schedule (none,
LambdaLR, CosineAnnealingLR) x groups (one, or decay / no-decay). Each trains four AdamW steps with
clipping that fires (max norm 0.05, the norms are ~1) and is compared with the same GPT trained
in this process on the global batch with the same groups and schedule: losses, the lr of every
group at every step (exactly: the same arithmetic on the same numbers), and the final parameters
at the default fp32 tolerances of ``torch.testing.assert_close`` (the reduction order differs
from the reference's; `helpers.EPS` keeps AdamW well conditioned). CI runs `CI_SAMPLE`, in which
every strategy, every step path, every schedule and both group settings appear;
``HYPOTHESIS_PROFILE=long`` runs all of `MATRIX`. A checkpoint saved under one layout with two
groups and a schedule resumes under another and ends where the uninterrupted run ends.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from minipar import Mesh, Offload, ShardedModule, checkpoint, kernels
from minipar.models import GPT, GPTConfig, gpt_loss

from helpers import EPS, LR, WD, batches

CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, seed=3)
STEPS, LOCAL_BS, SEQ, MAX_NORM = 4, 2, 8, 0.05

# name -> (world, mesh sizes, ShardedModule options)
LAYOUTS = {"ddp": (2, {}, dict(strategy="ddp")), "zero1": (2, {}, dict(strategy="zero1")),
           "zero2": (2, {}, dict(strategy="zero2")), "zero3": (2, {}, dict(strategy="zero3")),
           "hsdp": (4, dict(dp_shard=2), dict(strategy="zero3"))}
BUILDS = {"ddp": ("plain", "build"), "sharded": ("torch", "fused", "cpu", "nvme")}
SCHEDULES = ("none", "lambda", "cosine")
GROUPS = ("one", "two")

MATRIX = [(lay, build, sched, groups) for lay in LAYOUTS for build in BUILDS["ddp" if lay == "ddp" else "sharded"]
          for sched in SCHEDULES for groups in GROUPS]
CI_SAMPLE = [("ddp", "plain", "cosine", "two"), ("ddp", "build", "lambda", "two"), ("zero1", "torch", "cosine", "two"),
             ("zero2", "cpu", "lambda", "two"), ("zero3", "nvme", "cosine", "two"), ("zero3", "fused", "lambda", "two"),
             ("hsdp", "torch", "none", "two"), ("zero2", "fused", "cosine", "one")]
CASES = MATRIX if os.environ.get("HYPOTHESIS_PROFILE") == "long" else CI_SAMPLE


def _groups(module, groups: str):
    """The optimizer's params: everything in one group, or matrices decayed and vectors (norms, biases) not,
    at twice the lr."""
    if groups == "one":
        return list(module.parameters())
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0, "lr": 2 * LR}]


def _schedule(opt, schedule: str):
    if schedule == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    if schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    return None


def _optimizer(model, build: str, groups: str):
    params = _groups(model, groups)
    if build == "plain":
        return torch.optim.AdamW(params, lr=LR, weight_decay=WD, eps=EPS)
    return model.build_optimizer(torch.optim.AdamW, params, lr=LR, weight_decay=WD, eps=EPS)


def _fused_if(build: str):
    """The fused kernel's path for the step alone: the Triton interpreter stands in for a GPU (the
    dispatch rule is read at every call), while forward and backward keep PyTorch's kernels."""
    if build != "fused":
        return contextlib.nullcontext()
    return _env("TRITON_INTERPRET", "1")


@contextlib.contextmanager
def _env(key: str, value: str):
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[key]
        else:
            os.environ[key] = old


def _wrap(ctx, layout: str, build: str, tmp: str):
    world, sizes, options = LAYOUTS[layout]
    inner = GPT(GPTConfig(**{**CFG, "seed": CFG["seed"] + ctx.rank}))  # rank 0's weights must win
    offload = {"cpu": Offload(optimizer="cpu"), "nvme": Offload(optimizer="nvme", path=tmp, chunk_mb=0.01)}.get(build)
    return ShardedModule(inner, mesh=Mesh(**sizes), bucket_cap_mb=1e-3, offload=offload, **options)


def _train(model, opt, sched, data, build: str, steps: range):
    """Steps ``steps`` of ``data`` on this rank's rows; (losses, every group's lr at every step)."""
    mesh = model.mesh
    losses, lrs = [], []
    for s in steps:
        x = data[s, mesh.dp_rank * LOCAL_BS:(mesh.dp_rank + 1) * LOCAL_BS]
        losses.append(model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy).item())
        model.clip_grad_norm_(MAX_NORM)
        lrs.append([g["lr"] for g in opt.param_groups])
        with _fused_if(build):
            opt.step()
        if sched is not None:
            sched.step()
        model.zero_grad()
    return losses, lrs


def _unchanged(model, opt, build: str) -> bool:
    """step() without gradients changes nothing."""
    before = {k: v.clone() for k, v in model.full_state_dict().items()}
    with _fused_if(build):
        opt.step()
    return all(torch.equal(before[k], v) for k, v in model.full_state_dict().items())


def _run_layout(ctx, layout, build, schedule, groups, data, tmp):
    model = _wrap(ctx, layout, build, tmp)
    opt = _optimizer(model, build, groups)
    sched = _schedule(opt, schedule)
    quiet_before = _unchanged(model, opt, build)
    launched = sum(n for k, n in kernels.launches.items() if "adamw" in k)
    losses, lrs = _train(model, opt, sched, data, build, range(STEPS))
    fused = sum(n for k, n in kernels.launches.items() if "adamw" in k) > launched
    quiet_after = _unchanged(model, opt, build)
    state = {k: v.cpu().clone() for k, v in model.full_state_dict().items()}
    return isinstance(opt, torch.optim.Optimizer), quiet_before, quiet_after, fused, losses, lrs, state


def _reference(data, schedule: str, groups: str, steps: int = STEPS):
    model = GPT(GPTConfig(**CFG))
    opt = torch.optim.AdamW(_groups(model, groups), lr=LR, weight_decay=WD, eps=EPS)
    sched = _schedule(opt, schedule)
    losses, lrs = [], []
    for s in range(steps):
        x = data[s]
        loss = gpt_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        assert norm > 4 * MAX_NORM  # clipping fires
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, lrs, model.state_dict()


@pytest.mark.parametrize("layout,build,schedule,groups", CASES, ids=["-".join(c) for c in CASES])
def test_optimizer_habits_equal_the_single_process_run(pools, tmp_path, layout, build, schedule, groups):
    world = LAYOUTS[layout][0]
    data = batches(7, STEPS, 1, world, LOCAL_BS, SEQ, CFG["vocab_size"])[:, 0]  # (steps, global batch, seq + 1)
    ref_losses, ref_lrs, ref_state = _reference(data, schedule, groups)
    if schedule != "none":
        assert ref_lrs[0] != ref_lrs[1], "the schedule must change the lr"
    for rank, out in enumerate(pools.run(world, _run_layout, layout, build, schedule, groups, data, str(tmp_path))):
        is_optimizer, quiet_before, quiet_after, fused, losses, lrs, state = out
        where = f"rank {rank}, {layout}/{build}/{schedule}/{groups}"
        assert is_optimizer, f"{where}: not a torch.optim.Optimizer"
        assert quiet_before and quiet_after, f"{where}: step() without gradients changed the model"
        assert fused == (build == "fused"), f"{where}: the fused AdamW kernel {'did not run' if not fused else 'ran'}"
        assert lrs == ref_lrs, f"{where}: lrs {lrs} != {ref_lrs}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=where)
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, msg=f"{where}: {name}")


def _plain_under(ctx, strategy: str):
    model = ShardedModule(GPT(GPTConfig(**CFG)), mesh=Mesh(), strategy=strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x = torch.randint(0, CFG["vocab_size"], (LOCAL_BS, SEQ + 1), generator=torch.Generator().manual_seed(ctx.rank))
    model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy)
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_a_plain_optimizer_over_a_zero_model_is_refused(pools, strategy):
    """It would train nothing (its parameters never get a gradient): every rank raises at the first step."""
    for rank, message in enumerate(pools.run(2, _plain_under, strategy)):
        assert message is not None and "model.build_optimizer(torch.optim.AdamW" in message, f"rank {rank}: {message}"


def _plain_after_rewrapping(ctx):
    inner = GPT(GPTConfig(**CFG))
    ShardedModule(inner, mesh=Mesh(), strategy="zero2")  # dropped: its refusal must not outlive it
    model = ShardedModule(inner, mesh=Mesh(), strategy="ddp")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x = torch.randint(0, CFG["vocab_size"], (LOCAL_BS, SEQ + 1), generator=torch.Generator().manual_seed(ctx.rank))
    model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy)
    before = inner.wte.weight.detach().clone()
    opt.step()
    return not torch.equal(before, inner.wte.weight)


def test_a_model_wrapped_again_under_ddp_takes_a_plain_optimizer(pools):
    """The refusal lives with the ZeRO wrapper and applies to the parameters it syncs now: once DDP has
    wrapped the model again, a plain optimizer trains it."""
    assert all(pools.run(2, _plain_after_rewrapping))


def _save_then_resume(ctx, save_layout, load_layout, data, root):
    model = _wrap(ctx, save_layout, "torch", root)
    opt = _optimizer(model, "build", "two")
    sched = _schedule(opt, "cosine")
    _train(model, opt, sched, data, "torch", range(2))
    path = checkpoint.save(os.path.join(root, "step_2"), model, opt, extra_state={"scheduler": sched.state_dict()})
    resumed = _wrap(ctx, load_layout, "torch", root)
    opt = _optimizer(resumed, "build", "two")
    sched = _schedule(opt, "cosine")  # built before the load, as torch's recipe: its state comes from the checkpoint
    sched.load_state_dict(checkpoint.load(path, resumed, opt)["scheduler"])
    losses, lrs = _train(resumed, opt, sched, data, "torch", range(2, STEPS))
    return losses, lrs, {k: v.cpu().clone() for k, v in resumed.full_state_dict().items()}


@pytest.mark.parametrize("save_layout,load_layout", [("zero2", "zero3"), ("zero3", "ddp")])
def test_groups_and_schedule_survive_a_checkpoint_under_another_layout(pools, tmp_path, save_layout, load_layout):
    data = batches(7, STEPS, 1, 2, LOCAL_BS, SEQ, CFG["vocab_size"])[:, 0]
    ref_losses, ref_lrs, ref_state = _reference(data, "cosine", "two")
    for rank, (losses, lrs, state) in enumerate(pools.run(2, _save_then_resume, save_layout, load_layout, data,
                                                          str(tmp_path))):
        where = f"rank {rank}, {save_layout} -> {load_layout}"
        assert lrs == ref_lrs[2:], f"{where}: lrs {lrs} != {ref_lrs[2:]}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[2:]), msg=where)
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, msg=f"{where}: {name}")


def _sharded_optimizer_api(ctx):
    model = ShardedModule(GPT(GPTConfig(**CFG)), mesh=Mesh(), strategy="zero2")
    opt = _optimizer(model, "build", "two")
    out = {"groups": len(opt.param_groups), "decay": [g["weight_decay"] for g in opt.param_groups]}
    try:
        opt.add_param_group({"params": []})
    except ValueError as e:
        out["add_param_group"] = str(e)
    # torch's state_dict round trip, groups and scheduled lr included (same layout)
    sched = _schedule(opt, "cosine")
    data = batches(7, 1, 1, 2, LOCAL_BS, SEQ, CFG["vocab_size"])[:, 0]
    _train(model, opt, sched, data, "torch", range(1))
    again = model.build_optimizer(torch.optim.AdamW, model.named_parameters(), lr=LR)  # one group, by name
    out["named"] = len(again.param_groups)
    again = _optimizer(model, "build", "two")
    again.load_state_dict(opt.state_dict())
    out["round_trip"] = [g["lr"] for g in again.param_groups] == [g["lr"] for g in opt.param_groups] and all(
        torch.equal(again.state[a]["exp_avg"], opt.state[b]["exp_avg"])
        for a, b in zip(again.optimizer.param_groups[0]["params"], opt.optimizer.param_groups[0]["params"]))
    # a parameter in no group (here on rank 1 only): every rank raises, none goes on to train
    decay = [p for p in model.parameters() if p.dim() >= 2]
    try:
        model.build_optimizer(torch.optim.AdamW, [{"params": decay}] if ctx.rank == 1 else _groups(model, "two"))
    except ValueError as e:
        out["missing"] = str(e)
    return out


def test_the_sharded_optimizer_answers_as_torch_or_says_why_not(pools):
    for rank, out in enumerate(pools.run(2, _sharded_optimizer_api)):
        assert out["groups"] == 2 and out["decay"] == [WD, 0.0], (rank, out)
        assert "give all parameter groups to model.build_optimizer" in out["add_param_group"], (rank, out)
        assert out["named"] == 1 and out["round_trip"], (rank, out)
        assert "rank 1:" in out["missing"] and "are in no parameter group" in out["missing"], (rank, out)
