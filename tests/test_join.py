"""Uneven data (issue 19, point 5): under ``model.join(opt)`` a rank that runs out of batches
shadows the others' steps, and training equals one process on the batches that exist (each
step the mean over the ranks still training); without join the waiting ranks get a named
timeout, not a silent hang; a ZeRO-3 unit that only some ranks use works."""

from __future__ import annotations

import pytest
import torch

from minipar import Mesh, ShardedModule
from minipar.models import GPT, GPTConfig, gpt_loss

from helpers import EPS, LR, WD

CFG = dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.0, seed=3)
MAX_NORM = 0.05  # fires: the gradient norms here are ~1


def _data(steps_per_rank: list[int], rows: int = 2) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [[torch.randint(0, 16, (rows, 9), generator=g) for _ in range(n)] for n in steps_per_rank]


def _reference(steps_per_rank: list[int]):
    """One process: step s trains on the batches of the ranks that still have an s-th batch."""
    data = _data(steps_per_rank)
    model = GPT(GPTConfig(**CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses = []
    for s in range(max(steps_per_rank)):
        x = torch.cat([d[s] for d in data if s < len(d)])
        loss = gpt_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _uneven(ctx, strategy: str, layout: dict, steps_per_rank: list[int]):
    mesh = Mesh(**layout)
    model = ShardedModule(GPT(GPTConfig(**CFG)), mesh=mesh, strategy=strategy)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    losses = []
    with model.join(opt):
        for x in _data(steps_per_rank)[mesh.dp_rank]:
            losses.append(model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy).item())
            model.clip_grad_norm_(MAX_NORM)
            opt.step()
            opt.zero_grad()
    state = {k: v.float().cpu() for k, v in model.full_state_dict().items()}
    mesh.destroy()
    return losses, state


@pytest.mark.parametrize("strategy, layout, world", [
    ("ddp", {}, 2), ("zero1", {}, 2), ("zero2", {}, 2), ("zero3", {}, 2), ("zero2", dict(dp=2, tp=2), 4),
])
def test_join_trains_on_uneven_data_as_one_process_would(pools, strategy, layout, world):
    steps_per_rank = [3, 1]  # data-parallel rank 1 runs out after one step
    ref_losses, ref_state = _reference(steps_per_rank)
    for rank, (losses, state) in enumerate(pools.run(world, _uneven, strategy, layout, steps_per_rank, timeout=120)):
        dp_rank = rank // layout.get("tp", 1)
        n = steps_per_rank[dp_rank]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[:n]),
                                   msg=lambda s: f"rank {rank} losses: {s}")
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, msg=lambda s: f"rank {rank} {k}: {s}")


def _out_of_data_at_once(ctx):
    mesh = Mesh()
    model = ShardedModule(GPT(GPTConfig(**CFG)), mesh=mesh)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR)
    with pytest.raises(ValueError) as info:
        with model.join(opt):
            for x in _data([2, 0])[mesh.dp_rank]:
                model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy)
                opt.step()
                opt.zero_grad()
    mesh.destroy()
    return str(info.value)


def test_a_rank_without_any_batch_inside_join_is_an_error_everywhere(pools):
    for message in pools.run(2, _out_of_data_at_once, timeout=60):
        assert "ranks [1] ran out of data inside join() before their first step" in message
