"""Issue 34: compositions that trained or evaluated a different model than the user built, with no
error on any rank. Each test states the class it covers, and either that the composition now equals
one process (or keeps its copies of a parameter equal), or that it is refused on every rank, before
any collective, with a ValueError that says why and what to do.

Every test here failed on the code before its fix (each docstring says how).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from minipar import Mesh, ShardedModule
from minipar.models import GPT, GPTConfig

from helpers import EPS, LR, WD


# -- Mesh.new_group: every rank must create the same groups ---------------------------------------


def _new_group_per_rank(ctx, per_rank: list) -> list[str]:
    """Each rank asks for ``per_rank[rank]`` = (name, lists); returns what each call said."""
    mesh = Mesh()
    said = []
    for name, lists in per_rank[ctx.rank]:
        try:
            group = mesh.new_group(name, lists)
            said.append(f"ok {group.name} {group.ranks}")
        except ValueError as e:
            said.append(f"refused: {e}")
    mesh.destroy()
    return said


@pytest.mark.parametrize("per_rank", [
    # the same partition listed in another order: torch would pair rank 0's group [0] with rank 1's [1]
    [[("a", [[0], [1]])], [("a", [[1], [0]])]],
    # one rank's lists are no partition: before, it raised alone and the other created its groups
    [[("a", [[0], [1]])], [("a", [[0]])]],
    # another name: the groups would be counted and reported under two names
    [[("a", [[0, 1]])], [("b", [[0, 1]])]],
])
def test_new_group_with_different_lists_is_refused_on_every_rank(pools, per_rank):
    """Class 5. Lists, names or backends that differ between ranks raise ValueError on every rank,
    naming the ranks and the difference, and no group is created (a later, agreed call still works).
    Before: the first case built groups silently, the second hung in torch's new_group."""
    for case in per_rank:
        case.append(("after", [[0, 1]]))
    said = pools.run(2, _new_group_per_rank, per_rank, timeout=60)
    for rank, (first, after) in enumerate(said):
        assert first.startswith("refused:") and "differs between ranks" in first and "rank 1" in first, (rank, first)
        assert after == "ok after (0, 1)", (rank, after)


# -- the planner: nonsense inputs exit non-zero with the reason ------------------------------------


@pytest.mark.parametrize("args, why", [
    (["--global-batch", "-8"], "global batch=-8 must be a positive integer"),
    (["--global-batch", "0"], "global batch=0 must be a positive integer"),
    (["--gpus", "0"], "--gpus 0 must be at least 1"),
    (["--gpus", "-8"], "--gpus -8 must be at least 1"),
    (["--gpus-per-node", "0"], "--gpus-per-node 0 must be at least 1"),
    (["--gpus", "12"], "not a multiple of --gpus-per-node"),
    (["--memory-gb", "-1"], "--memory-gb -1.0 must be a finite number > 0"),
    (["--peak-tflops", "0"], "--peak-tflops 0.0 must be a finite number > 0"),
    (["--inter-gbps", "inf"], "--inter-gbps inf must be a finite number > 0"),
    (["--efficiency", "nan"], "--efficiency nan must be a finite number > 0"),
    (["--efficiency", "1.5"], "at most 1"),
    (["--top", "0"], "top=0 must be a positive integer"),
    (["--layers", "0"], "model layers=0 must be a positive integer"),
    (["--heads", "7"], "hidden=768 must be divisible by heads=7"),
    (["--kv-heads", "5"], "kv_heads=5 must divide heads=12"),
    (["--seq", "-1024"], "model seq=-1024 must be a positive integer"),
    (["--top-k", "2"], "top_k=2 describe experts, but the model has experts=0"),
    (["--experts", "8", "--top-k", "9", "--moe-ffn", "64"], "1 <= top_k <= experts"),
    (["--config", "/nonexistent/config.json"], "cannot read a JSON config"),
    (["--explain", "tp0.pp1.dp8"], "layout tp=0 must be a positive integer"),
    (["--explain", "tp1.pp1.dp8.zero9"], "cannot read 'zero9'"),
    (["--explain", "tp1.pp1.dp8", "--json"], "leave out --json"),
])
def test_planner_refuses_nonsense_inputs_with_a_message(capsys, args, why):
    """Class 6. Every size, rate and option is validated before any arithmetic: the command exits 2
    (a usage error) with the reason on stderr, never 0 with negative, infinite or nan step times.
    Before: a negative batch printed negative step times and exited 0; zero GPUs raised
    ZeroDivisionError; a negative memory or a top-k without experts planned on."""
    from minipar.plan.__main__ import main
    base = [] if "--config" in args else ["--model", "gpt2-124m"]
    with pytest.raises(SystemExit) as exit_:
        main(base + args)
    assert exit_.value.code == 2
    assert why in capsys.readouterr().err


