"""DeepSeekMoE in `MoELayer`: any top-k, fine-grained and shared experts, the sigmoid gate, bias
balancing, dropless and node-limited routing. The router against a token-by-token reference; the
layer and the MoE GPT under dp x ep (different data on every rank) equal to the single-process
model that routes each rank's share of the global batch as its own group: outputs, losses,
gradients, parameters and expert biases after three AdamW steps with clipping that fires.
``HYPOTHESIS_PROFILE=long`` runs the fuller matrix of options and layouts."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
from hypothesis import example, given, strategies as st

from minipar import Mesh, ShardedModule
from minipar.models import MoEGPT, deepseek_moe_config, gpt_loss
from minipar.moe.balance import update_expert_bias
from minipar.moe.layer import MoELayer
from minipar.moe.router import capacity, route

from helpers import LR, WD
from test_moe import _full_grads, _loss  # the MoE tests' loss and ep-gathered gradients

LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
# As in test_moe: tiny expert gradients make AdamW's lr/eps amplify fp32 summation-order noise; a
# larger eps keeps parameter differences under the default fp32 tolerances (gradients are compared
# directly, so a wrong scale still fails).
EPS = 1e-4
RATE = 0.01  # a bias step that changes routing within three steps at these score spreads


# -- the router, one process -----------------------------------------------------------------

def _route_by_hand(logits, k, cap, gate, bias, groups, limit, scale):
    """Token by token, in Python: scores, the biased choice restricted to the token's best groups,
    the k best experts, their unbiased weights; then capacity in priority order."""
    t, e = logits.shape
    scores = logits.softmax(-1) if gate == "softmax" else logits.sigmoid()
    per_group = e // groups
    chosen, weights = [], []
    for i in range(t):
        c = [float(scores[i, j]) + (float(bias[j]) if bias is not None else 0.0) for j in range(e)]
        allowed = range(e)
        if limit is not None:
            best = [max(c[g * per_group:(g + 1) * per_group]) for g in range(groups)]
            top_groups = sorted(range(groups), key=lambda g: -best[g])[:limit]
            allowed = [j for j in range(e) if j // per_group in top_groups]
        picks = sorted(allowed, key=lambda j: -c[j])[:k]
        w = [float(scores[i, j]) for j in picks]
        if k > 1 or gate == "sigmoid":
            w = [x / sum(w) for x in w]
        chosen.append(picks)
        weights.append([x * scale for x in w])
    expert = [chosen[i][c] for c in range(k) for i in range(t)]
    weight = [weights[i][c] for c in range(k) for i in range(t)]
    taken = [0] * e
    keep = []
    for ex in expert:
        keep.append(cap is None or taken[ex] < cap)
        taken[ex] += 1
    return expert, weight, keep


@given(t=st.integers(1, 24), shape=st.sampled_from([(4, 1, 1), (8, 2, 4), (16, 4, 4), (16, 2, 2), (6, 3, 3)]),
       k=st.integers(1, 4), gate=st.sampled_from(["softmax", "sigmoid"]), use_bias=st.booleans(),
       limit=st.sampled_from([None, 1, 2]), cf=st.sampled_from([None, 0.5, 1.0]),
       scale=st.sampled_from([1.0, 2.5]), seed=st.integers(0, 2**16))
def test_router_matches_token_by_token_reference(t, shape, k, gate, use_bias, limit, cf, scale, seed):
    """For any k <= E, either gate, a bias, a group limit, a capacity or none: the experts, weights
    and kept assignments of the vectorised router equal the Python loop's; the loads count every
    choice; the sigmoid gate's weights sum to route_scale."""
    e, groups, _ = shape
    k = min(k, e)
    if limit is not None:
        limit = min(limit, groups)
        k = min(k, limit * (e // groups))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    bias = torch.randn(e, generator=g) * 0.1 if use_bias else None
    cap = capacity(t, e, k, cf)
    r = route(logits, k, cap, gate=gate, bias=bias, expert_groups=groups, route_limit=limit, route_scale=scale)
    expert, weight, keep = _route_by_hand(logits, k, cap, gate, bias, groups, limit, scale)
    assert r.expert.tolist() == expert
    assert r.keep.tolist() == keep
    torch.testing.assert_close(r.weight, torch.tensor(weight))
    assert r.load.tolist() == torch.bincount(torch.tensor(expert), minlength=e).tolist()
    if k > 1 or gate == "sigmoid":
        torch.testing.assert_close(r.weight.view(k, t).sum(0), torch.full((t,), scale))
    if limit is not None:  # every token's experts lie in at most `limit` groups
        per_token = r.expert.view(k, t).t() // (e // groups)
        assert all(len(set(row.tolist())) <= limit for row in per_token)


def test_bias_picks_but_does_not_weight():
    """A large bias on expert 3 makes every token choose it, with its unbiased score as weight."""
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    r = route(logits, 1, None, gate="sigmoid", bias=bias)
    assert r.expert.tolist() == [3] * 5
    torch.testing.assert_close(r.weight, torch.ones(5))  # k = 1, sigmoid: normalised over the one choice
    r = route(logits, 2, None, gate="softmax", bias=bias)
    probs = logits.softmax(-1)
    assert r.expert[:5].tolist() == [3] * 5
    w3 = probs[:, 3] / (probs[:, 3] + probs.gather(1, r.expert[5:, None])[:, 0])
    torch.testing.assert_close(r.weight[:5], w3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_experts=4, top_k=5), "top_k=5 is larger than the expert count 4"),
    (dict(n_experts=4, gate="relu"), "gate='relu' is not a known gate"),
    (dict(n_experts=4, balance="loss"), "balance='loss' is not a known balancing"),
    (dict(n_experts=4, balance="bias"), "balance='bias' with aux_loss_coef=0.01: .* set aux_loss_coef=0"),
    (dict(n_experts=4, balance="bias", aux_loss_coef=0.0, bias_update_rate=0.0), "bias_update_rate=0.0 must be"),
    (dict(n_experts=8, expert_groups=3), "expert_groups=3 must divide n_experts=8"),
    (dict(n_experts=8, expert_groups=4, route_limit=5), "route_limit=5 must be between 1 and expert_groups=4"),
    (dict(n_experts=8, expert_groups=4, route_limit=0), "route_limit=0 must be between 1"),
    (dict(n_experts=8, top_k=4, expert_groups=4, route_limit=1), "route_limit=1 groups of 2 experts hold fewer"),
    (dict(n_experts=8, route_scale=0.0), "route_scale=0.0 must be a finite number > 0"),
    (dict(n_experts=8, n_shared_experts=-1), "n_shared_experts=-1 must be an integer >= 0"),
    (dict(n_experts=8, capacity_factor=0.0), "or None \\(dropless"),
])
def test_bad_deepseek_configuration_raises_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoELayer(4, 8, **kwargs)


