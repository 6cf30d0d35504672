"""Layout-free state: each tensor whole, under its single-process name.

The one place that knows how a rank's local tensor relates to the tensor of
the same model trained in one process: its name (a pipeline stage's
block ``layers.k`` is the model's ``layers.(offset + k)``; the last stage's copy of
a tied embedding is the embedding's weight, ``wte.weight``) and its cut (split over tp along its
tensor-parallel dim, then, an expert's, over ep along dim 0).
`ShardedModule.full_state_dict` gathers along the cuts (`full_tensors`);
checkpoints store the cuts with each piece and apply them on load
(`minipar.checkpoint.pieces`). The data-parallel part (ZeRO shards) is the
strategy's: it hands over full values with ``full_params()`` and its shard
ranges with ``stepped_ranges()``.
"""

from __future__ import annotations

from typing import Callable

import torch

from .core.placement import placement_of


def global_names(model) -> tuple[dict[int, str], dict[str, str]]:
    """({id(parameter or buffer): single-process name}, {alias: name}) for this rank's module.

    The single-process state dict lists a tied weight under both of its names: the first is the
    name, the other an alias.
    """
    module, pp = model.module, model.mesh.pp > 1
    embedding, head = module.spec.tied if pp and module.tied else (None, None)
    names: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for key, t in module.state_dict(keep_vars=True).items():
        name = module.global_name(key) if pp else key
        if key == head:  # the last stage's copy of the tied weight
            name = embedding
            aliases[head] = embedding
        if id(t) in names:
            aliases[name] = names[id(t)]
        else:
            names[id(t)] = name
    if head is not None and module.first:
        aliases[head] = embedding
    return names, aliases


def local_cut(t: torch.Tensor, mesh) -> tuple[list[tuple[str, int, int, int]], tuple[int, ...]]:
    """([(axis, dim, index, count), ...], full shape): ``t`` is
    ``full.chunk(count, dim)[index]`` for each cut in turn, ``index`` being this rank's on ``axis``."""
    cuts, full, where = [], list(t.shape), placement_of(t)
    if where.tensor_parallel and mesh.tp > 1:
        cuts.append(("tp", where.tp_dim, mesh.tp_rank, mesh.tp))
        full[where.tp_dim] *= mesh.tp
    if where.expert and mesh.ep > 1:
        cuts.append(("ep", 0, mesh.ep_rank, mesh.ep))
        full[0] *= mesh.ep
    return cuts, tuple(full)


@torch.no_grad()
def full_tensors(model, value_of: Callable[[torch.Tensor], torch.Tensor | None],
                 all_stages: bool = True) -> dict[str, torch.Tensor]:
    """{single-process name: full tensor} for each entry ``t`` of the module's state dict, from
    ``value_of(t)`` (this rank's local value; None leaves the entry out), gathered along its cuts
    (a collective over tp and ep: call on every rank) and, with ``all_stages``, from every pipeline
    stage (tied weights under both names). Fresh tensors, not views of the model's."""
    mesh = model.mesh
    names, aliases = global_names(model)
    out = {}
    for t in {id(t): t for t in model.module.state_dict(keep_vars=True).values()}.values():
        value = value_of(t)
        if value is None:
            continue
        value = value.detach().clone()
        for axis, dim, _, count in reversed(local_cut(t, mesh)[0]):  # undo the last cut first
            parts = torch.empty((count,) + tuple(value.shape), dtype=value.dtype, device=value.device)
            mesh.comm.all_gather(parts, value.unsqueeze(0), mesh.group(axis), tag="state_dict")
            value = torch.cat(parts.unbind(0), dim=dim)
        out[names[id(t)]] = value
    if all_stages and mesh.pp > 1:
        stages = mesh.comm.all_gather_object(out, mesh.group("pp"), tag="state_dict")
        out = {k: v for part in stages for k, v in part.items()}
        aliases = {a: n for part in mesh.comm.all_gather_object(aliases, mesh.group("pp"), tag="state_dict")
                   for a, n in part.items()}
    for alias, name in aliases.items():
        if name in out:
            out[alias] = out[name]
    return out
