"""Async tensor parallelism (collective matmul, minipar.tensor_parallel.collective_matmul): under
sequence parallelism the column-parallel layer's input all-gather and the row-parallel layer's output
reduce-scatter run as rings of tp chunks overlapped with the matmul.

Specification:
* the async layers equal the synchronous ones (outputs, input, weight and bias gradients) for tp 2 and
  4 and any shapes whose sequence tp divides, and move the same bytes (the ring's sends are the
  all-gather's / reduce-scatter's ring-algorithm wire bytes);
* a GPT under tp2 with sequence parallelism and async_comm trained for three AdamW steps with clipping
  that fires equals the single-process GPT (losses, gradients, parameters);
* on every rank each hop's transfer is launched before the matmul it overlaps and waited after it
  (from the comm layer's launches and waits and the chunk matmuls, in call order); a serialised ring
  fails the same check, so it can fail;
* async_comm without sequence parallelism is refused, on every rank, before any collective;
* the planner's exposed-communication model (`minipar.plan.overlap`) on cases worked by hand.

Data: every tensor comes from ``(seed, slot)``, so every rank builds the same full tensors and takes
its piece (as tests/test_tp_layers.py does).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import example, given, strategies as st

import minipar.tensor_parallel.collective_matmul as cm
from minipar import ShardedModule
from minipar.core.mesh import Mesh
from minipar.models import GPT, GPTConfig
from minipar.plan.overlap import exposed_comm_s, tp_matmul_exposed
from minipar.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TensorParallelConfig, clip_grad_norm_,
                                     parallelize, vocab_parallel_cross_entropy)

from conftest import ci_examples
from helpers import EPS, LR, WD, LoggedWork, train_rows
from test_tensor_parallel import _full, _train_reference

TIMEOUT = 180  # seconds per multi-rank call: the machine is shared and sometimes heavily loaded


def _gen(seed: int, slot: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 128 + slot)
    return torch.randn(tuple(shape), generator=g)


def _linear(seed: int, slot: int, fin: int, fout: int, bias: bool) -> nn.Linear:
    lin = nn.Linear(fin, fout, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(_gen(seed, slot, (fout, fin)))
        if bias:
            lin.bias.copy_(_gen(seed, slot + 1, (fout,)))
    return lin


def _run_layer(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, mesh: Mesh) -> dict:
    """Forward, backward with upstream ``dy``: {y, dx, dw, db} and the wire bytes sent per op."""
    x = x.clone().requires_grad_(True)
    with mesh.comm.counting() as stats:
        y = layer(x)
        y.backward(dy)
    return dict(y=y.detach(), dx=x.grad, dw=layer.weight.grad,
                db=None if layer.bias is None else layer.bias.grad,
                wire={op: stats.wire_bytes(op) for op in ("all_gather", "reduce_scatter", "send")})


def _rank_layers(ctx, case):
    """The column- and row-parallel layers, synchronous and async, on this rank's pieces of one input."""
    mesh = Mesh(tp=ctx.world_size)
    n, r = mesh.tp, mesh.group("tp").rank
    b, t, fin, fout, bias, seed = (case[k] for k in ("batch", "seq", "fin", "fout", "bias", "seed"))
    out = {}
    # column-parallel: x (B, T/n, in) the rank's sequence chunk -> y (B, T, out/n)
    x_col = _gen(seed, 10, (b, t, fin)).chunk(n, 1)[r]
    dy_col = _gen(seed, 11, (b, t, fout)).chunk(n, 2)[r]
    # row-parallel: x (B, T, in/n) the rank's feature chunk -> y (B, T/n, out)
    x_row = _gen(seed, 12, (b, t, fin)).chunk(n, 2)[r]
    dy_row = _gen(seed, 13, (b, t, fout)).chunk(n, 1)[r]
    dy_gathered = _gen(seed, 11, (b, t, fout))  # a replicated output: the same upstream gradient on every rank
    for async_comm in (False, True):
        col = ColumnParallelLinear(_linear(seed, 0, fin, fout, bias), mesh, sequence_parallel=True,
                                   async_comm=async_comm)
        row = RowParallelLinear(_linear(seed, 2, fin, fout, bias), mesh, sequence_parallel=True,
                                async_comm=async_comm)
        colg = ColumnParallelLinear(_linear(seed, 0, fin, fout, bias), mesh, gather_output=True, sequence_parallel=True,
                                    async_comm=async_comm)
        out[async_comm] = dict(col=_run_layer(col, x_col, dy_col, mesh), row=_run_layer(row, x_row, dy_row, mesh),
                               colg=_run_layer(colg, x_col, dy_gathered, mesh))
    mesh.destroy()
    return out


