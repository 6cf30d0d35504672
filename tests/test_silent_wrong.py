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
        except ValueError as e:
            said.append(f"refused: {e}")
            continue
        t = torch.ones(1)
        mesh.comm.all_reduce(t, group)  # the group works (and both ranks are done connecting before destroy)
        said.append(f"ok {group.name} {group.ranks} {t.item():g}")
    mesh.destroy()
    return said


@pytest.mark.parametrize("per_rank", [
    # the same partition listed in another order: torch would pair rank 0's group [0] with rank 1's [1]
    [[("a", [[0], [1]])], [("a", [[1], [0]])]],
    # one rank's lists are no partition: before, it raised alone and the other created its groups
    [[("a", [[0], [1]])], [("a", [[0]])]],
    # another partition: rank 0 would build [0] and [1], rank 1 one group of both
    [[("a", [[0], [1]])], [("a", [[0, 1]])]],
])
def test_new_group_with_different_lists_is_refused_on_every_rank(pools, per_rank):
    """Class 5. Lists or backends that differ between ranks raise ValueError on every rank,
    naming the ranks and the difference, and no group is created (a later, agreed call still works).
    Before: the first case built groups silently, the second hung in torch's new_group."""
    for case in per_rank:
        case.append(("after", [[0, 1]]))
    said = pools.run(2, _new_group_per_rank, per_rank, timeout=60)
    for rank, (first, after) in enumerate(said):
        assert first.startswith("refused:") and "differs between ranks" in first and "rank 1" in first, (rank, first)
        assert after == "ok after (0, 1) 2", (rank, after)


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
    # q, k and v from one fused projection: wired like separate ones (was refused: "no attention")
    (dict(cp=2), dict(context_parallel="ring", fused_qkv=True), [0, 1, 6, 7]),
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
    options = dict(options)
    cfg = dict(_CP_CFG, fused_qkv=options.pop("fused_qkv", False))
    ref_loss, ref_state = _one_step_reference(cfg, x, y)
    for rank, (loss, state) in enumerate(pools.run(2, _train_one_step, layout, options, cfg, x, y)):
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


def _direct_call_under_pp(ctx):
    mesh = Mesh(pp=2)
    model = ShardedModule(GPT(GPTConfig(**_CP_CFG)), mesh=mesh, microbatches=2)
    try:
        with mesh.comm.counting() as stats:
            model(torch.zeros(2, 8, dtype=torch.long))
        return None
    except ValueError as e:
        return str(e), len(stats.records)
    finally:
        mesh.destroy()


def test_a_direct_call_under_a_pipeline_is_refused(pools):
    """Under pipeline parallelism a rank holds one stage: ``model(x)`` would run that stage alone (the
    first stage returned hidden states, not logits). Refused on every rank, saying how to evaluate."""
    for out in pools.run(2, _direct_call_under_pp):
        assert out is not None and "holds one stage" in out[0] and "full_state_dict" in out[0], out
        assert out[1] == 0, out


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


# -- pipelines: parameters shared across stages, and specs that are not the model -----------------


def _gpt_for(case: str) -> tuple[nn.Module, object]:
    """(model, StageSpec) of each pipeline case, built on the rank (specs hold functions)."""
    from dataclasses import replace

    from minipar.pipeline import gpt_spec

    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=4, n_head=2, n_embd=8, seed=5))
    spec = gpt_spec(model)
    if case == "a weight shared by two depths":  # ALBERT-style tying inside the trunk
        model.layers[3].mlp.fc.weight = model.layers[0].mlp.fc.weight
    elif case == "a block used at two depths":
        model.layers[2] = model.layers[0]
    elif case == "a tie the spec does not declare":
        spec = replace(spec, tied=None)
    elif case == "the final norm left out":
        spec = replace(spec, last=("lm_head",), head=_head_without_norm)
    elif case == "a wrong width":
        spec = replace(spec, hidden_size=16)
    elif case == "a head that is not the model's":
        spec = replace(spec, head=_scaled_head)
    elif case == "a head using a first-stage module":
        spec = replace(spec, first=("wte", "wpe", "drop", "ln_f"), last=("lm_head",))
    return model, spec


def _head_without_norm(s, h):
    return s.lm_head(h)


def _scaled_head(s, h):
    return s.lm_head(s.ln_f(h)) * 2.0


def _wrap_pipeline(ctx, case: str):
    from minipar.pipeline import PipelineConfig

    mesh = Mesh(pp=2)
    model, spec = _gpt_for(case)
    with mesh.comm.counting() as stats:
        try:
            ShardedModule(model, mesh=mesh, pipeline=PipelineConfig(microbatches=2, stage_spec=spec))
            said = None
        except ValueError as e:
            said = str(e)
    mesh.destroy()
    return said, stats.calls()


