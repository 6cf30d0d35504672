"""Pipeline schedules as plain Python: no processes. For any stage and micro-batch count, every
micro-batch is forwarded and backwarded exactly once on every stage, dependencies hold, sends
match receives and nothing deadlocks; 1F1B holds at most stages - stage_index micro-batches'
activations, GPipe all of them. A step's timeline exports as a Chrome/Perfetto trace."""

import json

import pytest
from hypothesis import given, strategies as st

from minipar.pipeline import SCHEDULES, Action, gpipe, one_f_one_b, simulate


@given(name=st.sampled_from(sorted(SCHEDULES)), stages=st.integers(1, 8), microbatches=st.integers(1, 16))
def test_every_schedule_is_complete_ordered_and_deadlock_free(name, stages, microbatches):
    schedule = SCHEDULES[name](stages, microbatches)
    result = simulate(schedule)  # raises on deadlock, mismatched channels, B before F, F twice
    for s, actions in enumerate(schedule):
        for kind in ("F", "B"):
            assert sorted(a.microbatch for a in actions if a.kind == kind) == list(range(microbatches))
        if s == 0:
            assert not any(a.kind in ("RECV_ACT", "SEND_GRAD") for a in actions)
        if s == stages - 1:
            assert not any(a.kind in ("SEND_ACT", "RECV_GRAD") for a in actions)
    # Dependencies in the execution found: F(i) on s after F(i) on s-1; B(i) on s after B(i) on s+1.
    when = {(s, str(a)): t for t, (s, a) in enumerate(result["order"])}
    for s in range(stages):
        for i in range(microbatches):
            if s > 0:
                assert when[(s, f"F{i}")] > when[(s - 1, f"F{i}")]
            if s < stages - 1:
                assert when[(s, f"B{i}")] > when[(s + 1, f"B{i}")]
            assert when[(s, f"B{i}")] > when[(s, f"F{i}")]
    peak = result["peak_live"]
    if name == "1f1b":
        assert all(peak[s] <= stages - s for s in range(stages))
    else:
        assert peak == [microbatches] * stages


def test_one_f_one_b_shape_for_four_stages():
    """The textbook picture: stage 0 warms up with three forwards, the last stage alternates at once."""
    sched = one_f_one_b(4, 6)
    compute = [[str(a) for a in actions if a.kind in ("F", "B")] for actions in sched]
    assert compute[0] == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    assert compute[3] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]
    assert [str(a) for a in sched[1][:3]] == ["RECV_ACT0", "F0", "SEND_ACT0"]


def test_simulate_catches_a_deadlock_and_a_crossed_channel():
    # Both stages wait for the other first.
    with pytest.raises(ValueError, match="deadlock"):
        simulate([[Action("RECV_GRAD", 0), Action("F", 0), Action("SEND_ACT", 0), Action("B", 0)],
                  [Action("RECV_ACT", 0), Action("F", 0), Action("B", 0), Action("SEND_GRAD", 0)]])
    with pytest.raises(ValueError, match="expected RECV_ACT0 but the channel delivers micro-batch 1"):
        simulate([[Action("F", 1), Action("SEND_ACT", 1)], [Action("RECV_ACT", 0), Action("F", 0)]])
    with pytest.raises(ValueError, match="stages >= 1 and microbatches >= 1"):
        gpipe(2, 0)


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
