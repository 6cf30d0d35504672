"""Two halves of work on one rank, each computing while the other's collective is in flight.

DualPipe's overlapped pair runs the forward of one micro-batch and the backward of another on one
rank. Both are ordinary code with deep call stacks (a model's forward; autograd's backward), and
each has collectives in the middle (the MoE dispatch and combine all-to-alls). The pair wants:

    forward:   compute ... launch A1 |                     | wait A1, compute ... launch A2 |  ...
    backward:                        | compute ... launch G1 |                               | wait G1 ...

each half handing over to the other right after it launches a collective, and taking its turn back
to wait for it: the collective is in flight during the other half's compute. That is a pair of
coroutines. Python's generators cannot yield from inside autograd's engine or a module's forward,
so `Interleave` runs each half on a thread of its own and lets exactly one of them run at a time:
a half gives the turn away only at `switch` (called by a collective it launched, through its
owner's `WhileInFlight`) and when it finishes. The order of every launch, wait and compute is then
fixed by the program, the same on every rank and on every run, as if one thread ran it; the threads
only keep the two call stacks. Every rank of a collective group runs the same pair in the same
order, so their collectives match.

Nothing runs at the same time as anything else on this rank except the communication itself (which
is the point); the arithmetic of each half is that of running it alone, so results are bitwise
those of the forward, then the backward.
"""

from __future__ import annotations

import threading
from typing import Callable


class WhileInFlight:
    """What a collective launched by its owner (an MoE layer) runs before waiting for it: nothing
    (``run`` None, the collective is waited at once) or the other half of a pair (`Interleave.switch`)."""

    def __init__(self) -> None:
        self.run: Callable[[], None] | None = None

    def __bool__(self) -> bool:
        return self.run is not None

    def __call__(self) -> None:
        if self.run is not None:
            self.run()


class Interleave:
    """Runs ``first`` (on this thread) and ``second`` (on a helper thread) as two coroutines: ``first``
    starts; a half that calls ``switch(its side)`` hands the turn to the other and gets it back when
    the other switches or finishes. An exception in either half is raised here once both have stopped.
    With a ``clock``, ``spans`` lists when each half ran, (label, clock() at start, at end), the
    labels set by `label`: a timeline of the pair with nothing counted twice."""

    def __init__(self, clock: Callable[[], object] | None = None) -> None:
        self._turn = threading.Condition()
        self._running = 0                  # the side (0: first, 1: second) whose turn it is
        self._done = [False, False]
        # When each half ran: ``clock()`` read at every hand-over; (label, start, end) in order.
        self._clock, self.spans = clock, []
        self._labels, self._since = ["", ""], [None, None]

    def label(self, side: int, name: str) -> None:
        """The running half ``side`` names what it does from now on: its spans after this carry ``name``."""
        self._stop(side)
        self._labels[side] = name
        self._start(side)

    def _start(self, side: int) -> None:
        if self._clock is not None:
            self._since[side] = self._clock()

    def _stop(self, side: int) -> None:
        if self._clock is not None and self._since[side] is not None:
            if self._labels[side]:  # (an unnamed stretch, before the half's first `label`, is not kept)
                self.spans.append((self._labels[side], self._since[side], self._clock()))
            self._since[side] = None

    def switch(self, side: int) -> None:
        """Called by the half ``side`` (0 or 1) after launching a collective: the other half runs until
        it switches back or finishes; then this half goes on (and waits for its collective)."""
        with self._turn:
            if self._done[1 - side]:
                return
            self._stop(side)
            self._running = 1 - side
            self._turn.notify_all()
            self._turn.wait_for(lambda: self._running == side)
            self._start(side)

    def run(self, first: Callable[[], None], second: Callable[[], None]) -> None:
        errors: list[BaseException | None] = [None, None]

        def half(side: int, fn: Callable[[], None]) -> None:
            try:
                if side == 1:
                    with self._turn:
                        self._turn.wait_for(lambda: self._running == 1)
                self._start(side)
                fn()
            except BaseException as e:  # raised on this (the caller's) thread below
                errors[side] = e
            finally:
                with self._turn:  # finished: the other half keeps the turn to the end
                    self._stop(side)
                    self._done[side] = True
                    self._running = 1 - side
                    self._turn.notify_all()

        helper = threading.Thread(target=half, args=(1, second), name="minipar-pair-backward", daemon=True)
        helper.start()
        half(0, first)
        helper.join()
        for e in errors:
            if e is not None:
                raise e
