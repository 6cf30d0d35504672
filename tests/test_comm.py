"""The collective layer (minipar.core.comm), the mesh groups (minipar.core.mesh) and the
autograd-aware conjugate collectives (minipar.core.regions), each checked against a
reference that every rank computes from every rank's input.

Data. Every tensor is generated from ``(seed, slot, owner)``: ``owner`` is the
rank that holds it (or ``SHARED``: the same tensor on every rank), so each rank
holds different data and can still regenerate what any other rank holds.

Regions. The reference is the single-process program, in which a *replicated*
tensor (the same on every rank of the group) is one logical tensor. So
``copy_to_region`` and ``scatter_to_region`` take one shared input, whose
gradient is the sum over the ranks' branches; ``reduce_from_region`` and
``gather_from_region`` produce one replicated output, whose gradient ``dy`` is
one shared tensor (the downstream computation is replicated). ``gather_sequence``,
``reduce_scatter_sequence`` and ``all_to_all`` have per-rank inputs and per-rank
outputs. In every case the reference loss is ``sum <dy, y>`` over the logical
outputs, differentiated by autograd on plain tensors.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, strategies as st
from torch.testing import assert_close

from minipar import regions
from minipar.core.comm import Comm
from minipar.core.mesh import AXES, Mesh, axis_rank_lists

WORLDS = (1, 2, 3, 4)
SHARED = -1  # owner of a tensor that every rank holds


# -- data ------------------------------------------------------------------------


def _gen(seed: int, slot: int, owner: int, shape, dtype: torch.dtype = torch.float32,
         device: str = "cpu") -> torch.Tensor:
    """Tensor number ``slot`` of rank ``owner`` (SHARED: held by every rank); any rank can regenerate it.

    Drawn on the CPU (the same values whatever the backend), then moved to ``device``: the rank's
    ``ctx.device``, since nccl takes only tensors on the rank's GPU."""
    g = torch.Generator().manual_seed((seed * 64 + slot) * 16 + owner + 1)
    if dtype.is_floating_point:
        return torch.randn(tuple(shape), generator=g, dtype=dtype).to(device)
    return torch.randint(-1000, 1000, tuple(shape), generator=g, dtype=dtype).to(device)


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _ring(op: str, n: int, b: int) -> int:
    """Ring-model wire bytes of the module docstring, exactly, then rounded to an integer."""
    exact = {
        "all_reduce": Fraction(2 * (n - 1), n) * b,
        "reduce_scatter": Fraction(n - 1, n) * b,
        "all_gather": Fraction(n - 1, n) * b,
        "broadcast": Fraction(b),
    }[op]
    return round(exact)


def _sum(ts):
    return functools.reduce(operator.add, ts)


def _check_stats(stats, expected) -> None:
    """``expected``: (op, group, tag, bytes, wire_bytes, dtype) per call in issue order; bytes None = unchecked."""
    got = [(r.op, r.group, r.tag, r.bytes, r.wire_bytes, r.dtype) for r in stats.records]
    assert len(got) == len(expected), f"recorded {got}\nexpected {expected}"
    resolved = []
    for g, e in zip(got, expected):
        e = e if e[3] is not None else e[:3] + (g[3],) + e[4:]
        assert g == e, f"recorded {g}, expected {e}"
        assert type(g[3]) is int and type(g[4]) is int
        resolved.append(e)
    # The query API, under every filter (None means "any").
    ops = {e[0] for e in resolved} | {None, "no_such_op"}
    groups = {e[1] for e in resolved} | {None, "no_such_group"}
    tags = {e[2] for e in resolved if e[2] is not None} | {None, "no_such_tag"}
    for op, group, tag in itertools.product(ops, groups, tags):
        sel = [e for e in resolved
               if (op is None or e[0] == op) and (group is None or e[1] == group) and (tag is None or e[2] == tag)]
        assert stats.calls(op, group, tag) == len(sel), (op, group, tag)
        assert stats.bytes(op, group, tag) == sum(e[3] for e in sel), (op, group, tag)
        assert stats.wire_bytes(op, group, tag) == sum(e[4] for e in sel), (op, group, tag)
    summary: dict = {}
    for e in resolved:
        row = summary.setdefault((e[0], e[1]), {"calls": 0, "bytes": 0, "wire_bytes": 0})
        row["calls"] += 1
        row["bytes"] += e[3]
        row["wire_bytes"] += e[4]
    assert stats.summary() == summary


# -- 1 + 2. every Comm collective: values and counting ----------------------------


