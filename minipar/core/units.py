"""Which modules become units: the wrap policies of ZeRO-3 (its gather units) and of activation
checkpointing (its recomputed blocks), and which unit owns each parameter.

A policy is None (every entry of every ``nn.ModuleList``: the blocks of a transformer), a tuple of
module classes, a parameter count, or a callable(module) -> bool; `select_units` documents each.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def select_units(module: nn.Module, wrap_policy: Any, option: str = "wrap_policy") -> list[tuple[str, nn.Module]]:
    """The (name, submodule) pairs that become units, in registration order.

    wrap_policy: None -> every entry of every nn.ModuleList (the blocks of a
    transformer); a tuple of module classes -> the outermost modules of those
    classes; an int -> bottom-up, a module whose parameters not yet in a unit
    number at least that many (units may nest); a callable(module) -> bool ->
    the outermost modules it accepts. ``option`` names the argument in error messages
    (activation checkpointing chooses its modules the same way).
    """
    named = [(n, m) for n, m in module.named_modules() if n and not isinstance(m, _CONTAINERS)]
    if wrap_policy is None:
        lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
        members = {id(c) for lst in lists for c in lst}
        return [(n, m) for n, m in named if id(m) in members]
    if isinstance(wrap_policy, int) and not isinstance(wrap_policy, bool):
        if wrap_policy < 1:
            raise ValueError(f"a size {option} must be >= 1 parameters, got {wrap_policy}")
        chosen: list[tuple[str, nn.Module]] = []
        taken: set[int] = set()
        for n, m in reversed(named):  # children before parents
            free = [p for p in m.parameters() if id(p) not in taken]
            if sum(p.numel() for p in free) >= wrap_policy:
                chosen.append((n, m))
                taken.update(id(p) for p in free)
        if not chosen:
            raise ValueError(f"{option}={wrap_policy} matches no module (the largest has "
                             f"{max((sum(p.numel() for p in m.parameters()) for _, m in named), default=0)} "
                             "parameters); lower the threshold, or pass module classes or a callable")
        return [(n, m) for n, m in named if any(m is c for _, c in chosen)]
    if isinstance(wrap_policy, (tuple, list, set)) and all(isinstance(c, type) for c in wrap_policy):
        accept = lambda m: isinstance(m, tuple(wrap_policy))  # noqa: E731
        what = f"module classes {[c.__name__ for c in wrap_policy]}"
    elif callable(wrap_policy):
        accept, what = wrap_policy, f"callable {wrap_policy!r}"
    else:
        raise ValueError(f"{option}={wrap_policy!r} is not understood; pass None (each nn.ModuleList entry), "
                         "a tuple of module classes, a parameter count (int) or a callable(module) -> bool")
    out: list[tuple[str, nn.Module]] = []
    for n, m in named:
        if accept(m) and not any(n.startswith(o + ".") for o, _ in out):
            out.append((n, m))
    if not out:
        classes = sorted({type(m).__name__ for _, m in named})
        raise ValueError(f"{option} ({what}) matches no submodule; the model has {classes}. "
                         "Pass classes or a callable that match, a parameter count, or None")
    return out


def assign_params(module: nn.Module, units: list[tuple[str, nn.Module]]) -> list[list[nn.Parameter]]:
    """Trainable parameters per unit (then the root's, last), each in registration order.

    A parameter goes to the innermost unit whose subtree registers it; one
    registered under two different units, or under a unit and outside every
    unit (tied weights), goes to the root.
    """
    unit_of_module: dict[int, int] = {}
    for i, (_, m) in enumerate(units):  # pre-order: an inner unit comes after its outer one and overrides it
        for sub in m.modules():
            unit_of_module[id(sub)] = i
    root = len(units)
    owners: dict[int, set[int]] = {}
    order: list[nn.Parameter] = []
    for m in module.modules():
        for p in m._parameters.values():
            if p is None or not p.requires_grad:
                continue
            if id(p) not in owners:
                owners[id(p)] = set()
                order.append(p)
            owners[id(p)].add(unit_of_module.get(id(m), root))
    out: list[list[nn.Parameter]] = [[] for _ in range(root + 1)]
    for p in order:
        o = owners[id(p)]
        out[o.pop() if len(o) == 1 else root].append(p)
    return out
