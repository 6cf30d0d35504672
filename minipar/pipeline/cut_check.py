"""What is checked when a model is cut into pipeline stages (`check_spec`), in one process,
before any collective: that the stages, run one after another, are the model (`check_cut`), and
that no Parameter would have copies on several stages that nothing keeps equal (`check_shared`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from ..context_parallel.context import left_as_it_was
from .spec import StageSpec, find, hidden_of
from .stage import Stage


def check_spec(model: nn.Module, spec: StageSpec) -> None:
    """ValueError unless the stages cut by ``spec``, run one after another, are ``model``: every path names
    a module and the blocks are an nn.ModuleList (`StageSpec.check_paths`); in one process on a tiny input,
    the stages compute the model's own forward on ``spec.example`` with hidden states of ``hidden_size``
    between every two blocks, and run every module the model's forward runs (`check_cut`); and no
    Parameter is held by two parts that may land on different stages, but the declared tie
    (`check_shared`). `ShardedModule` calls it before any collective; a `Stage` built by hand checks the
    paths only. Costs two forwards of two tokens; touches nothing of ``model``."""
    spec.check_paths(model)
    check_cut(model, spec)  # first: a module left out is named as such, not as a stray parameter
    check_shared(model, spec)


def check_shared(model: nn.Module, spec: StageSpec) -> None:
    """ValueError when a Parameter of ``model`` would have copies on several stages that nothing keeps
    equal: one used by two blocks (weights tied inside the trunk), by a block and the embedding or
    head, by the embedding and the head other than through the tie ``spec.tied`` names (whose two
    copies have their gradients summed, `sync_tied_grads`), or one outside the embedding, the head
    and the blocks (such a module is kept on every stage).

    Each stage would train its own copy. Summing the copies' gradients, as for the tie, is refused
    rather than done: every path that touches a parameter (the gradient norm, checkpoints, 1-bit
    Adam's exchange, ZeRO's shards) would need to know the copies, and a cut between any two blocks is
    a possible cut (the balanced default moves with sizes; interleaved chunks scatter the blocks), so
    a tie is refused whether or not today's cut separates it."""
    parts = [("the embedding", [find(model, path) for path in spec.first]),
             ("the head", [find(model, path) for path in spec.last])]
    parts += [(f"block {i}", [block]) for i, block in enumerate(find(model, spec.blocks))]
    holders: dict[int, list[str]] = {}  # a trainable Parameter's id -> the parts that hold it
    for label, modules in parts:
        for p in {id(p): p for m in modules for p in m.parameters()}.values():
            if p.requires_grad:
                holders.setdefault(id(p), []).append(label)
    tied = find(model, spec.tied[0]) if spec.tied_in(model) else None
    for n, p in model.named_parameters():
        where = holders.get(id(p), [])
        if not p.requires_grad or len(where) == 1 or (p is tied and where == ["the embedding", "the head"]):
            continue
        if not where:
            raise ValueError(f"pipeline stages: parameter {n!r} of {type(model).__name__} belongs to none of the "
                             f"embedding ({', '.join(spec.first) or 'nothing'}), the head "
                             f"({', '.join(spec.last) or 'nothing'}) or a block of {spec.blocks!r}: its module is kept "
                             "on every stage, and each stage would train its own copy; name its module in the "
                             "StageSpec's first= or last=, move it into a block, or freeze it (requires_grad=False)")
        raise ValueError(f"pipeline stages: parameter {n!r} of {type(model).__name__} is shared by "
                         f"{' and '.join(where)}, which a pipeline may place on different stages: each would "
                         "train its own copy. minipar keeps only the embedding/head tie that StageSpec.tied names "
                         "in step; give each block its own parameters, or train this model without pipeline "
                         "parallelism (pp=1)")


