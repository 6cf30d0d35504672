"""The host's work per training step on one device: minipar adds a fixed number of operations per
gradient bucket (or ZeRO-3 unit), never one per parameter.

On a GPU every operation is a kernel launch the host must issue, and a 350M GPT has ~400 parameters:
two launches per parameter per step (a copy and a divide into the gradient buckets, as minipar did)
cost as much host time as the model's own layers. Counted here on the CPU with
`minipar.core.syncs.count_launches` (the ATen operators that would launch work), for a GPT with and without
biases: the biases add 8 parameters per block and change the model's own operations (addmm for mm,
the bias gradients' sums), which the plain PyTorch forward and backward of the same model measure.
minipar's operations beyond the plain model's must be the same for both forms.
"""

from __future__ import annotations

import pytest
import torch

import minipar
from minipar import MixedPrecision, ShardedModule
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.core.syncs import count_launches

CFG = dict(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)


def _batch() -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(0))


def _plain_ops(bias: bool) -> int:
    """The plain model's forward, loss and backward: the model's own operations."""
    model, x = GPT(GPTConfig(**CFG, bias=bias)), _batch()
    gpt_loss(model(x[:, :-1]), x[:, 1:]).backward()  # a first step: lazy state, as below
    model.zero_grad()
    with count_launches() as ops:
        gpt_loss(model(x[:, :-1]), x[:, 1:]).backward()
    return ops.total


def _minipar_ops(strategy: str, options: dict, bias: bool) -> tuple[int, dict]:
    """One whole step (train_step, clip, optimizer step, zero_grad) on a world of one."""
    model = ShardedModule(GPT(GPTConfig(**CFG, bias=bias)), mesh=minipar.Mesh(), strategy=strategy,
                          bucket_cap_mb=64, **options)
    opt = model.build_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1, foreach=True)
    x = _batch()

    def step():
        model.train_step(x[:, :-1], x[:, 1:], gpt_loss)
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    step()  # the optimizer's state is created in the first step
    with count_launches() as ops:
        step()
    return ops.total, dict(ops.ops)


BF16 = dict(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


@pytest.mark.parametrize("strategy, options", [("ddp", {}), ("zero1", {}), ("zero1", BF16), ("zero2", BF16),
                                               ("zero3", BF16)], ids=["ddp", "zero1", "zero1-bf16", "zero2-bf16",
                                                                      "zero3-bf16"])
def test_minipar_adds_no_operation_per_parameter(world_of_one, strategy, options):
    extra = {}
    for bias in (False, True):
        total, ops = _minipar_ops(strategy, options, bias)
        extra[bias] = (total - _plain_ops(bias), ops)
    n_bias = sum(p.numel() > 0 for n, p in GPT(GPTConfig(**CFG, bias=True)).named_parameters() if n.endswith("bias"))
    more = {op: n - extra[False][1].get(op, 0) for op, n in extra[True][1].items() if n != extra[False][1].get(op, 0)}
    assert extra[True][0] == extra[False][0], (
        f"{n_bias} more parameters (the biases) cost {extra[True][0] - extra[False][0]} more operations beyond "
        f"the model's own (with biases, per operator: {more})")
