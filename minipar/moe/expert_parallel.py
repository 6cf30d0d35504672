"""The MoE family's part of the front door: checks before any collective, then expert parallelism.

`check_experts` runs on every rank before the first collective (ep > 1 over a model without MoE
layers; experts that ep does not divide); `apply_experts` then gives each ep rank its E / ep
experts, under sequence parallelism has each tp rank route its own slice of the sequence, and
tells bias-balanced layers which ranks' expert loads to sum.
"""

from __future__ import annotations

import torch.nn as nn

from ..core.mesh import Mesh
from ..tensor_parallel import mark_sequence_parallel
from .layer import MoELayer, check_moe_config, moe_layers


def check_experts(module: nn.Module, mesh: Mesh) -> list[MoELayer]:
    """``module``'s MoE layers; ValueError, saying what to change, for a layout they cannot take."""
    layers = moe_layers(module)
    if mesh.ep > 1 and not layers:
        raise ValueError(f"the mesh has ep={mesh.ep} but {type(module).__name__} has no MoE layers: "
                         "expert parallelism has nothing to split; build the mesh with ep=1")
    for layer in layers:
        check_moe_config(layer.n_experts, layer.top_k, layer.capacity_factor, mesh.ep, **layer.options)
    return layers


def apply_experts(module: nn.Module, mesh: Mesh, sequence_parallel: bool) -> bool:
    """Shard ``module``'s experts over ep (tokens reach the others by all-to-all). Returns whether the
    tp ranks route different slices of the sequence (sequence parallelism at tp > 1): their MoE
    figures are then summed over tp too."""
    layers = moe_layers(module)
    group = mesh.group("ep")
    for layer in layers:
        layer.shard_experts(mesh.comm, group)
    per_slice = bool(layers) and sequence_parallel and mesh.tp > 1
    # The ranks that route different tokens: a bias-balanced layer sums its expert loads over them
    # (`minipar.moe.balance`); the ep ranks are part of dp, the pipeline stages hold other layers.
    load_axes = [mesh.grad_axis] + (["tp"] if per_slice else [])
    for layer in layers:
        layer.load_groups = [mesh.group(axis) for axis in load_axes if mesh.size(axis) > 1]
    if per_slice:  # each tp rank routes its own slice: the aux loss is divided by tp, the grads summed over it
        for layer in layers:
            layer.sequence_shards = mesh.tp
            for p in layer.parameters():
                mark_sequence_parallel(p, mesh)
    return per_slice
