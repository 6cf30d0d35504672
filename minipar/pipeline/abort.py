"""When one pipeline stage fails in a step, every stage stops at once, told which stage and why.

A stage that raises in the middle of a schedule (a loss function that fails on the last stage, a
forward that fails on one stage's batch, a receive that timed out) leaves its neighbours blocked in
a receive of a message it will never send; they used to wait for the mesh's timeout and then report
only their own receive. Instead the failing stage sends, in place of the next message each
neighbour still expects from it on each channel, a *marker*: a message of the very same shape and
dtype (so it matches the receive the neighbour has posted, or will post), whose bytes begin with
`_MAGIC` and go on with the failure in words: "pipeline stage 1 (rank 3) failed at F0: RuntimeError:
...". A stage that receives a marker raises `PipelineAborted` with those words, after passing the
same marker on to its own other neighbours the same way, so it travels down the chain of stages
waiting on one another. Every stage raises within one message time of the failure.

Why the next message on each channel is the right one: point-to-point messages between two ranks
on one group are matched in order, and the schedule fixes that order on both sides. The failing
stage's remaining SEND actions (from the one it failed at on) list, per (peer, group), the messages
its peer is waiting for or will wait for next; the first of each is replaced by the marker. A peer
that stopped already never receives its marker; the unmatched message stays in that channel.

What this costs when nothing fails: each receive through the host (gloo: CPU tensors, or GPU
tensors staged through host memory) compares its first 16 bytes with `_MAGIC` (about a
microsecond on the CPU; on a GPU one 16-byte copy after the receive's own copy). A receive over NCCL is not
read: that would make the host wait for the device at every receive; so over NCCL no marker is
sent (it would be taken for an activation), and the stages end in NCCL's timeout, as before. Nor
can a message smaller than 24 bytes carry a marker. A failure after a stage's last send of the
step (e.g. in its last W) reaches the others as before: as the named timeout of the step's next
collective.

After an abort the stages' channels hold the step's unmatched messages (sends already issued,
markers to stages that had stopped): the `Pipeline` refuses further steps, and the mesh's pp groups
must not carry another pipeline (destroy the Mesh, build a new one).
"""

from __future__ import annotations

import ctypes
from typing import Callable, Iterable

import torch

from ..core.mesh import AxisGroup
from .schedule import Action

_MAGIC = b"\x7fminipar:abort\x00\xff"  # 16 bytes no activation or gradient begins with in practice
_MIN_BYTES = len(_MAGIC) + 8


class PipelineAborted(RuntimeError):
    """Another pipeline stage failed in this step; ``origin`` says which, where, and its error."""

    def __init__(self, origin: str, here: str, sender: int | None = None) -> None:
        super().__init__(f"{origin}\n{here} stopped instead of waiting for it. The pipeline's messages of this step "
                         "are left unmatched, so this ShardedModule cannot train on: destroy the Mesh and build a new "
                         "Mesh and ShardedModule (from full_state_dict() or a checkpoint)")
        self.origin, self.sender = origin, sender  # sender: the pp index of the stage that told this one


def marker(like: torch.Tensor, origin: str) -> torch.Tensor | None:
    """A message of ``like``'s shape, dtype and device saying ``origin``; None when ``like`` is too
    small to hold the magic and a few words."""
    n = like.numel() * like.element_size()
    if n < _MIN_BYTES:
        return None
    payload = _MAGIC + origin.encode()[:n - len(_MAGIC)]
    raw = torch.zeros(n, dtype=torch.uint8)
    raw[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return raw.view(like.dtype).view(like.shape).to(like.device)


def read_marker(received: torch.Tensor, readable: bool) -> str | None:
    """The failure a received message reports, or None for an ordinary message. ``readable``: the
    message came through the host (gloo), so reading its first bytes waits for nothing more; else
    it is not read (see the module docstring)."""
    if not readable or received.numel() * received.element_size() < _MIN_BYTES:
        return None
    if received.is_cpu and received.is_contiguous():  # every receive: the first bytes straight from memory
        if ctypes.string_at(received.data_ptr(), len(_MAGIC)) != _MAGIC:
            return None
    raw = received.reshape(-1).view(torch.uint8)
    if raw[:len(_MAGIC)].cpu().numpy().tobytes() != _MAGIC:
        return None
    return raw[len(_MAGIC):].cpu().numpy().tobytes().rstrip(b"\0").decode(errors="replace")


def send_markers(remaining: Iterable[Action], route: Callable[[Action], tuple[int, AxisGroup] | None],
                 like: torch.Tensor, origin: str, send: Callable, skip: int | None = None) -> list:
    """Send ``origin`` as a marker in place of the first of ``remaining`` sends to each (peer, group).

    route(action): (peer's index in the group, group) of a send action to another rank, None for
    anything else; skip: a peer not to tell (the one that told us). Best effort: a send that fails
    is left out. Returns what must stay alive until the messages leave: (handle, tensor) pairs."""
    message = marker(like, origin)
    if message is None:
        return []
    told, kept = set(), []
    for a in remaining:
        target = route(a)
        if target is None:
            continue
        peer, group = target
        key = (peer, group.name, group.ranks)
        if key in told or peer == skip:
            continue
        told.add(key)
        try:
            kept.append((send(message, peer, group, async_op=True, tag="pp_abort"), message))
        except RuntimeError:  # that peer is gone: the others are still told
            continue
    return kept
