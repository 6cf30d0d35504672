"""What `ShardedModule` checks before it communicates: the model and options at wrap time, each batch.

Wrap time (`agree_on_model`): every rank of the world describes the model it
was given (each parameter's and buffer's name, shape and dtype) and the
options, in words that are equal on equal inputs (a function by its
qualified name, never its address), and one collective compares them: a
difference raises ValueError on every rank naming the two ranks, their mesh
coordinates, and every option (as its config's field, e.g.
``strategy.bucket_cap_mb``) and tensor that differs, with both ranks' values. Then every rank takes world rank 0's
initial weights (`broadcast_initial_state`), so ranks seeded differently
still train one model: each tensor-parallel shard is cut from the same full
tensor and every replica (over dp, tp, pp's tied copy) starts equal.

Each step (`check_batch`): ids and targets inside the vocabulary (targets
may be ``ignore_index``), a sequence no longer than the model's block size,
and the batch shape equal on the ranks that must see the same batch (the
tensor- and pipeline-parallel peers). Each rank tests its own batch, then one
all-gather of a few integers over the world tells every rank what every rank
found, so a bad batch raises on all of them instead of failing on one while
the others wait.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.nn as nn

from .core.comm_errors import first_difference
from .core.mesh import Mesh
from .core.syncs import read_on_host

_SHAPE_DIMS = 4  # batch shapes compared: up to this many dims (ids are (batch, seq))


def describe(value: Any) -> Any:
    """A description of an option equal on every rank iff the options are: dataclasses by field,
    functions and classes by qualified name (a repr would carry the object's address)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: describe(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if callable(value) and hasattr(value, "__qualname__"):  # functions, classes
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))  # torch.bfloat16 stays itself; addresses go


def _freed(t: torch.Tensor) -> bool:
    """A tensor whose storage is gone: a parameter of a model a ZeRO-3 wrapper sharded (its full values
    live in the wrapper's shards only)."""
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


def model_structure(module: nn.Module) -> list[str]:
    """"name shape dtype" of every parameter and buffer, in registration order ("... freed" when its
    storage is gone)."""
    return [f"{n} {tuple(t.shape)} {t.dtype}" + (" freed" if _freed(t) else "")
            for n, t in module.state_dict(keep_vars=True).items()]


def agree_on_model(mesh: Mesh, module: nn.Module, options: dict[str, Any]) -> None:
    """ValueError on every rank unless every rank of the world holds the same model and options, and
    the model's tensors hold their values. The message names every option and tensor that differs
    between world rank 0 and the first rank that differs from it, with both ranks' values."""
    structure = model_structure(module)
    mine = {"options": describe(options), "model": structure}
    everyone = mesh.comm.all_gather_object(mine, mesh.world, tag="config_check")
    odd = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if odd:  # every rank gathered the same list: all raise together
        raise ValueError(_configuration_differs(mesh, everyone[0], everyone[odd[0]], odd))
    freed = [line.split()[0] for line in structure if line.endswith(" freed")]
    if freed:  # the same on every rank (just agreed): all raise together
        raise ValueError(f"the model's tensors {freed[:3]}{' ...' if len(freed) > 3 else ''} have no storage: a ZeRO-3 "
                         "ShardedModule wrapped this model and keeps its values in its shards. Wrap a fresh model "
                         "(load that wrapper's full_state_dict() into it to go on from where it was)")


def _configuration_differs(mesh: Mesh, first: dict, other: dict, odd: list[int]) -> str:
    """The message for world rank 0's description ``first`` against rank ``odd[0]``'s ``other``."""
    r = odd[0]
    lines = ["the ShardedModule configuration (model structure and options) differs between ranks of the "
             "'world' group; build it identically on every rank (an option computed from the rank, or a "
             "model built from rank-dependent sizes, is the usual cause).",
             f"{', '.join(f'rank {o}' for o in odd)} differ(s) from rank 0; rank 0 ({mesh.where(0)}) and rank {r} "
             f"({mesh.where(r)}) differ first at {first_difference(first, other)}",
             f"what differs between rank 0 and rank {r}:"]
    found = [f"option {path}: {a} on rank 0, {b} on rank {r}"
             for path, a, b in _leaf_differences(first["options"], other["options"])]
    found += _model_differences(first["model"], other["model"], r)
    shown = 8  # enough to see the pattern; a model built from another config differs in every tensor
    lines += [f"  {line}" for line in found[:shown]]
    if len(found) > shown:
        lines.append(f"  ... and {len(found) - shown} more")
    return "\n".join(lines)