def _rank_collectives(ctx, case):
    n, me, dev = ctx.world_size, ctx.rank, ctx.device
    seed, m, tail, async_op = case["seed"], case["m"], tuple(case["tail"]), case["async_op"]
    dt = getattr(torch, case["dtype"])
    src, S = case["src"], case["splits"]
    shard = (m,) + tail
    mesh = Mesh()  # dp = world
    try:
        comm, g = mesh.comm, mesh.group("dp")
        assert (g.name, g.ranks, g.rank, g.size) == ("dp", tuple(range(n)), me, n)
        one = mesh.group("tp")  # a group of one: nothing is issued or recorded
        assert one.size == 1
        expected = []

        def expect(op, group, tag, b, wire):
            if group.size > 1:
                expected.append((op, group.name, tag, b, wire, dt))

        def done(handle):
            if async_op:
                assert handle is not None
                handle.wait()
            else:
                assert handle is None

        with comm.counting() as stats:
            # all_reduce, every reduction op, on the dp group
            xs = [_gen(seed, 0, r, shard, dt, dev) for r in range(n)]
            stack = torch.stack(xs)
            for i, (op, ref) in enumerate([("sum", _sum(xs)), ("max", stack.amax(0)),
                                           ("min", stack.amin(0)), ("product", stack.prod(0))]):
                t = xs[me].clone()
                done(comm.all_reduce(t, g, op=op, async_op=async_op, tag="reduce"))
                assert_close(t, ref, msg=lambda s, op=op: f"all_reduce({op}): {s}")
                expect("all_reduce", g, "reduce", _nbytes(shard, dt), _ring("all_reduce", n, _nbytes(shard, dt)))
            # ... and on the world group (another group name in the records)
            t = xs[me].clone()
            done(comm.all_reduce(t, mesh.world, op="max", async_op=async_op, tag="world"))
            assert torch.equal(t, stack.amax(0))
            expect("all_reduce", mesh.world, "world", _nbytes(shard, dt), _ring("all_reduce", n, _nbytes(shard, dt)))

            # reduce_scatter: every rank's full (n*m, ...) input, summed; this rank keeps rows [me*m, (me+1)*m)
            full = (n * m,) + tail
            ins = [_gen(seed, 1, r, full, dt, dev) for r in range(n)]
            out = torch.full(shard, 7, dtype=dt, device=dev)
            done(comm.reduce_scatter(out, ins[me].clone(), g, async_op=async_op, tag="rs"))
            assert_close(out, _sum(ins)[me * m:(me + 1) * m])
            expect("reduce_scatter", g, "rs", _nbytes(full, dt), _ring("reduce_scatter", n, _nbytes(full, dt)))
            # in place (the output is the input's own slice), with and without leave to overwrite the
            # rest of the input: without it, the rest must be untouched
            for scratch in (False, True):
                buf = ins[me].clone()
                done(comm.reduce_scatter(buf[me * m:(me + 1) * m], buf, g, async_op=async_op, tag="rs",
                                         input_is_scratch=scratch))
                assert_close(buf[me * m:(me + 1) * m], _sum(ins)[me * m:(me + 1) * m])
                if not scratch:
                    assert torch.equal(buf[:me * m], ins[me][:me * m])
                    assert torch.equal(buf[(me + 1) * m:], ins[me][(me + 1) * m:])
                expect("reduce_scatter", g, "rs", _nbytes(full, dt), _ring("reduce_scatter", n, _nbytes(full, dt)))

            # all_gather: every rank's shard, concatenated in rank order
            out = torch.full(full, 7, dtype=dt, device=dev)
            done(comm.all_gather(out, xs[me].clone(), g, async_op=async_op, tag="ag"))
            assert torch.equal(out, torch.cat(xs))
            expect("all_gather", g, "ag", _nbytes(full, dt), _ring("all_gather", n, _nbytes(full, dt)))
            # in place: the input is the output's own slice
            out = torch.full(full, 7, dtype=dt, device=dev)
            out[me * m:(me + 1) * m] = xs[me]
            done(comm.all_gather(out, out[me * m:(me + 1) * m], g, async_op=async_op, tag="ag"))
            assert torch.equal(out, torch.cat(xs))
            expect("all_gather", g, "ag", _nbytes(full, dt), _ring("all_gather", n, _nbytes(full, dt)))

            # broadcast from group member src (non-zero whenever the world has more than one rank)
            t = xs[me].clone()
            done(comm.broadcast(t, src, g, async_op=async_op, tag="bcast"))
            assert torch.equal(t, xs[src])
            expect("broadcast", g, "bcast", _nbytes(shard, dt), _ring("broadcast", n, _nbytes(shard, dt)))

            # all_to_all, equal splits: rank j's rows [me*m, (me+1)*m) land in block j of this rank's output
            a2a = [_gen(seed, 2, r, full, dt, dev) for r in range(n)]
            out = torch.full(full, 7, dtype=dt, device=dev)
            done(comm.all_to_all(out, a2a[me].clone(), g, async_op=async_op, tag="a2a"))
            assert torch.equal(out, torch.cat([a2a[j][me * m:(me + 1) * m] for j in range(n)]))
            row = _nbytes(tail, dt)
            expect("all_to_all", g, "a2a", _nbytes(full, dt), (n - 1) * m * row)

            # all_to_all, uneven splits (zero rows allowed): S[i][j] rows go from rank i to rank j
            ua = [_gen(seed, 3, r, (sum(S[r]),) + tail, dt, dev) for r in range(n)]
            in_splits, out_splits = S[me], [S[j][me] for j in range(n)]
            out = torch.full((sum(out_splits),) + tail, 7, dtype=dt, device=dev)
            done(comm.all_to_all(out, ua[me].clone(), g, output_splits=out_splits, input_splits=in_splits,
                                 async_op=async_op, tag="a2a_uneven"))
            ref = torch.cat([ua[j].split(S[j])[me] for j in range(n)])
            assert torch.equal(out, ref)
            expect("all_to_all", g, "a2a_uneven", _nbytes(ua[me].shape, dt), (sum(S[me]) - S[me][me]) * row)

            # send / recv around a ring: rank r sends its tensor to r+1 and receives r-1's
            if n > 1:
                nxt, prv = (me + 1) % n, (me - 1) % n
                mine = _gen(seed, 4, me, shard, dt, dev)
                inbox = torch.full(shard, 7, dtype=dt, device=dev)
                if async_op:
                    hs = comm.send(mine, nxt, g, async_op=True, tag="p2p")
                    hr = comm.recv(inbox, prv, g, async_op=True, tag="p2p")
                    hs.wait()
                    hr.wait()
                    order = ("send", "recv")
                elif me == 0:
                    assert comm.send(mine, nxt, g, tag="p2p") is None
                    assert comm.recv(inbox, prv, g, tag="p2p") is None
                    order = ("send", "recv")
                else:
                    assert comm.recv(inbox, prv, g, tag="p2p") is None
                    assert comm.send(mine, nxt, g, tag="p2p") is None
                    order = ("recv", "send")
                assert torch.equal(inbox, _gen(seed, 4, prv, shard, dt, dev))
                for op in order:  # send: payload B, wire B; recv puts nothing on the wire (payload not specified)
                    expect(op, g, "p2p", _nbytes(shard, dt) if op == "send" else None,
                           _nbytes(shard, dt) if op == "send" else 0)

            # a group of one: the result is already in place; nothing is recorded
            t = xs[me].clone()
            for op in ("sum", "max"):
                done(comm.all_reduce(t, one, op=op, async_op=async_op, tag="solo"))
                assert torch.equal(t, xs[me])
            done(comm.broadcast(t, 0, one, async_op=async_op, tag="solo"))
            assert torch.equal(t, xs[me])
            for fn in (comm.all_gather, comm.reduce_scatter, comm.all_to_all):
                out = torch.full(shard, 7, dtype=dt, device=dev)
                done(fn(out, xs[me], one, async_op=async_op, tag="solo"))
                assert torch.equal(out, xs[me])

            # shape errors are raised on every rank before anything is issued (or recorded)
            with pytest.raises(ValueError, match="all_gather"):
                comm.all_gather(torch.empty((n * m + 1,) + tail, dtype=dt, device=dev), xs[me], g, tag="bad")
            with pytest.raises(ValueError, match="reduce_scatter"):
                comm.reduce_scatter(torch.empty((m + 1,) + tail, dtype=dt, device=dev), ins[me], g, tag="bad")

        _check_stats(stats, expected)
        # a closed block records nothing more
        before = len(stats.records)
        comm.all_reduce(xs[me].clone(), g, tag="after")
        assert len(stats.records) == before
        return len(expected)
    finally:
        mesh.destroy()