@pytest.mark.parametrize("case, why", [
    ("a weight shared by two depths", "'layers.0.mlp.fc.weight' of GPT is shared by block 0 and block 3"),
    ("a block used at two depths", "is shared by block 0 and block 2"),
    ("a tie the spec does not declare", "'wte.weight' of GPT is shared by the embedding and the head"),
])
def test_a_parameter_shared_across_stages_is_refused(pools, case, why):
    """Class 2. A Parameter used by blocks a pipeline may put on different stages (weights tied
    inside the trunk, one block at two depths), or by the embedding and the head without the tie
    being declared in StageSpec.tied, is refused on every rank before any collective: each stage
    would train its own copy. Before: the pipeline trained the copies apart silently."""
    for said, calls in pools.run(2, _wrap_pipeline, case):
        assert said is not None, "not refused"
        assert why in said and "each would train its own copy" in said, said
        assert calls == 0


@pytest.mark.parametrize("case, why", [
    ("the final norm left out", "GPT's forward runs ln_f, but no stage cut by its StageSpec does"),
    ("a wrong width", "block 0 of GPT takes or gives hidden states of shape (1, 2, 8) (input), but the stages "
                      "send each other (batch, seq, hidden_size=16)"),
    ("a head that is not the model's", "compute other logits than its own forward"),
    ("a head using a first-stage module", "fail on token ids of shape (1, 2)"),
])
def test_a_stage_spec_that_is_not_the_model_is_refused(pools, case, why):
    """Class 3. A StageSpec whose stages, run one after another in one process, are not the model: a
    module of the model's forward in no stage (the final norm), a boundary width other than the
    model's (before: a gloo abort in the first send), a head computing something else, a head using
    a module only the first stage holds. Refused on every rank when wrapped, before any collective.
    Before: the first and third trained another model silently, the last failed on one stage only."""
    for said, calls in pools.run(2, _wrap_pipeline, case, timeout=120):
        assert said is not None, "not refused"
        assert why in said, said
        assert calls == 0


def test_the_stage_check_passes_every_built_in_model_and_costs_little():
    """Class 3's check on the models minipar cuts (its GPT in each form, the MoE GPT; Hugging Face
    GPT-2, Llama and Mistral with eager and SDPA attention, tied and untied): no refusal, a fraction
    of a second each, and the model left as it was (training mode, random state, MoE statistics).
    (Flex attention passes too; it is left out here: its first compile takes many seconds on a CPU.)"""
    import time

    transformers = pytest.importorskip("transformers")
    from minipar.models import MoEGPT, MoEGPTConfig
    from minipar.pipeline import spec_for
    from minipar.pipeline.cut_check import check_spec

    small = dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8)
    models = [GPT(GPTConfig(**small, **kw)) for kw in (dict(), dict(tie_weights=False), dict(fused_qkv=True),
                                                          dict(norm="rmsnorm", mlp="swiglu", pos="rope"))]
    models.append(MoEGPT(MoEGPTConfig(**small, n_experts=4, top_k=2)))
    hf = dict(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=8, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    for attn in ("eager", "sdpa"):
        for tied in (True, False):
            models.append(transformers.GPT2LMHeadModel(transformers.GPT2Config(
                vocab_size=16, n_positions=8, n_embd=8, n_layer=2, n_head=2, tie_word_embeddings=tied,
                attn_implementation=attn)))
            models.append(transformers.LlamaForCausalLM(transformers.LlamaConfig(
                **hf, tie_word_embeddings=tied, attn_implementation=attn)))
            models.append(transformers.MistralForCausalLM(transformers.MistralConfig(
                **hf, sliding_window=3, tie_word_embeddings=tied, attn_implementation=attn)))
    for model in models:
        model.train()
        rng = torch.random.get_rng_state()
        start = time.perf_counter()
        check_spec(model, spec_for(model))
        assert time.perf_counter() - start < 5.0, type(model).__name__  # generous: a loaded CI machine
        assert all(m.training for m in model.modules()), "the check left the model in eval mode"
        assert torch.equal(torch.random.get_rng_state(), rng), "the check drew from the global generator"
        assert all(getattr(m, "last_aux", None) is None for m in model.modules()), "MoE statistics changed"


# -- 1-bit Adam: copies of a parameter stay equal after the warm-up ---------------------------------


def _onebit_copies(ctx, layout: dict, cfg: dict, steps: int):
    """Train ``steps`` 1-bit Adam steps (warm-up 1, so the rest are compressed); return this rank's
    mesh coordinates, its parameters and its losses."""
    from minipar import OneBitAdam
    from minipar.core.placement import placement_of

    mesh = Mesh(**layout)
    options = dict(microbatches=2) if mesh.pp > 1 else {}
    model = ShardedModule(GPT(GPTConfig(**cfg)), mesh=mesh, **options)
    opt = model.build_optimizer(OneBitAdam, lr=3e-2, freeze_step=1)
    data = torch.randint(0, cfg["vocab_size"], (steps, 4 * mesh.dp, 9), generator=torch.Generator().manual_seed(9))
    losses = []
    for s in range(steps):
        x = data[s, 4 * mesh.dp_rank:4 * (mesh.dp_rank + 1)]
        losses.append(model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy).item())
        model.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    replicated = {n: p.detach().clone() for n, p in model.module.named_parameters()
                  if not placement_of(p).tensor_parallel}
    tied = model.module.tied_weight() if mesh.pp > 1 else None
    out = dict(tp_rank=mesh.tp_rank, dp_rank=mesh.dp_rank, pp_rank=mesh.pp_rank, replicated=replicated,
               tied=tied.detach().clone() if tied is not None else None, losses=losses)
    mesh.destroy()
    return out


