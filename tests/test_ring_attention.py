"""Context parallelism's numerical core (minipar.context_parallel.ring_attention), each piece against a single-process
reference: block attention against a masked softmax; ring attention (zig-zag split) and Ulysses
attention (contiguous split) at cp in {2, 4} against causal SDPA on the whole sequence, forward and
the gradients of q, k, v; the bytes each one sends, counted by the collective layer; the work each
rank does (equal under zig-zag, and no fully masked block ever computed).

Data. Every tensor comes from ``(seed, slot)``, so every rank builds the same full q, k, v and
upstream gradient (B, H, T, D), takes the rows at its positions, runs the distributed attention and
returns its output and gradients. The test process computes the reference once on the full sequence
and compares each rank's rows with the reference's rows at that rank's positions.

The world is the cp group: ``Mesh()`` over the world, ``mesh.world`` as the group, ``mesh.comm`` as comm.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st
from torch.testing import assert_close

import minipar.context_parallel.ring_attention as ra
from minipar.core.comm import AxisGroup, Comm
from minipar.plan.model_traffic import ring_bytes
from minipar.core.mesh import Mesh
from minipar.context_parallel.ring_attention import (block_attention, contiguous_positions, ring_attention, score_elements,
                                    ulysses_attention, zigzag_positions)

from helpers import LoggedWork

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TIMEOUT = 180  # seconds per multi-rank call: the machine is shared and sometimes heavily loaded


def _gen(seed: int, slot: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 64 + slot)
    return torch.randn(tuple(shape), generator=g)


def _full(case) -> list[torch.Tensor]:
    """q, k, v, dout of the whole sequence: (B, H, T, D) each, different in every batch row and head."""
    shape = (case["batch"], case["heads"], case["seq"], case["head_dim"])
    return [_gen(case["seed"], slot, shape) for slot in range(4)]


def _reference(case, dtype=torch.float32):
    """Single-process causal SDPA on the full sequence (fp32, from the inputs rounded to ``dtype``):
    the output and the gradients of <dout, out> with respect to q, k, v."""
    q, k, v, dout = (t.to(dtype).float() for t in _full(case))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=case["scale"])
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _rank_attention(ctx, kind: str, case, dtype_name: str):
    """This rank's rows of q, k, v -> (out, dq, dk, dv, forward records, backward records, the score
    elements computed forward and backward); records are (op, tag, bytes)."""
    dtype = DTYPES[dtype_name]
    mesh = Mesh()
    try:
        cp, r, seq = mesh.world.size, mesh.world.rank, case["seq"]
        pos = (zigzag_positions if kind == "ring" else contiguous_positions)(seq, cp, r)
        q, k, v, dout = (t.index_select(2, pos).to(dtype) for t in _full(case))
        q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
        computed = []
        scores = ra._scores

        def counting_scores(qb, kb, *args):  # how many score elements each block computes
            computed.append(qb.shape[0] * qb.shape[1] * qb.shape[2] * kb.shape[2])
            return scores(qb, kb, *args)

        ra._scores = counting_scores
        try:
            with mesh.comm.counting() as fwd:
                if kind == "ring":
                    out = ring_attention(q, k, v, mesh.comm, mesh.world, seq, scale=case["scale"])
                else:
                    out = ulysses_attention(q, k, v, mesh.comm, mesh.world, scale=case["scale"])
            work_fwd = sum(computed)
            with mesh.comm.counting() as bwd:
                out.backward(dout)
            work_bwd = sum(computed) - work_fwd
        finally:
            ra._scores = scores
        assert out.dtype == dtype and out.shape == q.shape
        recs = lambda stats: [(rec.op, rec.tag, rec.bytes) for rec in stats.records]  # noqa: E731
        return (out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float(),
                recs(fwd), recs(bwd), work_fwd, work_bwd)
    finally:
        mesh.destroy()


def _compare(kind: str, results, case, atol=1e-5, rtol=1e-5) -> None:
    ref = _reference(case)
    cp = len(results)
    for r, res in enumerate(results):
        pos = (zigzag_positions if kind == "ring" else contiguous_positions)(case["seq"], cp, r)
        for name, got, want in zip(("out", "dq", "dk", "dv"), res[:4], ref):
            assert_close(got, want.index_select(2, pos), atol=atol, rtol=rtol,
                         msg=lambda s: f"{kind} cp={cp} rank {r} {name}: {s}")


# -- 1. block attention, one process -----------------------------------------------------------


def _masked_softmax_reference(q, k, v, q_pos, k_pos, scale):
    """Row by row in float64: softmax over the visible keys (k_pos <= q_pos), out = Σ p v."""
    B, H, Tq, D = q.shape
    out, lse = torch.zeros(B, H, Tq, D, dtype=torch.float64), torch.full((B, H, Tq), -math.inf, dtype=torch.float64)
    for i in range(Tq):
        seen = k_pos <= q_pos[i]
        if seen.any():
            s = (q[:, :, i:i + 1].double() @ k[:, :, seen].double().transpose(-2, -1)).squeeze(-2) * scale
            m = s.max(-1, keepdim=True).values
            e = (s - m).exp()
            lse[:, :, i] = (m + e.sum(-1, keepdim=True).log()).squeeze(-1)
            out[:, :, i] = ((e / e.sum(-1, keepdim=True)).unsqueeze(-2) @ v[:, :, seen].double()).squeeze(-2)
    return out, lse


@settings(max_examples=25)
@given(b=st.integers(1, 2), h=st.integers(1, 3), tq=st.integers(1, 6), tk=st.integers(1, 6), d=st.integers(1, 5),
       seed=st.integers(0, 2**16), scale=st.sampled_from([0.25, 1.0, 2.0]))
def test_block_attention_equals_masked_softmax(b, h, tq, tk, d, seed, scale):
    """Arbitrary (unsorted, repeated) positions; the first query sees no key at all: out 0, lse -inf."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for n in (tq, tk, tk))
    k_pos = torch.randint(0, 10, (tk,), generator=g)
    q_pos = torch.randint(0, 10, (tq,), generator=g)
    q_pos[0] = int(k_pos.min()) - 1  # a row with no visible key
    out, lse = block_attention(q, k, v, q_pos, k_pos, scale)
    ref_out, ref_lse = _masked_softmax_reference(q, k, v, q_pos, k_pos, scale)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert (out[:, :, 0] == 0).all() and (lse[:, :, 0] == -math.inf).all()
    assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    out16, lse16 = block_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), q_pos, k_pos, scale)
    assert out16.dtype == torch.bfloat16 and lse16.dtype == torch.float32