@st.composite
def layer_cases(draw):
    tp = draw(st.sampled_from([2, 4]))
    return dict(tp=tp, batch=draw(st.integers(1, 2)), seq=tp * draw(st.integers(1, 3)),
                fin=tp * draw(st.integers(1, 6)), fout=tp * draw(st.integers(1, 6)), bias=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))


@given(case=layer_cases())
@example(case=dict(tp=4, batch=2, seq=8, fin=16, fout=8, bias=True, seed=1))
@example(case=dict(tp=2, batch=1, seq=2, fin=2, fout=2, bias=False, seed=2))
@ci_examples(4)  # the two examples above hold both tp sizes, bias and none, one and several rows per chunk
def test_async_layers_equal_synchronous_layers(pools, case):
    """Outputs and gradients of the async layers (column-parallel, also with its output gathered, and
    row-parallel) equal the synchronous ones. The weight gradient (and
    the column layer's bias gradient) is bit for bit the synchronous one: the same one matmul (sum) over
    the same gathered rows. The rest to fp32 rounding (assert_close's fp32 defaults): a chunk's product
    is the synchronous product's rows, but BLAS rounds a (T/n)-row matmul differently from a T-row one
    (another kernel, another blocking), and at tp = 4 the reduce-scatter sums in ring order. The bytes
    on the wire are the synchronous collectives' ring-algorithm figures."""
    for rank, res in enumerate(pools.run(case["tp"], _rank_layers, case, timeout=TIMEOUT)):
        sync, asyn = res[False], res[True]
        for layer, exact in (("col", ("dw", "db")), ("colg", ("dw", "db")), ("row", ("dw",))):
            for k in ("y", "dx", "dw", "db"):
                a, s = asyn[layer][k], sync[layer][k]
                if s is None:
                    assert a is None
                elif k in exact:
                    assert torch.equal(a, s), (rank, layer, k, (a - s).abs().max())
                else:
                    torch.testing.assert_close(a, s, msg=lambda m: f"rank {rank} {layer} {k}: {m}")
            ring = sync[layer]["wire"]["all_gather"] + sync[layer]["wire"]["reduce_scatter"]
            if layer == "colg":  # the features' all-gather of the output stays; the sequence's is the ring
                ring -= asyn[layer]["wire"]["all_gather"]
                assert asyn[layer]["wire"]["all_gather"] > 0, rank
            else:
                assert asyn[layer]["wire"]["all_gather"] == 0, (rank, layer)
            assert asyn[layer]["wire"]["reduce_scatter"] == 0 and asyn[layer]["wire"]["send"] == ring, (rank, layer)


# -- the whole GPT ---------------------------------------------------------------------


