"""Mixture of experts: the router against a token-by-token reference, and expert parallelism (ep in
{1, 2, 4}, alone and under dp, tp and pp) equal to the single-process layer or GPT that routes each
rank's share of the global batch as its own group."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from hypothesis import example, given, strategies as st

from minipar import Mesh, ShardedModule
from minipar.moe.layer import MoELayer, capacity, route
from minipar.core.placement import placement_of
from minipar.models import MoEGPT, MoEGPTConfig, gpt_loss

from helpers import LR, WD

# Expert gradients of these tiny models are ~1e-4 with elements near 1e-7; AdamW turns an element's
# fp32 rounding noise (other summation order) into parameter noise of up to lr/eps times it. A larger
# eps keeps that below the comparison tolerance. Adam hides a gradient's scale (g/sqrt(v)), so the
# gradients themselves are compared directly too: a wrong scale fails there.
EPS = 1e-4


# -- the router, one process -----------------------------------------------------------------

def _route_by_hand(logits: torch.Tensor, k: int, cap: int):
    """Token by token: choices in priority order (all first choices, then all second choices), each
    expert taking assignments until it has ``cap``."""
    probs = logits.softmax(-1)
    t, e = logits.shape
    taken = [0] * e
    keep, expert, weight = [], [], []
    top_w, top_e = probs.topk(k, dim=-1)
    if k == 2:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    for c in range(k):
        for i in range(t):
            ex = int(top_e[i, c])
            expert.append(ex)
            weight.append(float(top_w[i, c]))
            keep.append(taken[ex] < cap)
            taken[ex] += 1
    f = torch.bincount(torch.tensor(expert), minlength=e).float() / (t * k)
    aux = e * float((f * probs.mean(0)).sum())
    return expert, weight, keep, aux


@given(t=st.integers(1, 40), e=st.sampled_from([2, 3, 4, 8]), k=st.sampled_from([1, 2]),
       cf=st.sampled_from([0.25, 0.5, 1.0, 1.25, 4.0]), seed=st.integers(0, 2**16))
def test_router_matches_token_by_token_reference(t, e, k, cf, seed):
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(seed))
    cap = capacity(t, e, k, cf)
    assert cap == math.ceil(cf * t * k / e)
    expert, weight, keep, aux, z, _ = route(logits, k, cap)
    ref_expert, ref_weight, ref_keep, ref_aux = _route_by_hand(logits, k, cap)
    assert expert.tolist() == ref_expert
    assert keep.tolist() == ref_keep
    torch.testing.assert_close(weight, torch.tensor(ref_weight))
    torch.testing.assert_close(aux, torch.tensor(ref_aux))
    torch.testing.assert_close(z, logits.logsumexp(-1).pow(2).mean())
    for ex in range(e):  # capacity is respected and used up before anything is dropped
        kept = sum(1 for x, kp in zip(ref_expert, ref_keep) if x == ex and kp)
        wanted = ref_expert.count(ex)
        assert kept == min(cap, wanted)
    if k == 2:  # renormalised: each token's two weights sum to one
        torch.testing.assert_close(weight.view(2, t).sum(0), torch.ones(t))


def test_dropped_token_passes_through_the_residual_as_zero():
    """A capacity of one slot per expert: the later tokens' assignments are dropped and give zero."""
    layer = MoELayer(6, 8, n_experts=2, top_k=1, capacity_factor=0.01, seed=3)
    x = torch.randn(10, 6, generator=torch.Generator().manual_seed(0))
    out = layer(x)
    assert layer.last_dropped == 10 - 2
    zero_rows = (out.abs().sum(-1) == 0).sum().item()
    assert zero_rows == 8


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_experts=4, top_k=0), "top_k=0 must be a positive integer"),
    (dict(n_experts=1, top_k=2), "top_k=2 is larger than the expert count 1"),
    (dict(n_experts=4, top_k=1, capacity_factor=0.0), "capacity_factor=0.0 must be a finite number > 0"),
    (dict(n_experts=4, top_k=1, capacity_factor=-1.0), "capacity_factor=-1.0 must be a finite number > 0"),
])
def test_bad_moe_configuration_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoELayer(4, 8, **kwargs)


# -- expert parallelism: one MoE layer -------------------------------------------------------

