"""Pipeline schedules as data: for each rank, the list of actions it performs in one step.

A schedule is a pure function of (stages, microbatches[, virtual_stages]); it can be printed,
drawn and checked without any process (`minipar.pipeline.simulator`). One executor runs any
such list.

Model pieces. The model is cut into p * v consecutive pieces, the virtual stages 0 .. p*v - 1,
and each of the p ranks holds v of them, its chunks 0 .. v-1 (`virtual_stage`):

    "interleaved"  chunk c of rank r is virtual stage c*p + r: the model loops over the ranks v times
    "v"            (v = 2) chunk 0 of rank r is virtual stage r, chunk 1 is 2p-1-r: down the ranks and
                   back up, so the last rank holds both sides of the turn (p-1 and p) and the first
                   rank both ends of the model

With one chunk both are the plain pipeline, rank r holds stage r. Activations go from virtual stage
k to k+1, gradients from k+1 back to k. Every action names a micro-batch and the chunk on this rank
(chunk 0 by default):

    F i          forward of micro-batch i
    B i          backward of micro-batch i; in a schedule that has W actions, only the gradient of
                 the chunk's input (the critical path: the previous stage waits for it), and what
                 the weight gradient needs (saved activations, the output gradient) is kept for W
    W i          the gradient of the chunk's weights for micro-batch i, deferred off the critical
                 path; only in schedules that split the backward (zb_h1, zb_v)
    SEND_ACT i   send micro-batch i's output activation to the holder of the next virtual stage
    RECV_ACT i   receive micro-batch i's input activation from the holder of the previous one
    SEND_GRAD i  send the gradient of micro-batch i's input back to the previous virtual stage
    RECV_GRAD i  receive the gradient of micro-batch i's output from the next virtual stage

The peer of a send or receive is not in the action: it is the rank that holds the neighbouring
virtual stage. Where that is the same rank (ZB-V's turn on the last rank, virtual stage p-1 -> p)
the schedule still has a SEND/RECV pair, so every hop between pieces looks alike; an executor hands
the tensor over in memory. Sends are asynchronous (they never wait for the receiver); receives block.
Between two ranks, messages of one kind are received in the order they were sent (`simulate`
checks this), so an executor may match them by order alone.

GPipe: every forward, then every backward: a rank holds all m micro-batches' activations at once.
1F1B: rank r runs (p - 1 - r) warm-up forwards, then alternates one forward and one backward, then
drains the remaining backwards: it never holds more than p - r. Both idle (p-1) / (m+p-1) of the
step. Interleaved 1F1B (Megatron-LM) gives each rank v thinner chunks: the ramp at either end is
made of chunk-sized steps, so the idle share falls to (p-1) / (v*m + p-1), for a little more memory
and v times the messages. ZB-H1 and ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism") split the
backward: only B is on the path back to the first stage, W fills time the rank would wait. With
F = B = W, ZB-H1 idles (p-1) / (3m + p-1), a third of 1F1B's idle time, holding at most p
micro-batches on any rank (1F1B's peak); ZB-V holds 2p half-size chunks (again p stages) and each
rank is busy from its first action to its last: its only idle time is the ramp at either end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

KINDS = ("F", "B", "W", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD")
PLACEMENTS = ("interleaved", "v")


@dataclass(frozen=True)
class Action:
    kind: str
    microbatch: int
    chunk: int = 0  # which of this rank's model chunks; 0 in a one-chunk schedule

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


class Schedule(list):
    """``schedule[rank]`` is that rank's list of actions, in order. A list, plus the layout of the
    model pieces: ``chunks`` per rank, placed by ``placement`` ("interleaved" or "v")."""

    def __init__(self, per_rank: list[list[Action]], chunks: int = 1, placement: str = "interleaved") -> None:
        super().__init__(per_rank)
        self.chunks, self.placement = chunks, placement


def virtual_stage(rank: int, chunk: int, stages: int, placement: str = "interleaved") -> int:
    """The global model piece (0 .. stages * chunks - 1) that ``chunk`` of ``rank`` holds."""
    if placement not in PLACEMENTS or (placement == "v" and chunk not in (0, 1)):
        raise ValueError(f"placement={placement!r} chunk={chunk}: choose one of {PLACEMENTS} ('v' has chunks 0, 1)")
    if placement == "v":
        return rank if chunk == 0 else 2 * stages - 1 - rank
    return chunk * stages + rank


def holder(vstage: int, stages: int, placement: str = "interleaved") -> tuple[int, int]:
    """(rank, chunk) holding virtual stage ``vstage``: the inverse of `virtual_stage`."""
    chunk, rank = divmod(vstage, stages)
    if placement == "v" and chunk == 1:
        rank = stages - 1 - rank
    return rank, chunk


@dataclass(frozen=True)
class _Layout:
    """Writes the hops around a compute action: a receive before it and a send after it, unless the
    virtual stage is the first (nothing to receive forward) or the last (the loss is here)."""

    stages: int
    chunks: int = 1
    placement: str = "interleaved"

    def _ends(self, rank: int, chunk: int) -> tuple[bool, bool]:
        k = virtual_stage(rank, chunk, self.stages, self.placement)
        return k == 0, k == self.stages * self.chunks - 1

    def forward(self, rank: int, i: int, chunk: int = 0) -> list[Action]:
        first, last = self._ends(rank, chunk)
        return ([] if first else [Action("RECV_ACT", i, chunk)]) + [Action("F", i, chunk)] + \
            ([] if last else [Action("SEND_ACT", i, chunk)])

    def backward(self, rank: int, i: int, chunk: int = 0) -> list[Action]:
        first, last = self._ends(rank, chunk)
        return ([] if last else [Action("RECV_GRAD", i, chunk)]) + [Action("B", i, chunk)] + \
            ([] if first else [Action("SEND_GRAD", i, chunk)])


def _check(stages: int, microbatches: int, virtual_stages: int, name: str, chunks: int | None = None) -> None:
    if stages < 1 or microbatches < 1:
        raise ValueError(f"a schedule needs stages >= 1 and microbatches >= 1, got {stages} and {microbatches}")
    if chunks is not None and virtual_stages != chunks:
        other = "; for more chunks per rank use interleaved_1f1b" if chunks == 1 else ""
        raise ValueError(f"{name} runs {chunks} model chunk(s) per rank: pass virtual_stages={chunks} "
                         f"(got {virtual_stages}){other}")


def gpipe(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """All forwards, then all backwards (in the same order), on every rank."""
    _check(stages, microbatches, virtual_stages, "gpipe", chunks=1)
    pipe = _Layout(stages)
    return Schedule([[a for i in range(microbatches) for a in pipe.forward(r, i)]
                     + [a for i in range(microbatches) for a in pipe.backward(r, i)] for r in range(stages)])


def one_f_one_b(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Warm-up forwards, then one forward / one backward, then the remaining backwards (rank r holds
    at most p - r micro-batches)."""
    _check(stages, microbatches, virtual_stages, "1f1b", chunks=1)
    pipe, out = _Layout(stages), []
    for r in range(stages):
        warmup = min(stages - 1 - r, microbatches)
        acts: list[Action] = []
        for i in range(warmup):
            acts += pipe.forward(r, i)
        for k in range(microbatches - warmup):  # steady state: F(warmup + k), then B(k)
            acts += pipe.forward(r, warmup + k) + pipe.backward(r, k)
        for i in range(microbatches - warmup, microbatches):
            acts += pipe.backward(r, i)
        out.append(acts)
    return Schedule(out)


