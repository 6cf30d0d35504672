"""The tensor-parallel building blocks (minipar.tensor_parallel), each against the single-process
layer it replaces: ColumnParallelLinear / RowParallelLinear (plain and sequence-parallel),
VocabParallelEmbedding, vocab_parallel_cross_entropy, parallelize(plan), and the communication
each one issues.

Data. Every tensor is generated from ``(seed, slot)``, so every rank rebuilds the same full
reference module, input and upstream gradient, runs the reference itself (autograd on plain
tensors), and compares its parallel layer's results with its own piece of the reference:
``full.chunk(tp, dim)[tp_rank]`` for split tensors, the whole tensor for replicated ones.

Upstream gradients. A *replicated* output (the same on every rank) is one logical tensor of the
single-process program, so every rank feeds the same ``dy``; a *split* output (features or
sequence) gets the rank's chunk of one full ``dy``. The reference loss is ``<dy, y>``.

The world is the tp group: ``Mesh(tp=world)`` with world in {1, 2, 4}.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import example, given, strategies as st
from torch.testing import assert_close

from minipar.core.mesh import Mesh
from minipar.core.placement import placement_of
from minipar.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, SequenceShard,
                                     VocabParallelEmbedding, parallelize, vocab_parallel_cross_entropy)

# A replicated parameter that sees only this rank's sequence chunk (marked ``sequence_parallel``: the
# row-parallel bias, norms) has a partial gradient that must be summed over tp. Two designs exist:
# an explicit ``sync_sequence_parallel_grads(module, mesh)`` after backward, or a gradient hook that
# all-reduces it as it arrives (tag "sp_grad"). The tests accept either; with the explicit form they
# also check the gradient is partial before the sync.
try:
    from minipar.tensor_parallel import sync_sequence_parallel_grads as _explicit_sp_sync
except ImportError:
    _explicit_sp_sync = None


def _sync_sp(module: nn.Module, mesh: Mesh) -> None:
    if _explicit_sp_sync is not None:
        _explicit_sp_sync(module, mesh)


WORLDS = (1, 2, 4)
F32 = 4  # bytes per fp32 element


# -- data and references -------------------------------------------------------------


def _gen(seed: int, slot: int, shape, scale: float = 1.0) -> torch.Tensor:
    """Tensor number ``slot`` of example ``seed``: the same on every rank (CPU generator)."""
    g = torch.Generator().manual_seed(seed * 128 + slot)
    return torch.randn(tuple(shape), generator=g) * scale


def _linear(seed: int, slot: int, fin: int, fout: int, bias: bool, dev) -> nn.Linear:
    lin = nn.Linear(fin, fout, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(_gen(seed, slot, (fout, fin)))
        if bias:
            lin.bias.copy_(_gen(seed, slot + 1, (fout,)))
    return lin.to(dev)


def _embedding(seed: int, slot: int, vocab: int, dim: int, dev, **kw) -> nn.Embedding:
    emb = nn.Embedding(vocab, dim, **kw)
    with torch.no_grad():
        emb.weight.copy_(_gen(seed, slot, (vocab, dim)))
        if emb.padding_idx is not None:
            emb.weight[emb.padding_idx].zero_()  # as nn.Embedding initialises it
    return emb.to(dev)


def _reference(module: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    """Output of ``module(x)`` and the gradients of <dy, y>: w.r.t. x (None for integer x) and each parameter."""
    module.zero_grad(set_to_none=True)
    x = x.clone()
    if x.is_floating_point():
        x.requires_grad_(True)
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def _chunk(t: torch.Tensor, tp: int, dim: int, r: int) -> torch.Tensor:
    return t.chunk(tp, dim)[r]


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _close(actual, expected, what: str) -> None:
    assert actual is not None, f"{what}: no gradient"
    assert actual.shape == expected.shape, (what, tuple(actual.shape), tuple(expected.shape))
    assert_close(actual, expected, msg=lambda s: f"{what}: {s}")


def _tp_mesh(ctx) -> Mesh:
    mesh = Mesh(tp=ctx.world_size)
    g = mesh.group("tp")
    assert (mesh.tp, mesh.tp_rank, g.size, g.rank) == (ctx.world_size, ctx.rank, ctx.world_size, ctx.rank)
    return mesh


# -- 1. ColumnParallelLinear ----------------------------------------------------------


def _rank_column(ctx, case):
    tp, r, dev = ctx.world_size, ctx.rank, ctx.device
    seed, lead, fin, fout = case["seed"], tuple(case["lead"]), case["fin"], case["fout"]
    mesh = _tp_mesh(ctx)
    try:
        x = _gen(seed, 0, lead + (fin,)).to(dev)
        dy = _gen(seed, 1, lead + (fout,)).to(dev)
        for bias, gather in itertools.product((True, False), repeat=2):
            what = f"column(bias={bias}, gather_output={gather})"
            ref = _linear(seed, 2, fin, fout, bias, dev)
            y_ref, dx_ref, g_ref = _reference(ref, x, dy)
            layer = ColumnParallelLinear(ref, mesh, gather_output=gather)
            assert placement_of(layer.weight).tensor_parallel and tuple(layer.weight.shape) == (fout // tp, fin)
            xi = _leaf(x)
            y = layer(xi)
            # gathered: the full, replicated output and the same dy everywhere; else this rank's features
            y_exp, dy_in = (y_ref, dy) if gather else (_chunk(y_ref, tp, -1, r), _chunk(dy, tp, -1, r))
            _close(y.detach(), y_exp, f"{what} forward")
            y.backward(dy_in)
            _close(xi.grad, dx_ref, f"{what} input grad")  # full, on every rank
            _close(layer.weight.grad, _chunk(g_ref["weight"], tp, 0, r), f"{what} weight grad")
            if bias:
                _close(layer.bias.grad, _chunk(g_ref["bias"], tp, 0, r), f"{what} bias grad")
            else:
                assert layer.bias is None
        if tp > 1:  # output features the tp size does not divide
            with pytest.raises(ValueError, match="not divisible"):
                ColumnParallelLinear(nn.Linear(fin, fout + 1), mesh)
        return True
    finally:
        mesh.destroy()


@st.composite
def _column_cases(draw):
    tp = draw(st.sampled_from(WORLDS))
    return dict(tp=tp, seed=draw(st.integers(0, 2**20)),
                lead=draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)),
                fin=draw(st.integers(1, 6)), fout=tp * draw(st.integers(1, 3)))


@given(case=_column_cases())
@example(case=dict(tp=4, seed=1, lead=[2, 3], fin=5, fout=8))
@example(case=dict(tp=2, seed=2, lead=[], fin=3, fout=6))
def test_column_parallel_linear_matches_linear(pools, case):
    assert pools.run(case["tp"], _rank_column, case) == [True] * case["tp"]


# -- 2. RowParallelLinear ---------------------------------------------------------------


def _rank_row(ctx, case):
    tp, r, dev = ctx.world_size, ctx.rank, ctx.device
    seed, lead, fin, fout = case["seed"], tuple(case["lead"]), case["fin"], case["fout"]
    mesh = _tp_mesh(ctx)
    try:
        x = _gen(seed, 0, lead + (fin,)).to(dev)
        dy = _gen(seed, 1, lead + (fout,)).to(dev)  # the output is replicated: one dy on every rank
        for bias, parallel_in in itertools.product((True, False), repeat=2):
            what = f"row(bias={bias}, input_is_parallel={parallel_in})"
            ref = _linear(seed, 2, fin, fout, bias, dev)
            y_ref, dx_ref, g_ref = _reference(ref, x, dy)
            layer = RowParallelLinear(ref, mesh, input_is_parallel=parallel_in)
            assert placement_of(layer.weight).tensor_parallel and tuple(layer.weight.shape) == (fout, fin // tp)
            xi = _leaf(_chunk(x, tp, -1, r) if parallel_in else x)
            y = layer(xi)
            _close(y.detach(), y_ref, f"{what} forward")
            y.backward(dy)
            _close(xi.grad, _chunk(dx_ref, tp, -1, r) if parallel_in else dx_ref, f"{what} input grad")
            _close(layer.weight.grad, _chunk(g_ref["weight"], tp, 1, r), f"{what} weight grad")
            if bias:
                assert not placement_of(layer.bias).tensor_parallel
                _close(layer.bias.grad, g_ref["bias"], f"{what} bias grad")
            else:
                assert layer.bias is None
        if tp > 1:  # input features the tp size does not divide
            with pytest.raises(ValueError, match="not divisible"):
                RowParallelLinear(nn.Linear(fin + 1, fout), mesh)
        return True
    finally:
        mesh.destroy()


@st.composite
def _row_cases(draw):
    tp = draw(st.sampled_from(WORLDS))
    return dict(tp=tp, seed=draw(st.integers(0, 2**20)),
                lead=draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)),
                fin=tp * draw(st.integers(1, 3)), fout=draw(st.integers(1, 6)))


@given(case=_row_cases())
@example(case=dict(tp=4, seed=3, lead=[3, 2], fin=12, fout=5))
@example(case=dict(tp=2, seed=4, lead=[], fin=2, fout=1))
def test_row_parallel_linear_matches_linear(pools, case):
    assert pools.run(case["tp"], _rank_row, case) == [True] * case["tp"]


# -- 3. sequence parallelism --------------------------------------------------------------


def _rank_sequence_parallel(ctx, case):
    tp, r, dev = ctx.world_size, ctx.rank, ctx.device
    seed, b, s, fin, fout = case["seed"], case["batch"], case["seq"], case["fin"], case["fout"]
    mesh = _tp_mesh(ctx)
    try:
        x = _gen(seed, 0, (b, s, fin)).to(dev)
        dy = _gen(seed, 1, (b, s, fout)).to(dev)

        # Column: x split along the sequence -> all sequence positions, this rank's output features
        # (or the whole replicated output with gather_output).
        for bias, gather in itertools.product((True, False), repeat=2):
            what = f"sp column(bias={bias}, gather_output={gather})"
            ref = _linear(seed, 2, fin, fout, bias, dev)
            y_ref, dx_ref, g_ref = _reference(ref, x, dy)
            layer = ColumnParallelLinear(ref, mesh, gather_output=gather, sequence_parallel=True)
            xi = _leaf(_chunk(x, tp, 1, r))
            y = layer(xi)
            y_exp, dy_in = (y_ref, dy) if gather else (_chunk(y_ref, tp, -1, r), _chunk(dy, tp, -1, r))
            _close(y.detach(), y_exp, f"{what} forward")
            y.backward(dy_in)
            _close(xi.grad, _chunk(dx_ref, tp, 1, r), f"{what} input grad (sequence chunk)")
            _close(layer.weight.grad, _chunk(g_ref["weight"], tp, 0, r), f"{what} weight grad")
            if bias:
                assert not placement_of(layer.bias).sequence_parallel  # sees every position
                _close(layer.bias.grad, _chunk(g_ref["bias"], tp, 0, r), f"{what} bias grad")
            _sync_sp(layer, mesh)  # nothing of a column layer is marked: a no-op
            _close(layer.weight.grad, _chunk(g_ref["weight"], tp, 0, r), f"{what} weight grad after sync")

        # Row: x split along features (or full) -> this rank's sequence chunk of the summed output.
        for bias, parallel_in in itertools.product((True, False), repeat=2):
            what = f"sp row(bias={bias}, input_is_parallel={parallel_in})"
            ref = _linear(seed, 2, fin, fout, bias, dev)
            y_ref, dx_ref, g_ref = _reference(ref, x, dy)
            layer = RowParallelLinear(ref, mesh, input_is_parallel=parallel_in, sequence_parallel=True)
            xi = _leaf(_chunk(x, tp, -1, r) if parallel_in else x)
            y = layer(xi)
            _close(y.detach(), _chunk(y_ref, tp, 1, r), f"{what} forward (sequence chunk)")
            dy_r = _chunk(dy, tp, 1, r)
            y.backward(dy_r)
            _close(xi.grad, _chunk(dx_ref, tp, -1, r) if parallel_in else dx_ref, f"{what} input grad")
            w_ref = _chunk(g_ref["weight"], tp, 1, r)
            _close(layer.weight.grad, w_ref, f"{what} weight grad")
            if bias:
                # The bias is added to this rank's sequence chunk only: its local gradient is that chunk's share.
                assert placement_of(layer.bias).sequence_parallel
                if _explicit_sp_sync is not None:
                    _close(layer.bias.grad, dy_r.sum((0, 1)), f"{what} bias grad before sync (partial)")
            _sync_sp(layer, mesh)
            if bias:
                _close(layer.bias.grad, g_ref["bias"], f"{what} bias grad after sync")
            _close(layer.weight.grad, w_ref, f"{what} weight grad after sync (unchanged)")
        return True
    finally:
        mesh.destroy()


@st.composite
def _sp_cases(draw):
    tp = draw(st.sampled_from(WORLDS))
    return dict(tp=tp, seed=draw(st.integers(0, 2**20)), batch=draw(st.integers(1, 3)),
                seq=tp * draw(st.integers(1, 3)), fin=tp * draw(st.integers(1, 3)), fout=tp * draw(st.integers(1, 3)))


@given(case=_sp_cases())
@example(case=dict(tp=4, seed=5, batch=2, seq=8, fin=4, fout=12))
@example(case=dict(tp=2, seed=6, batch=1, seq=6, fin=6, fout=2))
def test_sequence_parallel_linears_match_linear(pools, case):
    assert pools.run(case["tp"], _rank_sequence_parallel, case) == [True] * case["tp"]


# -- 4. VocabParallelEmbedding --------------------------------------------------------------


def _ids(seed: int, slot: int, shape, vocab: int, tp: int, dev) -> torch.Tensor:
    """Random ids in [0, vocab) whose first positions hit every shard's first and last row."""
    g = torch.Generator().manual_seed(seed * 128 + slot)
    ids = torch.randint(0, vocab, tuple(shape), generator=g)
    k = vocab // tp
    edges = torch.tensor([v for j in range(tp) for v in (j * k, j * k + k - 1)])
    flat = ids.view(-1)
    n = min(flat.numel(), edges.numel())
    flat[:n] = edges[torch.randperm(edges.numel(), generator=g)[:n]]
    if flat.numel() >= edges.numel():
        assert set(range(0, vocab, k)) <= set(flat.tolist())
    return ids.to(dev)


