"""Tensor parallelism on the GPT: for any shape and tp in {1, 2, 4}, with and without sequence
parallelism, the parallelized model trained for several steps equals the single-process model.

Every tp rank sees the same batch (tensor parallelism splits the model, not the data). The
reference is the same GPT from the same seed in this process; gradients and parameters of the
parallel model are gathered back to full tensors along each shard's dim before comparing.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import example, given, strategies as st

from minipar import Mesh, ShardedModule
from minipar.plan import model_traffic
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.core.placement import placement_of
from minipar.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, clip_grad_norm_,
                                     parallelize, vocab_parallel_cross_entropy)

from helpers import EPS, LR, WD


def _shard_dim(model, name: str) -> int | None:
    owner = model.get_submodule(name.rpartition(".")[0])
    if isinstance(owner, RowParallelLinear):
        return 1 if name.endswith("weight") else None
    if isinstance(owner, (ColumnParallelLinear, VocabParallelEmbedding)):
        return 0
    return None


def _full(model, mesh, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gather each tensor-parallel shard back into the full tensor (replicated ones as they are)."""
    out = {}
    for name, t in tensors.items():
        dim = _shard_dim(model, name)
        if dim is None or mesh.tp == 1:
            out[name] = t.detach().cpu().clone()
            continue
        parts = [torch.empty_like(t) for _ in range(mesh.tp)]
        dist.all_gather(parts, t.detach().contiguous(), group=mesh.group("tp").pg)
        out[name] = torch.cat(parts, dim).cpu()
    return out