@st.composite
def _collective_cases(draw):
    n = draw(st.sampled_from(WORLDS))
    return dict(
        n=n,
        seed=draw(st.integers(0, 2**20)),
        m=draw(st.integers(0, 7)),
        tail=draw(st.lists(st.integers(0, 5), max_size=2)),
        dtype=draw(st.sampled_from(["float32", "float64", "int64"])),
        src=draw(st.integers(1, n - 1)) if n > 1 else 0,
        splits=draw(st.lists(st.lists(st.integers(0, 3), min_size=n, max_size=n), min_size=n, max_size=n)),
        async_op=draw(st.booleans()),
    )


@given(case=_collective_cases())
@example(case=dict(n=4, seed=1, m=3, tail=[5], dtype="float32", src=3, async_op=True,
                   splits=[[0, 2, 0, 1], [3, 0, 0, 0], [0, 0, 0, 0], [1, 1, 2, 0]]))
@example(case=dict(n=3, seed=2, m=5, tail=[7, 1], dtype="int64", src=2, async_op=False,
                   splits=[[1, 0, 2], [0, 0, 0], [2, 3, 0]]))
@example(case=dict(n=2, seed=3, m=0, tail=[3], dtype="float64", src=1, async_op=True,
                   splits=[[0, 0], [0, 0]]))
@example(case=dict(n=1, seed=4, m=3, tail=[], dtype="float32", src=0, async_op=False, splits=[[2]]))
def test_collectives_compute_the_math_and_are_counted(pools, case):
    issued = pools.run(case["n"], _rank_collectives, case)
    assert issued == [issued[0]] * case["n"]
    assert (issued[0] == 0) == (case["n"] == 1)  # a world of one records nothing


# -- 2. nested counting blocks ------------------------------------------------------