def test_planner_api_refuses_nonsense_inputs():
    """Class 6, from Python: `plan` and `evaluate` raise ValueError for the same inputs."""
    from dataclasses import replace

    from minipar.plan import Layout, evaluate, plan
    from minipar.plan.presets import H100, MODELS

    with pytest.raises(ValueError, match="global batch=-8"):
        plan("gpt2-124m", H100, -8)
    with pytest.raises(ValueError, match="model hidden=0"):
        plan(replace(MODELS["gpt2-124m"], hidden=0), H100, 64)
    with pytest.raises(ValueError, match="cluster memory"):
        evaluate(MODELS["gpt2-124m"], replace(H100, memory=-1.0), 64, Layout(tp=1, pp=1, dp=8))
    with pytest.raises(ValueError, match="layout dp=-8"):
        Layout(tp=1, pp=1, dp=-8)
    with pytest.raises(ValueError, match="unknown model"):
        plan("no-such-model")


# -- context parallelism: modules it does not wire, direct calls, losses that ignore padding --------


def padded_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A user's loss that ignores padding: torch's cross-entropy, -100 ignored (mean over the rest)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def _one_step_reference(cfg: dict, x: torch.Tensor, y: torch.Tensor, loss_fn=padded_loss):
    """One process, one AdamW step on the whole batch: (loss, state after the step)."""
    model = GPT(GPTConfig(**cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    return loss.item(), model.state_dict()


def _train_one_step(ctx, layout: dict, options: dict, cfg: dict, x: torch.Tensor, y: torch.Tensor):
    mesh = Mesh(**layout)
    model = ShardedModule(GPT(GPTConfig(**cfg)), mesh=mesh, **options)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    loss = model.train_step(x, y, padded_loss).item()
    opt.step()
    state = {k: v.detach().clone() for k, v in model.full_state_dict().items()}
    mesh.destroy()
    return loss, state


_CP_CFG = dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.0, seed=4)


@pytest.mark.parametrize("layout, options, ignored", [
    # cp=2 ring: rank 0 holds zig-zag chunks 0 and 3, positions 0, 1, 6, 7: all of them padding
    (dict(cp=2), dict(context_parallel="ring"), [0, 1, 6, 7]),
    # Ulysses: rank 1 holds positions 4..7
    (dict(cp=2), dict(context_parallel="ulysses"), [4, 5, 6, 7]),
    # a pipeline of two micro-batches whose first is all padding (one row each)
    (dict(pp=2), dict(microbatches=2), "row 0"),
    # a pipeline whose micro-batches count different numbers of tokens: a mean of their means is not
    # the mean over the batch's tokens
    (dict(pp=2), dict(microbatches=2), "half of row 0"),
])
def test_a_loss_that_ignores_padding_equals_one_process(pools, layout, options, ignored):
    """Classes 4c and 7 (the split of the batch into micro-batches is a split too). A user loss with
    ignore_index=-100 where one cp rank's tokens (or one micro-batch) are all padding: the loss and
    the parameters after a step equal one process on the batch (a finite loss). Before: NaN loss and
    NaN parameters everywhere under cp (and under pp with an all-padding micro-batch); under pp with
    uneven padding the mean of the micro-batches' means, not one process's loss."""
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 16, (2, 9), generator=g)
    x, y = data[:, :-1], data[:, 1:].clone()
    if ignored == "row 0":
        y[0] = -100
    elif ignored == "half of row 0":
        y[0, :5] = -100
    else:
        y[:, ignored] = -100
    ref_loss, ref_state = _one_step_reference(_CP_CFG, x, y)
    for rank, (loss, state) in enumerate(pools.run(2, _train_one_step, layout, options, _CP_CFG, x, y)):
        assert loss == pytest.approx(ref_loss, rel=1e-5), (rank, loss, ref_loss)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, msg=lambda m: f"rank {rank} {k}: {m}")


