"""Uneven data over the data-parallel ranks: ``ShardedModule.join(optimizer)``.

    with model.join(opt):
        for x, y in my_batches:                  # some ranks have fewer
            model.train_step(x, y, loss_fn)
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()

Without it, a rank that runs out of data leaves the others waiting in their
next collective (until the timeout names it). With it:

* Every ``train_step`` begins with the batch check's all-gather
  (`minipar.checks.check_batch`), which also carries each rank's flag: 1
  training, 0 shadowing. It is the only place the ranks learn who is left.
* A rank that leaves the block while others still train *shadows* them: it
  replays its own last iteration -- the train_steps, the clip and the
  optimizer step it recorded -- on its last batch with the loss multiplied by
  zero. It so issues exactly the collectives the others issue, contributes a
  zero gradient, and keeps stepping its parameters (and, under ZeRO, its
  shards, which the others need) with everyone else.
* The ranks still training multiply their loss by dp / (ranks still
  training): each step is then the mean over the samples that exist, as one
  process training on them alone would compute, and the returned loss is
  their mean.
* When the check finds no rank training, every rank leaves the block.

Limits: an MoE router's auxiliary loss on a shadowing rank still counts; a
rank must take at least one step before it runs out of data (otherwise
every rank raises ValueError at the next check).
"""

from __future__ import annotations

from typing import Any, Callable


class Join:
    """Records this rank's iterations; replays the last one while others train (see the module docstring)."""

    def __init__(self, model, optimizer) -> None:
        if not callable(getattr(optimizer, "register_step_post_hook", None)):
            raise ValueError("join(optimizer) needs the optimizer build_optimizer returned (or any torch optimizer)")
        self.model, self.optimizer = model, optimizer
        self.shadowing = False
        self._events: list[tuple] = []           # this iteration's calls so far
        self._last: list[tuple] | None = None    # the last complete iteration: what a shadow replays
        self._hook = optimizer.register_step_post_hook(self._stepped)

    def _stepped(self, *args: Any) -> None:
        if not self.shadowing:
            self._last, self._events = self._events + [("step",)], []

    def record(self, *event: Any) -> None:
        if not self.shadowing:
            self._events.append(event)

    @staticmethod
    def loss_factor(flags: list[int], dp_ranks: tuple[int, ...], mine: int) -> float:
        """What this rank multiplies its loss by: 0 when shadowing, else dp / (dp ranks training)."""
        training = sum(flags[r] == 1 for r in dp_ranks)
        return len(dp_ranks) / training if mine == 1 else 0.0

    def shadow(self) -> None:
        """Replay the last iteration until no rank trains any more."""
        self.shadowing = True
        try:
            if self._last is None:  # tell the others at their next check; they raise with us
                self.model._train_step(None, None, None, active=-1)
            while True:
                for kind, *args in self._last:
                    if kind == "train_step" and self.model._train_step(*args, active=0) is None:
                        return  # nobody trains any more
                    if kind == "clip":
                        self.model.clip_grad_norm_(*args)
                    if kind == "step":
                        self.optimizer.step()
                        self.optimizer.zero_grad()
        finally:
            self.shadowing = False

    def close(self) -> None:
        self._hook.remove()


def scaled(loss_fn: Callable, factor: float) -> Callable:
    return lambda out, y: loss_fn(out, y) * factor