def _rank_embedding(ctx, case):
    tp, r, dev = ctx.world_size, ctx.rank, ctx.device
    seed, b, s, vocab, dim = case["seed"], case["batch"], case["seq"], case["vocab"], case["dim"]
    mesh = _tp_mesh(ctx)
    try:
        ids = _ids(seed, 0, (b, s), vocab, tp, dev)
        dy = _gen(seed, 1, (b, s, dim)).to(dev)
        for sp in (False, True):
            what = f"embedding(sequence_parallel={sp})"
            ref = _embedding(seed, 2, vocab, dim, dev)
            y_ref, _, g_ref = _reference(ref, ids, dy)
            layer = VocabParallelEmbedding(ref, mesh, sequence_parallel=sp)
            assert placement_of(layer.weight).tensor_parallel and tuple(layer.weight.shape) == (vocab // tp, dim)
            y = layer(ids.clone())
            # replicated output: one dy; sequence-parallel output: this rank's sequence chunk
            y_exp, dy_in = (_chunk(y_ref, tp, 1, r), _chunk(dy, tp, 1, r)) if sp else (y_ref, dy)
            _close(y.detach(), y_exp, f"{what} forward")
            y.backward(dy_in)
            _close(layer.weight.grad, _chunk(g_ref["weight"], tp, 0, r), f"{what} weight grad")
        if tp > 1:
            for extra in range(1, tp):
                with pytest.raises(ValueError, match="not divisible"):
                    VocabParallelEmbedding(nn.Embedding(vocab + extra, dim), mesh)
        return True
    finally:
        mesh.destroy()


@st.composite
def _embedding_cases(draw):
    tp = draw(st.sampled_from(WORLDS))
    return dict(tp=tp, seed=draw(st.integers(0, 2**20)), batch=draw(st.integers(1, 3)),
                seq=tp * draw(st.integers(1, 3)), vocab=tp * draw(st.integers(1, 5)), dim=draw(st.integers(1, 5)))


@given(case=_embedding_cases())
@example(case=dict(tp=4, seed=7, batch=2, seq=4, vocab=12, dim=3))
@example(case=dict(tp=2, seed=8, batch=1, seq=2, vocab=2, dim=1))
def test_vocab_parallel_embedding_matches_embedding(pools, case):
    assert pools.run(case["tp"], _rank_embedding, case) == [True] * case["tp"]


def _rank_embedding_padding_idx(ctx, case):
    tp, r, dev = ctx.world_size, ctx.rank, ctx.device
    seed, vocab, dim, pad = case["seed"], case["vocab"], case["dim"], case["pad"]
    mesh = _tp_mesh(ctx)
    try:
        ids = _ids(seed, 0, (2, 2 * tp), vocab, tp, dev)
        ids[0, 0] = pad  # the padding id occurs
        dy = _gen(seed, 1, (2, 2 * tp, dim)).to(dev)
        ref = _embedding(seed, 2, vocab, dim, dev, padding_idx=pad)
        y_ref, _, g_ref = _reference(ref, ids, dy)
        assert not g_ref["weight"][pad].any()  # nn.Embedding never trains the padding row
        layer = VocabParallelEmbedding(ref, mesh)
        y = layer(ids)
        _close(y.detach(), y_ref, "embedding(padding_idx) forward")
        y.backward(dy)
        _close(layer.weight.grad, _chunk(g_ref["weight"], tp, 0, r), "embedding(padding_idx) weight grad")
        return True
    finally:
        mesh.destroy()


# Regression: the layer once ignored ``padding_idx`` and trained the padding row.
# (Parametrized rather than drawn: a failing hypothesis test spends its time shrinking.)
@pytest.mark.parametrize("tp, vocab, dim, pad", [(1, 5, 3, 0), (2, 6, 2, 4), (4, 8, 3, 5)])
def test_vocab_parallel_embedding_honours_padding_idx(pools, tp, vocab, dim, pad):
    case = dict(seed=16, vocab=vocab, dim=dim, pad=pad)
    assert pools.run(tp, _rank_embedding_padding_idx, case) == [True] * tp


# -- 5. vocab_parallel_cross_entropy ----------------------------------------------------------

IGNORE = -100


def _targets(seed: int, slot: int, shape, vocab: int, tp: int, dev) -> torch.Tensor:
    """Targets in [0, vocab) on every shard, some positions ignored (position 0 always, one never)."""
    g = torch.Generator().manual_seed(seed * 128 + slot)
    t = torch.randint(0, vocab, tuple(shape), generator=g)
    t[torch.rand(tuple(shape), generator=g) < 0.3] = IGNORE
    flat, k = t.view(-1), vocab // tp
    flat[0] = IGNORE
    for j in range(min(tp, flat.numel() - 1)):  # a target in each shard (the shape leaves room)
        flat[1 + j] = j * k + int(torch.randint(0, k, (), generator=g))
    return t.to(dev)


def _rank_cross_entropy(ctx, case):
    tp, r, dev = ctx.world_size, ctx.rank, ctx.device
    seed, b, s, vocab, eps, scale, upstream = (case["seed"], case["batch"], case["seq"], case["vocab"], case["eps"],
                                               case["scale"], case["upstream"])
    mesh = _tp_mesh(ctx)
    try:
        raw = _gen(seed, 0, (b, s, vocab)).to(dev)
        targets = _targets(seed, 1, (b, s), vocab, tp, dev)
        assert (targets != IGNORE).any() and (targets == IGNORE).any()

        full = _leaf(raw * scale)  # large logits: a missing max subtraction overflows exp
        ref = F.cross_entropy(full.flatten(0, -2), targets.flatten(), ignore_index=IGNORE, label_smoothing=eps)
        ref.backward(torch.tensor(upstream, device=dev))

        base = _leaf(_chunk(raw, tp, -1, r))
        logits = base * scale  # a non-leaf, so an in-place write would go unnoticed by autograd
        logits.retain_grad()
        before = logits.detach().clone()
        loss = vocab_parallel_cross_entropy(logits, targets, mesh.comm, mesh.group("tp"), ignore_index=IGNORE,
                                            label_smoothing=eps)
        assert torch.equal(logits.detach(), before), "the forward wrote into the logits"
        assert loss.shape == ()
        _close(loss.detach(), ref.detach(), "cross-entropy loss")
        loss.backward(torch.tensor(upstream, device=dev))
        assert torch.equal(logits.detach(), before), "the backward wrote into the logits"
        assert torch.isfinite(logits.grad).all()
        _close(logits.grad, _chunk(full.grad, tp, -1, r), "cross-entropy logits grad")
        return loss.item()
    finally:
        mesh.destroy()


@st.composite
def _ce_cases(draw):
    tp = draw(st.sampled_from(WORLDS))
    return dict(tp=tp, seed=draw(st.integers(0, 2**20)), batch=draw(st.integers(1, 3)),
                seq=tp + draw(st.integers(1, 4)),  # room for an ignored position and a target per shard
                vocab=tp * draw(st.integers(1, 6)), eps=draw(st.sampled_from([0.0, 0.1, 0.3])),
                scale=draw(st.sampled_from([1.0, 50.0])), upstream=draw(st.sampled_from([1.0, 0.5, -3.0])))


@given(case=_ce_cases())
@example(case=dict(tp=4, seed=9, batch=2, seq=6, vocab=12, eps=0.3, scale=50.0, upstream=1.0))
@example(case=dict(tp=2, seed=10, batch=1, seq=3, vocab=2, eps=0.1, scale=50.0, upstream=-3.0))
@example(case=dict(tp=4, seed=11, batch=3, seq=5, vocab=4, eps=0.0, scale=50.0, upstream=0.5))
def test_vocab_parallel_cross_entropy_matches_cross_entropy(pools, case):
    losses = pools.run(case["tp"], _rank_cross_entropy, case)
    assert losses == [losses[0]] * case["tp"]  # the same loss on every rank
    assert math.isfinite(losses[0])


# -- 6. parallelize ------------------------------------------------------------------------------


class _Tiny(nn.Module):
    """Embedding (+ position embedding) -> residual MLP -> LayerNorm -> LM head tied to the embedding."""

    def __init__(self, seed: int, vocab: int, dim: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        # eps=1: a LayerNorm over a few features whose values nearly agree divides by a tiny std and
        # amplifies rounding differences (the sums are ordered differently per rank) past fp32 tolerances
        self.norm = nn.LayerNorm(dim, eps=1.0)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        h = h + self.down(torch.tanh(self.up(h)))
        return self.head(self.norm(h))


PLAN = {"wte": "vocab", "wpe": SequenceShard(0), "up": "colwise", "down": "rowwise", "head": "colwise"}
SHARD_DIM = {"wte.weight": 0, "up.weight": 0, "up.bias": 0, "down.weight": 1}  # others replicated
SP_MARKED = {"down.bias", "norm.weight", "norm.bias"}  # replicated, but see a sequence chunk under SP

BAD_PLANS = [
    ({"up": "diagonal"}, ["unknown style", "'diagonal'"]),
    ({"up": None}, ["unknown style"]),
    ({"blocks.*.fc": "colwise"}, ["matches no module", "'blocks.*.fc'"]),
    ({"up": "vocab"}, ["needs an nn.Embedding", "'up'", "Linear"]),
    ({"wte": "rowwise"}, ["needs an nn.Linear", "'wte'", "Embedding"]),
    ({"norm": "colwise"}, ["needs an nn.Linear", "'norm'", "LayerNorm"]),
    ({"wte": "vocab", "head": "rowwise"}, ["share a weight", "different dims"]),  # vocab rows vs input columns
    ({"head": "rowwise", "wte": "vocab"}, ["share a weight", "different dims"]),
]


def _rank_parallelize(ctx, case):
    tp, r, dev = ctx.world_size, ctx.rank, ctx.device
    seed, b, s, vocab, dim, hidden = (case["seed"], case["batch"], case["seq"], case["vocab"], case["dim"],
                                      case["hidden"])
    mesh = _tp_mesh(ctx)
    try:
        make = lambda: _Tiny(seed, vocab, dim, hidden, s).to(dev)  # noqa: E731
        ids = _ids(seed, 1, (b, s), vocab, tp, dev)
        targets = _targets(seed, 2, (b, s), vocab, tp, dev)

        ref = make()
        ref_loss = F.cross_entropy(ref(ids).flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        assert set(ref_grads) == {"wte.weight", "wpe.weight", "up.weight", "up.bias", "down.weight", "down.bias",
                                  "norm.weight", "norm.bias"}  # the tied head is wte.weight

        for sp in (False, True):
            what = f"parallelize(sequence_parallel={sp})"
            model = parallelize(make(), mesh, PLAN, sequence_parallel=sp)
            assert isinstance(model.wte, VocabParallelEmbedding) and isinstance(model.head, ColumnParallelLinear)
            assert isinstance(model.up, ColumnParallelLinear) and isinstance(model.down, RowParallelLinear)
            assert model.head.weight is model.wte.weight, f"{what}: the tie was broken"
            assert isinstance(model.head.weight, nn.Parameter)
            # under SP the position embedding sits inside its SequenceShard wrapper: "wpe.inner.weight"
            params = {n.replace(".inner.", "."): p for n, p in model.named_parameters()}
            assert set(params) == set(ref_grads), (what, sorted(params))
            for n, p in params.items():
                assert placement_of(p).sequence_parallel == (sp and n in SP_MARKED), (what, n)
                assert placement_of(p).tensor_parallel == (n in SHARD_DIM), (what, n)
            logits = model(ids)
            assert tuple(logits.shape) == (b, s, vocab // tp), (what, tuple(logits.shape))
            loss = vocab_parallel_cross_entropy(logits, targets, mesh.comm, mesh.group("tp"), ignore_index=IGNORE)
            _close(loss.detach(), ref_loss.detach(), f"{what} loss")
            loss.backward()
            _sync_sp(model, mesh)
            for n, p in params.items():
                exp = ref_grads[n] if n not in SHARD_DIM else _chunk(ref_grads[n], tp, SHARD_DIM[n], r)
                _close(p.grad, exp, f"{what} grad of {n}")  # wte.weight: embedding + head, summed

        # Bad plans: a ValueError naming the problem, on every rank, before anything is communicated.
        messages = []
        for plan, needles in BAD_PLANS:
            with mesh.comm.counting() as stats:
                with pytest.raises(ValueError) as info:
                    parallelize(make(), mesh, plan)
            assert stats.records == [], (plan, stats.records)
            msg = str(info.value)
            for needle in needles:
                assert needle in msg, (plan, needle, msg)
            messages.append(msg)
        return messages
    finally:
        mesh.destroy()


@st.composite
def _parallelize_cases(draw):
    tp = draw(st.sampled_from(WORLDS))
    return dict(tp=tp, seed=draw(st.integers(0, 2**20)), batch=draw(st.integers(1, 2)),
                seq=tp * draw(st.integers(1, 2)) + (2 if tp == 1 else 0),
                vocab=tp * draw(st.integers(1, 4)), dim=4 * draw(st.integers(1, 2)),
                hidden=tp * draw(st.integers(1, 3)))


@given(case=_parallelize_cases())
@example(case=dict(tp=4, seed=12, batch=2, seq=8, vocab=8, dim=4, hidden=8))
@example(case=dict(tp=2, seed=13, batch=1, seq=4, vocab=6, dim=4, hidden=2))
@example(case=dict(tp=2, seed=2, batch=2, seq=4, vocab=6, dim=4, hidden=6))
def test_parallelize_plan_tied_weights_and_errors(pools, case):
    messages = pools.run(case["tp"], _rank_parallelize, case)
    assert messages == [messages[0]] * case["tp"]  # the same error on every rank


# -- 7. communication volume --------------------------------------------------------------------


def _records(stats):
    return [(rec.op, rec.group, rec.tag, rec.bytes, rec.dtype) for rec in stats.records]


def _rank_counts(ctx, case):
    tp, r, dev = ctx.world_size, ctx.rank, ctx.device
    seed, b, s, fin, fout, vocab = case["seed"], case["batch"], case["seq"], case["fin"], case["fout"], case["vocab"]
    mesh = _tp_mesh(ctx)
    comm = mesh.comm

    def rec(op, elements, tag="tp"):
        return [(op, "tp", tag, elements * F32, torch.float32)] if tp > 1 else []  # a group of one: nothing

    def measure(layer, x, what, fwd_expected, bwd_expected, sp_grad_elements=0):
        with comm.counting() as fwd:
            y = layer(x)
        with comm.counting() as bwd:
            y.backward(torch.ones_like(y))
            _sync_sp(layer, mesh)
        assert _records(fwd) == fwd_expected, (what, "forward", _records(fwd), fwd_expected)
        # the activation collectives (tag "tp"), in order; then the partial gradients of sequence-parallel
        # parameters, summed over tp once (by the explicit sync or by a hook, whatever its tag)
        acts = [rec_ for rec_ in _records(bwd) if rec_[2] == "tp"]
        assert acts == bwd_expected, (what, "backward", _records(bwd), bwd_expected)
        sp = [(op, group, nbytes, dt) for op, group, tag, nbytes, dt in _records(bwd) if tag != "tp"]
        sp_expected = [("all_reduce", "tp", sp_grad_elements * F32, torch.float32)] if tp > 1 and sp_grad_elements \
            else []
        assert sp == sp_expected, (what, "sequence-parallel gradients", _records(bwd), sp_expected)

    try:
        x = _gen(seed, 0, (b, s, fin)).to(dev)
        x_in = _leaf(x)  # replicated input
        x_feat = _leaf(_chunk(x, tp, -1, r))  # features split
        x_seq = _leaf(_chunk(x, tp, 1, r))  # sequence split
        lin_col = _linear(seed, 1, fin, fout, True, dev)
        lin_row = _linear(seed, 3, fin, fout, True, dev)
        act_in, act_out = b * s * fin, b * s * fout  # elements of the full activations

        # column: nothing forward (the input is replicated), one all-reduce of dX backward
        measure(ColumnParallelLinear(lin_col, mesh), x_in, "column", [], rec("all_reduce", act_in))
        measure(ColumnParallelLinear(lin_col, mesh, gather_output=True), x_in, "column(gather_output)",
                rec("all_gather", act_out), rec("all_reduce", act_in))
        # row: one all-reduce of Y forward, nothing backward (or an all-gather of dX for a full input)
        measure(RowParallelLinear(lin_row, mesh), x_feat, "row", rec("all_reduce", act_out), [])
        measure(RowParallelLinear(lin_row, mesh, input_is_parallel=False), x_in, "row(full input)",
                rec("all_reduce", act_out), rec("all_gather", act_in))
        # sequence parallel: the same bytes, as an all-gather and a reduce-scatter
        measure(ColumnParallelLinear(lin_col, mesh, sequence_parallel=True), x_seq, "sp column",
                rec("all_gather", act_in), rec("reduce_scatter", act_in))
        measure(RowParallelLinear(lin_row, mesh, sequence_parallel=True), x_feat, "sp row",
                rec("reduce_scatter", act_out), rec("all_gather", act_out), sp_grad_elements=fout)  # + the bias

        # embedding: all-reduce of the looked-up rows (or reduce-scatter under SP)
        ids = _ids(seed, 5, (b, s), vocab, tp, dev)
        emb = _embedding(seed, 6, vocab, fout, dev)
        measure(VocabParallelEmbedding(emb, mesh), ids, "embedding", rec("all_reduce", act_out), [])
        measure(VocabParallelEmbedding(emb, mesh, sequence_parallel=True), ids, "sp embedding",
                rec("reduce_scatter", act_out), rec("all_gather", act_out))

        # cross-entropy: one all-reduce of the row maxima, one of three (tokens,) sums; never the logits
        logits = _leaf(_gen(seed, 7, (b, s, vocab // tp)))
        targets = _targets(seed, 8, (b, s), vocab, tp, dev)
        with comm.counting() as fwd:
            loss = vocab_parallel_cross_entropy(logits, targets, comm, mesh.group("tp"))
        with comm.counting() as bwd:
            loss.backward()
        tokens = b * s
        assert _records(fwd) == rec("all_reduce", tokens, "tp_ce") + rec("all_reduce", 3 * tokens, "tp_ce"), \
            _records(fwd)
        assert _records(bwd) == [], _records(bwd)
        return True
    finally:
        mesh.destroy()


@st.composite
def _count_cases(draw):
    tp = draw(st.sampled_from(WORLDS))
    return dict(tp=tp, seed=draw(st.integers(0, 2**20)), batch=draw(st.integers(1, 3)),
                seq=tp * draw(st.integers(1, 3)), fin=tp * draw(st.integers(1, 3)),
                fout=tp * draw(st.integers(1, 3)), vocab=tp * draw(st.integers(1, 3)))


@given(case=_count_cases())
@example(case=dict(tp=4, seed=14, batch=3, seq=8, fin=4, fout=12, vocab=8))
@example(case=dict(tp=2, seed=15, batch=1, seq=2, fin=6, fout=2, vocab=2))
def test_tp_layers_communication_volume(pools, case):
    assert pools.run(case["tp"], _rank_counts, case) == [True] * case["tp"]