def _misaligned(ctx):
    mesh = Mesh(dp=4, ep=4)
    cfg = dict(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=4, n_experts=12, top_k=2,
               expert_groups=3, route_limit=2, first_dense=0)
    with pytest.raises(ValueError) as info:
        ShardedModule(MoEGPT(deepseek_moe_config(**cfg)), mesh=mesh)
    mesh.destroy()
    return str(info.value)


def test_groups_that_straddle_ep_ranks_raise_on_every_rank(pools):
    """3 routing groups of 4 experts over ep=4 ranks of 3: a group would be parts of two ranks."""
    for msg in pools.run(4, _misaligned):
        assert "expert_groups=3 does not line up with ep=4" in msg


# -- one MoE layer under dp x ep -------------------------------------------------------------

class Net(nn.Module):
    """An MoE layer between two dense layers, with a residual, as in a transformer block."""

    def __init__(self, d: int, options: dict, seed: int, groups: int = 1) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(d, d)
        self.moe = MoELayer(d, options.pop("hidden", 2 * d), seed=seed, **options)
        self.moe.route_groups = groups
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.moe(h))




def _train_layer(ctx, layout, d, options, seed, xs, ys):
    mesh = Mesh(**layout)
    model = ShardedModule(Net(d, dict(options), seed), mesh=mesh, bucket_cap_mb=1e-4)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    local = xs.shape[1] // mesh.dp
    rows = slice(mesh.dp_rank * local, (mesh.dp_rank + 1) * local)
    outs, grads, routed = [], [], []
    with mesh.comm.counting() as stats:
        for s in range(xs.shape[0]):
            out = model(xs[s, rows])
            outs.append(out.detach())
            routed.append(sum(int(c.sum()) for c in model.module.moe.last_counts))
            _loss(out, ys[s, rows]).backward()
            grads.append(_full_grads(model, mesh))
            model.clip_grad_norm_(0.05)
            opt.step()
            update_expert_bias(model.module)
            opt.zero_grad()
    bias_calls = stats.calls(tag="moe_bias_load")
    state = model.full_state_dict()
    mesh.destroy()
    return outs, grads, state, mesh.dp_rank, routed, bias_calls