def _rank_nested_counting(ctx):
    mesh = Mesh()
    g, t = mesh.group("dp"), torch.ones(3, device=ctx.device)
    out = {}
    try:
        # Each scenario on a fresh Comm, so that one scenario's failure cannot leak into the next.
        comm = Comm()
        try:
            with comm.counting() as outer:
                comm.all_reduce(t, g, tag="a")
                with comm.counting() as inner:
                    comm.all_reduce(t, g, tag="b")
                comm.all_reduce(t, g, tag="c")
            out["inner opened after a record"] = ([r.tag for r in outer.records], [r.tag for r in inner.records])
        except Exception as e:  # noqa: BLE001 -- reported to the test, which names it
            out["inner opened after a record"] = repr(e)
        comm = Comm()
        try:
            with comm.counting() as outer:
                with comm.counting() as inner:
                    comm.all_reduce(t, g, tag="b")
                comm.all_reduce(t, g, tag="c")
            out["inner opened first"] = ([r.tag for r in outer.records], [r.tag for r in inner.records])
        except Exception as e:  # noqa: BLE001
            out["inner opened first"] = repr(e)
        comm = Comm()
        try:
            with comm.counting() as outer:
                with comm.counting() as inner:
                    pass
                comm.all_reduce(t, g, tag="c")
            out["empty inner block"] = ([r.tag for r in outer.records], [r.tag for r in inner.records])
        except Exception as e:  # noqa: BLE001
            out["empty inner block"] = repr(e)
        return out
    finally:
        mesh.destroy()


# Regression: `counting()` once closed its block with `list.remove`, which matches by equality; two
# nested blocks with equal (e.g. empty) records then closed the wrong one.
def test_nested_counting_blocks_both_record(pools):
    for result in pools.run(2, _rank_nested_counting):
        assert result == {
            "inner opened after a record": (["a", "b", "c"], ["b"]),
            "inner opened first": (["b", "c"], ["b"]),
            "empty inner block": (["c"], []),
        }


# -- 3. mesh groups ---------------------------------------------------------------------

# (dp, tp, pp, ep, dp_shard, cp)
LAYOUTS_4 = [(4, 1, 1, 1, 4, 1), (2, 2, 1, 1, 2, 1), (1, 2, 2, 1, 1, 1), (2, 1, 2, 2, 2, 1), (4, 1, 1, 2, 4, 1),
             (4, 1, 1, 4, 4, 1), (1, 1, 4, 1, 1, 1), (1, 4, 1, 1, 1, 1), (4, 1, 1, 1, 2, 1), (4, 1, 1, 2, 2, 1),
             (2, 2, 1, 1, 1, 1), (2, 1, 1, 1, 2, 2), (1, 2, 1, 1, 1, 2), (1, 1, 2, 1, 1, 2), (1, 1, 1, 1, 1, 4)]


