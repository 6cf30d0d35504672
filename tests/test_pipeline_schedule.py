"""Pipeline schedules as plain Python: no processes. For any stage and micro-batch count, every
micro-batch is forwarded and backwarded exactly once on every stage, dependencies hold, sends
match receives and nothing deadlocks; 1F1B holds at most stages - stage_index micro-batches'
activations, GPipe all of them."""

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