class Net(nn.Module):
    """An MoE layer between two dense layers, with a residual, as in a transformer block."""

    def __init__(self, d: int, n_experts: int, k: int, cf: float, seed: int, groups: int = 1) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(d, d)
        self.moe = MoELayer(d, 2 * d, n_experts, k, cf, aux_loss_coef=0.1, z_loss_coef=0.01, seed=seed)
        self.moe.route_groups = groups
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.moe(h))


def _loss(out, y):
    return nn.functional.cross_entropy(out.flatten(0, -2), y.flatten())


def _full_grads(model, mesh):
    """This rank's gradients, expert parameters gathered over ep into the full stack."""
    out = {}
    for name, p in model.module.named_parameters():
        g = p.grad.detach().clone()
        if placement_of(p).expert and mesh.ep > 1:
            parts = torch.empty((mesh.ep,) + tuple(g.shape))
            mesh.comm.all_gather(parts, g.unsqueeze(0), mesh.group("ep"))
            g = torch.cat(parts.unbind(0))
        out[name] = g
    return out


def _train_layer(ctx, layout, net_args, xs, ys, bias_gate):
    mesh = Mesh(**layout)
    net = Net(*net_args)
    if bias_gate:
        _bias_gate(net)
    model = ShardedModule(net, mesh=mesh, bucket_cap_mb=1e-4)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    local = xs.shape[1] // mesh.dp
    rows = slice(mesh.dp_rank * local, (mesh.dp_rank + 1) * local)
    outs, auxes, grads, losses = [], [], [], []
    for s in range(xs.shape[0]):
        x, y = xs[s, rows], ys[s, rows]
        out = model(x)
        outs.append(out.detach())
        auxes.append((model.module.moe.last_aux.item(), model.module.moe.last_z.item()))
        loss = _loss(out, y)
        loss.backward()
        losses.append(loss.item())
        grads.append(_full_grads(model, mesh))
        model.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()
    state = model.full_state_dict()
    mesh.destroy()
    return outs, auxes, grads, state, mesh.dp_rank


def _bias_gate(net):
    """Every token prefers expert 0, then expert 1: the other experts (and, with ep > 1, the ranks
    that hold them) receive nothing."""
    with torch.no_grad():
        net.inp.weight.zero_()
        net.inp.bias.fill_(1.0)
        net.moe.gate.weight.zero_()
        net.moe.gate.weight[0] = 1.0
        net.moe.gate.weight[1] = 0.5


def _reference_layer(net_args, xs, ys, dp, bias_gate):
    net = Net(*net_args, groups=dp)
    if bias_gate:
        _bias_gate(net)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    outs, auxes, grads, norms = [], [], [], []
    for s in range(xs.shape[0]):
        out = net(xs[s])
        outs.append(out.detach())
        auxes.append((net.moe.last_aux.item(), net.moe.last_z.item()))
        # The ranks' losses are means over their own tokens; the global loss their mean.
        loss = torch.stack([_loss(o, y) for o, y in zip(out.chunk(dp), ys[s].chunk(dp))]).mean()
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in net.named_parameters()})
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05).item())
        opt.step()
        opt.zero_grad()
    return outs, auxes, grads, net.state_dict(), norms


LAYER_LAYOUTS = [(2, dict(dp=2, ep=1)), (2, dict(dp=2, ep=2)), (4, dict(dp=4, ep=2)), (4, dict(dp=4, ep=4))]


