"""Pipeline schedules as plain Python: no processes.

For every schedule (GPipe, 1F1B, interleaved 1F1B with v chunks, ZB-H1, ZB-V), stage count and
micro-batch count: every (micro-batch, chunk) is forwarded, backwarded and (when the backward is
split) weight-updated exactly once on every rank, in dependency order across the virtual stages,
sends match receives pair by pair and nothing deadlocks. Activation memory stays within each
schedule's bound, and with unit costs the simulated idle share of the step is exactly the published
figure, compared as fractions: 1F1B and GPipe (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1), ZB-H1
(p-1)/(3m+p-1). ZB-V's published "zero bubble" is the idle time inside each rank's own span (0); of
the whole step it idles (p-1)/(6m+p-1), the ramp no schedule can avoid. The simulator rejects broken
schedules, and a step's timeline exports as a Chrome/Perfetto trace."""

import json
from fractions import Fraction

import pytest
from hypothesis import given, strategies as st

from minipar.plan.compute import bubble_fraction
from minipar.pipeline import Action, gpipe, one_f_one_b, simulate
from minipar.pipeline.schedule import SCHEDULES, Schedule, chunks_per_rank, holder, interleaved_1f1b, \
    virtual_stage, zb_h1, zb_v

STAGES = (2, 3, 4, 5)


def _cases(name: str, stages: int):
    """(microbatches, virtual_stages) for every m from p to 4p (multiples of p for interleaved)."""
    if name == "interleaved_1f1b":
        return [(m, v) for v in (1, 2, 3) for m in range(stages, 4 * stages + 1, stages)]
    return [(m, chunks_per_rank(name)) for m in range(stages, 4 * stages + 1)]


def _build(name: str, stages: int, m: int, v: int) -> Schedule:
    return SCHEDULES[name](stages, m, virtual_stages=v)


def _check_order(schedule: Schedule, result: dict, m: int) -> None:
    """Independently of simulate's own checks: each (micro-batch, chunk) runs F, B (and W) once per
    rank, the ends of the model send/receive nothing outward, and the execution order found respects
    F(k-1) < F(k), B(k+1) < B(k) across virtual stages and F < B < W on one."""
    p, v, place = len(schedule), schedule.chunks, schedule.placement
    split = any(a.kind == "W" for acts in schedule for a in acts)
    every = sorted((i, c) for i in range(m) for c in range(v))
    for r, actions in enumerate(schedule):
        for kind in ("F", "B", "W") if split else ("F", "B"):
            assert sorted((a.microbatch, a.chunk) for a in actions if a.kind == kind) == every, (r, kind)
        for a in actions:
            k = virtual_stage(r, a.chunk, p, place)
            assert not (k == 0 and a.kind in ("RECV_ACT", "SEND_GRAD")), (r, a)
            assert not (k == p * v - 1 and a.kind in ("SEND_ACT", "RECV_GRAD")), (r, a)
    when = {(a.kind, virtual_stage(r, a.chunk, p, place), a.microbatch): t for t, (r, a) in enumerate(result["order"])}
    for k in range(p * v):
        for i in range(m):
            if k > 0:
                assert when["F", k, i] > when["F", k - 1, i]
            if k < p * v - 1:
                assert when["B", k, i] > when["B", k + 1, i]
            assert when["B", k, i] > when["F", k, i]
            if split:
                assert when["W", k, i] > when["B", k, i]


def _check_timing(result: dict, costs: dict) -> None:
    """The timing is a valid execution: a rank's compute never overlaps, each lasts its cost, and
    busy time is the sum of the costs."""
    for row, busy in zip(result["timeline"], result["busy"]):
        assert all(prev[2] <= nxt[1] for prev, nxt in zip(row, row[1:]))
        assert all(end - start == costs[name[0]] for name, start, end in row)
        assert busy == sum(end - start for _, start, end in row)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("stages", STAGES)
def test_every_schedule_is_complete_ordered_and_deadlock_free(name, stages):
    for m, v in _cases(name, stages):
        schedule = _build(name, stages, m, v)
        assert schedule.chunks == chunks_per_rank(name, v)
        result = simulate(schedule)  # raises on deadlock, crossed channels, broken dependencies, leftovers
        _check_order(schedule, result, m)
        split = any(a.kind == "W" for acts in schedule for a in acts)  # the schedules that split the backward
        unit = {"F": 1, "B": 1, "W": 1} if split else {"F": 1, "B": 2}
        _check_timing(result, {k: Fraction(c, schedule.chunks) for k, c in unit.items()})


