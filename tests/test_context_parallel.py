"""Context parallelism through `ShardedModule` (issue 14): the cp ranks of a group split each
sequence, and training equals one process on the global batch.

The compositions with every other axis (strategies, tp with and without sequence parallelism, pp,
recomputation, bf16) are layouts of the composition matrix (tests/test_composition.py);
checkpoints across cp layouts are in tests/test_checkpoint.py; the attention kernels alone (ring,
Ulysses, their bytes and balance) in tests/test_ring_attention.py. Here: hypothesis draws the
sequence length, heads, cp size, form and strategy, with ignored targets (-100) placed unevenly so
that the cp ranks hold different numbers of counted tokens; the counted communication of a step;
and what is refused.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, strategies as st

from minipar import Mesh, ShardedModule
from minipar.plan import model_traffic
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.plan.model_traffic import ring_bytes

from helpers import EPS, LR, WD, reference_steps

MAX_NORM = 0.05


LLAMA = dict(norm="rmsnorm", mlp="swiglu", pos="rope")  # rotary positions: rotated by the true positions


def _cfg(case: dict) -> dict:
    return dict(vocab_size=16, block_size=case["seq"], n_layer=2, n_head=case["heads"],
                n_embd=4 * case["heads"], dropout=0.0, seed=case["seed"],
                **(LLAMA if case.get("model") == "llama" else {}))


def _data(case: dict, rows: int) -> torch.Tensor:
    """(3 steps, rows, seq + 1) ids; targets in the first rows' early tokens ignored (-100 after the
    shift), so one cp rank counts fewer tokens than another."""
    g = torch.Generator().manual_seed(case["seed"])
    return torch.randint(0, 16, (3, rows, case["seq"] + 1), generator=g)


def _targets(x: torch.Tensor, case: dict) -> torch.Tensor:
    y = x[:, 1:].clone()
    y[0, :case["ignored"]] = -100
    return y


def _train(ctx, case: dict):
    mesh = Mesh(cp=case["cp"])
    model = ShardedModule(GPT(GPTConfig(**_cfg(case))), mesh=mesh, strategy=case["strategy"],
                          context_parallel=case["form"], bucket_cap_mb=1e-3)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    data = _data(case, 2 * mesh.dp)
    losses, norms = [], []
    for s in range(data.shape[0]):
        x = data[s, 2 * mesh.dp_rank:2 * mesh.dp_rank + 2]
        losses.append(model.train_step(x[:, :-1], _targets(x, case), gpt_loss).item())
        norms.append(model.clip_grad_norm_(MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    state = {k: v.float().cpu() for k, v in model.full_state_dict().items()}
    mesh.destroy()
    return losses, norms, state


def _reference(case: dict, world: int):
    model = GPT(GPTConfig(**_cfg(case)))
    data = _data(case, 2 * (world // case["cp"]))

    def step_loss(s):  # each data-parallel rank's loss is the mean over its counted tokens; the global their mean
        return torch.stack([gpt_loss(model(x[:, :-1]), _targets(x, case)) for x in data[s].split(2)]).mean()
    losses, norms = reference_steps(model, data.shape[0], step_loss, MAX_NORM)
    return losses, norms, model.state_dict()


@st.composite
def cp_cases(draw):
    cp = draw(st.sampled_from([2, 4]))
    form = draw(st.sampled_from(["ring", "ulysses"]))
    chunk = draw(st.integers(1, 3))
    seq = (2 * cp if form == "ring" else cp) * chunk
    heads = cp * draw(st.integers(1, 2)) if form == "ulysses" else draw(st.integers(1, 3))
    return dict(cp=cp, form=form, seq=seq, heads=heads, strategy=draw(st.sampled_from(["ddp", "zero1", "zero2", "zero3"])),
                ignored=draw(st.integers(0, seq - 1)), seed=draw(st.integers(0, 2**16)),
                model=draw(st.sampled_from(["gpt", "llama"])))


@given(case=cp_cases())
@example(case=dict(cp=2, form="ring", seq=8, heads=2, strategy="zero3", ignored=3, seed=5, model="llama"))
@example(case=dict(cp=2, form="ulysses", seq=6, heads=2, strategy="ddp", ignored=0, seed=6, model="llama"))
def test_context_parallel_equals_single_process(pools, case):
    """World 4 as dp x cp (cp 2 or 4), ring or Ulysses, any strategy, minipar's GPT (learned
    positions) or its Llama-style form (rotary positions, RMSNorm, SwiGLU): the losses, clipped
    gradient norms and parameters after three AdamW steps equal the single-process run on the
    global batch; so each rank's tokens were given their true positions, in the table or the rotation.
    Ignored targets sit in the first sequence's early tokens, so the cp ranks count different
    numbers of tokens: the loss must be weighted per token, not averaged per rank."""
    ref_losses, ref_norms, ref_state = _reference(case, 4)
    for rank, (losses, norms, state) in enumerate(pools.run(4, _train, case)):
        where = lambda s: f"rank {rank} of {case}: {s}"  # noqa: E731
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=where)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), msg=where)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, msg=lambda s: f"rank {rank} {k} of {case}: {s}")


def _count_step(ctx, form: str):
    mesh = Mesh(cp=2)
    case = dict(seq=8, heads=2, seed=0)
    model = ShardedModule(GPT(GPTConfig(**_cfg(case))), mesh=mesh, context_parallel=form)
    x = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(1))
    with mesh.comm.counting() as stats:
        model.train_step(x[:, :-1], x[:, 1:], gpt_loss)
    out = [(r.op, r.group, r.tag, r.bytes) for r in stats.records]
    mesh.destroy()
    return out, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("form", ["ring", "ulysses"])
def test_a_step_sends_what_the_theory_says(pools, form):
    """One training step at cp=2 (world 2, dp=1): ring sends exactly ring_bytes per attention
    layer; Ulysses runs four all-to-alls per layer forward and four backward, each moving one of
    q, k, v or the output. Besides, the gradients are all-reduced once over dp x cp (the cp ranks
    hold other tokens of the same sequences), and the loss and the batch check."""
    layers, b, h, t, d = 2, 2, 2, 8, 4
    for records, n_params in pools.run(2, _count_step, form):
        cp_records = [r for r in records if r[1] == "cp"]
        if form == "ring":
            theory = ring_bytes(b, h, t, d, 2, torch.float32)
            sent = sum(r[3] for r in cp_records if r[0] == "send")
            assert sent == layers * (theory["forward"] + theory["backward"]), (sent, theory)
            assert all(r[0] in ("send", "recv") for r in cp_records), cp_records
        else:
            a2a = [r for r in cp_records if r[0] == "all_to_all"]
            assert a2a == [(c.op, c.axis, c.tag, c.bytes) for c in model_traffic.ulysses_calls(layers, b, h, t, d, 2, 4)]
        others = {(r[0], r[1], r[2]) for r in records if r[1] != "cp"}
        assert others <= {("all_gather", "world", "batch_check"), ("all_reduce", "dp_cp", "loss"),
                          ("all_reduce", "dp_cp", "grad"), ("all_reduce", "dp_cp", "unused_map")}, others
        grad_bytes = sum(r[3] for r in records if r[2] == "grad")
        assert grad_bytes == n_params * 4, (grad_bytes, n_params)  # every gradient once, over dp x cp


def _refused(ctx, layout: dict, cfg: dict, form, seq: int):
    mesh = Mesh(**layout)
    try:
        with mesh.comm.counting() as stats:
            model = ShardedModule(GPT(GPTConfig(**cfg)), mesh=mesh, context_parallel=form)
            x = torch.randint(0, 16, (2, seq + 1))
            model.train_step(x[:, :-1], x[:, 1:], gpt_loss)
        out = None
    except ValueError as e:
        out = (str(e), [r.tag for r in stats.records])
    mesh.destroy()
    return out


_CFG = dict(vocab_size=16, block_size=16, n_layer=1, n_head=2, n_embd=8, dropout=0.0)


@pytest.mark.parametrize("layout, cfg, form, seq, message, tags", [
    (dict(cp=2), _CFG, "ring", 6, "a sequence of 6 does not split into 4 chunks for context_parallel='ring' at "
     "cp=2; use a sequence length divisible by 4", ["config_check", "initial_state", "batch_check"]),
    (dict(cp=2), _CFG, "ulysses", 7, "does not split into 2 chunks", ["config_check", "initial_state", "batch_check"]),
    (dict(cp=2, tp=2), dict(_CFG, n_head=2), "ulysses", 8, "the attention has 1 heads per tp rank and cp=2", []),
    (dict(cp=2), dict(_CFG, dropout=0.1), "ring", 8, "attention dropout (0.1) under context parallelism", []),
    (dict(cp=2), _CFG, "zigzag", 8, "context_parallel='zigzag'; choose one of 'ring', 'ulysses'", []),
])
def test_refusals_say_what_to_change(pools, layout, cfg, form, seq, message, tags):
    """A sequence the split cannot cut raises at the batch check (on every rank, before any
    attention collective); heads Ulysses cannot split, attention dropout and an unknown form raise
    when the model is wrapped, before any collective."""
    world = 2 * layout.get("tp", 1)
    for out in pools.run(world, _refused, layout, cfg, form, seq):
        assert out is not None, "no error"
        text, seen = out
        assert message in text, text
        assert [t for t in seen if t != "initial_state"] == [t for t in tags if t != "initial_state"], seen


def test_mesh_layout_puts_cp_between_tp_and_dp():
    """rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank; dp_cp joins every dp and cp
    rank of one tp rank and stage (the gradient axis); edp and dp_shard take in the cp ranks."""
    from minipar.core.mesh import axis_rank_lists
    kw = dict(dp=2, cp=2, tp=2, pp=1)
    assert axis_rank_lists("tp", **kw) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_rank_lists("cp", **kw) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_rank_lists("dp", **kw) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert axis_rank_lists("dp_cp", **kw) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # world 8 as dp=4 x cp=2: ep=2 splits dp; the experts' replicas (edp) and HSDP's shard groups
    # (dp_shard=2) take in the cp ranks; ep and dp_replicate stay within one cp rank
    kw = dict(dp=4, cp=2, ep=2, dp_shard=2)
    assert axis_rank_lists("ep", **kw) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_rank_lists("edp", **kw) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert axis_rank_lists("dp_shard", **kw) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert axis_rank_lists("dp_replicate", **kw) == [[0, 4], [1, 5], [2, 6], [3, 7]]
