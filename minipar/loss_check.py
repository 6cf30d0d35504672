"""Which loss functions may read vocab-parallel logits, and the check that refuses the others.

A tensor-parallel plan may leave the LM head's output split over the vocabulary ('colwise' on
the head): each tp rank then holds logits (..., V / tp), its slice of the vocabulary, which is
what `minipar.tensor_parallel.vocab_parallel_cross_entropy` takes. An ordinary cross-entropy
(``F.cross_entropy``, ``minipar.models.gpt_loss``) reads that slice as the whole vocabulary: a
target at or past V / tp is out of its range (an IndexError on the last stage while the other
stages wait), and when no target is, it trains silently wrong (each rank's loss and gradient are
those of a softmax over its slice alone).

So the front door refuses, on every rank and before the step's first collective, a loss
function not known to read split logits when the plan splits the head (`check_loss`). Known:

* `vocab_parallel_cross_entropy` itself, and any callable marked with `vocab_parallel`
  (``ShardedModule.cross_entropy`` is: ``loss_fn=model.cross_entropy``);
* the same seen through ``functools.partial``, a bound method, or a ``functools.wraps``
  wrapper (``__wrapped__``).

A loss of one's own that combines the tp ranks' slices (e.g. by calling
vocab_parallel_cross_entropy, or its own all-reduces over ``mesh.group("tp")``) is marked with
``@minipar.loss_check.vocab_parallel``. The other way out: keep the logits whole, with the plan
style 'colwise_gather' on the head (minipar's GPT: ``tp_plan=model.tp_plan(tp, gather_logits=True)``).
The marker is an attribute of the function and the list of known functions a constant of this
module: nothing is registered at run time.
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Any, Callable

import torch.nn as nn

from .tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

_MARK = "__minipar_vocab_parallel__"
_KNOWN = (vocab_parallel_cross_entropy,)  # minipar's own; marked here so tensor_parallel/ need not know


def vocab_parallel(loss_fn: Callable) -> Callable:
    """Mark ``loss_fn(logits, targets)`` as reading vocab-parallel logits (..., V / tp): it combines
    the tp ranks' slices itself. Use as a decorator; returns ``loss_fn``. A bound method cannot
    carry the mark: mark the function it is bound from (the method in its class body)."""
    setattr(loss_fn, _MARK, True)
    return loss_fn


def is_vocab_parallel(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` is known to read vocab-parallel logits (see the module docstring)."""
    seen: set[int] = set()
    fn = loss_fn
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if getattr(fn, _MARK, False) is True or any(fn is known for known in _KNOWN):
            return True
        if isinstance(fn, functools.partial):
            fn = fn.func
        else:  # a bound method's function, then what a functools.wraps wrapper wraps
            fn = getattr(fn, "__func__", None) or getattr(fn, "__wrapped__", None)
    return False


def vocab_split_head(module: nn.Module, plan: dict | None) -> tuple[str, int] | None:
    """(name, vocabulary size) of ``module``'s output head when ``plan`` leaves its output split
    over the vocabulary, else None. ``module``: the whole model as built for one process.

    The head is the last nn.Linear (in registration order) with as many outputs as the vocabulary
    (``module.config.vocab_size``, else the rows of an embedding the plan gives the style 'vocab'):
    the LM head of minipar's and Hugging Face's models; an MLP that happens to be as wide comes
    before it. It is split when a plan pattern gives it the style 'colwise'."""
    if not plan:
        return None
    names = [n for n, _ in module.named_modules() if n]

    def styles(name: str) -> list:
        return [style for pattern, style in plan.items() if fnmatch.fnmatchcase(name, pattern)]

    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    if not isinstance(vocab, int):
        vocab = next((m.num_embeddings for n in names if "vocab" in styles(n)
                      for m in (module.get_submodule(n),) if isinstance(m, nn.Embedding)), None)
    heads = [n for n in names if isinstance(module.get_submodule(n), nn.Linear)
             and module.get_submodule(n).out_features == vocab]
    if vocab is None or not heads or "colwise" not in styles(heads[-1]):
        return None
    return heads[-1], vocab


def check_loss(loss_fn: Any, head: tuple[str, int] | None, tp: int) -> None:
    """ValueError, saying what to pass instead, when ``head`` (`vocab_split_head`) is split over
    ``tp`` > 1 ranks and ``loss_fn`` is not known to read vocab-parallel logits. Looks at nothing
    but its arguments: called on every rank with the same ones, every rank raises together."""
    if head is None or tp == 1 or loss_fn is None or is_vocab_parallel(loss_fn):
        return
    name, vocab = head
    label = getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__
    raise ValueError(
        f"loss_fn={label} is not known to take vocab-parallel logits, but under tensor parallelism (tp={tp}) "
        f"the plan leaves {name!r} 'colwise': each tp rank's logits hold {vocab // tp} of the {vocab} "
        "vocabulary columns, so an ordinary cross-entropy fails on a target past its slice (IndexError) or, "
        "when there is none, trains silently wrong. Pass loss_fn=model.cross_entropy (the ShardedModule's "
        "vocab-parallel cross-entropy; or minipar.tensor_parallel.vocab_parallel_cross_entropy with "
        "mesh.comm and mesh.group('tp')); mark a loss of your own that combines the tp ranks' slices with "
        f"@minipar.loss_check.vocab_parallel; or gather the logits: plan style 'colwise_gather' on {name!r} "
        "(minipar's GPT: tp_plan=model.tp_plan(tp, gather_logits=True))")