def _reference_layer(d, options, seed, xs, ys, dp):
    net = Net(d, dict(options), seed, groups=dp)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    outs, grads, norms, counts = [], [], [], []
    for s in range(xs.shape[0]):
        out = net(xs[s])
        outs.append(out.detach())
        counts.append([c.clone() for c in net.moe.last_counts])
        torch.stack([_loss(o, y) for o, y in zip(out.chunk(dp), ys[s].chunk(dp))]).mean().backward()
        grads.append({n: p.grad.detach().clone() for n, p in net.named_parameters()})
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05).item())
        opt.step()
        update_expert_bias(net)
        opt.zero_grad()
    return net, outs, grads, norms, counts


LAYER_OPTIONS = {
    # fine-grained: 16 small experts, top-4, a capacity that drops
    "fine_grained_k4": dict(n_experts=16, top_k=4, hidden=4, capacity_factor=1.0),
    # DeepSeek-V3's router: sigmoid, bias balancing, shared expert, dropless, 2 of 4 groups
    "v3": dict(n_experts=16, top_k=4, hidden=4, capacity_factor=None, gate="sigmoid", route_scale=2.5,
               balance="bias", aux_loss_coef=0.0, bias_update_rate=RATE, n_shared_experts=2,
               expert_groups=4, route_limit=2),
}
LONG_OPTIONS = {
    "k3_softmax_shared": dict(n_experts=8, top_k=3, capacity_factor=1.0, n_shared_experts=1, z_loss_coef=0.01),
    "sigmoid_aux_dropless": dict(n_experts=8, top_k=2, capacity_factor=None, gate="sigmoid", aux_loss_coef=0.1),
    "softmax_bias_limit": dict(n_experts=8, top_k=2, capacity_factor=1.0, balance="bias", aux_loss_coef=0.0,
                               bias_update_rate=RATE, expert_groups=4, route_limit=1),
}
LAYER_LAYOUTS = {"dp4_ep2": (4, dict(dp=4, ep=2))}
LONG_LAYOUTS = {"dp2_ep1": (2, dict(dp=2, ep=1)), "dp2_ep2": (2, dict(dp=2, ep=2)), "dp4_ep4": (4, dict(dp=4, ep=4))}
LAYER_CASES = [(o, lay) for o in LAYER_OPTIONS for lay in LAYER_LAYOUTS] + \
    ([(o, lay) for o in LAYER_OPTIONS | LONG_OPTIONS for lay in LAYER_LAYOUTS | LONG_LAYOUTS
      if (o, lay) not in [(a, b) for a in LAYER_OPTIONS for b in LAYER_LAYOUTS]] if LONG else [])