def _leaf_differences(a: Any, b: Any, path: str = "") -> list[tuple[str, str, str]]:
    """(dotted path, value on one side, value on the other) of every leaf where two descriptions
    (`describe`) differ: ``tensor_parallel.sequence_parallel``, ``pipeline.boundaries[1]``."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            where = f"{path}.{k}" if path else str(k)
            if k not in a or k not in b:
                out.append((where, repr(a[k]) if k in a else "absent", repr(b[k]) if k in b else "absent"))
            elif a[k] != b[k]:
                out += _leaf_differences(a[k], b[k], where)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) if x != y for d in _leaf_differences(x, y, f"{path}[{i}]")]
    return [(path or "the options", repr(a), repr(b))]


def _model_differences(first: list[str], other: list[str], r: int) -> list[str]:
    """What differs between two `model_structure` lists, tensor by tensor (by name)."""
    def by_name(lines: list[str]) -> dict[str, str]:
        return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in lines}
    a, b = by_name(first), by_name(other)
    out = [f"model tensor {n}: {a[n]} on rank 0, {b[n]} on rank {r}" for n in a if n in b and a[n] != b[n]]
    out += [f"model tensor {n}: {a[n]} on rank 0, absent on rank {r}" for n in a if n not in b]
    out += [f"model tensor {n}: absent on rank 0, {b[n]} on rank {r}" for n in b if n not in a]
    if not out and first != other:  # the same tensors, registered in another order
        out.append(f"model: the same tensors registered in another order on rank {r}")
    return out


@torch.no_grad()
def broadcast_initial_state(module: nn.Module, mesh: Mesh) -> None:
    """Every parameter and buffer of ``module`` takes world rank 0's value, one tensor at a time
    through ``mesh.device`` (the whole model never needs to fit there at once)."""
    for t in {id(t): t for t in list(module.parameters()) + list(module.buffers())}.values():
        on_device = t.detach().to(mesh.device)
        mesh.comm.broadcast(on_device, 0, mesh.world, tag="initial_state")
        if on_device.data_ptr() != t.data_ptr():
            t.copy_(on_device)


def check_batch(mesh: Mesh, inputs: Any, targets: Any, vocab_size: int | None, block_size: int | None,
                ignore_index: int = -100, active: int = 1, microbatches: int = 1, seq_shards: int = 1,
                seq_shards_why: str = "", ids_only_why: str = "") -> list[int]:
    """ValueError on every rank if any rank's batch is bad (see the module docstring). One
    all-gather of ``8 + 2 * _SHAPE_DIMS`` integers per rank over the world, which also carries
    each rank's ``active`` flag (`minipar.data_parallel.join`: 1 training, 0 shadowing, -1 out of data before
    its first step); returns every rank's flag. ``microbatches`` must divide the batch and
    ``seq_shards`` the sequence (``seq_shards_why`` says who cuts it: "tp=2" under sequence
    parallelism, "2 x cp=2" under ring attention). ``ids_only_why``, when given, says why the inputs
    must be one tensor (a pipeline's stages pass nothing else between them: no attention mask)."""
    # ids out of range, targets out of range, sequence too long, shapes differ, batch or sequence not
    # divisible, inputs other than token ids where only they are taken
    mine = [0, 0, 0, 0, 0, 0, 0]
    ids = inputs if torch.is_tensor(inputs) and not inputs.is_floating_point() else None
    tgt = targets if torch.is_tensor(targets) and not targets.is_floating_point() else None
    here = next((t.device for t in (ids, tgt) if t is not None), torch.device("cpu"))  # the flags stay with the batch
    flags = [torch.tensor(False, device=here), torch.tensor(False, device=here)]
    if vocab_size is not None and ids is not None and ids.numel():
        flags[0] = (ids.min() < 0) | (ids.max() >= vocab_size)
    if vocab_size is not None and tgt is not None and tgt.numel():
        flags[1] = ((tgt != ignore_index) & ((tgt < 0) | (tgt >= vocab_size))).any()
    seq = ids.shape[1] if ids is not None and ids.dim() >= 2 else 0
    mine[2] = int(block_size is not None and seq > block_size)
    if ids is not None and tgt is not None and ids.shape != tgt.shape:
        mine[3] = 1
    lead = inputs if torch.is_tensor(inputs) else None
    mine[4] = int(lead is not None and lead.dim() >= 1 and lead.shape[0] % microbatches != 0)
    mine[5] = int(lead is not None and lead.dim() >= 2 and lead.shape[1] % seq_shards != 0)
    mine[6] = int(bool(ids_only_why) and not torch.is_tensor(inputs))
    shapes = [list(t.shape)[:_SHAPE_DIMS] + [-1] * (_SHAPE_DIMS - min(t.dim(), _SHAPE_DIMS)) if torch.is_tensor(t)
              else [-2] * _SHAPE_DIMS for t in (inputs, targets)]
    both = torch.stack(flags).to(torch.int64)
    # The range flags are read where they are: free for a host batch, one read-back of a device batch.
    mine = (read_on_host(both) if here.type == "cpu" else both.tolist()) + mine[2:] + shapes[0] + shapes[1] + [active]
    if mesh.world_size == 1:
        rows = [mine]
    else:  # agreed on the host whichever way the batches came: the same collective on every rank
        everyone = torch.empty(mesh.world_size * len(mine), dtype=torch.int64)
        mesh.comm.all_gather(everyone, torch.tensor(mine), mesh.host_world, tag="batch_check")
        rows = read_on_host(everyone.view(mesh.world_size, -1))
    flags = [row.pop() for row in rows]
    lost = [r for r, f in enumerate(flags) if f < 0]
    if lost:
        raise ValueError(f"ranks {lost} ran out of data inside join() before their first step, so they "
                         "cannot shadow the others' steps; give every rank at least one batch")
    problems = []
    for r, row in enumerate(rows):
        b, t = row[7], row[8]  # this rank's inputs' batch and sequence lengths
        what = [w for w, bad in zip((f"token ids outside [0, {vocab_size})",
                                     f"targets outside [0, {vocab_size}) other than ignore_index={ignore_index}",
                                     f"a sequence longer than the block size {block_size}",
                                     "inputs and targets of different shapes",
                                     f"a batch of {b} does not split into microbatches={microbatches}; use a batch "
                                     "size divisible by the micro-batch count",
                                     f"a sequence of {t} does not split into {seq_shards_why or f'{seq_shards} shards'}; "
                                     f"use a sequence length divisible by {seq_shards}",
                                     f"inputs that are not one tensor (token ids), which {ids_only_why} takes alone "
                                     "(no attention mask: pass unpadded token ids (batch, seq), or train without "
                                     "pipeline parallelism)"), row[:7]) if bad]
        if what:
            problems.append(f"rank {r} ({mesh.where(r)}): {'; '.join(what)}")
    for axis in ("tp", "cp", "pp"):  # these ranks cut one batch: they must be given the same shape
        groups = mesh.rank_lists(axis)
        ranks = next((g for g in groups if len({tuple(rows[r][7:]) for r in g}) > 1), None)  # every group's,
        if ranks is not None:  # not only this rank's: all ranks must raise together
            got = {r: rows[r][7:] for r in ranks}
            shown = ", ".join(f"rank {r}: {_shape(v[:_SHAPE_DIMS])}/{_shape(v[_SHAPE_DIMS:])}" for r, v in got.items())
            problems.append(f"the {axis} ranks {list(ranks)} were given batches of different shapes "
                            f"(inputs/targets): {shown}; give every rank of a {axis} group the same batch")
    if problems:
        raise ValueError("bad batch, nothing was computed:\n  " + "\n  ".join(problems))
    return flags


def _shape(dims: list[int]) -> str:
    return "none" if dims[0] == -2 else str(tuple(d for d in dims if d >= 0))
