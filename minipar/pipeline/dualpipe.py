"""DualPipeV: the V-shaped DualPipe (DeepSeek-V3), whose forward of one micro-batch and backward of
another run as an overlapped pair, so one's communication is in flight during the other's compute.

The model pieces sit as in ZB-V ("v" placement: rank r holds virtual stages r, its chunk 0, and
2p-1-r, its chunk 1); micro-batches enter at rank 0, go down chunk 0 and back up chunk 1. A rank's
step, in eight phases (p ranks, m micro-batches, rank r; F0 = forward on chunk 0, B1 = backward on
chunk 1, and so on):

    1  2(p-1-r)     F0            fill chunk 0 until the first micro-batch turns at the last rank
    2  r+1          F0 F1         chunk 1's inputs start to come back up
    3  p-1-r        B1 W1 F1      the first gradients; the weight gradient right after its B
    4  m-2p+r+1     F0+B1, F1+B0  the steady state: two overlapped pairs (a forward on one chunk with
                                  a whole backward, B then W, on the other)
    5  p-1-r        B1, F1+B0     chunk 0's forwards are done
    6  r+1          B1 B0         the second half of these defer their W (zero-bubble style)...
    7  p-1-r        W B0          ...and the deferred W's fill the wait for chunk 0's gradients
    8  r+1          W             the deferred W's left

The deferred W's run in the order their B's ran (a queue). On the last rank the first steady pair
is not overlapped (the forward's output turns on this rank into chunk 1's input: nothing to hide).

The pair as data. No new compute kind: a pair is written as the forward's actions, then the
backward's, with the backward's gradient receive hoisted in front as an IRECV_GRAD (a receive
posted, not waited):

    IRECV_GRAD j c1, RECV_ACT i c0, F i c0, SEND_ACT i c0, B j c1, SEND_GRAD j c1, W j c1

so the simulator times it like any other list and the timeline draws F and B as they ran. What
overlaps what in p2p is read off the list: micro-batch j's gradient is in flight during F i (and its
wait is after F i's compute), F i's output is in flight during B j and W j (sends never wait).

The pairs are also named (``Schedule.pairs[rank]``: index of the F -> index of the B, every
overlapped pair, those on the last piece too, whose B receives nothing), so that the executor can
run the two halves together: where their chunks hold MoE layers over ep > 1 it runs F on this
thread and B on a second, one at a time (`minipar.core.interleave`), each handing over to the other
right after it launches an all-to-all and taking its turn back to wait for it:

    F i:  attention, route | dispatch in flight       | experts | combine in flight      | ...
    B j:                   | combine^T's grads ...    |         | experts' grads ...     | ...

so each dispatch and combine (forward) and each adjoint (backward) flies during the other half's
compute, as DeepSeek-V3 hides its expert-parallel traffic. Where B j's whole backward is W's (the
first piece: no input gradient), W j runs inside the pair. The arithmetic of each half is unchanged:
results are bitwise those of running them one after the other (`without_overlap`, and
tests/test_dualpipe_all_to_all.py).

Cost. On one device the two halves of a pair still take F + B + W of compute: what the pair hides
is communication, which `simulate` counts as free. Its bubble there is that of the phases above
(`tests/test_dualpipe.py` prints it beside ZB-V's and 1F1B's): with F = B = W and m >= 2p it is
ZB-V's, (p-1) / (6m + p-1), the ramp no schedule avoids. Every rank holds at most 2p + 1 chunk
activations (ZB-V: 2p), p + 1/2 full stages. It needs m >= 2p micro-batches for its steady state;
with fewer it runs the same order with the missing micro-batches left out (as `zb_v` does).
"""

from __future__ import annotations

from .actions import Action, Layout, Schedule, check_counts