def _check_layer(pools, layout, n_experts, k, cf, seed, bias_gate=False):
    world, sizes = layout
    dp = sizes["dp"]
    d, tokens = 6, 5
    net_args = (d, n_experts, k, cf, seed)
    g = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(3, dp * 2, tokens, d, generator=g)    # 3 steps, 2 sequences per rank
    ys = torch.randint(0, 3, (3, dp * 2, tokens), generator=g)
    ref_outs, ref_auxes, ref_grads, ref_state, ref_norms = _reference_layer(net_args, xs, ys, dp, bias_gate)
    assert max(ref_norms) > 0.05  # clipping fires
    if bias_gate:  # the setup holds: experts 0 and 1 work, the others get no token and no gradient
        for s in range(3):
            for name in ("w1", "b1", "w2", "b2"):
                g = ref_grads[s][f"moe.{name}"]
                assert g[2:].abs().max() == 0 and g[:2].abs().max() > 0, (s, name)
    results = pools.run(world, _train_layer, sizes, net_args, xs, ys, bias_gate)
    for s in range(3):
        # The auxiliary losses: every rank's own group, averaged, is the reference's mean over groups.
        by_dp = {r[4]: r[1][s] for r in results}
        aux = sum(a for a, _ in by_dp.values()) / dp
        zl = sum(z for _, z in by_dp.values()) / dp
        torch.testing.assert_close(torch.tensor([aux, zl]), torch.tensor(ref_auxes[s]), msg=f"step {s} aux, z")
    for rank, (outs, _, grads, state, dp_rank) in enumerate(results):
        for s in range(3):
            torch.testing.assert_close(outs[s], ref_outs[s].chunk(dp)[dp_rank],
                                       msg=lambda m: f"rank {rank} step {s} output: {m}")
            for name, ref in ref_grads[s].items():
                torch.testing.assert_close(grads[s][name], ref, msg=lambda m: f"rank {rank} step {s} grad {name}: {m}")
        for name, ref in ref_state.items():
            torch.testing.assert_close(state[name], ref, msg=lambda m: f"rank {rank} param {name}: {m}")


@example(layout=LAYER_LAYOUTS[3], n_experts=8, k=2, cf=0.5, seed=5)  # drops, 2 experts per rank, edp = 1
@example(layout=LAYER_LAYOUTS[2], n_experts=2, k=1, cf=4.0, seed=6)  # ep=2 x edp=2, nothing dropped
@given(layout=st.sampled_from(LAYER_LAYOUTS), n_experts=st.sampled_from([2, 4, 8]), k=st.sampled_from([1, 2]),
       cf=st.sampled_from([0.5, 1.0, 4.0]), seed=st.integers(0, 2**16))
def test_expert_parallel_layer_equals_single_process(pools, layout, n_experts, k, cf, seed):
    """Outputs, auxiliary losses, gradients (expert ones gathered over ep) at every step and
    parameters after three AdamW steps with clipping equal the single-process layer; capacity
    factor 0.5 drops assignments, 4.0 drops none."""
    n_experts = max(n_experts, layout[1]["ep"])  # 2 experts cannot split over 4 ranks
    _check_layer(pools, layout, n_experts, k, cf, seed)


@pytest.mark.parametrize("layout", [LAYER_LAYOUTS[1], LAYER_LAYOUTS[3]], ids=["ep2", "ep4"])
def test_experts_and_ranks_without_tokens(pools, layout):
    """Every token routed to experts 0 and 1 (the first ep rank's): the other experts get no tokens,
    the other ranks receive nothing and send everything to rank 0. No hang, zero gradients for the
    idle experts, results equal to the single-process layer."""
    _check_layer(pools, layout, n_experts=4, k=2, cf=4.0, seed=11, bias_gate=True)


@pytest.mark.parametrize("layout", [LAYER_LAYOUTS[2], LAYER_LAYOUTS[3]], ids=["dp4_ep2", "dp4_ep4"])
def test_expert_gradients_are_scaled_by_the_whole_data_parallel_size(pools, layout):
    """Expert gradients averaged over edp (2 or 1 ranks) instead of dp (4) would be 2x or 4x too
    large; the gradients are compared directly to the reference, before any optimizer step."""
    _check_layer(pools, layout, n_experts=4, k=1, cf=4.0, seed=21)


# -- the MoE GPT under ShardedModule -----------------------------------------------------------

def _train_gpt(ctx, layout, cfg, data, m, options):
    mesh = Mesh(**layout)
    kwargs = dict(microbatches=m) if mesh.pp > 1 else {}
    model = ShardedModule(MoEGPT(MoEGPTConfig(**cfg)), mesh=mesh, bucket_cap_mb=1e-3, **kwargs, **options)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    local = data.shape[1] // mesh.dp
    losses, norms = [], []
    for s in range(data.shape[0]):
        x = data[s, mesh.dp_rank * local:(mesh.dp_rank + 1) * local]
        losses.append(model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy).item())
        norms.append(model.clip_grad_norm_(0.05).item())
        opt.step()
        opt.zero_grad()
        stats = model.moe_stats()  # the whole job's figures of this step's (last) forward
    state = model.full_state_dict()
    mesh.destroy()
    return losses, norms, state, stats