@given(name=st.sampled_from(sorted(SCHEDULES)), stages=st.integers(1, 8), microbatches=st.integers(1, 24),
       v=st.integers(1, 4))
def test_any_size_simulates_cleanly(name, stages, microbatches, v):
    """Beyond the grid: any stage count 1-8 and micro-batch count, fewer than the stages included."""
    if name == "interleaved_1f1b":
        microbatches = stages * -(-microbatches // stages) if v > 1 else microbatches
    else:
        v = chunks_per_rank(name)
    schedule = _build(name, stages, microbatches, v)
    _check_order(schedule, simulate(schedule), microbatches)


@pytest.mark.parametrize("stages", STAGES)
def test_activation_memory_stays_within_each_schedules_bound(stages):
    """Peak live activations per rank, counted per (micro-batch, chunk) until B (until W when the
    backward is split). GPipe holds all m; 1F1B rank r at most p - r; interleaved rank r its warm-up
    + 1 chunks, (v-1)p + 2(p-1-r) + 1 (Megatron: p + (p-1)/v stages on rank 0); ZB-H1 fills every
    rank to p, 1F1B's peak (rank 0's), never above; ZB-V holds at most 1F1B's peak in full stages
    (a chunk is half a stage), exactly p once m >= 2p."""
    p = stages
    for m in range(1, 4 * p + 1):
        ofob = simulate(one_f_one_b(p, m))["peak_live"]
        assert ofob == [min(p - r, m) for r in range(p)]
        assert simulate(gpipe(p, m))["peak_live"] == [m] * p
        assert simulate(zb_h1(p, m))["peak_live"] == [min(p, m)] * p == [ofob[0]] * p
        zbv = simulate(zb_v(p, m))["peak_live_stages"]
        assert max(zbv) <= max(ofob)
        if m >= 2 * p:
            assert zbv == [p] * p
    for v in (2, 3):
        for m in range(p, 4 * p + 1, p):
            result = simulate(interleaved_1f1b(p, m, v))
            assert result["peak_live"] == [min(v * m, (v - 1) * p + 2 * (p - 1 - r) + 1) for r in range(p)]
            assert result["peak_live_stages"][0] <= p + Fraction(p - 1, v)


@pytest.mark.parametrize("stages", STAGES)
def test_bubble_fractions_are_the_published_ones(stages):
    """With unit costs (F=1, B=2 whole; F=B=W=1 split; a chunk's share 1/v of that), the simulated
    idle share of the step, exactly; for GPipe, 1F1B and interleaved 1F1B it is what the planner
    uses, `minipar.plan.compute.bubble_fraction(p, m, v)` (a float: the fraction correctly rounded)."""
    p = stages
    for m in range(p, 4 * p + 1):
        for schedule in (gpipe(p, m), one_f_one_b(p, m)):
            bubble = simulate(schedule)["bubble"]
            assert bubble == Fraction(p - 1, m + p - 1)
            assert float(bubble) == bubble_fraction(p, m)
        h1 = simulate(zb_h1(p, m))
        assert h1["bubble"] == Fraction(p - 1, 3 * m + p - 1)
        idle_1f1b = simulate(one_f_one_b(p, m))["makespan"] - 3 * m  # per rank: 3(p-1)
        assert h1["makespan"] - 3 * m == idle_1f1b / 3 == p - 1  # a third of 1F1B's idle time
        if m % p == 0:
            for v in (1, 2, 3):
                bubble = simulate(interleaved_1f1b(p, m, v))["bubble"]
                assert bubble == Fraction(p - 1, v * m + p - 1)
                assert float(bubble) == bubble_fraction(p, m, v)


@pytest.mark.parametrize("stages", STAGES)
def test_zb_v_is_a_parallelogram_without_gaps(stages):
    """ZB-V with F = B = W and m >= 2p: rank r starts r chunk steps (1/2 each) late and then never
    waits, every rank busy for 3m: the published zero bubble is the idle share inside each rank's
    span. Of the whole step the idle share is the ramp, (p-1)/(6m+p-1): the last rank cannot start
    before p-1 chunk forwards have run, so no schedule of these chunks does better. Below 2p
    micro-batches it is never worse than ZB-H1."""
    p = stages
    for m in range(2 * p, 4 * p + 1):
        result = simulate(zb_v(p, m))
        assert result["bubble_in_span"] == 0
        assert result["bubble"] == Fraction(p - 1, 6 * m + p - 1)
        for r, row in enumerate(result["timeline"]):
            assert (row[0][1], row[-1][2]) == (Fraction(r, 2), Fraction(r, 2) + 3 * m)
    for m in range(1, 2 * p):
        assert simulate(zb_v(p, m))["bubble"] <= simulate(zb_h1(p, m))["bubble"]


def test_placement_loops_or_folds_the_model_over_the_ranks():
    """interleaved: vstage = chunk * p + rank; V: chunk 0 holds rank, chunk 1 holds 2p-1-rank. In ZB-V
    the turn is on the last rank: it sends its chunk 0's output to itself (a SEND/RECV pair the
    executor hands over in memory), and rank 0 holds both ends of the model."""
    p = 4
    assert [[virtual_stage(r, c, p) for c in range(3)] for r in range(p)] == [[0, 4, 8], [1, 5, 9], [2, 6, 10],
                                                                               [3, 7, 11]]
    assert [[virtual_stage(r, c, p, "v") for c in range(2)] for r in range(p)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    for place, v in (("interleaved", 3), ("v", 2)):
        assert all(holder(virtual_stage(r, c, p, place), p, place) == (r, c) for r in range(p) for c in range(v))
    last = [str(a) for a in zb_v(p, 8)[p - 1]]
    assert last[:5] == ["RECV_ACT0", "F0", "SEND_ACT0", "RECV_ACT0c1", "F0c1"]
    first = zb_v(p, 8)[0]
    assert not any(a.kind in ("RECV_ACT", "SEND_GRAD") and a.chunk == 0 for a in first)
    assert not any(a.kind in ("SEND_ACT", "RECV_GRAD") and a.chunk == 1 for a in first)
    with pytest.raises(ValueError, match="choose one of"):
        virtual_stage(0, 2, p, "v")


def test_one_f_one_b_shape_for_four_stages():
    """The textbook picture: stage 0 warms up with three forwards, the last stage alternates at once."""
    sched = one_f_one_b(4, 6)
    compute = [[str(a) for a in actions if a.kind in ("F", "B")] for actions in sched]
    assert compute[0] == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    assert compute[3] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]
    assert [str(a) for a in sched[1][:3]] == ["RECV_ACT0", "F0", "SEND_ACT0"]


def test_zb_h1_and_interleaved_shapes():
    """ZB-H1 is 1F1B's order with each rank's W's r micro-batches behind its B's and the input
    gradient sent before the W; interleaved with v=2 sweeps groups of p micro-batches per chunk."""
    sched = zb_h1(3, 4)
    compute = [[str(a) for a in actions if a.kind in ("F", "B", "W")] for actions in sched]
    assert compute[0] == ["F0", "F1", "F2", "B0", "W0", "F3", "B1", "W1", "B2", "W2", "B3", "W3"]
    assert compute[2] == ["F0", "B0", "F1", "B1", "F2", "B2", "W0", "F3", "B3", "W1", "W2", "W3"]
    assert [str(a) for a in sched[1]][7:10] == ["B0", "SEND_GRAD0", "RECV_ACT2"]  # W0 comes a round later
    forwards = [str(a) for a in interleaved_1f1b(2, 4)[0] if a.kind == "F"]
    assert forwards == ["F0", "F1", "F0c1", "F1c1", "F2", "F3", "F2c1", "F3c1"]


def test_bad_arguments_say_what_to_change():
    with pytest.raises(ValueError, match="microbatches=6 must be a multiple of 4; use 4 or 8"):
        interleaved_1f1b(4, 6)
    with pytest.raises(ValueError, match="microbatches=3 must be a multiple of 4; use 4$"):
        interleaved_1f1b(4, 3, virtual_stages=3)
    with pytest.raises(ValueError, match="virtual_stages >= 1"):
        interleaved_1f1b(4, 8, virtual_stages=0)
    with pytest.raises(ValueError, match="gpipe runs 1 model chunk.* pass virtual_stages=1 .* use interleaved_1f1b"):
        gpipe(2, 4, virtual_stages=2)
    with pytest.raises(ValueError, match="zb_v runs 2 model chunk.* pass virtual_stages=2"):
        zb_v(2, 4, virtual_stages=3)
    with pytest.raises(ValueError, match="stages >= 1 and microbatches >= 1"):
        zb_h1(2, 0)
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'; choose one of gpipe, 1f1b"):
        chunks_per_rank("zigzag")
    with pytest.raises(ValueError, match="needs a time for each of F, B, W"):
        simulate(zb_h1(2, 2), costs={"F": 1, "B": 2})
    assert chunks_per_rank("interleaved_1f1b", 3) == 3 and chunks_per_rank("zb_v") == 2


def _without(actions, drop):
    return [a for a in actions if a != drop]


def test_simulate_catches_broken_schedules():
    """Each check can fail: a deadlock, a crossed channel (whole or by chunk), a W before its B, a W
    missing, a send before its compute."""
    with pytest.raises(ValueError, match="deadlock"):  # both stages wait for the other first
        simulate([[Action("RECV_GRAD", 0), Action("F", 0), Action("SEND_ACT", 0), Action("B", 0)],
                  [Action("RECV_ACT", 0), Action("F", 0), Action("B", 0), Action("SEND_GRAD", 0)]])
    with pytest.raises(ValueError, match="expected RECV_ACT0 but the channel delivers micro-batch 1"):
        simulate([[Action("F", 1), Action("SEND_ACT", 1)], [Action("RECV_ACT", 0), Action("F", 0)]])
    # Interleaved p=2: rank 0 receives chunk 1's inputs in the order rank 1 sent them; swap two.
    sched = interleaved_1f1b(2, 2)
    i, j = [n for n, a in enumerate(sched[0]) if a.kind == "RECV_ACT"][:2]
    sched[0][i], sched[0][j] = sched[0][j], sched[0][i]
    with pytest.raises(ValueError, match="rank 0 expected RECV_ACT1c1 but the channel delivers micro-batch 0"):
        simulate(sched)
    sched = zb_h1(2, 2)  # rank 1: F0 B0 F1 B1 W0 W1 (and the hops): move W0 before B0
    w = sched[1].index(Action("W", 0))
    sched[1].insert(sched[1].index(Action("B", 0)), sched[1].pop(w))
    with pytest.raises(ValueError, match="rank 1 runs W0 before its B"):
        simulate(sched)
    sched = zb_v(2, 4)
    sched[1] = _without(sched[1], Action("W", 3, 1))
    with pytest.raises(ValueError, match=r"rank 1 never runs W for \(micro-batch, chunk\) \[\(3, 1\)\]"):
        simulate(sched)
    sched = zb_v(2, 4)
    s = sched[0].index(Action("SEND_ACT", 0))
    sched[0].insert(s - 1, sched[0].pop(s))  # the send before its forward
    with pytest.raises(ValueError, match="rank 0 runs SEND_ACT0 before computing it"):
        simulate(sched)


def test_costs_change_the_timing_not_the_order():
    """Given costs are taken per action: with B twice as slow as F in ZB-H1, rank 0 still does all
    its work and the step gets longer, not reordered."""
    unit, slow = simulate(zb_h1(3, 6)), simulate(zb_h1(3, 6), costs={"F": 1, "B": 2, "W": 1})
    assert unit["order"] == slow["order"]
    assert slow["busy"] == [24] * 3 and slow["makespan"] > unit["makespan"]
    _check_timing(slow, {"F": 1, "B": 2, "W": 1})


def test_chrome_trace_has_one_numbered_row_per_rank_sorted_by_stage(tmp_path):
    """The trace format wants numeric thread ids: one per rank, named after its stage and sorted by
    it; every action becomes a complete ("X") event, in microseconds from the earliest start."""
    from minipar.pipeline import RankTimeline, draw_timeline, write_trace
    rows = [RankTimeline(1, 3, [("F0", 10.5, 10.75), ("B0", 11.0, 11.5)]),
            RankTimeline(0, 0, [("F0", 10.0, 10.25), ("F1", 10.25, 10.5), ("B0", 11.5, 12.0)])]
    trace = json.loads(open(write_trace(rows, str(tmp_path / "t.json"))).read())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    assert names == {0: "stage 0 (rank 0)", 3: "stage 1 (rank 3)"}
    order = {e["tid"]: e["args"]["sort_index"] for e in trace if e["name"] == "thread_sort_index"}
    assert order[0] < order[3]
    boxes = sorted((e["tid"], e["name"], e["ts"], e["dur"], e["cat"]) for e in trace if e["ph"] == "X")
    assert boxes == [(0, "B0", 1.5e6, 0.5e6, "backward"), (0, "F0", 0.0, 0.25e6, "forward"),
                     (0, "F1", 0.25e6, 0.25e6, "forward"), (3, "B0", 1.0e6, 0.5e6, "backward"),
                     (3, "F0", 0.5e6, 0.25e6, "forward")]
    assert all(isinstance(e["tid"], int) for e in trace)
    png = tmp_path / "t.png"
    said = draw_timeline(rows, str(png))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert said.startswith("no PNG: matplotlib is not installed") and not png.exists()
    else:
        assert said == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
