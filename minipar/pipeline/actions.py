"""The vocabulary of pipeline schedules: actions, the per-rank lists, where the model pieces sit.

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
                 path; only in schedules that split the backward (zb_h1, zb_v, dualpipe_v)
    SEND_ACT i   send micro-batch i's output activation to the holder of the next virtual stage
    RECV_ACT i   receive micro-batch i's input activation from the holder of the previous one
    SEND_GRAD i  send the gradient of micro-batch i's input back to the previous virtual stage
    RECV_GRAD i  receive the gradient of micro-batch i's output from the next virtual stage
    IRECV_ACT i, IRECV_GRAD i
                 the same receives, posted without waiting: the F (B) of micro-batch i waits for
                 the message, so whatever the rank computes in between overlaps the transfer
                 (dualpipe_v's overlapped pairs, `minipar.pipeline.dualpipe`)

The peer of a send or receive is not in the action: it is the rank that holds the neighbouring
virtual stage. Where that is the same rank (the V's turn on the last rank, virtual stage p-1 -> p)
the schedule still has a SEND/RECV pair, so every hop between pieces looks alike; an executor hands
the tensor over in memory. Sends are asynchronous (they never wait for the receiver); a RECV blocks,
an IRECV blocks the compute that needs it. Between two ranks, messages of one kind are received in
the order they were sent, counting posted receives at the place they are posted (`simulate` checks
this), so an executor may match them by order alone.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("F", "B", "W", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD", "IRECV_ACT", "IRECV_GRAD")
RECEIVES = ("RECV_ACT", "RECV_GRAD", "IRECV_ACT", "IRECV_GRAD")
PLACEMENTS = ("interleaved", "v")


@dataclass(frozen=True)
class Action:
    kind: str
    microbatch: int
    chunk: int = 0  # which of this rank's model chunks; 0 in a one-chunk schedule

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


def carries(kind: str) -> str:
    """What a receive kind brings: "ACT" or "GRAD" (the channel it is matched on)."""
    return kind.rsplit("_", 1)[1]


class Schedule(list):
    """``schedule[rank]`` is that rank's list of actions, in order. A list, plus the layout of the
    model pieces: ``chunks`` per rank, placed by ``placement`` ("interleaved" or "v"); and the
    overlapped pairs, ``pairs[rank]`` = {index of an F: index of a B} (DualPipeV's): the executor
    runs the two together, each half's collectives in flight during the other's compute
    (`minipar.core.interleave`); run one after the other they are the same list."""

    def __init__(self, per_rank: list[list[Action]], chunks: int = 1, placement: str = "interleaved",
                 pairs: list[dict[int, int]] | None = None) -> None:
        super().__init__(per_rank)
        self.chunks, self.placement = chunks, placement
        self.pairs = pairs if pairs is not None else [{} for _ in per_rank]


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


def check_counts(stages: int, microbatches: int, virtual_stages: int, name: str, chunks: int | None = None) -> None:
    """ValueError unless stages, microbatches >= 1 and (where the schedule fixes it) virtual_stages == chunks."""
    if stages < 1 or microbatches < 1:
        raise ValueError(f"a schedule needs stages >= 1 and microbatches >= 1, got {stages} and {microbatches}")
    if chunks is not None and virtual_stages != chunks:
        other = "; for more chunks per rank use interleaved_1f1b" if chunks == 1 else ""
        raise ValueError(f"{name} runs {chunks} model chunk(s) per rank: pass virtual_stages={chunks} "
                         f"(got {virtual_stages}){other}")


@dataclass(frozen=True)
class Layout:
    """Writes the hops around a compute action: a receive before it and a send after it, unless the
    virtual stage is the first (nothing to receive forward) or the last (the loss is here)."""

    stages: int
    chunks: int = 1
    placement: str = "interleaved"

    def ends(self, rank: int, chunk: int) -> tuple[bool, bool]:
        """(holds the model's first piece, holds its last) for ``chunk`` of ``rank``."""
        k = virtual_stage(rank, chunk, self.stages, self.placement)
        return k == 0, k == self.stages * self.chunks - 1

    def forward(self, rank: int, i: int, chunk: int = 0) -> list[Action]:
        first, last = self.ends(rank, chunk)
        return ([] if first else [Action("RECV_ACT", i, chunk)]) + [Action("F", i, chunk)] + \
            ([] if last else [Action("SEND_ACT", i, chunk)])

    def backward(self, rank: int, i: int, chunk: int = 0) -> list[Action]:
        first, last = self.ends(rank, chunk)
        return ([] if last else [Action("RECV_GRAD", i, chunk)]) + [Action("B", i, chunk)] + \
            ([] if first else [Action("SEND_GRAD", i, chunk)])
