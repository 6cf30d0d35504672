"""The one interpreter that runs any schedule's action list on this stage.

Activations travel between neighbouring stages with the collective layer's
send/recv over the ``pp`` group; their shape (micro-batch, seq, n_embd) and
dtype are known up front, so nothing is exchanged but the tensors. Sends are
asynchronous (handles kept until the end of the step), receives block: the
order the schedule gives is the order that cannot deadlock (`simulate` checks
it). Each micro-batch's loss is divided by the micro-batch count, so the
accumulated gradients are those of the mean over the whole batch.

With several chunks per rank every action names its chunk, and the peer of a
message is the rank holding the neighbouring virtual stage (a hop between two
chunks of one rank is handed over in memory). In a schedule with W actions, B
computes the input's gradient only and W the weights' (`split_backward`).

A posted receive (IRECV_ACT, IRECV_GRAD: DualPipeV's overlapped pairs) is launched where the list
has it and waited just before the F (B) that needs it, so whatever runs in between computes while
the message is in flight; the wait is recorded in the timeline as WAIT_ACT / WAIT_GRAD.

An overlapped pair (``schedule.pairs``) where a chunk holds layers with collectives to hide (MoE
layers over ep > 1: `collectives_in_flight`) runs its F and B together at the F's place, as two
halves of an `Interleave`: each layer's all-to-all, forward or backward, hands over to the other half
while in flight. The timeline gets the stretches each half ran, which never overlap.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core.interleave import Interleave, WhileInFlight
from ..core.mesh import AxisGroup, Mesh
from .abort import PipelineAborted, read_marker, send_markers
from .actions import Action, Schedule, carries, holder, virtual_stage
from .split_backward import WeightGrad, backward_input


def collectives_in_flight(stage: nn.Module, chunk: int) -> list[WhileInFlight]:
    """The hooks of the layers in ``chunk`` of ``stage`` whose collectives can run during other compute:
    MoE layers whose all-to-alls go to other ranks (ep > 1)."""
    lo, hi = stage.chunk_blocks[chunk]
    return [m.in_flight for block in stage.stage_blocks()[lo:hi] for m in block.modules()
            if isinstance(getattr(m, "in_flight", None), WhileInFlight) and getattr(m, "ep_size", 1) > 1]


def run_schedule(stage: nn.Module, schedule: Schedule, mesh: Mesh, inputs: list[torch.Tensor] | None,
                 targets: list[torch.Tensor] | None, loss_fn: Callable, act_shape: tuple, act_dtype: torch.dtype,
                 timeline: list | None = None, grad_group: AxisGroup | None = None,
                 abandoned: list | None = None) -> tuple[torch.Tensor, int]:
    """Run this rank's actions of ``schedule`` on ``stage`` (a `Stage` with ``schedule.chunks`` chunks).
    Returns (sum of the loss over this rank's micro-batches / m, 0 where the rank holds no last
    piece; the most (micro-batch, chunk) activations this rank held at once).

    inputs: the micro-batches of token ids (on the rank holding the first piece); targets: of
    labels (the last piece's rank).
    timeline: if given, (action, start, end) in perf_counter seconds is appended for each action (on a
        GPU: when its kernels ran, see below).
    grad_group: the group gradients travel on (default: the ``pp`` group, as activations). With more
        than one chunk per rank two ranks exchange both kinds in both directions (interleaved at
        pp = 2, ZB-V), while a schedule orders messages only per kind (`simulate` checks FIFO per
        kind); point-to-point messages are matched by order per group (NCCL has no tags), so the
        gradients need a group of their own (`Mesh.twin`).
    abandoned: where a failed step leaves the sends still in flight (kept alive until they leave).

    An exception here is passed on to the neighbouring stages at once (`minipar.pipeline.abort`):
    this rank raises it, and each stage waiting on this one raises `PipelineAborted` naming it.
    """
    import time

    # On a GPU, perf_counter around an action would time its kernel launches, not its kernels: there
    # each action is bracketed by CUDA events on the compute stream (a receive's wait included), read
    # back once at the end of the step as seconds after an origin event recorded at the start, placed
    # at the host time of that record (exact when the GPU was idle then, e.g. after a synchronize).
    # That read is one host sync per step whenever a timeline is kept (ShardedModule keeps one every step).
    gpu_clock = timeline is not None and mesh.device.type == "cuda"
    if gpu_clock:
        origin_s, origin = time.perf_counter(), torch.cuda.Event(enable_timing=True)
        origin.record()
        spans = []
    pp = mesh.group("pp")
    groups = {"pp_act": pp, "pp_grad": grad_group or pp}
    readable = mesh.device.type == "cpu" or dist.get_backend(pp.pg) == "gloo"  # markers come through the host
    comm = mesh.comm
    p, rank, pieces = pp.size, pp.rank, pp.size * schedule.chunks
    split = any(a.kind == "W" for a in schedule[rank])  # B is the input's gradient only, W the weights'
    m = len(inputs) if inputs is not None else len(targets) if targets is not None else \
        sum(1 for a in schedule[rank] if a.kind == "F" and a.chunk == 0)

    def piece(a: Action) -> int:
        return virtual_stage(rank, a.chunk, p, schedule.placement)

    def peer(k: int) -> tuple[int, int]:  # (rank, chunk) holding virtual stage k
        return holder(k, p, schedule.placement)

    def route(a: Action) -> tuple[int, AxisGroup] | None:  # where a send action goes, if to another rank
        if a.kind not in ("SEND_ACT", "SEND_GRAD"):
            return None
        dst_rank, _ = peer(piece(a) + 1 if a.kind == "SEND_ACT" else piece(a) - 1)
        return None if dst_rank == rank else (dst_rank, groups["pp_act" if a.kind == "SEND_ACT" else "pp_grad"])

    # Everything is keyed by (micro-batch, chunk). A hop between two chunks of this rank (ZB-V's turn)
    # is handed over in memory: the send parks the tensor in `local`, the receive takes it.
    received: dict[tuple, torch.Tensor] = {}   # input activation (requires grad)
    outputs: dict[tuple, torch.Tensor] = {}    # output activation, or loss on the last piece
    out_grads: dict[tuple, torch.Tensor] = {}
    weight_grads: dict[tuple, WeightGrad] = {}  # split backward: what each W still has to do
    local: dict[tuple, torch.Tensor] = {}      # (kind, micro-batch, receiving chunk) -> tensor
    pending = []                               # (handle, tensor kept alive until the send completes)
    posted: dict[tuple, tuple] = {}            # (tag, micro-batch, chunk) -> (handle or None, buffer, source)
    total = torch.zeros((), device=mesh.device)
    live, peak_live = 0, 0
    actions, at = schedule[rank], 0

    def arrived(a: Action, tag: str, key: tuple, handle, buf: torch.Tensor | None, src_rank: int) -> None:
        """Wait for a receive's message (buf None: handed over in memory), check it is no failure
        marker, keep it."""
        if buf is None:
            buf = local.pop((tag,) + key)
        else:
            handle.wait()
            told = read_marker(buf, readable)  # another stage failed: stop now, not at the timeout
            if told is not None:
                raise PipelineAborted(told, f"pipeline stage {rank} (rank {mesh.rank}) at {a}", src_rank)
        if tag == "pp_act":
            received[key] = buf.detach().requires_grad_()
        else:
            out_grads[key] = buf

    def wait_posted(a: Action, tag: str, key: tuple, start_event=None) -> tuple:
        """Wait for the posted receive compute ``a`` needs, recorded as WAIT_ACT / WAIT_GRAD from when
        the compute's span began (``start_event`` on a GPU). Returns when the compute itself starts:
        (perf_counter seconds, on a GPU a new start event for its span)."""
        name = f"WAIT_{tag[3:].upper()}{a.microbatch}" + (f"c{a.chunk}" if a.chunk else "")
        t = time.perf_counter()
        arrived(a, tag, key, *posted.pop((tag,) + key))
        end = time.perf_counter()
        if gpu_clock:  # the wait is the compute stream's, after start_event
            waited = torch.cuda.Event(enable_timing=True)
            waited.record()
            spans.append((name, start_event, waited))
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        elif timeline is not None:
            timeline.append((name, t, end))
        return end, start_event

    def clock() -> tuple:
        """(perf_counter seconds, on a GPU a start event recorded now): where an action's span starts."""
        t = time.perf_counter()
        if not gpu_clock:
            return t, None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return t, ev

    def record(a: Action, t0: float, ev0) -> None:
        if gpu_clock:
            ev1 = torch.cuda.Event(enable_timing=True)
            ev1.record()
            spans.append((str(a), ev0, ev1))
        elif timeline is not None:
            timeline.append((str(a), t0, time.perf_counter()))

    def forward(a: Action, t0: float, ev0, timed: bool = True) -> None:
        nonlocal live, peak_live
        key, k = (a.microbatch, a.chunk), piece(a)
        if ("pp_act",) + key in posted:
            t0, ev0 = wait_posted(a, "pp_act", key, ev0)
        out = stage(inputs[a.microbatch] if k == 0 else received[key], chunk=a.chunk)
        if k == pieces - 1:
            out = loss_fn(out, targets[a.microbatch]) / m
            total.add_(out.detach())
        outputs[key] = out
        live += 1
        peak_live = max(peak_live, live)
        if timed:
            record(a, t0, ev0)

    def backward(a: Action, t0: float, ev0, timed: bool = True) -> None:
        nonlocal live
        key = (a.microbatch, a.chunk)
        if ("pp_grad",) + key in posted:
            t0, ev0 = wait_posted(a, "pp_grad", key, ev0)
        out, grad = outputs.pop(key), out_grads.pop(key, None)
        if split:
            weight_grads[key] = backward_input(out, grad, received.get(key))
        else:
            out.backward(grad)
            live -= 1
        if timed:
            record(a, t0, ev0)

    def weight(a: Action, t0: float, ev0, timed: bool = True) -> None:
        nonlocal live
        weight_grads.pop((a.microbatch, a.chunk)).run()
        live -= 1
        if timed:
            record(a, t0, ev0)

    def pair(f: Action, b: Action, t0: float, ev0) -> None:
        """F ``f`` and B ``b`` as one overlapped pair (`Interleave`): each hands over to the other while
        one of its chunk's all-to-alls is in flight; F starts. The timeline gets the spans each half
        actually ran (`Interleave.spans`), so that no time is counted twice."""
        both = Interleave(clock=clock if timeline is not None else None)
        both.label(0, str(f))
        for side, c in enumerate((f.chunk, b.chunk)):
            for hook in in_flight[c]:
                hook.run = (lambda side=side: both.switch(side))

        def backward_half() -> None:
            both.label(1, str(b))
            backward(b, *clock(), timed=False)  # (the clock: where a posted receive's wait starts)
            w = Action("W", b.microbatch, b.chunk)
            if split and weight_grads[(b.microbatch, b.chunk)].full is not None:
                # B had nothing to do (the first piece: no input gradient), W is the whole backward: it
                # runs here, in the half, where its all-to-alls have the forward to hide behind
                both.label(1, str(w))
                weight(w, None, None, timed=False)
                ran.add(actions.index(w, at))

        try:
            both.run(lambda: forward(f, t0, ev0, timed=False), backward_half)
        finally:
            for hook in in_flight[f.chunk] + in_flight[b.chunk]:
                hook.run = None
            for name, (s0, e0), (s1, e1) in both.spans:
                if gpu_clock:
                    spans.append((name, e0, e1))
                elif timeline is not None:
                    timeline.append((name, s0, s1))

    # Overlapped pairs (F position -> its B's) where a chunk has all-to-alls to hide (MoE layers over
    # ep > 1; with one side's only, its first exchange hides behind the other's whole half); every
    # other F and B runs alone, its collectives waited at once.
    in_flight = [collectives_in_flight(stage, c) for c in range(schedule.chunks)]
    paired = {f: b for f, b in schedule.pairs[rank].items()
              if in_flight[actions[f].chunk] or in_flight[actions[b].chunk]}
    ran = set(paired.values())  # B's (and W's) already run inside their pair

    try:
        for at, a in enumerate(actions):
            t0, ev0 = clock()
            key, k = (a.microbatch, a.chunk), piece(a)
            if a.kind in ("RECV_ACT", "RECV_GRAD", "IRECV_ACT", "IRECV_GRAD"):
                tag = "pp_" + carries(a.kind).lower()
                src_rank, _ = peer(k - 1 if tag == "pp_act" else k + 1)
                if src_rank == rank:  # a hop between this rank's chunks: taken from memory when waited
                    buf, handle = None, None
                else:
                    buf = torch.empty(act_shape, dtype=act_dtype, device=mesh.device)
                    handle = comm.recv(buf, src_rank, groups[tag], async_op=True, tag=tag)
                if a.kind.startswith("I"):  # waited at the compute that needs it
                    posted[(tag,) + key] = (handle, buf, src_rank)
                else:
                    arrived(a, tag, key, handle, buf, src_rank)
            elif a.kind in ("SEND_ACT", "SEND_GRAD"):
                if a.kind == "SEND_ACT":
                    dst, tag, t = k + 1, "pp_act", outputs[key].detach()
                else:
                    dst, tag, t = k - 1, "pp_grad", received.pop(key).grad
                t = t.contiguous()  # a sequence-parallel shard may be a strided view
                dst_rank, dst_chunk = peer(dst)
                if dst_rank == rank:
                    local[(tag, a.microbatch, dst_chunk)] = t
                else:
                    pending.append((comm.send(t, dst_rank, groups[tag], async_op=True, tag=tag), t))
            elif a.kind == "F" and at in paired:
                pair(a, actions[paired[at]], t0, ev0)
                continue  # (both spans recorded)
            elif a.kind == "F":
                forward(a, t0, ev0)
                continue
            elif a.kind in ("B", "W"):
                if at not in ran:
                    (backward if a.kind == "B" else weight)(a, t0, ev0)
                continue
            record(a, t0, ev0)
    except Exception as e:  # tell the stages waiting on this one, then raise here
        failure = e.origin if isinstance(e, PipelineAborted) else \
            f"pipeline stage {rank} (rank {mesh.rank}) failed at {actions[at]}: {type(e).__name__}: {e}"
        kept = [] if not readable else \
            send_markers(actions[at:], route, torch.empty(act_shape, dtype=act_dtype, device=mesh.device),
                         failure, comm.send, skip=e.sender if isinstance(e, PipelineAborted) else None)
        if abandoned is not None:  # (receives posted and never waited: their buffers too)
            abandoned.extend(pending + kept + [(h, buf) for h, buf, _ in posted.values() if buf is not None])
        raise
    for handle, _ in pending:
        handle.wait()
    if gpu_clock:
        spans[-1][2].synchronize()  # every span's events are on one stream: the last one done, all are
        timeline.extend((name, origin_s + origin.elapsed_time(e0) / 1e3, origin_s + origin.elapsed_time(e1) / 1e3)
                        for name, e0, e1 in spans)
    return total, peak_live
