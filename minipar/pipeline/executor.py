"""The one interpreter that runs any schedule's action list on this stage.

Activations travel between neighbouring stages with the collective layer's
send/recv over the ``pp`` group; their shape (micro-batch, seq, n_embd) and
dtype are known up front, so nothing is exchanged but the tensors. Sends are
asynchronous (handles kept until the end of the step), receives block: the
order the schedule gives is the order that cannot deadlock (`simulate` checks
it). Each micro-batch's loss is divided by the micro-batch count, so the
accumulated gradients are those of the mean over the whole batch.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from ..mesh import Mesh
from .schedule import Action


def run_schedule(stage: nn.Module, actions: list[Action], mesh: Mesh, inputs: list[torch.Tensor] | None,
                 targets: list[torch.Tensor] | None, loss_fn: Callable, act_shape: tuple, act_dtype: torch.dtype,
                 timeline: list | None = None) -> tuple[torch.Tensor, int]:
    """Run ``actions`` on this stage. Returns (sum of this stage's micro-batch losses / m, 0 off the last
    stage; the most micro-batches whose activations this stage held at once).

    inputs: the micro-batches of token ids (first stage); targets: of labels (last stage).
    timeline: if given, (action, start, end) in perf_counter seconds is appended for each action (on a
        GPU: when its kernels ran, see below).
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
    comm = mesh.comm
    first, last = pp.rank == 0, pp.rank == pp.size - 1
    m = len(inputs) if inputs is not None else len(targets) if targets is not None else \
        sum(1 for a in actions if a.kind == "F")
    received: dict[int, torch.Tensor] = {}   # micro-batch -> input activation (requires grad)
    outputs: dict[int, torch.Tensor] = {}    # micro-batch -> output activation or loss
    out_grads: dict[int, torch.Tensor] = {}
    pending = []                             # (handle, tensor kept alive until the send completes)
    total = torch.zeros((), device=mesh.device)
    peak_live = 0
    for a in actions:
        t0 = time.perf_counter()
        if gpu_clock:
            ev0 = torch.cuda.Event(enable_timing=True)
            ev0.record()
        i = a.microbatch
        if a.kind == "RECV_ACT":
            buf = torch.empty(act_shape, dtype=act_dtype, device=mesh.device)
            comm.recv(buf, pp.rank - 1, pp, tag="pp_act")
            received[i] = buf.requires_grad_()
        elif a.kind == "F":
            out = stage(inputs[i] if first else received[i])
            if last:
                out = loss_fn(out, targets[i]) / m
                total += out.detach()
            outputs[i] = out
            peak_live = max(peak_live, len(outputs))
        elif a.kind == "SEND_ACT":
            act = outputs[i].detach().contiguous()  # a sequence-parallel shard may be a strided view
            pending.append((comm.send(act, pp.rank + 1, pp, async_op=True, tag="pp_act"), act))
        elif a.kind == "RECV_GRAD":
            buf = torch.empty(act_shape, dtype=act_dtype, device=mesh.device)
            comm.recv(buf, pp.rank + 1, pp, tag="pp_grad")
            out_grads[i] = buf
        elif a.kind == "B":
            if last:
                outputs.pop(i).backward()
            else:
                outputs.pop(i).backward(out_grads.pop(i))
        elif a.kind == "SEND_GRAD":
            grad = received.pop(i).grad.contiguous()
            pending.append((comm.send(grad, pp.rank - 1, pp, async_op=True, tag="pp_grad"), grad))
        if gpu_clock:
            ev1 = torch.cuda.Event(enable_timing=True)
            ev1.record()
            spans.append((str(a), ev0, ev1))
        elif timeline is not None:
            timeline.append((str(a), t0, time.perf_counter()))
    for handle, _ in pending:
        handle.wait()
    if gpu_clock:
        spans[-1][2].synchronize()  # every span's events are on one stream: the last one done, all are
        timeline.extend((name, origin_s + origin.elapsed_time(e0) / 1e3, origin_s + origin.elapsed_time(e1) / 1e3)
                        for name, e0, e1 in spans)
    return total, peak_live