@pytest.mark.parametrize("option, layout", LAYER_CASES)
def test_deepseek_layer_equals_single_process(pools, option, layout):
    """Outputs and gradients (expert ones gathered over ep) at every step, parameters and the expert
    bias after three AdamW steps with clipping (and bias updates) equal the single-process layer;
    the bias is bit-identical on every rank and to the reference's."""
    options, (world, sizes) = LAYER_OPTIONS.get(option) or LONG_OPTIONS[option], LAYER_LAYOUTS.get(layout) or \
        LONG_LAYOUTS[layout]
    dp, d, seed = sizes["dp"], 8, 5
    g = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(3, dp * 2, 6, d, generator=g)
    ys = torch.randint(0, 3, (3, dp * 2, 6), generator=g)
    net, ref_outs, ref_grads, ref_norms, ref_counts = _reference_layer(d, options, seed, xs, ys, dp)
    assert min(ref_norms) > 0.05  # clipping fires every step
    moe = net.moe
    if options.get("capacity_factor", 1.25) is None:  # dropless where a capacity factor of 1 would drop
        cap = capacity(12, moe.n_experts, moe.top_k, 1.0)
        assert moe.last_dropped == 0 and max(int(c.max()) for cs in ref_counts for c in cs) > cap
    if moe.balance == "bias":  # the bias moved, and it changes the choice of some token
        assert moe.expert_bias.abs().max() > 0
        h = net.inp(xs[-1].reshape(-1, d))
        logits = moe.gate(h).float()
        kw = dict(gate=moe.score, expert_groups=moe.expert_groups, route_limit=moe.route_limit)
        assert not torch.equal(route(logits, moe.top_k, None, bias=moe.expert_bias, **kw).expert,
                               route(logits, moe.top_k, None, **kw).expert)
    results = pools.run(world, _train_layer, sizes, d, options, seed, xs, ys)
    ref_state = net.state_dict()
    for rank, (outs, grads, state, dp_rank, routed, bias_calls) in enumerate(results):
        assert bias_calls == (3 if moe.balance == "bias" and dp > 1 else 0), bias_calls
        for s in range(3):
            if options.get("capacity_factor", 1.25) is None:  # every assignment reached its expert
                assert routed[s] == 12 * moe.top_k
            torch.testing.assert_close(outs[s], ref_outs[s].chunk(dp)[dp_rank],
                                       msg=lambda m: f"rank {rank} step {s} output: {m}")
            for name, ref in ref_grads[s].items():
                torch.testing.assert_close(grads[s][name], ref, msg=lambda m: f"rank {rank} step {s} grad {name}: {m}")
        assert state.keys() == ref_state.keys()
        for name, ref in ref_state.items():
            if name.endswith("expert_bias"):  # sign updates of equal counts: exact
                assert torch.equal(state[name], ref), (rank, state[name], ref)
            torch.testing.assert_close(state[name], ref, msg=lambda m: f"rank {rank} param {name}: {m}")


# -- the DeepSeekMoE GPT under ShardedModule ---------------------------------------------------

def _tiny(**overrides):
    """deepseek_moe_config at test size: 16 experts of width 8, top-4 from 2 of 4 groups, one shared
    expert, sigmoid, bias balancing, dropless, block 0 dense."""
    base = dict(vocab_size=16, block_size=6, n_layer=3, n_head=2, n_embd=8, expert_hidden=8,
                bias_update_rate=RATE, seed=3)
    return deepseek_moe_config(**(base | overrides))


def _train_gpt(ctx, layout, m, options, data, overrides):
    mesh = Mesh(**layout)
    kwargs = dict(microbatches=m) if mesh.pp > 1 else {}
    model = ShardedModule(MoEGPT(_tiny(**overrides)), mesh=mesh, bucket_cap_mb=1e-3, **kwargs, **options)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    local = data.shape[1] // mesh.dp
    losses, norms = [], []
    for s in range(data.shape[0]):
        x = data[s, mesh.dp_rank * local:(mesh.dp_rank + 1) * local]
        losses.append(model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy).item())
        norms.append(model.clip_grad_norm_(0.05).item())
        opt.step()
        model.update_expert_bias()  # the front door's call
        opt.zero_grad()
    state = model.full_state_dict()
    mesh.destroy()
    return losses, norms, state


# (world, mesh sizes, micro-batches, ShardedModule options)
GPT_LAYOUTS = {"dp4_ep2": (4, dict(dp=4, ep=2), 1, {})}
LONG_GPT_LAYOUTS = {
    "zero1_dp4_ep2": (4, dict(dp=4, ep=2), 1, dict(strategy="zero1")),
    "zero3_dp4_ep4": (4, dict(dp=4, ep=4), 1, dict(strategy="zero3")),
    "tp2_dp2_ep2": (4, dict(dp=2, ep=2, tp=2), 1, {}),
    "sp_tp2_dp2_ep2": (4, dict(dp=2, ep=2, tp=2), 1, dict(sequence_parallel=True)),
    "pp2_dp2_ep2_m2": (4, dict(dp=2, ep=2, pp=2), 2, {}),
}


