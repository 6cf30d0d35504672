"""DualPipeV's overlapped pairs hide the MoE all-to-all: in each pair the forward of one micro-batch
and the backward of another hand over to each other while one of their all-to-alls is in flight
(`minipar.core.interleave`), so every dispatch and combine exchange of the pair, forward and
backward, runs during the other half's compute.

Rank processes (gloo), the MoE GPT at pp2 x dp2 x ep2 (one MoE block per model piece: each half of
a pair has two all-to-alls), m = 4, under schedule="dualpipe_v":

* the collective layer's all-to-all launches and waits, logged with the half that made them (a pair's
  backward half runs on a thread of its own) beside the ends of the halves, show every
  exchange launched inside a pair waited only after the other half did something (launched its own,
  or finished), four per pair; the same run with the two halves run one after the other (each
  exchange waited at once) fails that check;
* the timeline holds the stretches each half of a pair ran, several each, no two overlapping;
* the interleaved and the serialised runs train bitwise the same (losses, clipped gradient norms and
  parameters after two AdamW steps): the interleaving moves no arithmetic. Both equal one process
  through `tests/test_dualpipe.py`'s MoE test (the same layout).
"""

from __future__ import annotations

import threading

import torch

from minipar import Mesh, ShardedModule
from minipar.core.interleave import Interleave
from minipar.models import MoEGPT, MoEGPTConfig
from minipar.pipeline import dualpipe_v
from minipar.pipeline import executor as executor_module
from minipar.pipeline.timeline import is_compute

from helpers import LR, WD, LoggedWork

M = 4


class _OneAfterTheOther(Interleave):
    """`Interleave` without the interleaving: the forward half runs to its end, then the backward half;
    a collective's hand-over does nothing, so it is waited as soon as it is launched."""

    def switch(self, side: int) -> None:
        pass

    def run(self, first, second) -> None:
        for side, half in enumerate((first, second)):
            self._start(side)
            half()
            self._stop(side)


def _logged_training(ctx, serialise: bool):
    mesh = Mesh(pp=2, dp=2, ep=2)
    cfg = MoEGPTConfig(vocab_size=16, block_size=6, n_layer=4, n_head=2, n_embd=8, n_experts=4, top_k=2,
                       capacity_factor=None, aux_loss_coef=0.1, seed=5)
    model = ShardedModule(MoEGPT(cfg), mesh=mesh, schedule="dualpipe_v", microbatches=M, record_timeline=True)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
    log: list[tuple] = []
    all_to_all, forward, backward_input = mesh.comm.all_to_all, model.module.forward, executor_module.backward_input
    interleave = executor_module.Interleave

    def logged_all_to_all(output, input, group, output_splits=None, input_splits=None, async_op=False, tag=None):
        # a pair's backward half runs on a thread of its own (its forward half and every lone compute on this one)
        side = "B" if threading.current_thread().name == "minipar-pair-backward" else "F"
        n = len(log)
        log.append(("launch" if async_op else "call", side, tag, n))
        work = all_to_all(output, input, group, output_splits, input_splits, async_op=async_op, tag=tag)
        if not async_op:  # (outside a pair, and the counts' exchange: tiny, and routing needs it at once)
            return work
        return LoggedWork(work, log, ("wait", side, tag, n))

    def logged_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        log.append(("end", "F"))
        return out

    def logged_backward_input(*args):
        out = backward_input(*args)
        log.append(("end", "B"))
        return out

    mesh.comm.all_to_all, model.module.forward = logged_all_to_all, logged_forward
    executor_module.backward_input = logged_backward_input
    if serialise:
        executor_module.Interleave = _OneAfterTheOther
    try:
        data = torch.randint(0, 16, (2, 2 * M, 7), generator=torch.Generator().manual_seed(6))
        losses, norms = [], []
        for x in data[:, mesh.dp_rank * M:(mesh.dp_rank + 1) * M]:
            losses.append(model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy))
            norms.append(model.clip_grad_norm_(0.05))
            opt.step()
            opt.zero_grad()
        return mesh.pp_rank, log, losses, norms, model.full_state_dict(), model.timeline
    finally:
        executor_module.backward_input = backward_input
        executor_module.Interleave = interleave
        mesh.destroy()


def _unhidden(log: list[tuple]) -> tuple[list[tuple], int]:
    """(the asynchronous exchanges waited before the other half did anything, how many were launched)."""
    bad, launched = [], 0
    for i, event in enumerate(log):
        if event[0] != "launch":
            continue
        wait = log.index(("wait",) + event[1:], i)
        launched += 1
        if not any(e[1] != event[1] for e in log[i + 1:wait]):
            bad.append(event)
    return bad, launched


def test_each_all_to_all_of_a_pair_runs_during_the_other_halfs_compute(pools):
    interleaved = pools.run(4, _logged_training, False)
    serialised = pools.run(4, _logged_training, True)
    for rank, (stage, log, *_, timeline) in enumerate(interleaved):
        schedule = dualpipe_v(2, M)
        pairs = len(schedule.pairs[stage])
        bad, launched = _unhidden(log)
        # per step and pair: dispatch and combine in the forward half, their adjoints in the backward's
        assert launched == 2 * 4 * pairs and not bad, (rank, stage, pairs, launched, bad)
        # the timeline has the stretches each half ran: a pair's F and B each in several, none overlapping
        computes = sorted((s, e) for name, s, e in timeline if is_compute(name))
        assert all(e0 <= s1 for (_, e0), (s1, _) in zip(computes, computes[1:])), (rank, timeline)
        names = [name for name, _, _ in timeline]
        for f, b in schedule.pairs[stage].items():
            f, b = schedule[stage][f], schedule[stage][b]
            backward_half = names.count(str(b)) + names.count("W" + str(b)[1:])  # (with W, on the first piece)
            assert names.count(str(f)) >= 2 and backward_half >= 2, (rank, f, b, names)
    for rank, (stage, log, *_) in enumerate(serialised):
        bad, launched = _unhidden(log)
        assert bad and len(bad) == launched, (rank, "the check must see the serialisation", bad)
    for rank, (a, b) in enumerate(zip(interleaved, serialised)):
        for x, y in zip(a[2] + a[3], b[2] + b[3]):
            assert torch.equal(x, y), (rank, a[2], b[2], a[3], b[3])
        assert a[4].keys() == b[4].keys()
        for k in a[4]:
            assert torch.equal(a[4][k], b[4][k]), (rank, k)
