"""Auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert bias on the routing scores.

Each MoE layer with ``balance="bias"`` keeps a buffer ``expert_bias`` (E,), added to the scores
for the choice of experts only (the combine weights are the unbiased scores, `minipar.moe.router`).
Between optimizer steps the layer counts how many assignments chose each expert (``load``, every
training forward: micro-batches and routing groups included). After the step::

    load_e  = sum over every rank that routes different tokens (dp x cp, and tp under sequence
              parallelism: the ep ranks are part of dp) of that rank's count for expert e
    b_e    += rate * sign(mean_e(load) - load_e)

so an overloaded expert becomes less attractive and an idle one more, without a gradient. The
count is summed through the counted comm layer (tag ``moe_bias_load``), so every rank applies
the same update to the same bias: the biases stay identical everywhere, and a single-process
run on the global batch (routing each rank's share as its own group) computes the same one.
The rule only compares each load to the mean, so a count scaled uniformly (a forward recomputed
under activation checkpointing counts twice) gives the same update.

The bias is a persistent buffer: checkpoints and ``full_state_dict`` carry it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .layer import MoELayer, moe_layers


@torch.no_grad()
def bias_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """bias += rate * sign(mean(load) - load), in place; load: (E,) global assignment counts."""
    load = load.to(torch.float64)
    bias += (rate * torch.sign(load.mean() - load)).to(bias.dtype)


@torch.no_grad()
def update_bias(layer: MoELayer) -> None:
    """One layer: sum its load since the last update over ``layer.load_groups``, move its bias, start
    counting afresh. Nothing (and no collective) for a layer balanced by the auxiliary loss."""
    if layer.balance != "bias":
        return
    load = layer.load.to(torch.float64)
    for group in layer.load_groups:  # set by `minipar.moe.expert_parallel.apply_experts`
        layer.comm.all_reduce(load, group, tag="moe_bias_load")
    bias_update(layer.expert_bias, load, layer.bias_update_rate)
    layer.load.zero_()


def update_expert_bias(module: nn.Module) -> None:
    """After ``opt.step()``: `update_bias` for every MoE layer of ``module``. A collective when some
    layer is bias-balanced: call it on every rank."""
    for layer in moe_layers(module):
        update_bias(layer)
