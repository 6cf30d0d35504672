"""The user's parameter groups over ZeRO's flat master shards: which piece of which master each group steps.

    model.build_optimizer(torch.optim.AdamW, [{"params": decay, "weight_decay": 0.1},
                                              {"params": no_decay, "weight_decay": 0.0}], lr=3e-4)

A flat group (a ZeRO-1/2 bucket, a ZeRO-3 unit) lays parameters of any of the user's groups end to
end, and this rank's fp32 master is one contiguous range of it, cutting parameters anywhere. The
sharded optimizer's groups mirror the user's, in order and with their options; group i steps the
*pieces* of the masters that hold parameters the user put in group i::

    flat group:   | w0 (decay) | b0 (no decay) | w1 (decay) | b1 (no decay) | pad |
    this rank's master:        [-------------------------)
    pieces:                    [ b0 ) [  w1  ) [ b1 )          -> groups 1, 0, 1

A piece is a maximal run of consecutive parameters of one group inside the master: an
``nn.Parameter`` viewing those elements of the master (the master itself when one group holds
the whole of it, the usual case of a single group, which so steps and saves exactly as before).
Views, not copies, so that everything else about a master stays as it is: where offloading keeps
it, the gather of full parameters, the copy into the compute shard after the step, its files
under "nvme" (whose masters have no storage between steps: their pieces are placeholders there,
re-pointed when the master is loaded, `minipar.data_parallel.offload.NvmeOptimizer`). The fused
AdamW kernel steps piece by piece with its group's lr and weight decay: one launch per piece, so
interleaved groups cost more launches for the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .flat import ShardGroup


@dataclass
class Piece:
    """Elements [lo, hi) of master ``index``'s real part, stepped by the optimizer as ``param``."""

    param: nn.Parameter   # the master itself, or a 1-D view of it (a storage-less placeholder under "nvme")
    index: int            # of its flat group in the strategy's groups
    lo: int
    hi: int


def user_groups(params: Any) -> list[dict]:
    """torch's forms of an optimizer's ``params`` (tensors, (name, tensor) pairs, or dicts with "params"),
    as a list of dicts of tensors."""
    if isinstance(params, torch.Tensor):
        raise ValueError("build_optimizer: params must be an iterable of tensors or of dicts, got one tensor; "
                        "wrap it in a list")
    groups = list(params)
    if not groups:
        raise ValueError("build_optimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for g in groups:
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError("build_optimizer: give parameters, or parameter groups as dicts with 'params' "
                             "({'params': [...], 'weight_decay': 0.0}), not a mix")
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        # named_parameters() as torch also takes it: (name, parameter) pairs
        out.append({**g, "params": [p[1] if isinstance(p, tuple) else p for p in ps]})
    return out


def split_masters(groups: list[ShardGroup], requested: list[dict], names: dict[int, str]) -> list[list[Piece]]:
    """For each of the user's groups, the pieces of this rank's masters it steps (see the module docstring).

    ``names``: {id(param): its name}, for the messages. Every parameter the strategy shards must be in
    exactly one group (ZeRO steps whole flat shards); a frozen parameter of the model may be given and is
    left alone, as a torch optimizer leaves a parameter without a gradient. ValueError names the fix."""
    sharded = {id(p) for g in groups for p in g.layout.params}
    group_of: dict[int, int] = {}
    for k, g in enumerate(requested):
        for p in g["params"]:
            if id(p) in group_of:
                raise ValueError(f"parameter {_name(p, names)} is in parameter groups {group_of[id(p)]} and {k}; "
                                 "give each parameter to one group")
            if id(p) not in sharded and (id(p) not in names or p.requires_grad):
                raise ValueError(f"build_optimizer: {_name(p, names)} is not a parameter of the wrapped model; pass "
                                 "the ShardedModule's own parameters (model.parameters() or model.named_parameters())")
            group_of[id(p)] = k
    missing = [_name(p, names) for g in groups for p in g.layout.params if id(p) not in group_of]
    if missing:
        raise ValueError(f"parameters {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} are in no "
                         "parameter group: under ZeRO every trained parameter must be in one (add a group for "
                         "them, e.g. {'params': rest, 'weight_decay': 0.0}), or freeze them with "
                         "requires_grad_(False) before wrapping the model")
    pieces: list[list[Piece]] = [[] for _ in requested]
    for index, g in enumerate(groups):
        runs: list[list[int]] = []  # [group, lo, hi] over this rank's real part
        for p, a, b in g.layout.local_pieces():
            k = group_of[id(p)]
            if runs and runs[-1][0] == k:
                runs[-1][2] = b
            else:
                runs.append([k, a, b])
        if len(runs) <= 1:  # one group holds the whole master (or it is empty): the master is the piece
            k = runs[0][0] if runs else group_of[id(g.layout.params[0])]
            pieces[k].append(Piece(g.master, index, 0, g.layout.real_len))
            continue
        for k, a, b in runs:
            pieces[k].append(Piece(view_of(g.master, a, b), index, a, b))
    return pieces


def view_of(master: nn.Parameter, lo: int, hi: int) -> nn.Parameter:
    """Elements [lo, hi) of ``master`` as a parameter of their own (a placeholder when the master has no
    storage: its data lives in a file until loaded)."""
    if master.untyped_storage().nbytes() == 0 and master.numel() > 0:
        placeholder = torch.empty(hi - lo, dtype=master.dtype)
        placeholder.untyped_storage().resize_(0)
        return nn.Parameter(placeholder)
    return nn.Parameter(master.detach()[lo:hi])


def _name(p: torch.Tensor, names: dict[int, str]) -> str:
    return names.get(id(p), f"(a tensor of shape {tuple(p.shape)})")
