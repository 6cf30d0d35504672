"""Pipeline schedules as data: for each rank, the list of actions it performs in one step.

A schedule is a pure function of (stages, microbatches[, virtual_stages]); it can be printed,
drawn and checked without any process (`minipar.pipeline.simulator`). One executor runs any
such list.

The vocabulary (`Action`, its kinds, `Schedule`, the "interleaved" and "v" placements of the
model pieces) is `minipar.pipeline.actions`'s; DualPipeV, whose forward and backward run as
overlapped pairs, is `minipar.pipeline.dualpipe`'s. All are listed in `SCHEDULES`.

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

from typing import Callable

from .actions import KINDS, PLACEMENTS, Action, Layout, Schedule, holder, virtual_stage  # noqa: F401 (re-exported)
from .actions import check_counts as _check
from .dualpipe import dualpipe_v


def gpipe(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """All forwards, then all backwards (in the same order), on every rank."""
    _check(stages, microbatches, virtual_stages, "gpipe", chunks=1)
    pipe = Layout(stages)
    return Schedule([[a for i in range(microbatches) for a in pipe.forward(r, i)]
                     + [a for i in range(microbatches) for a in pipe.backward(r, i)] for r in range(stages)])


def one_f_one_b(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Warm-up forwards, then one forward / one backward, then the remaining backwards (rank r holds
    at most p - r micro-batches)."""
    _check(stages, microbatches, virtual_stages, "1f1b", chunks=1)
    pipe, out = Layout(stages), []
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
    pipe = Layout(p, v)

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
    pipe, out = Layout(p), []
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
    pipe, out = Layout(p, 2, "v"), []
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
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b, "zb_h1": zb_h1, "zb_v": zb_v,
    "dualpipe_v": dualpipe_v}
_FIXED_CHUNKS = {"gpipe": 1, "1f1b": 1, "zb_h1": 1, "zb_v": 2, "dualpipe_v": 2}


def placement_of(name: str) -> str:
    """Where schedule ``name`` puts a rank's chunks: "v" for zb_v and dualpipe_v, else "interleaved"."""
    return "v" if name in ("zb_v", "dualpipe_v") else "interleaved"


def chunks_per_rank(name: str, virtual_stages: int | None = None) -> int:
    """How many model chunks each rank holds under schedule ``name``: fixed, or for interleaved_1f1b
    ``virtual_stages`` (its default 2). Every schedule function takes ``virtual_stages`` and refuses
    a count it cannot run."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return _FIXED_CHUNKS.get(name) or (2 if virtual_stages is None else virtual_stages)