def test_one_rank_is_plain_causal_attention():
    """cp = 1 (a group of one): ring and Ulysses attention are causal SDPA, any length, and send nothing."""
    comm, group = Comm(), AxisGroup("world", (0,), 0, None)
    case = dict(seed=7, batch=2, heads=3, seq=7, head_dim=4, scale=None)
    ref = _reference(case)
    for fn in (lambda q, k, v: ring_attention(q, k, v, comm, group, case["seq"]),
               lambda q, k, v: ulysses_attention(q, k, v, comm, group)):
        q, k, v, dout = _full(case)
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        with comm.counting() as stats:
            out = fn(q, k, v)
            out.backward(dout)
        assert stats.records == []
        for got, want in zip((out.detach(), q.grad, k.grad, v.grad), ref):
            assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- 2. ring attention equals causal attention on the whole sequence -------------------------------


@st.composite
def _ring_cases(draw):
    cp = draw(st.sampled_from([2, 4]))
    return dict(cp=cp, seed=draw(st.integers(0, 2**16)), batch=draw(st.integers(1, 2)),
                heads=draw(st.integers(1, 3)), head_dim=draw(st.integers(1, 8)),
                seq=2 * cp * draw(st.integers(1, 4)), scale=draw(st.sampled_from([None, 0.3])))


