"""Pieces the equivalence tests share: per-rank data and one accumulated training step."""

from __future__ import annotations

import contextlib

import torch

from minipar.models import gpt_loss

# AdamW's step g / (|g| + eps) multiplies *absolute* gradient rounding noise by up to lr / eps. A
# gradient element that is a sum of large terms cancelling to ~eps carries ~1e-10 of noise when the
# sum is ordered differently (per rank, then all-reduced); at the default eps=1e-8 and lr=3e-3 that
# becomes a 3e-5 parameter difference although every gradient matches. eps=1e-6 keeps the optimizer
# well conditioned, so the comparisons can stay at the default fp32 tolerances.
LR, WD, EPS = 1e-3, 0.1, 1e-6


def batches(seed: int, steps: int, accum: int, world: int, local_bs: int, seq: int, vocab: int) -> torch.Tensor:
    """(steps, accum, world * local_bs, seq + 1) token ids; rank r owns rows r*local_bs:(r+1)*local_bs."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (steps, accum, world * local_bs, seq + 1), generator=g)


def accumulated_step(model, step_data: torch.Tensor, rows: slice, device, sync_all: bool = False) -> float:
    """Forward/backward over this rank's micro-batches of one step (no_sync on all but the last, or
    on none with ``sync_all``: every backward synchronises); returns the global loss of the step."""
    accum = step_data.shape[0]
    total = 0.0
    for a in range(accum):
        x = step_data[a, rows].to(device)
        sync = contextlib.nullcontext() if sync_all or a == accum - 1 else model.no_sync()
        with sync:
            total += model.train_step(x[:, :-1], x[:, 1:], lambda out, y: gpt_loss(out, y) / accum).item()
    return total


def train_rows(model, opt, data: torch.Tensor, max_norm: float, loss_fn=None) -> tuple[list[float], list[float]]:
    """One step per data[s] (global batch, seq + 1) on this data-parallel rank's rows: train_step
    with ``loss_fn`` (default: the layout's cross-entropy), clip to ``max_norm``, step. Returns
    (losses, gradient norms)."""
    mesh = model.mesh
    local = data.shape[1] // mesh.dp
    losses, norms = [], []
    for s in range(data.shape[0]):
        x = data[s, mesh.dp_rank * local:(mesh.dp_rank + 1) * local].to(mesh.device)
        losses.append(model.train_step(x[:, :-1], x[:, 1:], loss_fn or model.cross_entropy).item())
        norms.append(model.clip_grad_norm_(max_norm).item())
        opt.step()
        opt.zero_grad()
    return losses, norms


def reference_steps(model, steps: int, step_loss, max_norm: float, eps: float = EPS) -> tuple[list[float], list[float]]:
    """The single-process reference: ``steps`` AdamW steps (LR, WD, ``eps``) of ``model``, each on
    ``step_loss(s)`` (the global batch's loss as the layout defines it), clipped to ``max_norm``.
    Returns (losses, gradient norms before clipping)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=eps)
    losses, norms = [], []
    for s in range(steps):
        loss = step_loss(s)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


class LoggedWork:
    """A communication handle whose ``wait`` appends ``event`` to ``log`` (then waits): the overlap tests
    (ring attention, async tp, DualPipeV) record launches, computes and waits in call order with it."""

    def __init__(self, work, log: list, event: tuple) -> None:
        self._work, self._log, self._event = work, log, event

    def wait(self, *args):
        self._log.append(self._event)
        return self._work.wait(*args)