def check_cut(model: nn.Module, spec: StageSpec) -> None:
    """ValueError unless ``spec``'s stages, run one after another in this process, compute ``model``'s
    own forward (the first stage with one block, the second with the rest, so that the embedding,
    the head and the blocks' keyword arguments all run on a stage holding only its own modules):

    * the logits of ``spec.example`` (default `example_input`: token ids (1, 2)) must equal the
      model's own (a module the spec leaves out, such as a final norm, changes them); an exception in
      either forward is refused with it;
    * every block must take and give hidden states (batch, seq, ``spec.hidden_size``): that is the
      shape the stages send each other (another width would abort the first send);
    * every module without children that the model's forward runs must run in some stage (a dropout
      left out changes nothing in eval mode but trains another model).

    Eval mode, no gradient; the model is left as it was (`left_as_it_was`)."""
    blocks = find(model, spec.blocks)
    ids = spec.example if spec.example is not None else example_input(model, spec)
    batch, seq = ids.shape[:2]
    called: set[str] = set()
    leaves = {n: m for n, m in model.named_modules() if n and not any(True for _ in m.children())}
    hooks = [m.register_forward_pre_hook(functools.partial(lambda name, *_: called.add(name), n))
             for n, m in leaves.items()]
    shapes: list[tuple[int, str, tuple]] = []  # (block, "input" | "output", shape) that differ

    def check_shape(i: int, what: str, h: Any) -> None:
        if what == "input":  # the positional arguments: the hidden states first (none: passed by keyword)
            if not h:
                return
            h = h[0]
        h = hidden_of(h)
        if not torch.is_tensor(h) or tuple(h.shape) != (batch, seq, spec.hidden_size):
            shapes.append((i, what, tuple(h.shape) if torch.is_tensor(h) else type(h).__name__))
    hooks += [b.register_forward_pre_hook(functools.partial(lambda i, _, args: check_shape(i, "input", args), i))
              for i, b in enumerate(blocks)]
    hooks += [b.register_forward_hook(functools.partial(lambda i, _, a, out: check_shape(i, "output", out), i))
              for i, b in enumerate(blocks)]
    what = type(model).__name__
    try:
        with left_as_it_was(model):
            try:
                whole = _logits(model(ids))
            except Exception as e:  # noqa: BLE001 -- any failure is reported as the reason
                raise ValueError(f"pipeline stages: {what}'s own forward fails on {_shown(ids)} "
                                 f"({type(e).__name__}: {e}), so its stages cannot be checked against it; pass "
                                 "StageSpec(example=...), a small input the model takes (batch, seq, ...)") from e
            model_called = set(called)
            called.clear()
            shapes.clear()
            cuts = [0, 1, len(blocks)] if len(blocks) > 1 else None
            stages = [Stage(model, s, len(cuts) - 1 if cuts else 1, cuts, spec, copy_tied=False)
                      for s in range(len(cuts) - 1 if cuts else 1)]
            try:
                h = ids
                for stage in stages:
                    h = stage(h)
                staged = _logits(h)
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"pipeline stages: the stages cut from {what} by its StageSpec fail on "
                                 f"{_shown(ids)} ({type(e).__name__}: {e}); check the spec's embed/head/block_kwargs "
                                 "and that first= / last= name every module they use (a stage holds only its "
                                 "own)") from e
    finally:
        for h_ in hooks:
            h_.remove()
    if shapes:
        i, which, shape = shapes[0]
        raise ValueError(f"pipeline stages: block {i} of {what} takes or gives hidden states of shape {shape} "
                         f"({which}), but the stages send each other (batch, seq, hidden_size={spec.hidden_size}): "
                         f"set StageSpec(hidden_size=...) to the model's width, and make embed= return "
                         "(batch, seq, width)")
    missing = sorted(model_called - called)
    if missing:
        raise ValueError(f"pipeline stages: {what}'s forward runs {', '.join(missing)}, but no stage cut by its "
                         "StageSpec does: the pipeline would train a model without it. Call it in the spec's embed=, "
                         "head= or a block, and name its module in first= (embedding) or last= (head)")
    if not _same(staged, whole):
        diff = (staged.float() - whole.float()).abs().max().item() if torch.is_tensor(staged) and \
            staged.shape == whole.shape else None
        raise ValueError(f"pipeline stages: the stages cut from {what} by its StageSpec compute other logits than "
                         f"its own forward on {_shown(ids)} ("
                         + (f"max difference {diff:.3g}" if diff is not None else
                            f"shape {tuple(staged.shape) if torch.is_tensor(staged) else type(staged).__name__} "
                            f"against {tuple(whole.shape)}")
                         + "): embed=, head= and the blocks must do what the model's forward does (a module left "
                         "out, a norm or a scale missing from head=)")


def example_input(model: nn.Module, spec: StageSpec) -> torch.Tensor:
    """The input `check_cut` runs when the spec gives none: token ids (1, 2) (below the vocabulary
    of the first embedding the first stage holds), or (1, 2, in_features) floats when the first
    layer with parameters there is a Linear."""
    device = next(model.parameters()).device
    for path in spec.first:
        for m in find(model, path).modules():
            if isinstance(m, nn.Linear):
                gen = torch.Generator().manual_seed(0)
                return torch.randn(1, 2, m.in_features, generator=gen, dtype=m.weight.dtype).to(device)
            if isinstance(m, nn.Embedding):
                return torch.tensor([[0, 1 % m.num_embeddings]], device=device)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 2
    return torch.tensor([[0, 1 % vocab]], device=device)


def _shown(x: torch.Tensor) -> str:
    return f"{'token ids' if not x.is_floating_point() else 'inputs'} of shape {tuple(x.shape)}"


def _logits(out: Any) -> Any:
    logits = getattr(out, "logits", None)
    return logits if torch.is_tensor(logits) else out


def _same(a: Any, b: Any) -> bool:
    if not torch.is_tensor(a) or not torch.is_tensor(b) or a.shape != b.shape:
        return False
    scale = b.float().abs().max().item() or 1.0
    tol = 1e-4 if b.dtype in (torch.float32, torch.float64) else 3e-2
    return bool(((a.float() - b.float()).abs() <= tol * scale).all())