@settings(max_examples=10)
@given(case=_ring_cases())
@example(case=dict(cp=4, seed=1, batch=2, heads=3, head_dim=5, seq=24, scale=None))
@example(case=dict(cp=2, seed=2, batch=1, heads=2, head_dim=8, seq=4, scale=0.3))
def test_ring_attention_equals_causal_attention(pools, case):
    """For any shapes and cp in {2, 4}: each rank's output and q/k/v gradients are the reference's
    rows at its zig-zag positions."""
    _compare("ring", pools.run(case["cp"], _rank_attention, "ring", case, "fp32", timeout=TIMEOUT), case)


def test_ring_attention_bf16_is_close_to_fp32(pools):
    """bf16 inputs (scores and accumulators fp32 inside, K/V and dK/dV sent in bf16): the output and the
    gradients are within bf16's tolerance of the fp32 reference on the same (rounded) inputs."""
    case = dict(seed=11, batch=2, heads=2, seq=32, head_dim=16, scale=None)
    ref = _reference(case, torch.bfloat16)
    results = pools.run(4, _rank_attention, "ring", case, "bf16", timeout=TIMEOUT)
    for r, res in enumerate(results):
        pos = zigzag_positions(case["seq"], 4, r)
        assert_close(res[0], ref[0].index_select(2, pos), atol=2e-2, rtol=1.6e-2)
        for got, want in zip(res[1:4], ref[1:]):
            want = want.index_select(2, pos)
            assert (got - want).norm() <= 2e-2 * want.norm(), (r, float((got - want).norm() / want.norm()))


# -- 3. Ulysses attention --------------------------------------------------------------------------


@st.composite
def _ulysses_cases(draw):
    cp = draw(st.sampled_from([2, 4]))
    return dict(cp=cp, seed=draw(st.integers(0, 2**16)), batch=draw(st.integers(1, 2)),
                heads=cp * draw(st.integers(1, 2)), head_dim=draw(st.integers(1, 8)),
                seq=cp * draw(st.integers(1, 5)), scale=draw(st.sampled_from([None, 0.3])))


@settings(max_examples=10)
@given(case=_ulysses_cases())
@example(case=dict(cp=4, seed=3, batch=2, heads=8, head_dim=3, seq=12, scale=None))
@example(case=dict(cp=2, seed=4, batch=1, heads=2, head_dim=4, seq=2, scale=0.3))
def test_ulysses_attention_equals_causal_attention(pools, case):
    """For any shapes and cp in {2, 4} (heads a multiple of cp): each rank's output and q/k/v gradients
    are the reference's rows at its contiguous positions."""
    _compare("ulysses", pools.run(case["cp"], _rank_attention, "ulysses", case, "fp32", timeout=TIMEOUT), case)


def _rank_ulysses_bad_heads(ctx, heads: int):
    mesh = Mesh()
    try:
        q = torch.randn(1, heads, 2, 4)
        with mesh.comm.counting() as stats:
            with pytest.raises(ValueError) as err:
                ulysses_attention(q, q, q, mesh.comm, mesh.world)
        return str(err.value), len(stats.records)
    finally:
        mesh.destroy()


@pytest.mark.parametrize("cp,heads", [(2, 3), (4, 6)])
def test_ulysses_heads_not_divisible_raise_before_any_collective(pools, cp, heads):
    for msg, records in pools.run(cp, _rank_ulysses_bad_heads, heads, timeout=TIMEOUT):
        assert "heads must divide by cp" in msg and "tensor parallelism" in msg
        assert records == 0


def test_ring_attention_bad_lengths_raise_before_any_collective():
    """A sequence 2 * cp does not divide, or q holding the wrong number of tokens: ValueError, nothing sent
    (a group of two that is never used: the error must come first)."""
    comm, group = Comm(), AxisGroup("world", (0, 1), 0, None)
    with comm.counting() as stats:
        with pytest.raises(ValueError, match="multiple of 4"):
            t = torch.randn(1, 1, 3, 2)
            ring_attention(t, t, t, comm, group, seq_len=6)
        with pytest.raises(ValueError, match="tokens"):
            t = torch.randn(1, 1, 4, 2)
            ring_attention(t, t, t, comm, group, seq_len=4)
    assert stats.records == []