# (world, mesh sizes, micro-batches, ShardedModule options, model options)
GPT_LAYOUTS = {
    "dp2_ep2": (2, dict(dp=2, ep=2), 1, {}, {}),
    "tp2_dp2_ep2": (4, dict(dp=2, ep=2, tp=2), 1, {}, {}),
    "pp2_dp2_ep2_m2": (4, dict(dp=2, ep=2, pp=2), 2, {}, {}),
    "dp4_ep2": (4, dict(dp=4, ep=2), 1, {}, {}),
    # MoE under ZeRO: dense parameters sharded over dp, experts over edp
    "zero1_dp4_ep2": (4, dict(dp=4, ep=2), 1, dict(strategy="zero1"), {}),
    "zero2_dp4_ep4": (4, dict(dp=4, ep=4), 1, dict(strategy="zero2"), {}),
    "zero3_dp4_ep2": (4, dict(dp=4, ep=2), 1, dict(strategy="zero3"), {}),
    "zero3_tp2_dp2_ep2": (4, dict(dp=2, ep=2, tp=2), 1, dict(strategy="zero3"), {}),
    # a pipeline stage without any MoE layer (block 0 dense: stage 0 holds no expert)
    "zero1_pp2_dp2_ep2_m2_dense_stage": (4, dict(dp=2, ep=2, pp=2), 2, dict(strategy="zero1"), dict(moe_blocks=(1,))),
    "zero3_pp2_dp2_ep2_m2_dense_stage": (4, dict(dp=2, ep=2, pp=2), 2, dict(strategy="zero3"), dict(moe_blocks=(1,))),
    # sequence parallelism: each tp rank routes its own slice of the sequence
    "sp_tp2_dp2_ep2": (4, dict(dp=2, ep=2, tp=2), 1, dict(sequence_parallel=True), {}),
    "sp_zero2_tp2_dp2_ep2": (4, dict(dp=2, ep=2, tp=2), 1, dict(strategy="zero2", sequence_parallel=True), {}),
    "sp_zero3_tp2_pp2_m2": (4, dict(dp=1, tp=2, pp=2), 2, dict(strategy="zero3", sequence_parallel=True),
                            dict(moe_blocks=(0,))),
}


def moe_gpt_reference(cfg: dict, data: torch.Tensor, groups: int, seq_chunks: int = 1):
    """The single-process MoE GPT on the global batch ``data`` (steps, rows, seq + 1), routing each of
    ``groups`` shares (dp ranks x micro-batches; x ``seq_chunks`` sequence slices) as its own group:
    three clipped AdamW steps. Returns (model, losses, norms, the last step's dropped count) after
    asserting that tokens were dropped (none, for a dropless config: capacity_factor None) and that
    clipping fired every step (else the test proves less)."""
    ref = MoEGPT(MoEGPTConfig(**cfg, route_groups=groups, route_seq_chunks=seq_chunks))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    ref_losses, ref_norms, dropped = [], [], 0
    for s in range(data.shape[0]):
        x = data[s]
        logits = ref(x[:, :-1])
        last_dropped = ref.moe_stats()["dropped"]
        dropped += last_dropped
        # Each rank's loss is its own mean (over its micro-batches' means); the global loss their mean.
        lm = torch.stack([gpt_loss(lg, y) for lg, y in zip(logits.chunk(groups), x[:, 1:].chunk(groups))]).mean()
        lm.backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item())
        opt.step()
        opt.zero_grad()
        ref_losses.append(lm.item())
    dropless = cfg.get("capacity_factor", 1.25) is None
    assert (dropped == 0 if dropless else dropped > 0) and min(ref_norms) > 0.05, (dropped, ref_norms)
    return ref, ref_losses, ref_norms, last_dropped