def _axis_sizes(dp, tp, pp, ep, shard, cp):
    # edp and dp_shard take in the cp ranks (other tokens of the same parameters)
    return {"dp": dp, "tp": tp, "pp": pp, "ep": ep, "edp": dp // ep * cp, "dp_shard": shard * cp,
            "dp_replicate": dp // shard, "cp": cp, "dp_cp": dp * cp}


def _rank_mesh_groups(ctx, layout):
    dp, tp, pp, ep, shard, cp = layout
    me = ctx.rank
    mesh = Mesh(dp=dp, tp=tp, pp=pp, ep=ep, dp_shard=shard, cp=cp)
    try:
        assert me == ((mesh.pp_rank * dp + mesh.dp_rank) * cp + mesh.cp_rank) * tp + mesh.tp_rank
        assert mesh.dp_rank == mesh.edp_rank * ep + mesh.ep_rank == mesh.replicate_rank * shard + mesh.shard_rank
        coord = {"dp": mesh.dp_rank, "tp": mesh.tp_rank, "pp": mesh.pp_rank, "ep": mesh.ep_rank,
                 "edp": mesh.edp_rank * cp + mesh.cp_rank, "dp_shard": mesh.shard_rank * cp + mesh.cp_rank,
                 "dp_replicate": mesh.replicate_rank, "cp": mesh.cp_rank,
                 "dp_cp": mesh.dp_rank * cp + mesh.cp_rank}
        seen = {}
        for axis in AXES:
            grp = mesh.group(axis)
            lists = axis_rank_lists(axis, dp=dp, tp=tp, pp=pp, ep=ep, dp_shard=shard, cp=cp)
            mine = [ranks for ranks in lists if me in ranks]
            assert len(mine) == 1, (axis, lists)
            mine = mine[0]
            assert grp.name == axis
            assert grp.ranks == tuple(mine) and grp.rank == mine.index(me) == coord[axis], (axis, grp, mine)
            assert grp.size == mesh.size(axis) == _axis_sizes(dp, tp, pp, ep, shard, cp)[axis]
            # the raw process group joins exactly these ranks
            t = torch.tensor([me], dtype=torch.int64, device=ctx.device)
            if grp.pg is None:
                assert grp.size == 1
            else:
                dist.all_reduce(t, group=grp.pg)
            assert t.item() == sum(mine), (axis, t.item(), mine)
            # and through Comm, in group order
            t = torch.tensor([me], dtype=torch.int64, device=ctx.device)
            mesh.comm.all_reduce(t, grp)
            assert t.item() == sum(mine)
            gathered = torch.empty(grp.size, dtype=torch.int64, device=ctx.device)
            mesh.comm.all_gather(gathered, torch.tensor([me], device=ctx.device), grp)
            assert gathered.tolist() == mine, (axis, gathered.tolist(), mine)
            last = torch.tensor([me], device=ctx.device)
            mesh.comm.broadcast(last, grp.size - 1, grp)
            assert last.item() == mine[-1]
            seen[axis] = tuple(mine)
        return seen
    finally:
        mesh.destroy()


@pytest.mark.parametrize("layout", LAYOUTS_4, ids=lambda lay: "dp{}-tp{}-pp{}-ep{}-shard{}-cp{}".format(*lay))
def test_mesh_groups_match_axis_rank_lists(pools, layout):
    seen = pools.run(4, _rank_mesh_groups, layout)
    for axis in AXES:
        for r in range(4):
            assert r in seen[r][axis]
            for other in seen[r][axis]:  # every member of my group sees the same group
                assert seen[other][axis] == seen[r][axis]
        assert {len(seen[r][axis]) for r in range(4)} == {_axis_sizes(*layout)[axis]}


def _layouts(world):
    for dp, tp, cp in itertools.product(range(1, world + 1), repeat=3):
        if world % (dp * tp * cp) == 0:
            pp = world // (dp * tp * cp)
            for ep, shard in itertools.product(range(1, dp + 1), repeat=2):
                if dp % ep == 0 and dp % shard == 0:
                    yield dp, tp, pp, ep, shard, cp


@pytest.mark.parametrize("world", [8, 16])
def test_axis_rank_lists_partition_and_coordinates(world):
    layouts = list(_layouts(world))
    assert len(layouts) > 10
    for dp, tp, pp, ep, shard, cp in layouts:
        # Coordinates from the documented layout rank = ((pp_rank*dp + dp_rank)*cp + cp_rank)*tp + tp_rank,
        # dp_rank = edp_rank*ep + ep_rank; the independent ones are (pp, edp, ep, cp, tp).
        coords = {}
        for rank in range(world):
            tp_r, cp_r, dp_r, pp_r = rank % tp, (rank // tp) % cp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)
            coords[rank] = {"tp": tp_r, "pp": pp_r, "dp": dp_r, "ep": dp_r % ep, "edp": dp_r // ep * cp + cp_r,
                            "dp_shard": dp_r % shard * cp + cp_r, "dp_replicate": dp_r // shard, "cp": cp_r,
                            "dp_cp": dp_r * cp + cp_r}
        # edp and dp_shard count (dp coordinate, cp coordinate) with cp fastest: they vary with cp too
        varies = {"tp": {"tp"}, "pp": {"pp"}, "dp": {"edp", "ep"}, "ep": {"ep"}, "edp": {"edp", "cp"},
                  "dp_shard": {"dp_shard", "cp"}, "dp_replicate": {"dp_replicate"}, "cp": {"cp", "edp", "dp_shard"},
                  "dp_cp": {"edp", "ep", "cp"}}
        sizes = _axis_sizes(dp, tp, pp, ep, shard, cp)
        for axis in AXES:
            lists = axis_rank_lists(axis, dp=dp, tp=tp, pp=pp, ep=ep, dp_shard=shard, cp=cp)
            where = f"{axis} of dp={dp} tp={tp} pp={pp} ep={ep} dp_shard={shard} cp={cp}: {lists}"
            # the independent coordinates: dp splits as (edp, ep) or, for HSDP, (replicate, shard)
            family = {"pp", "tp", "cp", "dp_shard", "dp_replicate"} if axis in ("dp_shard", "dp_replicate") \
                else {"pp", "edp", "ep", "cp", "tp"}
            assert sorted(r for ranks in lists for r in ranks) == list(range(world)), where  # a partition
            assert all(len(ranks) == sizes[axis] for ranks in lists), where
            assert len(lists) == world // sizes[axis], where
            for ranks in lists:
                if axis == "tp":
                    assert ranks == list(range(ranks[0], ranks[0] + tp)), where  # contiguous runs
                for i, r in enumerate(ranks):
                    assert coords[r][axis] == i, where  # position in the group = the axis coordinate
                    for fixed in family - varies[axis]:
                        assert coords[r][fixed] == coords[ranks[0]][fixed], where  # other coordinates shared


def test_axis_rank_lists_docstring_example():
    """World 8, Mesh(dp=2, tp=2, pp=2), as drawn in minipar/core/mesh.py."""
    kw = dict(dp=2, tp=2, pp=2)
    as_sets = lambda axis: sorted(map(sorted, axis_rank_lists(axis, **kw)))  # noqa: E731
    assert as_sets("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert as_sets("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert as_sets("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="unknown mesh axis"):
        axis_rank_lists("xp", **kw)


BAD_MESHES_4 = [
    (dict(dp=3), "world size"),
    (dict(dp=2), "world size"),
    (dict(dp=2, tp=2, pp=2), "world size"),
    (dict(tp=3), "does not divide"),
    (dict(pp=8), "does not divide"),
    (dict(ep=3), "must divide"),
    (dict(dp=2, tp=2, ep=4), "must divide"),
    (dict(tp=0), "positive integer"),
    (dict(pp=-1), "positive integer"),
    (dict(dp=0), "positive integer"),
    (dict(ep=0), "positive integer"),
    (dict(tp=1.5), "positive integer"),
    (dict(dp=4.0), "positive integer"),
    (dict(tp="2"), "positive integer"),
    (dict(pp=True), "positive integer"),
]


def _rank_bad_meshes(ctx, cases):
    messages = []
    for kwargs, _ in cases:
        with pytest.raises(ValueError) as info:
            Mesh(**kwargs)
        messages.append(str(info.value))
    # the world is still in step: a valid mesh works afterwards
    mesh = Mesh()
    try:
        t = torch.tensor([ctx.rank], device=ctx.device)
        mesh.comm.all_reduce(t, mesh.group("dp"))
        assert t.item() == sum(range(ctx.world_size))
    finally:
        mesh.destroy()
    return messages


def test_invalid_mesh_sizes_raise_on_every_rank(pools):
    out = pools.run(4, _rank_bad_meshes, BAD_MESHES_4, timeout=60)
    for i, (kwargs, needle) in enumerate(BAD_MESHES_4):
        msgs = [out[r][i] for r in range(4)]
        assert msgs == [msgs[0]] * 4, kwargs
        assert needle in msgs[0], (kwargs, msgs[0])


def _differing_mesh_kwargs(case, rank, world):
    if case == "tp":  # rank 0: dp=world/2, tp=2; the others: dp=world, tp=1 -- each valid on its own
        return dict(tp=2) if rank == 0 else dict(tp=1)
    if case == "pp":
        return dict(pp=2) if rank == world - 1 else dict()
    if case == "ep":
        return dict(ep=2) if rank == 1 else dict(ep=1)
    raise AssertionError(case)


def _rank_differing_mesh(ctx, cases):
    messages = []
    for case in cases:
        with pytest.raises(ValueError) as info:
            Mesh(**_differing_mesh_kwargs(case, ctx.rank, ctx.world_size))
        messages.append(str(info.value))
    mesh = Mesh()
    try:
        t = torch.tensor([1], device=ctx.device)
        mesh.comm.all_reduce(t, mesh.world)
        assert t.item() == ctx.world_size
    finally:
        mesh.destroy()
    return messages


@pytest.mark.parametrize("world, cases", [(2, ("tp", "pp", "ep")), (4, ("tp", "pp", "ep"))])
def test_mesh_differing_between_ranks_raises_everywhere(pools, world, cases):
    out = pools.run(world, _rank_differing_mesh, cases, timeout=60)  # a hang would time out, not pass
    for i, _ in enumerate(cases):
        for r in range(world):
            assert "differs between ranks" in out[r][i], out[r][i]
            assert f"rank {r}:" in out[r][i]


# -- 4. regions: forward and backward against a single-process reference -----------------


def _reference(fn, leaves, dys):
    """Outputs of ``fn(*leaves)`` and the gradients of sum_i <dys[i], outputs[i]> w.r.t. the leaves."""
    leaves = [x.clone().requires_grad_(True) for x in leaves]
    outs = fn(*leaves)
    assert len(outs) == len(dys)
    loss = _sum([(y * dy).sum() for y, dy in zip(outs, dys)])
    grads = torch.autograd.grad(loss, leaves)
    return [y.detach() for y in outs], list(grads)


def _check_region(comm, what, apply, x_local, dy_local, y_ref, dx_ref, fwd_records, bwd_records):
    x = x_local.clone().requires_grad_(True)
    with comm.counting() as fwd:
        y = apply(x)
    assert y.shape == y_ref.shape, (what, y.shape, y_ref.shape)
    with comm.counting() as bwd:
        y.backward(dy_local)
    assert_close(y.detach(), y_ref, msg=lambda s: f"{what} forward: {s}")
    assert x.grad is not None, what
    assert_close(x.grad, dx_ref, msg=lambda s: f"{what} backward: {s}")
    assert torch.equal(x.detach(), x_local), f"{what} changed its input"
    got = lambda st_: [(r.op, r.group, r.tag, r.bytes, r.wire_bytes) for r in st_.records]  # noqa: E731
    assert got(fwd) == fwd_records, (what, "forward", got(fwd), fwd_records)
    assert got(bwd) == bwd_records, (what, "backward", got(bwd), bwd_records)


def _rank_regions(ctx, case):
    n, me, dev = ctx.world_size, ctx.rank, ctx.device
    seed, shape, dim, S = case["seed"], tuple(case["shape"]), case["dim"], case["splits"]
    d = dim % len(shape)
    k = shape[d]
    full = shape[:d] + (n * k,) + shape[d + 1:]  # n shards of `shape` along dim
    tail = shape[1:]
    f32 = torch.float32
    nb = lambda shp: _nbytes(shp, f32)  # noqa: E731

    def per_rank(slot, shp):
        return [_gen(seed, slot, r, shp, device=dev) for r in range(n)]

    def shared(slot, shp):
        return _gen(seed, slot, SHARED, shp, device=dev)

    def rec(op, tag, b, wire):
        return [(op, "dp", tag, b, wire)] if n > 1 else []

    mesh = Mesh()
    try:
        comm, g = mesh.comm, mesh.group("dp")

        # copy_to_region: one replicated x; y_r = x on each rank's branch; dx = sum_r dy_r
        x, dys = shared(0, shape), per_rank(1, shape)
        ys, (gx,) = _reference(lambda x: [x] * n, [x], dys)
        _check_region(comm, "copy_to_region", lambda t: regions.copy_to_region(t, comm, g, tag="copy"),
                      x, dys[me], ys[me], gx, [],
                      rec("all_reduce", "copy", nb(shape), _ring("all_reduce", n, nb(shape))))

        # reduce_from_region: y = sum_r x_r (replicated, one logical output with one dy)
        xs, dy = per_rank(2, shape), shared(3, shape)
        (y,), gxs = _reference(lambda *xs: [_sum(xs)], xs, [dy])
        _check_region(comm, "reduce_from_region", lambda t: regions.reduce_from_region(t, comm, g, tag="reduce"),
                      xs[me], dy, y, gxs[me],
                      rec("all_reduce", "reduce", nb(shape), _ring("all_reduce", n, nb(shape))), [])

        # scatter_to_region: one replicated x of the full size; rank r keeps block r along dim
        x, dys = shared(4, full), per_rank(5, shape)
        ys, (gx,) = _reference(lambda x: [x.narrow(d, r * k, k) for r in range(n)], [x], dys)
        _check_region(comm, "scatter_to_region", lambda t: regions.scatter_to_region(t, comm, g, dim=dim, tag="sc"),
                      x, dys[me], ys[me], gx, [],
                      rec("all_gather", "sc", nb(full), _ring("all_gather", n, nb(full))))

        # gather_from_region: y = cat_r x_r along dim (replicated, one dy)
        xs, dy = per_rank(6, shape), shared(7, full)
        (y,), gxs = _reference(lambda *xs: [torch.cat(xs, d)], xs, [dy])
        _check_region(comm, "gather_from_region",
                      lambda t: regions.gather_from_region(t, comm, g, dim=dim, tag="ga"),
                      xs[me], dy, y, gxs[me],
                      rec("all_gather", "ga", nb(full), _ring("all_gather", n, nb(full))), [])

        # gather_sequence: y_r = cat_s x_s along dim, each rank's branch with its own dy_r
        xs, dys = per_rank(8, shape), per_rank(9, full)
        ys, gxs = _reference(lambda *xs: [torch.cat(xs, d)] * n, xs, dys)
        _check_region(comm, "gather_sequence", lambda t: regions.gather_sequence(t, comm, g, dim=dim, tag="gs"),
                      xs[me], dys[me], ys[me], gxs[me],
                      rec("all_gather", "gs", nb(full), _ring("all_gather", n, nb(full))),
                      rec("reduce_scatter", "gs", nb(full), _ring("reduce_scatter", n, nb(full))))

        # reduce_scatter_sequence: y_r = block r along dim of sum_s x_s
        xs, dys = per_rank(10, full), per_rank(11, shape)
        ys, gxs = _reference(lambda *xs: [_sum(xs).narrow(d, r * k, k) for r in range(n)], xs, dys)
        _check_region(comm, "reduce_scatter_sequence",
                      lambda t: regions.reduce_scatter_sequence(t, comm, g, dim=dim, tag="rss"),
                      xs[me], dys[me], ys[me], gxs[me],
                      rec("reduce_scatter", "rss", nb(full), _ring("reduce_scatter", n, nb(full))),
                      rec("all_gather", "rss", nb(full), _ring("all_gather", n, nb(full))))

        # all_to_all, uneven splits: S[i][j] rows (dim 0) from rank i to rank j
        row = nb(tail)
        in_rows = [sum(S[r]) for r in range(n)]
        out_rows = [sum(S[j][r] for j in range(n)) for r in range(n)]
        xs = [_gen(seed, 12, r, (in_rows[r],) + tail, device=dev) for r in range(n)]
        dys = [_gen(seed, 13, r, (out_rows[r],) + tail, device=dev) for r in range(n)]
        ys, gxs = _reference(lambda *xs: [torch.cat([xs[j].split(S[j])[r] for j in range(n)]) for r in range(n)],
                             xs, dys)
        _check_region(comm, "all_to_all(uneven)",
                      lambda t: regions.all_to_all(t, comm, g, output_splits=[S[j][me] for j in range(n)],
                                                   input_splits=S[me], tag="a2a"),
                      xs[me], dys[me], ys[me], gxs[me],
                      rec("all_to_all", "a2a", nb(xs[me].shape), (in_rows[me] - S[me][me]) * row),
                      rec("all_to_all", "a2a", nb(dys[me].shape), (out_rows[me] - S[me][me]) * row))

        # all_to_all, equal splits: block j of rank i's rows goes to rank j
        m = shape[0]
        rows = (n * m,) + tail
        xs, dys = per_rank(14, rows), per_rank(15, rows)
        ys, gxs = _reference(lambda *xs: [torch.cat([x.narrow(0, r * m, m) for x in xs]) for r in range(n)],
                             xs, dys)
        _check_region(comm, "all_to_all(equal)", lambda t: regions.all_to_all(t, comm, g, tag="a2a_eq"),
                      xs[me], dys[me], ys[me], gxs[me],
                      rec("all_to_all", "a2a_eq", nb(rows), (n - 1) * m * row),
                      rec("all_to_all", "a2a_eq", nb(rows), (n - 1) * m * row))

        # scatter / reduce-scatter of a size the group does not divide: a clear error on every rank
        if n > 1:
            bad = torch.zeros(shape[:d] + (n * k + 1,) + shape[d + 1:], device=dev, requires_grad=True)
            with pytest.raises(ValueError, match="not divisible"):
                regions.scatter_to_region(bad, comm, g, dim=dim)
            with pytest.raises(ValueError, match="not divisible"):
                regions.reduce_scatter_sequence(bad, comm, g, dim=dim)
        return True
    finally:
        mesh.destroy()


@st.composite
def _region_cases(draw):
    n = draw(st.sampled_from(WORLDS))
    shape = draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
    return dict(
        n=n,
        seed=draw(st.integers(0, 2**20)),
        shape=shape,
        dim=draw(st.integers(-len(shape), len(shape) - 1)),
        splits=draw(st.lists(st.lists(st.integers(0, 3), min_size=n, max_size=n), min_size=n, max_size=n)),
    )


@given(case=_region_cases())
@example(case=dict(n=4, seed=5, shape=[3, 5, 2], dim=1, splits=[[0, 2, 0, 1], [3, 0, 0, 0], [0, 0, 0, 0], [1, 1, 2, 0]]))
@example(case=dict(n=3, seed=6, shape=[2, 7], dim=-1, splits=[[1, 0, 2], [0, 0, 0], [2, 3, 1]]))
@example(case=dict(n=2, seed=7, shape=[5, 0, 3], dim=0, splits=[[0, 3], [1, 0]]))
@example(case=dict(n=1, seed=8, shape=[3, 4], dim=-2, splits=[[2]]))
def test_regions_forward_backward_and_counts(pools, case):
    assert pools.run(case["n"], _rank_regions, case) == [True] * case["n"]


def _rank_p2p_through_host(ctx):
    """send/recv with the host-staging path forced on (it serves CUDA tensors over gloo): values and
    counts as the direct path's, sync and async."""
    import minipar.core.comm as comm_module
    from unittest import mock
    mesh = Mesh()
    peer = 1 - mesh.rank
    out = []
    with mock.patch.object(comm_module, "_through_host", lambda tensor, group: True), \
            mesh.comm.counting() as stats:
        mine = torch.arange(6.0).view(2, 3) + 10 * mesh.rank
        got = torch.zeros(2, 3)
        if mesh.rank == 0:
            mesh.comm.send(mine, peer, mesh.world)
            mesh.comm.recv(got, peer, mesh.world)
        else:
            mesh.comm.recv(got, peer, mesh.world)
            mesh.comm.send(mine, peer, mesh.world)
        out.append(got.clone())
        got2 = torch.zeros(2, 3)
        works = [mesh.comm.send(mine * 2, peer, mesh.world, async_op=True),
                 mesh.comm.recv(got2, peer, mesh.world, async_op=True)]
        for w in works:
            w.wait()
        out.append(got2)
    mesh.destroy()
    return out, stats.calls("send"), stats.calls("recv")


def test_point_to_point_through_a_host_copy_delivers_the_values(pools):
    for rank, (got, sends, recvs) in enumerate(pools.run(2, _rank_p2p_through_host)):
        other = torch.arange(6.0).view(2, 3) + 10 * (1 - rank)
        assert torch.equal(got[0], other) and torch.equal(got[1], 2 * other), rank
        assert sends == recvs == 2


def _rank_new_group(ctx):
    mesh = Mesh()
    evens_odds = [[r for r in range(ctx.world_size) if r % 2 == p] for p in (0, 1)]
    group = mesh.new_group("parity", evens_odds)
    t = torch.tensor([float(ctx.rank)])
    with mesh.comm.counting() as stats:
        mesh.comm.all_reduce(t, group)
    try:
        mesh.new_group("some", [[0], [1, 2]])  # rank 3 in no group: every rank must refuse, none create
        refused = None
    except ValueError as e:
        refused = str(e)
    mesh.destroy()
    return group.name, group.ranks, t.item(), stats.calls("all_reduce", "parity"), refused


def test_new_group_partitions_ranks_and_refuses_lists_that_do_not(pools):
    """Mesh.new_group: this rank's group of a partition, named for the counters; lists that leave a
    rank out raise on every rank before any group is created (creating one is collective)."""
    for rank, (name, ranks, total, calls, refused) in enumerate(pools.run(4, _rank_new_group)):
        assert name == "parity" and ranks == tuple(r for r in range(4) if r % 2 == rank % 2)
        assert total == sum(ranks) and calls == 1
        assert refused is not None and "exactly once" in refused, (rank, refused)
