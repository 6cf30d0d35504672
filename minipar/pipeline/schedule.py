"""Pipeline schedules as data: for each stage, the list of actions it performs in one step.

A schedule is a pure function of (stages, microbatches); it can be printed,
drawn and checked without any process (see `simulate`). One executor runs any
such list. Actions:

    F i          forward of micro-batch i on this stage
    B i          backward of micro-batch i on this stage
    SEND_ACT i   send micro-batch i's output activation to the next stage
    RECV_ACT i   receive micro-batch i's input activation from the previous stage
    SEND_GRAD i  send the gradient of micro-batch i's input to the previous stage
    RECV_GRAD i  receive the gradient of micro-batch i's output from the next stage

Sends are asynchronous (they never wait for the receiver); receives block. The
first stage has no RECV_ACT/SEND_GRAD, the last no SEND_ACT/RECV_GRAD.

GPipe: every forward, then every backward: a stage holds all m micro-batches'
activations at once. 1F1B: stage s runs (p - 1 - s) warm-up forwards, then
alternates one forward and one backward, then drains the remaining
backwards: it never holds more than p - s micro-batches' activations. Both
have the same bubble, (p - 1) / (m + p - 1) of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("F", "B", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD")


@dataclass(frozen=True)
class Action:
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def _forward(stage: int, stages: int, i: int) -> list[Action]:
    return ([Action("RECV_ACT", i)] if stage > 0 else []) + [Action("F", i)] + \
        ([Action("SEND_ACT", i)] if stage < stages - 1 else [])


def _backward(stage: int, stages: int, i: int) -> list[Action]:
    return ([Action("RECV_GRAD", i)] if stage < stages - 1 else []) + [Action("B", i)] + \
        ([Action("SEND_GRAD", i)] if stage > 0 else [])


def _check(stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise ValueError(f"a schedule needs stages >= 1 and microbatches >= 1, got {stages} and {microbatches}")


def gpipe(stages: int, microbatches: int) -> list[list[Action]]:
    """All forwards, then all backwards (in the same order), on every stage."""
    _check(stages, microbatches)
    return [[a for i in range(microbatches) for a in _forward(s, stages, i)]
            + [a for i in range(microbatches) for a in _backward(s, stages, i)] for s in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> list[list[Action]]:
    """Warm-up forwards, then one forward / one backward, then the remaining backwards."""
    _check(stages, microbatches)
    out = []
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        acts: list[Action] = []
        for i in range(warmup):
            acts += _forward(s, stages, i)
        for k in range(microbatches - warmup):  # steady state: F(warmup + k), then B(k)
            acts += _forward(s, stages, warmup + k)
            acts += _backward(s, stages, k)
        for i in range(microbatches - warmup, microbatches):
            acts += _backward(s, stages, i)
        out.append(acts)
    return out


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def simulate(schedule: list[list[Action]]) -> dict:
    """Run a schedule on paper. Sends are buffered, receives wait for their message.

    Returns {"order": [(stage, action), ...] in one valid execution order,
    "peak_live": [most micro-batches with a forward done and backward pending, per stage]}.
    Raises ValueError on a deadlock (every unfinished stage waits on a receive), a receive
    that gets another micro-batch than it expects, or a dependency broken.
    """
    stages = len(schedule)
    pos = [0] * stages
    channels: dict[tuple[int, int, str], list[int]] = {}  # (src, dst, kind) -> FIFO of micro-batches
    live = [set() for _ in range(stages)]
    peak = [0] * stages
    order = []
    while any(pos[s] < len(schedule[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while pos[s] < len(schedule[s]):
                a = schedule[s][pos[s]]
                if a.kind in ("RECV_ACT", "RECV_GRAD"):
                    src = s - 1 if a.kind == "RECV_ACT" else s + 1
                    queue = channels.get((src, s, a.kind.replace("RECV", "SEND")), [])
                    if not queue:
                        break  # blocked
                    got = queue.pop(0)
                    if got != a.microbatch:
                        raise ValueError(f"stage {s} expected {a} but the channel delivers micro-batch {got}")
                elif a.kind in ("SEND_ACT", "SEND_GRAD"):
                    dst = s + 1 if a.kind == "SEND_ACT" else s - 1
                    if not 0 <= dst < stages:
                        raise ValueError(f"stage {s}: {a} has no peer")
                    channels.setdefault((s, dst, a.kind), []).append(a.microbatch)
                elif a.kind == "F":
                    if a.microbatch in live[s]:
                        raise ValueError(f"stage {s} runs {a} twice")
                    live[s].add(a.microbatch)
                    peak[s] = max(peak[s], len(live[s]))
                elif a.kind == "B":
                    if a.microbatch not in live[s]:
                        raise ValueError(f"stage {s} runs {a} before its forward")
                    live[s].remove(a.microbatch)
                order.append((s, a))
                pos[s] += 1
                progressed = True
        if not progressed:
            waiting = {s: str(schedule[s][pos[s]]) for s in range(stages) if pos[s] < len(schedule[s])}
            raise ValueError(f"deadlock: every unfinished stage waits on a receive: {waiting}")
    leftovers = {k: v for k, v in channels.items() if v}
    if leftovers:
        raise ValueError(f"messages sent but never received: {leftovers}")
    return {"order": order, "peak_live": peak}