_ONEBIT_CFG = dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, seed=6)


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), dict(pp=2, tp=2)])
def test_onebit_adam_keeps_every_copy_of_a_parameter_equal(pools, layout):
    """Class 1. After several compressed steps (warm-up 1, with clipping), on 4 ranks: the parameters
    replicated over tp (norms, biases of the row-parallel layers, the position table) are bitwise
    equal on the tp ranks of each stage and data-parallel rank, and the first stage's embedding
    equals the last stage's tied head on each data-parallel and tp rank. Before: both kinds of copy
    drifted apart from the first compressed step (each copy was compressed within another buffer)."""
    results = pools.run(4, _onebit_copies, layout, _ONEBIT_CFG, 4)
    by = {(r["pp_rank"], r["dp_rank"], r["tp_rank"]): r for r in results}
    for (pp, dp, tp), r in by.items():
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        if tp == 1:
            peer = by[(pp, dp, 0)]["replicated"]
            assert r["replicated"].keys() == peer.keys() and len(peer) > 4
            for name, value in r["replicated"].items():
                assert torch.equal(value, peer[name]), f"pp {pp} dp {dp}: {name} differs between the tp ranks"
        if "pp" in layout and pp == 1:
            first, last = by[(0, dp, tp)]["tied"], r["tied"]
            assert first is not None and last is not None
            assert torch.equal(first, last), f"dp {dp} tp {tp}: the tied copies differ by {(first - last).abs().max()}"


def _onebit_under_ep(ctx):
    from minipar import OneBitAdam
    from minipar.models import MoEGPT, MoEGPTConfig

    mesh = Mesh(ep=2)
    model = ShardedModule(MoEGPT(MoEGPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8,
                                              n_experts=4, top_k=2)), mesh=mesh)
    with mesh.comm.counting() as stats:
        try:
            model.build_optimizer(OneBitAdam, lr=1e-3, freeze_step=2)
            said = None
        except ValueError as e:
            said = str(e)
    mesh.destroy()
    return said, stats.calls()


def test_onebit_adam_under_expert_parallelism_is_refused(pools):
    """Class 7 (found while checking 1-bit Adam's copies): under ep=2 the data-parallel ranks hold
    different experts, and the compressed exchange would average them together. build_optimizer
    refuses it on every rank, before any collective. Before: accepted, and after the warm-up each
    rank's experts took the average of unrelated experts' momenta."""
    for said, calls in pools.run(2, _onebit_under_ep):
        assert said is not None and "ep=2" in said and "different experts" in said, said
        assert calls == 0


# -- the parameter server: tensors no worker gave a gradient ---------------------------------------


def _gpt_with_idle_parameters(cfg: dict) -> nn.Module:
    """A GPT whose position table is frozen and which holds a Linear its forward never uses."""
    model = GPT(GPTConfig(**cfg))
    model.wpe.weight.requires_grad_(False)
    model.unused = nn.Linear(cfg["n_embd"], 3)
    with torch.no_grad():
        model.unused.weight.fill_(0.5)
        model.unused.bias.fill_(0.5)
    return model


def _ps_idle(ctx, cfg: dict, data: torch.Tensor):
    from minipar.models import gpt_loss
    from minipar.data_parallel.parameter_server import ParameterServer

    model = _gpt_with_idle_parameters(cfg)
    ps = ParameterServer(model, Mesh(), torch.optim.AdamW, servers=1, mode="sync", lr=LR, weight_decay=WD, eps=EPS)
    if ps.is_server:
        ps.serve()
        return None
    j = ctx.rank - 1
    for s in range(data.shape[0]):
        x = data[s, 2 * j:2 * j + 2]
        ps.train_step(x[:, :-1], x[:, 1:], gpt_loss)
    ps.finish()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_parameter_server_leaves_parameters_without_gradients_alone(pools):
    """Class 7 (found in the parameter server, a copy of the model per worker): a frozen parameter
    and one the forward never uses get no gradient; the servers leave them alone, as one process's
    AdamW does (grad None), and every worker's model equals one process after 3 sync steps. Before:
    the workers pushed zeros, and the servers' AdamW decayed the frozen table and the unused weight."""
    from minipar.models import gpt_loss

    cfg = dict(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8, seed=9)
    data = torch.randint(0, 16, (3, 4, 9), generator=torch.Generator().manual_seed(10))
    reference = _gpt_with_idle_parameters(cfg)
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    for s in range(3):
        gpt_loss(reference(data[s][:, :-1]), data[s][:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    for state in pools.run(3, _ps_idle, cfg, data)[1:]:
        for n, p in reference.named_parameters():
            torch.testing.assert_close(state[n], p.detach(), msg=lambda m: f"{n}: {m}")
        assert torch.equal(state["unused.weight"], torch.full((3, 8), 0.5))