def _train_tp(ctx, cfg: dict, data: torch.Tensor, sequence_parallel: bool, max_norm: float, norm_type: float):
    mesh = Mesh(tp=ctx.world_size)
    model = GPT(GPTConfig(**cfg))
    parallelize(model, mesh, model.tp_plan(mesh.tp, sequence_parallel=sequence_parallel),
                sequence_parallel=sequence_parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses, norms, grads = [], [], None
    for s in range(data.shape[0]):
        x = data[s].to(ctx.device)
        loss = vocab_parallel_cross_entropy(model(x[:, :-1]), x[:, 1:], mesh.comm, mesh.group("tp"))
        loss.backward()
        if s == data.shape[0] - 1:  # the last step's gradients, the ones compared (gathering costs collectives)
            grads = _full(model, mesh, {n: p.grad for n, p in model.named_parameters()})
        norms.append(clip_grad_norm_(model, mesh, max_norm, norm_type).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = _full(model, mesh, dict(model.named_parameters()))
    tied = model.lm_head.weight is model.wte.weight
    mesh.destroy()
    return losses, norms, grads, params, tied


def _train_reference(cfg: dict, data: torch.Tensor, max_norm: float, norm_type: float):
    model = GPT(GPTConfig(**cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses, norms, grads = [], [], None
    for s in range(data.shape[0]):
        x = data[s]
        loss = gpt_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, grads, dict(model.named_parameters())


@st.composite
def tp_cases(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    heads = tp * draw(st.integers(1, 2))
    seq = tp * draw(st.integers(1, 3))  # sequence parallelism splits the sequence
    return dict(tp=tp, sequence_parallel=draw(st.booleans()), norm_type=draw(st.sampled_from([2.0, 1.0, math.inf])),
                cfg=dict(vocab_size=tp * draw(st.integers(3, 17)), block_size=seq, n_layer=draw(st.integers(1, 2)),
                         n_head=heads, n_embd=heads * draw(st.sampled_from([4, 8])), bias=draw(st.booleans()),
                         tie_weights=draw(st.booleans()), seed=draw(st.integers(0, 2**16))),
                batch=draw(st.integers(1, 3)), data_seed=draw(st.integers(0, 2**16)))


_CASE = dict(norm_type=2.0, batch=2, data_seed=3, cfg=dict(vocab_size=20, block_size=4, n_layer=2, n_head=4,
                                                           n_embd=16, bias=True, tie_weights=True, seed=1))


@given(case=tp_cases())
@example(case={**_CASE, "tp": 4, "sequence_parallel": True})
@example(case={**_CASE, "tp": 2, "sequence_parallel": False, "norm_type": math.inf})
def test_tensor_parallel_gpt_equals_single_process(pools, case):
    """Losses, gradient norms (each replicated parameter counted once), gradients and parameters
    after three AdamW steps with clipping equal the single-process GPT; a tied head stays tied."""
    cfg = case["cfg"]
    data = torch.randint(0, cfg["vocab_size"], (3, case["batch"], cfg["block_size"] + 1),
                         generator=torch.Generator().manual_seed(case["data_seed"]))
    max_norm = 0.05 if case["norm_type"] != 1.0 else 0.5
    ref = _train_reference(cfg, data, max_norm, case["norm_type"])
    assert max(ref[1]) > max_norm, "clipping must fire for this test to mean anything"
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    for rank, (losses, norms, grads, params, tied) in enumerate(
            pools.run(case["tp"], _train_tp, cfg, data, case["sequence_parallel"], max_norm, case["norm_type"])):
        assert tied == cfg["tie_weights"]
        torch.testing.assert_close(f32(losses), f32(ref[0]), msg=lambda m: f"rank {rank} losses: {m}")
        # An L1 norm adds |g| over every element, so each element's fp32 difference from the sharded
        # matmuls (within the elementwise tolerance below) adds up instead of averaging out as in L2:
        # ~1.7e-6 relative was seen on 10k elements. The gradients themselves stay at the defaults.
        norm_tol = dict(rtol=1e-5, atol=1e-5) if case["norm_type"] == 1.0 else {}
        torch.testing.assert_close(f32(norms), f32(ref[1]), **norm_tol, msg=lambda m: f"rank {rank} norms: {m}")
        for name, g in ref[2].items():
            torch.testing.assert_close(grads[name], g, msg=lambda m: f"rank {rank} grad {name}: {m}")
        for name, p in ref[3].items():
            torch.testing.assert_close(params[name], p.detach(), msg=lambda m: f"rank {rank} {name}: {m}")


def test_sizes_tp_does_not_divide_are_refused():
    model = GPT(GPTConfig(vocab_size=21, block_size=4, n_layer=1, n_head=2, n_embd=8))
    with pytest.raises(ValueError, match="vocab_size=21 is not divisible by tp=2"):
        model.tp_plan(2)
    with pytest.raises(ValueError, match="n_head=2 is not divisible by tp=4"):
        GPT(GPTConfig(vocab_size=20, block_size=4, n_layer=1, n_head=2, n_embd=8)).tp_plan(4)
    with pytest.raises(ValueError, match="block_size=4 must be divisible by tp=8"):
        GPT(GPTConfig(vocab_size=24, block_size=4, n_layer=1, n_head=8, n_embd=16)).tp_plan(8, sequence_parallel=True)


def _volume(ctx, sequence_parallel: bool):
    mesh = Mesh(tp=ctx.world_size)
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, bias=False)
    model = parallelize(GPT(cfg), mesh, GPT(cfg).tp_plan(mesh.tp, sequence_parallel=sequence_parallel),
                        sequence_parallel=sequence_parallel)
    x = torch.randint(0, 16, (3, 9))
    with mesh.comm.counting() as fwd:
        logits = model(x[:, :-1])
    with mesh.comm.counting() as bwd:
        logits.float().pow(2).mean().backward()
    mesh.destroy()
    return [(r.op, r.bytes) for r in fwd.records], [(r.op, r.bytes) for r in bwd.records]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_communication_per_layer_matches_theory(pools, sequence_parallel):
    """Per transformer layer, forward: two reductions of batch*seq*hidden elements (after attention
    and after the MLP); backward the same two on the way back (before q/k/v and before fc). With
    sequence parallelism the same bytes travel as all-gathers and reduce-scatters."""
    b, t, c, layers = 3, 8, 8, 2
    act = b * t * c * 4  # bytes of one (batch, seq, hidden) fp32 activation
    fwd, bwd = pools.run(2, _volume, sequence_parallel)[0]
    theory = [(x.op, x.bytes) for x in model_traffic.tp_calls(layers, act, 2, sequence_parallel,
                                                          pos_grad_bytes=t * c * 4)]  # + wpe's gradient under sp
    n_fwd = len(model_traffic.tp_calls(layers, act, 2, sequence_parallel, backward=False))
    assert fwd == theory[:n_fwd]  # the embedding's reduction, two per layer, (sp) the head's gather, in order
    if not sequence_parallel:
        assert bwd == [("all_reduce", act)] * (2 * layers + 1), bwd  # + the LM head's input gradient; nothing else
    else:
        sp_grads = [r for r in bwd if r[1] == c * 4]  # norm weights' and biases' partial gradients
        assert sorted(r for r in bwd if r not in sp_grads) == sorted(theory[n_fwd:])
        assert sp_grads == [("all_reduce", c * 4)] * (2 * layers + 1)  # ln_1, ln_2 per layer, ln_f


# -- composition with data parallelism -------------------------------------------------


def _train_dp_tp(ctx, strategy: str, cfg: dict, data: torch.Tensor, sequence_parallel: bool, max_norm: float,
                 tp: int = 2):
    mesh = Mesh(dp=2, tp=tp)
    model = GPT(GPTConfig(**cfg))
    sharded = ShardedModule(model, mesh=mesh, strategy=strategy, sequence_parallel=sequence_parallel,
                            bucket_cap_mb=1e-3)
    opt = sharded.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    local = data.shape[1] // mesh.dp
    losses, norms = [], []
    for s in range(data.shape[0]):
        x = data[s, mesh.dp_rank * local:(mesh.dp_rank + 1) * local].to(ctx.device)  # dp ranks differ, tp ranks share
        losses.append(sharded.train_step(x[:, :-1], x[:, 1:], sharded.cross_entropy).item())
        if s == data.shape[0] - 1:  # the last step's reduced gradients, the ones compared
            by_id = sharded.strategy.full_grads() if strategy != "ddp" else {id(p): p.grad for p in model.parameters()}
            grads = _full(model, mesh, {n: by_id[id(p)] for n, p in model.named_parameters()})
        norms.append(sharded.clip_grad_norm_(max_norm).item())
        opt.step()
        opt.zero_grad()
    state = {k: v.cpu() for k, v in sharded.full_state_dict().items()}
    mesh.destroy()
    return losses, norms, grads, state


# (tp, data-parallel strategy, sequence parallelism) of every dp=2 layout the two tests below train:
# tp=2 on 4 ranks, tp=4 on 8. CI runs a sample holding every pair of those options (checked by
# test_the_dp_tp_sample_holds_every_pair_of_options); HYPOTHESIS_PROFILE=long runs all 16.
DP_TP_ALL = [(tp, s, sp) for tp in (2, 4) for s in ("ddp", "zero1", "zero2", "zero3") for sp in (False, True)]
DP_TP_SAMPLE = [(2, "ddp", False), (2, "zero1", True), (2, "zero2", False), (2, "zero3", True),
                (4, "ddp", True), (4, "zero1", False), (4, "zero2", True), (4, "zero3", False)]
DP_TP = DP_TP_ALL if os.environ.get("HYPOTHESIS_PROFILE") == "long" else DP_TP_SAMPLE


def test_the_dp_tp_sample_holds_every_pair_of_options():
    def pairs(layouts):
        return {(i, a, j, b) for c in layouts for (i, a), (j, b) in itertools.combinations(enumerate(c), 2)}
    assert set(DP_TP_SAMPLE) <= set(DP_TP_ALL) and pairs(DP_TP_SAMPLE) == pairs(DP_TP_ALL)


@pytest.mark.parametrize("strategy, sequence_parallel", [(s, sp) for tp, s, sp in DP_TP if tp == 2])
def test_tensor_parallel_composes_with_data_parallel(pools, strategy, sequence_parallel):
    """dp=2 x tp=2 in one ShardedModule (the model's own plan applied, DDP or ZeRO on the dp axis):
    losses, gradient norms, gradients and the full state dict (original names, gathered shards)
    after three steps equal the single-process run on the global batch."""
    cfg = dict(vocab_size=26, block_size=4, n_layer=2, n_head=2, n_embd=12, bias=True, tie_weights=True, seed=4)
    _check_dp_tp(pools, strategy, sequence_parallel, cfg, tp=2)


@pytest.mark.parametrize("strategy, sequence_parallel", [(s, sp) for tp, s, sp in DP_TP if tp == 4])
def test_tp4_composes_with_dp2_on_eight_ranks(pools, strategy, sequence_parallel):
    """dp=2 x tp=4 (8 processes): as above, with four heads split one per tp rank."""
    cfg = dict(vocab_size=28, block_size=4, n_layer=2, n_head=4, n_embd=16, bias=True, tie_weights=True, seed=6)
    _check_dp_tp(pools, strategy, sequence_parallel, cfg, tp=4)


def _check_dp_tp(pools, strategy: str, sequence_parallel: bool, cfg: dict, tp: int) -> None:
    data = torch.randint(0, cfg["vocab_size"], (3, 4, 5), generator=torch.Generator().manual_seed(8))
    ref_losses, ref_norms, ref_grads, ref_params = _train_reference(cfg, data, 0.05, 2.0)
    assert max(ref_norms) > 0.05
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    ref_state = GPT(GPTConfig(**cfg))
    ref_state.load_state_dict({k: v.detach() for k, v in ref_params.items()}, strict=False)
    for rank, (losses, norms, grads, state) in enumerate(
            pools.run(2 * tp, _train_dp_tp, strategy, cfg, data, sequence_parallel, 0.05, tp)):
        torch.testing.assert_close(f32(losses), f32(ref_losses), msg=lambda m: f"rank {rank} losses: {m}")
        torch.testing.assert_close(f32(norms), f32(ref_norms), msg=lambda m: f"rank {rank} norms: {m}")
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, msg=lambda m: f"rank {rank} grad {n}: {m}")
        assert state.keys() == ref_state.state_dict().keys()
        for k, v in ref_state.state_dict().items():
            torch.testing.assert_close(state[k], v, msg=lambda m: f"rank {rank} {k}: {m}")


# -- a model minipar did not write ----------------------------------------------------------


class LlamaAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, n, nn.Linear(dim, dim, bias=False))

    def forward(self, hidden_states, attention_mask=None):
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        bsz, t = q.shape[:2]
        q, k, v = (z.reshape(bsz, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        pos = torch.arange(t, dtype=torch.float32)
        freq = pos[:, None] / (10000 ** (torch.arange(0, self.head_dim, 2) / self.head_dim))
        cos, sin = freq.cos().repeat(1, 2), freq.sin().repeat(1, 2)
        rot = lambda z: torch.cat([-z[..., self.head_dim // 2:], z[..., :self.head_dim // 2]], -1)  # noqa: E731
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(bsz, t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.down_proj = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLike(nn.Module):
    """Hugging Face Llama's layout and habits: nested names, SwiGLU, RMSNorm, rotary positions,
    attention called with keyword arguments and reshaping with -1, an untied head. Written here,
    not in minipar."""

    def __init__(self, vocab=32, dim=16, heads=4, layers=2, seed=0):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, dim)
        self.model.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            layer.input_layernorm, layer.post_attention_layernorm = nn.RMSNorm(dim), nn.RMSNorm(dim)
            layer.self_attn, layer.mlp = LlamaAttention(dim, heads), LlamaMLP(dim)
            self.model.layers.append(layer)
        self.model.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 if p.dim() > 1 else torch.ones(p.shape))

    def forward(self, ids):
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = h + layer.self_attn(hidden_states=layer.input_layernorm(h), attention_mask=None)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.model.norm(h))


LLAMA_PLAN = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn": "enter_region",
    "model.layers.*.self_attn.[qkv]_proj": "colwise_in_region",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp": "enter_region",
    "model.layers.*.mlp.gate_proj": "colwise_in_region",
    "model.layers.*.mlp.up_proj": "colwise_in_region",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise",
}


def _llama_heads_refused(ctx):
    mesh = Mesh(tp=ctx.world_size)
    model = LlamaLike(dim=16, heads=2)  # head_dim 8: two heads, and tp=4 divides the 16 features but not them
    with mesh.comm.counting() as stats, pytest.raises(ValueError) as info:
        parallelize(model, mesh, LLAMA_PLAN)
    untouched = isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear) and \
        type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    mesh.destroy()
    return str(info.value), stats.records, untouched


def test_heads_tp_does_not_divide_are_refused_on_a_model_minipar_did_not_write(pools):
    """A Llama-style model with 2 heads at tp=4: every projection's 16 features split, but the heads
    would not. parallelize raises ValueError on every rank, names the projection and the head count,
    sends nothing and leaves the model as it was (without the check: a reshape error mid-forward)."""
    for msg, records, untouched in pools.run(4, _llama_heads_refused):
        assert "'model.layers.0.self_attn.q_proj' projects onto 2 heads of 8" in msg and "tp=4" in msg, msg
        assert records == [] and untouched


def _llama(ctx, sequence_parallel: bool, data: torch.Tensor):
    mesh = Mesh(tp=ctx.world_size)
    model = parallelize(LlamaLike(), mesh, LLAMA_PLAN, sequence_parallel=sequence_parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses, grads = [], []
    for ids in data:
        loss = vocab_parallel_cross_entropy(model(ids[:, :-1]), ids[:, 1:], mesh.comm, mesh.group("tp"))
        loss.backward()
        grads.append(_full(model, mesh, {n: p.grad for n, p in model.named_parameters()}))
        clip_grad_norm_(model, mesh, 0.05)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = _full(model, mesh, dict(model.named_parameters()))
    mesh.destroy()
    return losses, grads, params


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_plan_parallelizes_a_model_minipar_did_not_write(pools, sequence_parallel):
    """A Llama-style model parallelized from a plan alone trains as the original: losses, gradients
    at every step and parameters after three clipped AdamW steps are equal."""
    data = torch.randint(0, 32, (3, 2, 9), generator=torch.Generator().manual_seed(2))
    ref = LlamaLike()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    ref_losses, ref_grads = [], []
    for ids in data:
        loss = gpt_loss(ref(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        ref_grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        assert torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05) > 0.05  # clipping fires
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    for rank, (losses, grads, params) in enumerate(pools.run(2, _llama, sequence_parallel, data)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        for step, (got, want) in enumerate(zip(grads, ref_grads)):
            assert got.keys() == want.keys()
            for n, g in want.items():
                torch.testing.assert_close(got[n], g, msg=lambda m: f"rank {rank} step {step} grad {n}: {m}")
        for n, p in ref.named_parameters():
            torch.testing.assert_close(params[n], p.detach(), msg=lambda m: f"rank {rank} {n}: {m}")


class _CallsProjectionsDirectly(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = LlamaAttention(8, 2)

    def forward(self, x):
        return self.attn.o_proj(self.attn.q_proj(x))  # bypasses attn.forward, so its region entry never runs


def _region_misuse(ctx):
    mesh = Mesh(tp=2)
    out = []
    with pytest.raises(ValueError, match="'attn.q_proj' is 'colwise_in_region' but no module above it"):
        parallelize(_CallsProjectionsDirectly(), mesh, {"attn.q_proj": "colwise_in_region"})
    model = parallelize(_CallsProjectionsDirectly(), mesh, {"attn": "enter_region", "attn.q_proj": "colwise_in_region",
                                                            "attn.o_proj": "rowwise"})
    with pytest.raises(RuntimeError, match="marked 'enter_region' but its forward did not run") as info:
        model(torch.randn(2, 3, 8))
    out.append(str(info.value))
    mesh.destroy()
    return out


def test_a_region_entry_that_never_runs_is_an_error_not_a_wrong_gradient(pools):
    assert all(len(o) == 1 for o in pools.run(2, _region_misuse))


# -- dropout randomness ---------------------------------------------------------------------


def _dropout(ctx, sequence_parallel: bool):
    torch.manual_seed(1000 + ctx.rank)  # the global RNG differs per rank: masks must not depend on it
    mesh = Mesh(tp=2)
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.3)
    model = parallelize(GPT(cfg), mesh, GPT(cfg).tp_plan(2, sequence_parallel=sequence_parallel),
                        sequence_parallel=sequence_parallel, dropout_seed=5)
    masks = []
    model.layers[0].drop.register_forward_hook(lambda m, a, out: masks.append((out == 0).flatten().tolist()))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(0))
    global_before = torch.get_rng_state()
    for _ in range(2):
        vocab_parallel_cross_entropy(model(x[:, :-1]), x[:, 1:], mesh.comm, mesh.group("tp")).backward()
        opt.step()
        opt.zero_grad()
    untouched = torch.equal(torch.get_rng_state(), global_before)
    rng = model.tp_random
    draws = {}
    for region in ("replicated", "sharded"):
        with rng.fork(region):
            draws[region] = torch.rand(4).tolist()
    replicated = {n: p.detach().clone() for n, p in model.named_parameters() if not placement_of(p).tensor_parallel}
    mesh.destroy()
    return masks, untouched, draws, replicated


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_dropout_masks_follow_the_tensor_parallel_layout(pools, sequence_parallel):
    """Replicated activations get the same mask on every tp rank (so replicated parameters stay
    identical), sharded ones different masks; the global RNG is left as it was."""
    (m0, u0, d0, r0), (m1, u1, d1, r1) = pools.run(2, _dropout, sequence_parallel)
    assert u0 and u1
    assert d0["replicated"] == d1["replicated"] and d0["sharded"] != d1["sharded"]
    assert m0[0] != m0[1]  # the stream moves on between steps
    if sequence_parallel:
        assert m0 != m1  # each rank drops its own positions
    else:
        assert m0 == m1  # the residual stream is replicated: one mask everywhere
    for n in r0:
        assert torch.equal(r0[n], r1[n]), f"replicated parameter {n} drifted between tp ranks"


def _half_tied(ctx):
    mesh = Mesh(tp=2)
    out = []
    model = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=2, n_embd=8))
    before = {n: id(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match="'lm_head' shares a weight with 'wte', which the plan shards"):
        parallelize(model, mesh, {"wte": "vocab"})
    with pytest.raises(ValueError, match="matches no module"):
        parallelize(model, mesh, {"layers.*.mlp.fc": "colwise", "nothing.here": "rowwise"})
    out.append({n: id(m) for n, m in model.named_modules()} == before)  # a failed plan changes nothing
    mesh.destroy()
    return out


def test_half_of_a_tie_in_the_plan_is_refused_and_failed_plans_change_nothing(pools):
    assert pools.run(2, _half_tied) == [[True], [True]]


def _mismatched_sp(ctx):
    mesh = Mesh(tp=2)
    model = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=2, n_embd=8))
    with pytest.raises(ValueError, match=r"the ShardedModule configuration \(model structure and options\) differs between ranks") as info:
        ShardedModule(model, mesh=mesh, sequence_parallel=ctx.rank == 0)
    mesh.destroy()
    return str(info.value)


def test_a_tensor_parallel_setting_that_differs_between_ranks_raises_not_hangs(pools):
    for m in pools.run(2, _mismatched_sp, timeout=60):
        assert "['options']['tensor_parallel']['sequence_parallel']: True vs False" in m, m