# -- 4. what each one sends ------------------------------------------------------------------------


@pytest.mark.parametrize("cp,dtype_name", [(2, "fp32"), (4, "fp32"), (4, "bf16")])
def test_ring_attention_sends_ring_bytes(pools, cp, dtype_name):
    """Forward: C-1 hops of K/V; backward: C-1 hops of K/V and C of dK/dV. Every send is matched by a
    receive of the same size, and the counted bytes are exactly ``ring_bytes``."""
    case = dict(seed=5, batch=2, heads=3, seq=4 * cp, head_dim=5, scale=None)
    expected = ring_bytes(case["batch"], case["heads"], case["seq"], case["head_dim"], cp, DTYPES[dtype_name])
    block = case["batch"] * case["heads"] * (case["seq"] // cp) * case["head_dim"] * DTYPES[dtype_name].itemsize
    assert expected == {"forward": (cp - 1) * 2 * block, "backward": (2 * cp - 1) * 2 * block}
    for res in pools.run(cp, _rank_attention, "ring", case, dtype_name, timeout=TIMEOUT):
        fwd, bwd = res[4], res[5]
        for phase, recs in (("forward", fwd), ("backward", bwd)):
            sends = [b for op, _, b in recs if op == "send"]
            recvs = [b for op, _, b in recs if op == "recv"]
            assert {op for op, _, _ in recs} == {"send", "recv"}
            assert sum(sends) == expected[phase] and sorted(sends) == sorted(recvs)
        assert [t for op, t, _ in fwd if op == "send"] == ["cp_kv"] * (cp - 1)
        bwd_tags = [t for op, t, _ in bwd if op == "send"]
        assert bwd_tags.count("cp_kv") == cp - 1 and bwd_tags.count("cp_kv_grad") == cp


@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_sends_four_all_to_alls_each_way(pools, cp):
    """Forward: q, k, v to heads and the output back; backward: the same four, reversed. Each moves
    this rank's whole (B, H, T/C, D) tensor: B·H·(T/C)·D·4 bytes."""
    case = dict(seed=6, batch=2, heads=2 * cp, seq=3 * cp, head_dim=4, scale=None)
    each = case["batch"] * case["heads"] * (case["seq"] // cp) * case["head_dim"] * 4
    for res in pools.run(cp, _rank_attention, "ulysses", case, "fp32", timeout=TIMEOUT):
        for recs in res[4:6]:
            assert [(op, b) for op, _, b in recs] == [("all_to_all", each)] * 4


# -- 5. balance ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_zigzag_balances_the_causal_work(cp, chunk):
    """Zig-zag: every rank leaves the same number of scores unmasked; contiguous: the last rank about
    2C-1 times the first. Either way the ranks together cover the causal triangle T(T+1)/2 once."""
    seq = 2 * cp * chunk
    zig = [score_elements(seq, cp, r, "zigzag") for r in range(cp)]
    con = [score_elements(seq, cp, r, "contiguous") for r in range(cp)]
    assert max(zig) == min(zig)
    # contiguous, m = T/C tokens a rank: first m(m+1)/2, last (C-1)m² + m(m+1)/2, a ratio of
    # 1 + 2(C-1)m/(m+1), which tends to 2C-1 as m grows
    m = seq // cp
    assert math.isclose(con[-1] / con[0], 1 + 2 * (cp - 1) * m / (m + 1))
    if m >= 4:
        assert con[-1] / con[0] > 1.5 * cp - 1
    assert sum(zig) == sum(con) == seq * (seq + 1) // 2
    with pytest.raises(ValueError, match="split"):
        score_elements(seq, cp, 0, "striped")


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_computes_no_masked_block_and_equal_work(pools, cp):
    """The scores each rank actually computes: its unmasked ones plus the masked upper triangles of its
    two diagonal chunk blocks, n(n-1) with n = T/(2C), and nothing more (a fully masked block never
    computed); the same on every rank, and the same again in the backward."""
    n = 5
    case = dict(seed=8, batch=1, heads=2, seq=2 * cp * n, head_dim=3, scale=None)
    for r, res in enumerate(pools.run(cp, _rank_attention, "ring", case, "fp32", timeout=TIMEOUT)):
        per_head = score_elements(case["seq"], cp, r, "zigzag") + n * (n - 1)
        assert res[6] == res[7] == case["batch"] * case["heads"] * per_head, (r, res[6], res[7])


# -- 6. positions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_positions_partition_the_sequence(cp, chunk):
    """The ranks' zig-zag (and contiguous) positions together are a permutation of range(T); rank r
    holds chunks r and 2C-1-r of 2C, in that order."""
    seq = 2 * cp * chunk
    for split in (zigzag_positions, contiguous_positions):
        got = [split(seq, cp, r) for r in range(cp)]
        assert all(p.dtype == torch.int64 and p.shape == (seq // cp,) for p in got)
        assert sorted(torch.cat(got).tolist()) == list(range(seq))
    for r in range(cp):
        chunks = zigzag_positions(seq, cp, r).view(2, chunk)[:, 0] // chunk
        assert chunks.tolist() == [r, 2 * cp - 1 - r]


@pytest.mark.parametrize("seq,cp", [(6, 2), (4, 4), (7, 1), (10, 4)])
def test_positions_refuse_a_sequence_that_does_not_split(seq, cp):
    with pytest.raises(ValueError, match=f"multiple of {2 * cp}"):
        zigzag_positions(seq, cp, 0)
    if seq % cp:
        with pytest.raises(ValueError, match=f"multiple of {cp}"):
            contiguous_positions(seq, cp, 0)


# -- 7. overlap: each hop's transfer is in flight while the block in hand is computed -------------
#
# Each rank keeps an ordered event log of its ring: ("launch" | "wait", tag, hop, "send" | "recv") from the
# collective layer (the p2p call and ``wait()`` of the handle it returns) and ("compute", fn, hop, None)
# from the block kernels `_attend` (forward) and `_attend_backward`. Launches and waits are numbered by
# issue order per (tag, op): the n-th "cp_kv" send of a phase is hop n. A compute is numbered by the keys
# it reads: their chunk says whose K/V block it is (src), and the block of src is in hand at hop (r - src) % C.


def _kv_overlap_violations(log: list[tuple], cp: int, tag: str = "cp_kv") -> list[str]:
    """What is wrong with the K/V hops of one phase's log; [] when, for every hop i < C-1, the hop's send and
    receive are launched before the first compute on block i, waited only after its last compute, and
    waited before block i+1 is computed on; C-1 hops in all, and a compute at every one of the C hops."""
    at = lambda kind, hop, t=None: [j for j, e in enumerate(log)  # noqa: E731
                                    if e[0] == kind and e[2] == hop and (t is None or e[1] == t)]
    bad = [f"hop {h}: no compute" for h in range(cp) if not at("compute", h)]
    if bad:
        return bad
    for h in range(cp - 1):
        launches, waits = at("launch", h, tag), at("wait", h, tag)
        computes, nxt = at("compute", h), at("compute", h + 1)
        unpaired = [f"hop {h}: {what} {[log[j][3] for j in idx]}, not one send and one recv"
                    for what, idx in (("launched", launches), ("waited", waits))
                    if sorted(log[j][3] for j in idx) != ["recv", "send"]]
        if unpaired:
            bad += unpaired
            continue
        if max(launches) > min(computes):
            bad.append(f"hop {h}: transfer launched after the compute on the block in hand began")
        if min(waits) < max(computes):
            bad.append(f"hop {h}: transfer waited before the compute on the block in hand ended (serialised)")
        if max(waits) > min(nxt):
            bad.append(f"hop {h}: the next block was computed on before its transfer was waited")
    if at("launch", cp - 1, tag):
        bad.append(f"a hop {cp - 1}: K/V sent {cp} times, the ring needs {cp - 1}")
    return bad


def _accumulator_violations(log: list[tuple], cp: int, tag: str = "cp_kv_grad") -> list[str]:
    """The backward's dK/dV accumulator, C hops: at hop i one send and one recv, each waited once; the send
    launched after the last compute of hop i (it carries that block's contribution); the accumulator
    received at hop i waited only after the compute of hop i+1 (its transfer overlaps that compute) and
    before it is sent on at hop i+1."""
    at = lambda kind, hop, op=None: [j for j, e in enumerate(log) if e[:3] == (kind, tag, hop)  # noqa: E731
                                     and (op is None or e[3] == op)]
    bad = [f"accumulator hop {h}: {kind}es are not one send and one recv" for h in range(cp)
           for kind in ("launch", "wait") if sorted(log[j][3] for j in at(kind, h)) != ["recv", "send"]]
    if bad:
        return bad
    for h in range(cp):
        computes = [j for j, e in enumerate(log) if e[0] == "compute" and e[2] == h]
        if min(at("launch", h, "send")) < max(computes):
            bad.append(f"accumulator hop {h}: sent before its block's compute ended")
        if h + 1 < cp and max(at("wait", h, "recv")) > min(at("launch", h + 1, "send")):
            bad.append(f"accumulator hop {h}: sent on before it was received")
        nxt = [j for j, e in enumerate(log) if e[0] == "compute" and e[2] == h + 1]
        if nxt and min(at("wait", h)) < max(nxt):
            bad.append(f"accumulator hop {h}: waited before the compute of hop {h + 1} ended (exposed)")
    if any(e[0] == "launch" and e[1] == tag and e[2] >= cp for e in log):
        bad.append(f"accumulator sent more than {cp} times")
    return bad


def _rank_ring_event_logs(ctx, cp_seq: int, serialise: bool):
    """Ring attention forward and backward with the p2p calls, their waits and the block kernels logged:
    (forward log, backward log). ``serialise``: `ring_pass` waits its transfers before returning (what
    a ring without overlap does), to show the logs and checks can see the difference."""
    mesh = Mesh()
    comm, group = mesh.comm, mesh.world
    C, r = group.size, group.rank
    n = cp_seq // (2 * C)
    log: list[tuple] = []
    issued: dict[tuple, int] = {}

    def hop_of(k_pos: torch.Tensor) -> int:
        b = int(k_pos[0]) // n  # the key chunk, of 2C; its owner holds chunks src and 2C-1-src
        return (r - (b if b < C else 2 * C - 1 - b)) % C

    def logged_p2p(op: str, call):
        def p2p(tensor, peer, grp, async_op=False, tag=None):
            hop = issued.get((op, tag), 0)
            issued[(op, tag)] = hop + 1
            log.append(("launch", tag, hop, op))
            return LoggedWork(call(tensor, peer, grp, async_op=async_op, tag=tag), log, ("wait", tag, hop, op))
        return p2p

    def logged_kernel(name: str, kernel, k_pos_at: int):
        def run(*args):
            log.append(("compute", name, hop_of(args[k_pos_at]), None))
            return kernel(*args)
        return run

    def serialised_pass(*args):  # the same hop, but waited at once: no overlap
        for w in ring_pass(*args):
            w.wait()
        return []

    attend, attend_backward, ring_pass = ra._attend, ra._attend_backward, ra.ring_pass
    comm.send, comm.recv = logged_p2p("send", comm.send), logged_p2p("recv", comm.recv)  # this Comm only
    ra._attend = logged_kernel("attend", attend, 4)  # (q, k, v, q_pos, k_pos, scale, masked)
    ra._attend_backward = logged_kernel("attend_backward", attend_backward, 7)  # (q, k, v, do, lse, Δ, q_pos, k_pos,...
    if serialise:
        ra.ring_pass = serialised_pass
    try:
        q, k, v, dout = (_gen(3, slot, (1, 2, cp_seq, 4)).index_select(2, zigzag_positions(cp_seq, C, r))
                         for slot in range(4))
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        out = ring_attention(q, k, v, comm, group, cp_seq)
        fwd = list(log)
        log.clear()
        issued.clear()
        out.backward(dout)
        return fwd, list(log)
    finally:
        ra._attend, ra._attend_backward, ra.ring_pass = attend, attend_backward, ring_pass
        mesh.destroy()


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_overlaps_each_hop_with_compute(pools, cp):
    """Ring attention hides each K/V transfer behind the compute on the block in hand, forward and backward.

    On every rank, for every hop i < C-1, in the order the calls are made: the send of the block in hand
    to r+1 and the receive of the next one from r-1 are launched (async) before the first block kernel on
    the block in hand, and their handles are waited only after its last block kernel, and before the
    received block is computed on. Exactly C-1 K/V hops each way, every handle waited once.

    The backward's dK/dV accumulator (C hops, the last one home) is the output of hop i's compute, so it
    can only leave after it; checked: it does, it is in flight during the compute of hop i+1 (the rank
    computes its part of that block's dK/dV first, then waits and adds), and it is waited before it is
    sent on. This is the order calls are issued; whether bytes move meanwhile is the backend's business
    (gloo runs isend/irecv on its own threads).
    """
    for r, (fwd, bwd) in enumerate(pools.run(cp, _rank_ring_event_logs, 4 * cp, False, timeout=TIMEOUT)):
        assert _kv_overlap_violations(fwd, cp) == [], (r, "forward", fwd)
        assert [e for e in fwd if e[1] not in ("cp_kv", "attend")] == [], (r, fwd)
        assert _kv_overlap_violations(bwd, cp) == [], (r, "backward", bwd)
        assert _accumulator_violations(bwd, cp) == [], (r, "backward", bwd)
        assert [e for e in bwd if e[1] not in ("cp_kv", "cp_kv_grad", "attend_backward")] == [], (r, bwd)


@pytest.mark.parametrize("cp", [2, 4])
def test_overlap_check_rejects_a_serialised_ring(pools, cp):
    """The same run with each hop waited as soon as it is launched (before the compute): the checks above
    reject every K/V hop of every rank, forward and backward, and every accumulator hop but the last
    (home) as exposed, so they can fail."""
    for r, (fwd, bwd) in enumerate(pools.run(cp, _rank_ring_event_logs, 4 * cp, True, timeout=TIMEOUT)):
        for phase, log in (("forward", fwd), ("backward", bwd)):
            bad = _kv_overlap_violations(log, cp)
            assert bad == [f"hop {h}: transfer waited before the compute on the block in hand ended (serialised)"
                           for h in range(cp - 1)], (r, phase, bad)
        bad = _accumulator_violations(bwd, cp)
        assert bad == [f"accumulator hop {h}: waited before the compute of hop {h + 1} ended (exposed)"
                       for h in range(cp - 1)], (r, bad)


_GOOD = [  # C = 2, overlapped: launch, compute, wait, compute
    ("launch", "cp_kv", 0, "send"), ("launch", "cp_kv", 0, "recv"), ("compute", "attend", 0, None),
    ("wait", "cp_kv", 0, "send"), ("wait", "cp_kv", 0, "recv"), ("compute", "attend", 1, None)]


@pytest.mark.parametrize("log,problem", [
    (_GOOD, None),
    ([_GOOD[0], _GOOD[1], _GOOD[3], _GOOD[4], _GOOD[2], _GOOD[5]], "waited before the compute"),
    ([_GOOD[2], _GOOD[0], _GOOD[1], _GOOD[3], _GOOD[4], _GOOD[5]], "launched after the compute"),
    ([_GOOD[0], _GOOD[1], _GOOD[2], _GOOD[3], _GOOD[5], _GOOD[4]], "computed on before its transfer"),
    (_GOOD[:4] + _GOOD[5:], "not one send and one recv"),
    (_GOOD[:5], "hop 1: no compute"),
])
def test_overlap_check_on_hand_written_logs(log, problem):
    """The check itself, cp = 2: the overlapped order passes; a wait moved before the compute, a launch
    after it, a wait after the next compute, a missing wait, a missing hop are each rejected."""
    bad = _kv_overlap_violations(log, 2)
    if problem is None:
        assert bad == []
    else:
        assert any(problem in b for b in bad), bad
