"""Uneven data (issue 19, point 5): under ``model.join(opt)`` a rank that runs out of batches
shadows the others' steps, and training equals one process on the batches that exist (each
step the mean over the ranks still training); without join the waiting ranks get a named
timeout, not a silent hang; a ZeRO-3 unit that only some ranks run is a ValueError on every rank."""

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


# -- rank-dependent execution under ZeRO-3 ---------------------------------------------------------

class _Skipping(torch.nn.Module):
    """Five units (then the root's head); the layer ``skip`` is left out of this rank's forward,
    or, with ``detach``, run but cut from the loss, so only its backward is missing."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(6 + i, 7 + i) for i in range(5))
        self.head = torch.nn.Linear(11, 1)
        self.skip, self.detach = None, False

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i == self.skip and self.detach:
                layer(x)  # runs, but nothing depends on its output
            if i == self.skip:
                x = torch.nn.functional.pad(x, (0, 1))  # the layer's width, without the layer
            else:
                x = layer(x)
        return self.head(x)


def _skip_a_unit(ctx, reshard_after_forward: bool, detach: bool, skipping_step: int):
    mesh = Mesh()
    model = ShardedModule(_Skipping(), mesh=mesh, strategy="zero3", reshard_after_forward=reshard_after_forward)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(mesh.rank))
    try:
        for step in range(3):  # later steps prefetch in the order the first one recorded
            model.module.skip = 2 if mesh.rank == 1 and step == skipping_step else None
            model.module.detach = detach
            model.train_step(x, None, lambda out, _: out.square().mean())
            opt.step()
            opt.zero_grad()
        out = "trained"
    except ValueError as e:
        out = str(e)
    mesh.destroy()
    return out


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("detach", [False, True], ids=["skipped", "output-unused"])
@pytest.mark.parametrize("skipping_step", [0, 1])
def test_a_zero3_unit_run_on_some_ranks_only_is_an_error_everywhere(pools, reshard_after_forward, detach,
                                                                    skipping_step):
    """Rank 1 leaves unit layers.2 out of one step's forward (or out of its backward only): without
    the unit check the gathers pair with another unit's (a gloo size abort, or a mixed model), and
    a reduce-scatter the other rank launches only at the end of its backward leaves the first rank
    waiting; with it every rank raises the same ValueError at the first gather or reduce-scatter
    that differs, naming what each rank was about to do."""
    results = pools.run(2, _skip_a_unit, reshard_after_forward, detach, skipping_step, timeout=90)
    assert results[0] == results[1], "every rank raises the same error"
    message = results[0]
    assert "ran different units" in message, message
    assert "rank 0 (pp 0, dp 0, tp 0)" in message and "rank 1 (pp 0, dp 1, tp 0)" in message, message
    assert "unit 'layers." in message, message