def _train_tp_async(ctx, cfg: dict, data: torch.Tensor, max_norm: float):
    mesh = Mesh(tp=ctx.world_size)
    model = GPT(GPTConfig(**cfg))
    parallelize(model, mesh, model.tp_plan(mesh.tp, sequence_parallel=True), sequence_parallel=True,
                async_comm=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses, norms, grads = [], [], None
    with mesh.comm.counting() as stats:
        for s in range(data.shape[0]):
            x = data[s]
            loss = vocab_parallel_cross_entropy(model(x[:, :-1]), x[:, 1:], mesh.comm, mesh.group("tp"))
            loss.backward()
            if s == data.shape[0] - 1:
                grads = _full(model, mesh, {n: p.grad for n, p in model.named_parameters()})
            norms.append(clip_grad_norm_(model, mesh, max_norm).item())
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    rings = stats.calls("send", tag="tp_gather_mm"), stats.calls("send", tag="tp_mm_scatter")
    params = _full(model, mesh, dict(model.named_parameters()))
    mesh.destroy()
    return losses, norms, grads, params, rings


@pytest.mark.parametrize("tp, variant", [(2, {}), (4, dict(mlp="swiglu", pos="rope", norm="rmsnorm", bias=False,
                                                               tie_weights=False))])
def test_async_tp_gpt_equals_single_process(pools, tp, variant):
    """GPT (2 layers; gelu MLP, learned positions, tied head at tp2; SwiGLU, rotary, RMSNorm, untied head at
    tp4) under sequence parallelism + async_comm: losses, gradient norms, gradients and parameters after
    three AdamW steps with clipping that fires equal the single-process GPT (fp32 defaults, as
    tests/test_tensor_parallel.py); the rings ran (fc or nothing under SwiGLU's entered region, lm_head:
    all-gather-matmul; o_proj, proj: matmul-reduce-scatter)."""
    cfg = dict(vocab_size=20, block_size=8, n_layer=2, n_head=4, n_embd=16, bias=True, tie_weights=True, seed=1)
    cfg.update(variant)
    data = torch.randint(0, cfg["vocab_size"], (3, 2, cfg["block_size"] + 1), generator=torch.Generator().manual_seed(3))
    max_norm = 0.05
    ref = _train_reference(cfg, data, max_norm, 2.0)
    assert max(ref[1]) > max_norm, "clipping must fire for this test to mean anything"
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    for rank, (losses, norms, grads, params, rings) in enumerate(
            pools.run(tp, _train_tp_async, cfg, data, max_norm, timeout=TIMEOUT)):
        assert all(calls > 0 for calls in rings), (rank, rings)
        torch.testing.assert_close(f32(losses), f32(ref[0]), msg=lambda m: f"rank {rank} losses: {m}")
        torch.testing.assert_close(f32(norms), f32(ref[1]), msg=lambda m: f"rank {rank} norms: {m}")
        for name, g in ref[2].items():
            torch.testing.assert_close(grads[name], g, msg=lambda m: f"rank {rank} grad {name}: {m}")
        for name, p in ref[3].items():
            torch.testing.assert_close(params[name], p.detach(), msg=lambda m: f"rank {rank} {name}: {m}")


# -- through the front door -------------------------------------------------------------


def _train_front_door(ctx, cfg: dict, data: torch.Tensor, options: dict):
    mesh = Mesh(dp=2, tp=2)
    model = ShardedModule(GPT(GPTConfig(**cfg)), mesh=mesh, strategy="zero1", sequence_parallel=True, **options)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    with mesh.comm.counting() as stats:
        losses, norms = train_rows(model, opt, data, 0.05)
    rings = stats.calls("send", tag="tp_gather_mm") + stats.calls("send", tag="tp_mm_scatter")
    state = {k: v.float() for k, v in model.full_state_dict().items()}
    mesh.destroy()
    return losses, norms, state, rings


def test_the_front_door_runs_async_tp(pools):
    """``ShardedModule(..., async_comm=True)`` (the flat keyword of ``TensorParallelConfig(async_comm=True)``)
    runs the rings under dp2 x tp2 zero1 with sequence parallelism, and trains as the synchronous layout
    does, which tests/test_composition.py proves equal to one process (fp32 defaults: the ring sums the
    partial products in another order); without it no ring runs."""
    cfg = dict(vocab_size=20, block_size=8, n_layer=2, n_head=4, n_embd=16, seed=1)
    data = torch.randint(0, 20, (3, 4, 9), generator=torch.Generator().manual_seed(4))
    sync = pools.run(4, _train_front_door, cfg, data, {}, timeout=TIMEOUT)
    asyn = pools.run(4, _train_front_door, cfg, data, {"async_comm": True}, timeout=TIMEOUT)
    for rank, ((l0, n0, s0, r0), (l1, n1, s1, r1)) in enumerate(zip(sync, asyn)):
        assert r0 == 0 and r1 > 0, (rank, r0, r1)
        torch.testing.assert_close(torch.tensor(l1), torch.tensor(l0), msg=lambda m: f"rank {rank} losses: {m}")
        torch.testing.assert_close(torch.tensor(n1), torch.tensor(n0), msg=lambda m: f"rank {rank} norms: {m}")
        for k, v in s0.items():
            torch.testing.assert_close(s1[k], v, msg=lambda m: f"rank {rank} {k}: {m}")


# -- the order of launches, computes and waits ---------------------------------------


def _rank_event_logs(ctx, serialise: bool):
    """Each layer's forward and backward with the ring's sends / receives, their waits and the chunk
    matmuls logged in call order: {(layer, phase): [("launch" | "wait", hop, op) | ("compute", step)]}.
    ``serialise``: every hop is waited as soon as it is posted (a ring without overlap)."""
    mesh = Mesh(tp=ctx.world_size)
    comm, n = mesh.comm, mesh.tp
    log: list[tuple] = []
    issued: dict[str, int] = {}

    def logged_p2p(op: str, call):
        def p2p(tensor, peer, grp, async_op=False, tag=None):
            hop = issued.get(op, 0)
            issued[op] = hop + 1
            log.append(("launch", hop, op))
            return LoggedWork(call(tensor, peer, grp, async_op=async_op, tag=tag), log, ("wait", hop, op))
        return p2p

    def logged_matmul(x_chunk, weight, bias, step):
        log.append(("compute", step))
        return matmul(x_chunk, weight, bias, step)

    def serialised_pass(*args):
        for w in ring_pass(*args):
            w.wait()
        return []

    matmul, ring_pass = cm._chunk_matmul, cm.ring_pass
    comm.send, comm.recv = logged_p2p("send", comm.send), logged_p2p("recv", comm.recv)  # this Comm only
    cm._chunk_matmul = logged_matmul
    if serialise:
        cm.ring_pass = serialised_pass
    logs = {}
    try:
        for name, cls in (("col", ColumnParallelLinear), ("row", RowParallelLinear)):
            layer = cls(_linear(0, 0, 8, 8, True), mesh, sequence_parallel=True, async_comm=True)
            # col: (B, T/n, in) a sequence chunk; row: (B, T, in/n) a feature chunk; T = 2n
            x = _gen(0, 1, (1, 2, 8) if name == "col" else (1, 2 * n, 8 // n))
            y = layer(x.requires_grad_(True))
            logs[(name, "forward")] = list(log)
            log.clear()
            issued.clear()
            y.backward(torch.ones_like(y))
            logs[(name, "backward")] = [e for e in log]
            log.clear()
            issued.clear()
    finally:
        cm._chunk_matmul, cm.ring_pass = matmul, ring_pass
        mesh.destroy()
    return logs


def _hops(log: list, n: int, bad: list):
    """(h, its launch positions, its wait positions, pos) for each of the n-1 hops that launched and waited a
    send and a receive; a hop that did not is added to ``bad``. pos(kind, h): where events of hop h are."""
    pos = lambda kind, h: [i for i, e in enumerate(log) if e[0] == kind and e[1] == h]  # noqa: E731
    for h in range(n - 1):
        launches, waits = pos("launch", h), pos("wait", h)
        if len(launches) != 2 or len(waits) != 2:
            bad.append(f"hop {h}: launched {len(launches)}, waited {len(waits)} (want a send and a receive)")
            continue
        yield h, launches, waits, pos


def gather_ring_violations(log: list, n: int) -> list[str]:
    """All-gather-matmul: hop h brings the chunk of step h+1. Its send and receive are launched before
    the matmul of step h, waited after it, and before the matmul of step h+1. n-1 hops, n matmuls."""
    bad = []
    for h, launches, waits, pos in _hops(log, n, bad):
        if max(launches) > min(pos("compute", h)):
            bad.append(f"hop {h}: launched after the matmul it should overlap")
        elif min(waits) < max(pos("compute", h)):
            bad.append(f"hop {h}: waited before the matmul it overlaps ended (serialised)")
        if max(waits) > min(pos("compute", h + 1)):
            bad.append(f"hop {h}: the chunk of step {h + 1} was multiplied before it arrived")
    return bad


def scatter_ring_violations(log: list, n: int) -> list[str]:
    """Matmul-reduce-scatter: hop h carries the running sum made at step h, so it is launched after the
    matmul of step h, and waited after the matmul of step h+1 (which it overlaps), before hop h+1."""
    bad = []
    for h, launches, waits, pos in _hops(log, n, bad):
        if min(launches) < max(pos("compute", h)):
            bad.append(f"hop {h}: launched before its sum was made")
        if min(waits) < max(pos("compute", h + 1)):
            bad.append(f"hop {h}: waited before the matmul it overlaps ended (serialised)")
        if h + 1 < n - 1 and max(waits) > min(pos("launch", h + 1)):
            bad.append(f"hop {h + 1}: launched before the sum it carries arrived")
    return bad


_CHECKS = {("col", "forward"): gather_ring_violations, ("col", "backward"): scatter_ring_violations,
           ("row", "forward"): scatter_ring_violations, ("row", "backward"): gather_ring_violations}


@pytest.mark.parametrize("tp", [2, 4])
def test_each_hop_overlaps_a_chunk_matmul(pools, tp):
    """On every rank, forward and backward of both layers, in the order the calls are made: the
    all-gather ring launches the transfer of chunk k+1 before chunk k's matmul and waits for it after
    (and before multiplying it); the reduce-scatter ring sends chunk k's running sum after making it
    and waits for it after the matmul of chunk k+1. n matmuls and n-1 hops each way. This is the
    order of calls; whether bytes move meanwhile is the backend's business (gloo's p2p runs on its own
    threads, NCCL on its stream)."""
    for rank, logs in enumerate(pools.run(tp, _rank_event_logs, False, timeout=TIMEOUT)):
        for key, log in logs.items():
            assert [e[1] for e in log if e[0] == "compute"] == list(range(tp)), (rank, key, log)
            assert _CHECKS[key](log, tp) == [], (rank, key, log)


def test_order_check_rejects_a_serialised_ring(pools):
    """The same layers with each hop waited as soon as it is launched: the checks above call every hop
    serialised, so they can fail."""
    tp = 2
    for rank, logs in enumerate(pools.run(tp, _rank_event_logs, True, timeout=TIMEOUT)):
        for key, log in logs.items():
            assert _CHECKS[key](log, tp) == ["hop 0: waited before the matmul it overlaps ended (serialised)"], \
                (rank, key, log)


# -- refusals --------------------------------------------------------------------------


def test_async_without_sequence_parallel_is_refused():
    with pytest.raises(ValueError, match="async_comm=True .* needs sequence_parallel=True"):
        TensorParallelConfig(async_comm=True)
    with pytest.raises(ValueError, match="must be True or False"):
        TensorParallelConfig(sequence_parallel=True, async_comm=1)
    assert TensorParallelConfig(sequence_parallel=True, async_comm=True).async_comm


def _rank_refusal(ctx):
    mesh = Mesh(tp=ctx.world_size)
    model = GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=2, n_embd=8))
    errors = []
    with mesh.comm.counting() as stats:
        row = RowParallelLinear(nn.Linear(4, 4), mesh, sequence_parallel=True, async_comm=True)
        try:
            row(torch.zeros(1, 3, 2))  # a sequence of 3 over tp = 2
        except ValueError as e:
            errors.append(str(e))
        for build in (lambda: parallelize(model, mesh, model.tp_plan(2), async_comm=True),
                      lambda: ColumnParallelLinear(nn.Linear(4, 4), mesh, async_comm=True),
                      lambda: RowParallelLinear(nn.Linear(4, 4), mesh, async_comm=True)):
            try:
                build()
            except ValueError as e:
                errors.append(str(e))
    mesh.destroy()
    return errors, stats.calls()


def test_async_without_sequence_parallel_is_refused_on_every_rank(pools):
    """parallelize and both layers refuse async_comm without sequence parallelism on every rank, before
    any collective, saying the fix; so does the row-parallel ring given a sequence tp does not divide."""
    for rank, (errors, calls) in enumerate(pools.run(2, _rank_refusal, timeout=TIMEOUT)):
        assert len(errors) == 4 and "not divisible by tp=2" in errors[0], (rank, errors)
        assert all("pass sequence_parallel=True or async_comm=False" in e for e in errors[1:]), (rank, errors)
        assert calls == 0, rank


def _rank_fp8_async(ctx):
    """An async column- and row-parallel layer converted to FP8: which collectives one forward and backward issue."""
    from minipar.fp8 import Float8Config, apply_fp8
    mesh = Mesh(tp=ctx.world_size)
    layers = nn.Sequential(ColumnParallelLinear(_linear(0, 0, 32, 64, False), mesh, sequence_parallel=True,
                                                async_comm=True),
                           RowParallelLinear(_linear(0, 2, 64, 32, False), mesh, sequence_parallel=True,
                                             async_comm=True))
    apply_fp8(layers, Float8Config())
    with mesh.comm.counting() as stats:
        layers(_gen(0, 4, (1, 16, 32)).requires_grad_(True)).sum().backward()
    mesh.destroy()
    return {op: stats.calls(op) for op in ("all_gather", "reduce_scatter", "send")}


def test_fp8_layers_keep_the_synchronous_collectives(pools):
    """An FP8 layer takes over its layer's F.linear for the whole input (one scale per tensor) and has its
    own backward, so under async_comm it keeps the synchronous all-gather and reduce-scatter (no ring):
    the same function as FP8 without async_comm, not a chunk-by-chunk rescaling."""
    for rank, calls in enumerate(pools.run(2, _rank_fp8_async, timeout=TIMEOUT)):
        assert calls["send"] == 0 and calls["all_gather"] == 2 and calls["reduce_scatter"] == 2, (rank, calls)


# -- the planner's model of the overlap ------------------------------------------------


def test_overlap_model_on_cases_worked_by_hand():
    """Exposed communication of n chunks, each hop a transfer of c seconds overlapped with a chunk
    matmul of m: every one of the n-1 hops shows max(0, c - m) (the all-gather ring starts with the
    rank's own chunk, the reduce-scatter ring ends with it); without overlap all n-1 hops show."""
    assert exposed_comm_s(chunks=4, comm_chunk_s=1.0, compute_chunk_s=2.0) == 0.0  # compute-bound: all hidden
    assert exposed_comm_s(chunks=4, comm_chunk_s=3.0, compute_chunk_s=2.0) == 3 * 1.0  # comm-bound: the excess
    assert exposed_comm_s(chunks=4, comm_chunk_s=3.0, compute_chunk_s=2.0, overlap=False) == 9.0
    assert exposed_comm_s(chunks=1, comm_chunk_s=3.0, compute_chunk_s=2.0) == 0.0  # tp = 1: nothing to move
    # a whole layer: a hop is (T/tp, in) for the column layer, (T/tp, out) for the row layer; a chunk
    # matmul 2 (T/tp) in out / tp FLOPs
    kw = dict(tokens=1024, in_features=1024, out_features=4096, tp=4, bytes_per_element=2, flops_per_s=1e12)
    compute_chunk = 2 * 1024 / 4 * 1024 * 4096 / 4 / 1e12
    for bw in (1e10, 1e8):  # compute-bound, then comm-bound
        for layer, feats in (("column", 1024), ("row", 4096)):
            comm_chunk = 1024 / 4 * feats * 2 / bw
            sync = tp_matmul_exposed(**kw, bytes_per_s=bw, overlap=False, layer=layer)
            overlapped = tp_matmul_exposed(**kw, bytes_per_s=bw, layer=layer)
            assert sync == pytest.approx(3 * comm_chunk)
            assert overlapped == pytest.approx(3 * max(0.0, comm_chunk - compute_chunk))
            assert overlapped < sync
    with pytest.raises(ValueError, match="use 'column'"):
        tp_matmul_exposed(**kw, bytes_per_s=1e9, layer="rowwise")