def dualpipe_v(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """DualPipeV's per-rank actions for ``stages`` ranks and ``microbatches`` micro-batches (two chunks
    per rank, "v" placement). Raises ValueError unless stages, microbatches >= 1 and virtual_stages == 2."""
    check_counts(stages, microbatches, virtual_stages, "dualpipe_v", chunks=2)
    p, m = stages, microbatches
    n = max(m, 2 * p)  # the pattern's micro-batch count; those >= m are dropped when written out
    ranks = [_Rank(p, r, m) for r in range(p)]
    per_rank = [rank.actions(_phases(p, r, n)) for r, rank in enumerate(ranks)]
    return Schedule(per_rank, chunks=2, placement="v", pairs=[rank.pairs for rank in ranks])


def _phases(p: int, r: int, n: int) -> list[tuple]:
    """Rank r's steps for n micro-batches: ("F", chunk), ("B", chunk, defer_w), ("W",) (the oldest
    deferred W) or ("FB", forward chunk, backward chunk) (an overlapped pair, its backward whole)."""
    last = r == p - 1
    steps: list[tuple] = [("F", 0)] * (2 * (p - 1 - r))                                      # 1
    steps += [("F", 0), ("F", 1)] * (r + 1)                                                 # 2
    steps += [("B", 1, True), ("W",), ("F", 1)] * (p - 1 - r)                               # 3
    for i in range(n - 2 * p + r + 1):                                                      # 4
        steps += [("F", 0), ("B", 1, False)] if i == 0 and last else [("FB", 0, 1)]
        steps += [("FB", 1, 0)]
    steps += [("B", 1, False), ("FB", 1, 0)] * (p - 1 - r)                                  # 5
    # 6: r+1 times B1 B0, deferring the W of the second half of these 2(r+1) backwards (r+1 of them;
    # with 7's p-1-r that is the p W's 7 and 8 run): from micro-batch (r+1)//2 on, at its B1 for odd
    # r, at its B0 for even r
    half = (r + 1) // 2
    for i in range(r + 1):
        steps += [("B", 1, i > half or (i == half and r % 2 == 1)), ("B", 0, i >= half)]      # 6
    steps += [("W",), ("B", 0, True)] * (p - 1 - r)                                         # 7
    steps += [("W",)] * (r + 1)                                                             # 8
    return steps


class _Rank:
    """Writes one rank's steps as actions: each step's receives, compute and sends, the micro-batch
    numbers counted per (kind, chunk), those >= m left out."""

    def __init__(self, p: int, r: int, m: int) -> None:
        self.r, self.m, self.pipe = r, m, Layout(p, 2, "v")
        self.taken: dict[tuple[str, int], int] = {}  # (kind, chunk) -> micro-batches handed out
        self.queue: list[tuple[int, int]] = []       # deferred W's: (micro-batch, chunk), oldest first
        self.pairs: dict[int, int] = {}              # overlapped pairs: index of the F -> index of the B

    def _next(self, kind: str, chunk: int) -> int:
        i = self.taken[kind, chunk] = self.taken.get((kind, chunk), -1) + 1
        return i

    def actions(self, steps: list[tuple]) -> list[Action]:
        out: list[Action] = []
        for step in steps:
            if step[0] == "F":
                i = self._next("F", step[1])
                out += self.pipe.forward(self.r, i, step[1]) if i < self.m else []
            elif step[0] == "B":
                out += self._backward(step[1], defer=step[2])
            elif step[0] == "W":
                i, c = self.queue.pop(0)
                out += [Action("W", i, c)] if i < self.m else []
            else:
                pair = self._pair(*step[1:])
                kinds = [a.kind for a in pair]
                if "F" in kinds and "B" in kinds:  # both halves are there (not a micro-batch >= m)
                    self.pairs[len(out) + kinds.index("F")] = len(out) + kinds.index("B")
                out += pair
        return out

    def _backward(self, chunk: int, defer: bool) -> list[Action]:
        i = self._next("B", chunk)
        if defer:
            self.queue.append((i, chunk))
        if i >= self.m:
            return []
        return self.pipe.backward(self.r, i, chunk) + ([] if defer else [Action("W", i, chunk)])

    def _pair(self, f_chunk: int, b_chunk: int) -> list[Action]:
        """F on ``f_chunk`` and a whole backward on ``b_chunk``, the backward's gradient receive posted
        first (IRECV_GRAD) so that it is in flight during the forward's compute."""
        i = self._next("F", f_chunk)
        backward = self._backward(b_chunk, defer=False)
        if i >= self.m:
            return backward
        forward = self.pipe.forward(self.r, i, f_chunk)
        if backward and backward[0].kind == "RECV_GRAD":
            backward[0] = Action("IRECV_GRAD", backward[0].microbatch, b_chunk)
            return backward[:1] + forward + backward[1:]
        return forward + backward


def without_overlap(schedule: Schedule) -> Schedule:
    """The same lists with every posted receive made blocking (IRECV_* -> RECV_*) and no pair run
    together (each half's all-to-alls waited at once): the synchronous version of an overlapped
    schedule, for measuring what the overlap hides. On paper (communication free) no action of it
    starts sooner, some later (a forward waiting on a gradient it does not need)."""
    return Schedule([[Action(a.kind[1:], a.microbatch, a.chunk) if a.kind.startswith("IRECV_") else a for a in acts]
                     for acts in schedule], chunks=schedule.chunks, placement=schedule.placement)