def interleaved_1f1b(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Megatron-LM's interleaved 1F1B: each rank holds ``virtual_stages`` chunks, placed "interleaved".

    A rank runs v*m forwards, numbered k = 0, 1, ...; they sweep the chunks in groups of p
    micro-batches (micro-batches 0..p-1 through chunk 0, the same through chunk 1, ..., then p..2p-1
    through chunk 0 ...), because micro-batch i leaves the last rank's chunk c just as rank 0 finishes
    its group on chunk c and can take it on chunk c+1. Backwards follow the same numbering with the
    chunks reversed. Rank r warms up with (v-1)*p forwards (the first v-1 loops of the first group)
    plus 2*(p-1-r) (the first micro-batch's trip to the last rank and its gradient's trip back),
    then alternates one forward and one backward, then drains the backwards. It holds at most that
    warm-up + 1 chunk activations: p + (p-1)/v full stages on rank 0.
    Raises ValueError unless virtual_stages >= 1 and, with more than one chunk, microbatches is a
    multiple of stages. virtual_stages=1 is plain 1F1B.
    """
    p, m, v = stages, microbatches, virtual_stages
    _check(p, m, v, "interleaved_1f1b")
    if v < 1:
        raise ValueError(f"interleaved_1f1b needs virtual_stages >= 1 model chunks per rank, got {v}")
    if v == 1:
        return one_f_one_b(p, m)
    if m % p:
        fits = " or ".join(str(x) for x in (m - m % p, m - m % p + p) if x)
        raise ValueError(f"interleaved_1f1b sends micro-batches round the ranks in groups of stages={p}: "
                         f"microbatches={m} must be a multiple of {p}; use {fits}")
    pipe = _Layout(p, v)

    def nth(k: int, backward: bool) -> tuple[int, int]:  # the k-th forward (backward): (micro-batch, chunk)
        group, within = divmod(k, p * v)
        chunk = within // p
        return group * p + within % p, v - 1 - chunk if backward else chunk

    total, out = v * m, []
    for r in range(p):
        warmup = min(total, (v - 1) * p + 2 * (p - 1 - r))
        acts = [a for k in range(warmup) for a in pipe.forward(r, *nth(k, False))]
        for k in range(total - warmup):
            acts += pipe.forward(r, *nth(warmup + k, False)) + pipe.backward(r, *nth(k, True))
        acts += [a for k in range(total - warmup, total) for a in pipe.backward(r, *nth(k, True))]
        out.append(acts)
    return Schedule(out, chunks=v)


def zb_h1(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """ZB-H1: 1F1B's order, each backward split into B (sent back at once) and a W that rank r runs
    r micro-batches late, in the time 1F1B's rank waited for the longer backward.

    With F = B = W the last rank's B comes back p-1 steps sooner than 1F1B's full backward, so the
    idle time per rank is p-1 instead of 3(p-1): a bubble of (p-1) / (3m + p-1). The lag fills
    every rank to p activations (a micro-batch is held until its W), 1F1B's peak on rank 0, and
    no more: the later ranks hold more than in 1F1B, rank 0 the same. (Keeping 1F1B's p-r on every
    rank forces the last rank into F B W order, and no order then idles less than 2(p-1) per rank.)
    """
    _check(stages, microbatches, virtual_stages, "zb_h1", chunks=1)
    p, m = stages, microbatches
    pipe, out = _Layout(p), []
    for r in range(p):
        warmup, lag = min(p - 1 - r, m), r

        def late_w(k: int) -> list[Action]:  # after the k-th backward: the W of micro-batch k - lag
            return [Action("W", k - lag)] if k >= lag else []

        acts = [a for i in range(warmup) for a in pipe.forward(r, i)]
        for k in range(m - warmup):
            acts += pipe.forward(r, warmup + k) + pipe.backward(r, k) + late_w(k)
        for k in range(m - warmup, m):
            acts += pipe.backward(r, k) + late_w(k)
        acts += [Action("W", i) for i in range(max(0, m - lag), m)]
        out.append(acts)
    return Schedule(out)


def zb_v(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """ZB-V: two chunks per rank placed in a "v", the backward split into B and W.

    In chunk-sized time steps (F = B = W), rank r starts r steps late and then never waits:
      warm-up  2(p-r)-1 chunk-0 forwards, until micro-batch 0 comes back up the v to chunk 1
               (2p-1-r steps after rank 0 began); then r times chunk 1, chunk 0: the chunk-1 inputs
               arrive every other step
      fill     p-r times F B W on chunk 1: chunk 1's gradients have started to come back, chunk 0's
               not yet; the rank holds 2p chunk activations (p full stages, 1F1B's peak on rank 0),
               so each new forward waits for a W
      steady   F B W on chunk 0, F B W on chunk 1, while there are forwards
      drain    r times B on chunk 0, B on chunk 1; then p-r times B, W on chunk 0 (its gradients
               come down one every other step); then the W's left
    so every rank is busy for exactly 6m steps: a parallelogram. Its only idle time is the ramp at
    either end, p-1 chunk steps per rank (`simulate`'s bubble (p-1) / (6m + p-1), the least any
    schedule can have: the last rank cannot start sooner), which steps that overlap (no optimizer
    barrier between them, as in the paper) fill: "zero bubble". It needs 2p micro-batches in
    flight; with fewer it runs the same order with the missing micro-batches left out.
    """
    _check(stages, microbatches, virtual_stages, "zb_v", chunks=2)
    p, m = stages, microbatches
    n = max(m, 2 * p)  # the pattern's micro-batch count; those >= m are dropped below
    f0, b0, w0, f1, b1, w1 = ("F", 0), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1)
    pipe, out = _Layout(p, 2, "v"), []
    for r in range(p):
        slots = [f0] * (2 * (p - r) - 1) + [f1, f0] * r                   # warm-up: 2p-1 forwards
        slots += [f1, b1, w1] * (p - r)                                    # fill
        with_f0 = n - (2 * p - 1 - r)                                      # chunk-0 forwards left
        slots += [f0, b0, w0, f1, b1, w1] * with_f0 + [b0, w0, f1, b1, w1] * (n - p - with_f0)  # steady
        slots += [b0, b1] * r + [b0, w0] * (p - r) + [w1] * r + [w0] * r   # drain
        seen: dict[tuple[str, int], int] = {}
        acts = []
        for kind, chunk in slots:  # each (kind, chunk) takes the micro-batches in order
            i = seen[kind, chunk] = seen.get((kind, chunk), -1) + 1
            if i < m:  # dropping whole micro-batches keeps a deadlock-free order deadlock-free
                acts += pipe.forward(r, i, chunk) if kind == "F" else \
                    pipe.backward(r, i, chunk) if kind == "B" else [Action("W", i, chunk)]
        out.append(acts)
    return Schedule(out, chunks=2, placement="v")


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b, "zb_h1": zb_h1, "zb_v": zb_v}
_FIXED_CHUNKS = {"gpipe": 1, "1f1b": 1, "zb_h1": 1, "zb_v": 2}


def chunks_per_rank(name: str, virtual_stages: int | None = None) -> int:
    """How many model chunks each rank holds under schedule ``name``: fixed, or for interleaved_1f1b
    ``virtual_stages`` (its default 2). Every schedule function takes ``virtual_stages`` and refuses
    a count it cannot run."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return _FIXED_CHUNKS.get(name) or (2 if virtual_stages is None else virtual_stages)