@pytest.mark.parametrize("name", list(GPT_LAYOUTS))
def test_moe_gpt_equals_single_process(pools, name):
    """The MoE GPT (top-2, capacity factor 1.0: some tokens dropped) trained three steps under
    expert parallelism, alone and composed with dp, tp (with and without sequence parallelism), pp
    and every ZeRO stage, equals the single-process MoE GPT routing each rank's (each micro-batch's,
    each sequence slice's) share of the global batch as its own group: losses, clipped gradient
    norms and parameters."""
    world, sizes, m, options, model_options = GPT_LAYOUTS[name]
    dp, tp = sizes["dp"], sizes.get("tp", 1)
    seq_chunks = tp if options.get("sequence_parallel") else 1
    cfg = dict(vocab_size=16, block_size=6, n_layer=2, n_head=2, n_embd=8, n_experts=4, top_k=2,
               capacity_factor=1.0, aux_loss_coef=0.1, z_loss_coef=0.01, seed=3, **model_options)
    data = torch.randint(0, 16, (3, dp * 2 * m, 7), generator=torch.Generator().manual_seed(4))
    ref, ref_losses, ref_norms, last_dropped = moe_gpt_reference(cfg, data, dp * m, seq_chunks)
    for rank, (losses, norms, state, stats) in enumerate(pools.run(world, _train_gpt, sizes, cfg, data, m, options)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=lambda s: f"rank {rank}: {s}")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), msg=lambda s: f"rank {rank}: {s}")
        if m == 1:  # under pp the last forward is the last micro-batch only, not the whole step
            assert stats["dropped"] == last_dropped, (rank, stats, last_dropped)
        assert state.keys() == ref.state_dict().keys()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, msg=lambda s: f"rank {rank} {k}: {s}")


def _bad(ctx, cfg, layout, strategy):
    mesh = Mesh(**layout)
    with pytest.raises(ValueError) as info:
        ShardedModule(MoEGPT(MoEGPTConfig(**cfg)), mesh=mesh, strategy=strategy)
    mesh.destroy()
    return str(info.value)


@pytest.mark.parametrize("cfg, layout, strategy, match", [
    (dict(n_experts=6), dict(dp=4, ep=4), "ddp", "n_experts=6 is not divisible by ep=4"),
    (dict(n_experts=5, top_k=1), dict(dp=4, ep=2), "zero3", "n_experts=5 is not divisible by ep=2"),
])
def test_bad_expert_parallel_configurations_raise_on_every_rank(pools, cfg, layout, strategy, match):
    base = dict(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=4)
    for msg in pools.run(4, _bad, {**base, **cfg}, layout, strategy):
        assert match in msg


def _rank_without_tokens(ctx, x0):
    mesh = Mesh(dp=2, ep=2)
    layer = MoELayer(6, 8, n_experts=4, top_k=2, capacity_factor=4.0, aux_loss_coef=0.1, z_loss_coef=0.01, seed=3)
    layer.shard_experts(mesh.comm, mesh.group("ep"))
    x = (x0 if mesh.rank == 0 else x0[:0]).clone().to(ctx.device).requires_grad_(True)
    out = layer(x)
    out.sum().backward()
    result = dict(out=out.detach().cpu(), aux=float(layer.last_aux), z=float(layer.last_z),
                  grads={n: p.grad.detach().cpu() for n, p in layer.named_parameters()})
    mesh.destroy()
    return result


def test_a_rank_without_any_token(pools):
    """ep=2, and rank 1's batch is empty: it still joins every all-to-all (no hang), returns an empty
    output, reports an auxiliary and z loss of 0 (not the nan of a mean over nothing), and every
    rank's gradients are the single-process layer's on rank 0's tokens: rank 1's experts are fed by
    rank 0 only, and its gate gets nothing."""
    x0 = torch.randn(5, 6, generator=torch.Generator().manual_seed(4))
    ref = MoELayer(6, 8, n_experts=4, top_k=2, capacity_factor=4.0, aux_loss_coef=0.1, z_loss_coef=0.01, seed=3)
    x = x0.clone().requires_grad_(True)
    out = ref(x)
    out.sum().backward()
    r0, r1 = pools.run(2, _rank_without_tokens, x0)
    torch.testing.assert_close(r0["out"], out.detach())
    assert r1["out"].shape == (0, 6)
    assert (r0["aux"], r0["z"]) == pytest.approx((float(ref.last_aux), float(ref.last_z)))
    assert (r1["aux"], r1["z"]) == (0.0, 0.0)
    for rank, r in enumerate((r0, r1)):
        for name in ("w1", "b1", "w2", "b2"):
            torch.testing.assert_close(r["grads"][name], getattr(ref, name).grad[2 * rank:2 * rank + 2],
                                       msg=lambda m: f"rank {rank} {name}: {m}")
    torch.testing.assert_close(r0["grads"]["gate.weight"], ref.gate.weight.grad)
    assert r1["grads"]["gate.weight"].abs().max() == 0