@pytest.mark.parametrize("name", list(GPT_LAYOUTS) + (list(LONG_GPT_LAYOUTS) if LONG else []))
def test_deepseek_gpt_equals_single_process(pools, name):
    """The DeepSeekMoE-shaped GPT (first block dense; fine-grained, shared, sigmoid, bias-balanced,
    dropless, group-limited MoE blocks) trained three steps under dp x ep (and, under ``long``,
    ZeRO, tp, sequence parallelism, pp) equals the single-process GPT routing each rank's share of
    the batch as its own group: losses, clipped gradient norms, parameters and expert biases."""
    world, sizes, m, options = (GPT_LAYOUTS | LONG_GPT_LAYOUTS)[name]
    dp, tp = sizes["dp"], sizes.get("tp", 1)
    seq_chunks = tp if options.get("sequence_parallel") else 1
    data = torch.randint(0, 16, (3, dp * 2 * m, 7), generator=torch.Generator().manual_seed(4))
    ref = MoEGPT(_tiny(route_groups=dp * m, route_seq_chunks=seq_chunks))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    ref_losses, ref_norms = [], []
    for s in range(3):
        x = data[s]
        logits = ref(x[:, :-1])
        lm = torch.stack([gpt_loss(lg, y) for lg, y in zip(logits.chunk(dp * m), x[:, 1:].chunk(dp * m))]).mean()
        lm.backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item())
        opt.step()
        update_expert_bias(ref)
        opt.zero_grad()
        ref_losses.append(lm.item())
    ref_state = ref.state_dict()
    assert min(ref_norms) > 0.05 and all(ref_state[f"layers.{i}.mlp.expert_bias"].abs().max() > 0 for i in (1, 2))
    assert "layers.0.mlp.fc.weight" in ref_state and "layers.1.mlp.shared.fc.weight" in ref_state
    for rank, (losses, norms, state) in enumerate(pools.run(world, _train_gpt, sizes, m, options, data, {})):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=lambda s: f"rank {rank}: {s}")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), msg=lambda s: f"rank {rank}: {s}")
        assert state.keys() == ref_state.keys()
        for k, v in ref_state.items():
            if k.endswith("expert_bias"):
                assert torch.equal(state[k], v), (rank, k, state[k], v)
            torch.testing.assert_close(state[k], v, msg=lambda s: f"rank {rank} {k}: {s}")


def _checkpoint_round_trip(ctx, path, data):
    from minipar import checkpoint
    mesh = Mesh(dp=2, ep=2)

    def build():
        model = ShardedModule(MoEGPT(_tiny()), mesh=mesh)
        return model, model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)

    def step(model, opt, x):
        model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy)
        opt.step()
        update_expert_bias(model.module)
        opt.zero_grad()
    rows = slice(mesh.dp_rank * 2, mesh.dp_rank * 2 + 2)
    model, opt = build()
    for s in range(2):
        step(model, opt, data[s, rows])
    checkpoint.save(path, model, opt)
    saved = {n: b.clone() for n, b in model.module.named_buffers() if n.endswith("expert_bias")}
    step(model, opt, data[2, rows])
    after = {n: b.clone() for n, b in model.module.named_buffers() if n.endswith("expert_bias")}
    fresh, fresh_opt = build()
    checkpoint.load(path, fresh, fresh_opt)
    loaded = {n: b.clone() for n, b in fresh.module.named_buffers() if n.endswith("expert_bias")}
    step(fresh, fresh_opt, data[2, rows])
    resumed = {n: b.clone() for n, b in fresh.module.named_buffers() if n.endswith("expert_bias")}
    mesh.destroy()
    return saved, loaded, after, resumed


def test_expert_bias_survives_a_checkpoint(pools, tmp_path):
    """The bias is a buffer: a checkpoint after two steps holds it, a fresh model loads it, and the
    third step from there moves it exactly as the run that never stopped."""
    data = torch.randint(0, 16, (3, 4, 7), generator=torch.Generator().manual_seed(9))
    for saved, loaded, after, resumed in pools.run(2, _checkpoint_round_trip, str(tmp_path / "ckpt"), data):
        assert saved and all(b.abs().max() > 0 for b in saved.values())
        for name in saved:
            assert torch.equal(loaded[name], saved[name]), name
            assert torch.equal(resumed[name], after[name]), name
