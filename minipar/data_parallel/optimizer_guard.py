"""A plain torch optimizer over a ZeRO-wrapped model's parameters is refused at its first step.

Under ZeRO a parameter's gradient never stays in ``p.grad``: backward moves it into the stage's
flat buckets and this rank keeps only its reduced shard, and the tensors to step are the fp32
master shards (`minipar.data_parallel.sharded_state`), which the stage then spreads back into the
parameters. ``torch.optim.AdamW(model.parameters())`` therefore sees no gradient and changes
nothing, step after step, without a word. `guard_params` makes that a ValueError that names the
fix, on every rank alike (each rank steps its own optimizer over the same parameters; no
collective is involved, so no rank can wait for another).

Why a process-wide torch hook. torch has no hook on optimizer *construction*, and the optimizer
may be any class the user wrote; ``torch.optim.optimizer.register_optimizer_step_pre_hook`` is
the one place every optimizer's step passes. It is acceptable here because it is scoped to the
strategy: one hook per ZeRO strategy, holding it only weakly (a hook that held it would keep
every wrapped model alive for the life of the process, `tests/test_lifetime.py`), removed when
the strategy is freed; it reads nothing but the optimizer it is handed, and costs a set lookup
per parameter per step. What `build_optimizer` returns steps masters and pieces of them, never
these parameters, so it passes.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook


def guard_params(strategy: Any, params: Iterable[nn.Parameter], strategy_name: str) -> None:
    """Until ``strategy`` is freed, any optimizer stepping one of ``params`` raises ValueError."""
    guarded = frozenset(id(p) for p in params)  # ids, not tensors: the hook must not keep them alive
    alive = weakref.ref(strategy)  # ids are reused once the parameters die: the hook checks first

    def refuse_plain_optimizer(optimizer, args, kwargs) -> None:
        guarding = alive()
        if guarding is None:
            return
        for group in optimizer.param_groups:
            if any(id(p) in guarded and _current(p) is guarding for p in group["params"]):
                cls = type(optimizer)
                name = f"torch.optim.{cls.__name__}" if cls.__module__.startswith("torch.optim") else cls.__name__
                raise ValueError(
                    f"{cls.__name__} was built over the wrapped model's parameters, but strategy={strategy_name!r} "
                    "keeps their gradients in its shards and steps fp32 master shards instead: this optimizer would "
                    f"change nothing. Build it with model.build_optimizer({name}, lr=...) (parameter "
                    "groups: model.build_optimizer(torch.optim.AdamW, [{'params': decay, 'weight_decay': 0.1}, "
                    "{'params': no_decay, 'weight_decay': 0.0}], lr=...))")

    handle = register_optimizer_step_pre_hook(refuse_plain_optimizer)
    weakref.finalize(strategy, handle.remove)


def _current(p: nn.Parameter) -> Any:
    """The strategy that syncs ``p`` now (`minipar.data_parallel.buckets.adopt`): a model wrapped again
    (say zero1, then DDP) is the newest wrapper's, and a plain optimizer is then right."""
    ref = getattr(p, "minipar_strategy", None)
    return ref() if ref is not None else None