def _direct_calls(ctx, form: str, cfg: dict, x: torch.Tensor, y: torch.Tensor):
    mesh = Mesh(cp=2)
    model = ShardedModule(GPT(GPTConfig(**cfg)), mesh=mesh, context_parallel=form,
                          activation_checkpointing=True)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    with torch.no_grad():
        before = model(x).clone()
    loss = model.train_step(x, y, padded_loss).item()
    opt.step()
    with torch.no_grad():
        after = model(x).clone()
    state = {k: v.detach().clone() for k, v in model.full_state_dict().items()}
    mesh.destroy()
    return before, loss, after, state


@pytest.mark.parametrize("form", ["ring", "ulysses"])
def test_direct_calls_under_cp_compute_what_one_process_does(pools, form):
    """Class 4b. ``model(x)`` called directly (evaluation, before and after a training step) under
    ring or Ulysses cp returns one process's logits for the whole sequence on every rank, and a
    training step between the two calls (with recomputed blocks) still equals one process. Before:
    the direct call ran the split attention on unsplit tokens (other logits, or an error)."""
    cfg = dict(_CP_CFG, pos="rope", norm="rmsnorm", mlp="swiglu")
    g = torch.Generator().manual_seed(8)
    data = torch.randint(0, 16, (2, 9), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    reference = GPT(GPTConfig(**cfg))
    with torch.no_grad():
        ref_before = reference(x)
    ref_loss, ref_state = _one_step_reference(cfg, x, y)
    reference.load_state_dict(ref_state)
    with torch.no_grad():
        ref_after = reference(x)
    for rank, (before, loss, after, state) in enumerate(pools.run(2, _direct_calls, form, cfg, x, y)):
        torch.testing.assert_close(before, ref_before, msg=lambda m: f"rank {rank} before training: {m}")
        assert loss == pytest.approx(ref_loss, rel=1e-5), rank
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, msg=lambda m: f"rank {rank} {k}: {m}")
        torch.testing.assert_close(after, ref_after, msg=lambda m: f"rank {rank} after a step: {m}")


class WithMultiheadAttention(nn.Module):
    """A block followed by an nn.MultiheadAttention of its own: a mixing of tokens minipar does not wire."""

    def __init__(self, block: nn.Module, width: int) -> None:
        super().__init__()
        self.block = block
        self.mha = nn.MultiheadAttention(width, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(x)
        return x + self.mha(x, x, x, need_weights=False)[0]


class SequenceConv(nn.Module):
    """A causal convolution over the sequence (as in Mamba-style blocks): it mixes neighbouring tokens."""

    def __init__(self, block: nn.Module, width: int) -> None:
        super().__init__()
        self.block = block
        self.conv = nn.Conv1d(width, width, 2, padding=1, groups=width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(x)
        return x + self.conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)


def _wrap_mixing_model(ctx, form: str, extra: str):
    mesh = Mesh(cp=2)
    model = GPT(GPTConfig(**_CP_CFG))
    model.layers[1] = {"mha": WithMultiheadAttention, "conv": SequenceConv}[extra](model.layers[1], 8)
    with mesh.comm.counting() as stats:
        try:
            ShardedModule(model, mesh=mesh, context_parallel=form)
            said = None
        except ValueError as e:
            said = str(e)
    mesh.destroy()
    return said, stats.calls()


@pytest.mark.parametrize("form", ["ring", "ulysses"])
@pytest.mark.parametrize("extra", ["mha", "conv"])
def test_a_module_that_mixes_tokens_unwired_is_refused_under_cp(pools, form, extra):
    """Class 4a. A model with a token-mixing module minipar does not wire (an nn.MultiheadAttention
    inside a block, a convolution over the sequence) is refused when wrapped under cp, on every rank,
    before any collective, naming the module. Before: each rank's extra attention attended to its
    own tokens only and the model trained silently."""
    for said, calls in pools.run(2, _wrap_mixing_model, form, extra):
        assert said is not None, "not refused"
        assert "mixes tokens where minipar does not split them" in said and "cp=1" in said, said
        # the MHA's own output is (batch, seq, width) and is named; the convolution's is (batch,
        # width, seq), so the first output over the sequence that differs is its block's
        assert ("'layers.1.mha'" if extra == "mha" else "'layers.1'") in said, said
        assert calls == 0
