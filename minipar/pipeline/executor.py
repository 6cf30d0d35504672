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

import contextlib
from typing import Callable

import torch
import torch.nn as nn

from ..mesh import Mesh
from .schedule import Action


def run_schedule(stage: nn.Module, actions: list[Action], mesh: Mesh, inputs: list[torch.Tensor] | None,
                 targets: list[torch.Tensor] | None, loss_fn: Callable, act_shape: tuple, act_dtype: torch.dtype,
                 no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
                 timeline: list | None = None) -> tuple[torch.Tensor, int]:
    """Run ``actions`` on this stage. Returns (sum of this stage's micro-batch losses / m, 0 off the last
    stage; the most micro-batches whose activations this stage held at once).

    inputs: the micro-batches of token ids (first stage); targets: of labels (last stage).
    no_sync: entered around every backward but the last, so data-parallel gradient sync happens once.
    timeline: if given, (action, start, end) in perf_counter seconds is appended for each action.
    """
    import time

    pp = mesh.group("pp")
    comm = mesh.comm
    first, last = pp.rank == 0, pp.rank == pp.size - 1
    m = len(inputs) if inputs is not None else len(targets) if targets is not None else \
        sum(1 for a in actions if a.kind == "F")
    n_backward = sum(1 for a in actions if a.kind == "B")
    received: dict[int, torch.Tensor] = {}   # micro-batch -> input activation (requires grad)
    outputs: dict[int, torch.Tensor] = {}    # micro-batch -> output activation or loss
    out_grads: dict[int, torch.Tensor] = {}
    pending = []                             # (handle, tensor kept alive until the send completes)
    total = torch.zeros((), device=mesh.device)
    done_backward = 0
    peak_live = 0
    for a in actions:
        t0 = time.perf_counter()
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
            act = outputs[i].detach()
            pending.append((comm.send(act, pp.rank + 1, pp, async_op=True, tag="pp_act"), act))
        elif a.kind == "RECV_GRAD":
            buf = torch.empty(act_shape, dtype=act_dtype, device=mesh.device)
            comm.recv(buf, pp.rank + 1, pp, tag="pp_grad")
            out_grads[i] = buf
        elif a.kind == "B":
            done_backward += 1
            sync = contextlib.nullcontext() if no_sync is None or done_backward == n_backward else no_sync()
            with sync:
                if last:
                    outputs.pop(i).backward()
                else:
                    outputs.pop(i).backward(out_grads.pop(i))
        elif a.kind == "SEND_GRAD":
            grad = received.pop(i).grad
            pending.append((comm.send(grad, pp.rank - 1, pp, async_op=True, tag="pp_grad"), grad))
        if timeline is not None:
            timeline.append((str(a), t0, time.perf_counter()))
    for handle, _ in pending:
        handle.wait()
    return total, peak_live
