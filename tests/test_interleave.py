"""`minipar.core.interleave`: two halves run as coroutines, one at a time, handing over at `switch`.

The order is the program's: a half runs until it switches or ends, then the other runs; a half whose
partner has ended runs on without waiting; an exception in either half is raised by `run` after both
have stopped, and the other half still runs to its end (its collectives must match its peers').
"""

from __future__ import annotations

import threading

import pytest

from minipar.core.interleave import Interleave, WhileInFlight


def _halves(pair: Interleave, log: list, steps: tuple[int, int], fail: int | None = None):
    def half(side: int):
        def run():
            for i in range(steps[side]):
                log.append((side, i))
                if side == fail and i == 1:
                    raise RuntimeError(f"half {side} fails")
                pair.switch(side)
        return run
    return half(0), half(1)


@pytest.mark.parametrize("steps", [(3, 3), (1, 4), (4, 1), (0, 2), (2, 0)])
def test_the_halves_alternate_at_each_switch_and_the_longer_runs_on(steps):
    pair, log = Interleave(), []
    pair.run(*_halves(pair, log, steps))
    shared = min(steps)
    alternating = [(side, i) for i in range(shared) for side in (0, 1)]
    longer = 0 if steps[0] > steps[1] else 1
    rest = [(longer, i) for i in range(shared, steps[longer])]
    assert log == alternating + rest, log


def test_only_one_half_runs_at_a_time():
    pair, inside, overlaps = Interleave(), [0], []

    def half(side):
        def run():
            for _ in range(50):
                inside[0] += 1
                overlaps.append(inside[0])
                inside[0] -= 1
                pair.switch(side)
        return run
    pair.run(half(0), half(1))
    assert max(overlaps) == 1 and len(overlaps) == 100


@pytest.mark.parametrize("fail", [0, 1])
def test_an_error_in_either_half_is_raised_after_both_stopped(fail):
    pair, log = Interleave(), []
    with pytest.raises(RuntimeError, match=f"half {fail} fails"):
        pair.run(*_halves(pair, log, (3, 3), fail=fail))
    other = 1 - fail
    assert [i for side, i in log if side == other] == [0, 1, 2]  # the other half ran to its end
    assert not any(t.name == "minipar-pair-backward" for t in threading.enumerate())  # the helper has ended


def test_a_hook_runs_only_while_set():
    hook, calls = WhileInFlight(), []
    hook()
    assert not hook and calls == []
    hook.run = lambda: calls.append(1)
    hook()
    assert hook and calls == [1]


def test_spans_say_when_each_half_ran_under_its_labels_without_overlap():
    """With a clock, `spans` has one entry per stretch a half ran, in order, labelled as the half
    said; consecutive stretches never overlap (a tick counter as the clock)."""
    ticks = iter(range(1000))
    pair = Interleave(clock=lambda: next(ticks))

    def first():
        pair.label(0, "F")
        pair.switch(0)
        pair.switch(0)

    def second():
        pair.label(1, "B")
        pair.switch(1)
        pair.label(1, "W")
    pair.run(first, second)
    names = [name for name, _, _ in pair.spans]
    assert names == ["F", "B", "F", "B", "W", "F"], pair.spans
    ends = [(s, e) for _, s, e in pair.spans]
    assert all(s < e for s, e in ends) and all(e0 <= s1 for (_, e0), (s1, _) in zip(ends, ends[1:])), ends
