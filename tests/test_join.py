"""Uneven data (issue 19, point 5): under ``model.join(opt)`` a rank that runs out of batches
shadows the others' steps, and training equals one process on the batches that exist (each
step the mean over the ranks still training); without join the waiting ranks get a named
timeout, not a silent hang; a ZeRO-3 unit that only some ranks run is a ValueError on every rank."""

from __future__ import annotations

import pytest
import torch

from minipar import Mesh, ShardedModule
from minipar.models import GPT, GPTConfig, gpt_loss

from helpers import EPS, LR, WD, reference_steps

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


def _skips(world: int, step: int, skipping_step: int) -> list[int | None]:
    """The unit each rank leaves out in ``step``: in the skipping step rank 1 leaves out layers.2 and
    (with three ranks) rank 2 leaves out layers.1, so the ranks run three different sets of units."""
    if step != skipping_step:
        return [None] * world
    return [None, 2, 1][:world]


def _inputs(world: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(4, 6, generator=g) for _ in range(world)]


SKIP_MAX_NORM = 0.01  # fires: these gradient norms are 0.03 to 0.09


def _sq(out, _):
    return out.square().mean()


def _skip_a_unit(ctx, reshard_after_forward: bool, detach: bool, skipping_step: int):
    """Three steps of ZeRO-3 (AdamW, clipping that fires) with the skips of `_skips`: the losses, the
    gradient norms, the final parameters, and the bytes the parameter gathers and gradient
    reduce-scatters moved in each step."""
    mesh = Mesh()
    model = ShardedModule(_Skipping(), mesh=mesh, strategy="zero3", reshard_after_forward=reshard_after_forward)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    losses, norms, moved = [], [], []
    for step in range(3):  # later steps prefetch in the order the first one recorded
        model.module.skip = _skips(ctx.world_size, step, skipping_step)[ctx.rank]
        model.module.detach = detach
        with mesh.comm.counting() as stats:
            losses.append(model.train_step(_inputs(ctx.world_size, step)[ctx.rank], None, _sq).item())
        moved.append((stats.bytes(tag="param"), stats.bytes(tag="grad")))
        norms.append(model.clip_grad_norm_(SKIP_MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    state = {k: v.float().cpu() for k, v in model.full_state_dict().items()}
    mesh.destroy()
    return losses, norms, state, moved


def _skip_reference(world: int, detach: bool, skipping_step: int):
    """One process, the global batch: each step's loss is the mean of the ranks' losses, each rank's
    computed with its own skip (a parameter no rank used would get a zero gradient, as under ZeRO)."""
    model = _Skipping()

    def step_loss(s):
        model.detach = detach
        losses = []
        for x, skip in zip(_inputs(world, s), _skips(world, s, skipping_step)):
            model.skip = skip
            losses.append(_sq(model(x), None))
        return torch.stack(losses).mean()
    losses, norms = reference_steps(model, 3, step_loss, SKIP_MAX_NORM)
    return losses, norms, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("detach", [False, True], ids=["skipped", "output-unused"])
@pytest.mark.parametrize("skipping_step", [0, 1])
def test_a_zero3_unit_run_on_some_ranks_only_trains_as_one_process(pools, world, reshard_after_forward, detach,
                                                                  skipping_step):
    """Ranks leave different units out of one step's forward (or run them but cut them from the loss,
    so only their backward is missing), in the first step or in a later one (where the units are
    prefetched in the order the first step recorded). ZeRO-3 serves each gather in one order on every
    rank (a rank takes part in a gather it does not need) and, once the ranks' units differ, sends
    every reduce-scatter at the end of backward (zeros for a unit a rank did not run): the losses,
    clipped gradient norms and parameters after three AdamW steps equal one process on the global
    batch. (Before: a ValueError on every rank.) The parameter and gradient bytes are those of a step
    in which every rank runs every unit: nothing is gathered or reduced twice."""
    ref_losses, ref_norms, ref_state = _skip_reference(world, detach, skipping_step)
    assert min(ref_norms) > SKIP_MAX_NORM  # clipping fires
    results = pools.run(world, _skip_a_unit, reshard_after_forward, detach, skipping_step, timeout=120)
    for rank, (losses, norms, state, moved) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=f"rank {rank}")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), msg=f"rank {rank}")
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, msg=lambda m: f"rank {rank} {k}: {m}")
        uniform = [m for s, m in enumerate(moved) if s != skipping_step]
        assert all(m == uniform[0] for m in moved), (rank, moved)


class _Trunk(torch.nn.Module):
    """Block-sequential (a pipeline can cut it): an input layer, four equal blocks, a head; ``skip``
    makes a block the identity on this rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.inp = torch.nn.Linear(6, 8)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(4))
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.skip = torch.nn.Linear(8, 8), False

    def forward(self, h):
        return h if self.skip else torch.tanh(self.lin(h))


def _trunk_spec():
    from minipar.pipeline import StageSpec
    return StageSpec(blocks="blocks", first=("inp",), last=("out",), embed=_trunk_embed, head=_trunk_head, hidden_size=8)


def _trunk_embed(s, x):
    return s.inp(x)


def _trunk_head(s, h):
    return s.out(h)


def _trunk_inputs(step: int) -> torch.Tensor:
    """The global batch of a step: (dp=2) x 4 rows of 3 positions of 6 features."""
    return torch.randn(2, 4, 3, 6, generator=torch.Generator().manual_seed(200 + step))


def _skip_under_pipeline(ctx, schedule: str, reshard_after_forward: bool):
    """pp=2 x dp=2 under ZeRO-3 with every Linear a unit: in step 1, data-parallel rank 1 makes block 1
    (on the first stage) the identity for all its micro-batches, so it never calls that unit."""
    from minipar.pipeline import PipelineConfig
    mesh = Mesh(pp=2)
    model = ShardedModule(_Trunk(), mesh=mesh, strategy="zero3", wrap_policy=(torch.nn.Linear,),
                          reshard_after_forward=reshard_after_forward,
                          pipeline=PipelineConfig(schedule=schedule, microbatches=2, stage_spec=_trunk_spec()))
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    losses, norms = [], []
    for step in range(3):
        for k, block in enumerate(model.module.stage_blocks()):
            block.skip = step == 1 and mesh.dp_rank == 1 and model.module.block_index[k] == 1
        x = _trunk_inputs(step)[mesh.dp_rank]
        losses.append(model.train_step(x, torch.zeros(len(x)), _sq).item())  # (the loss reads no targets)
        norms.append(model.clip_grad_norm_(SKIP_MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    state = {k: v.float().cpu() for k, v in model.full_state_dict().items()}  # the whole model's names
    mesh.destroy()
    return losses, norms, state


@pytest.mark.parametrize("schedule, reshard_after_forward", [("gpipe", False), ("1f1b", True)])
def test_a_zero3_unit_some_ranks_skip_under_a_pipeline_trains_as_one_process(pools, schedule, reshard_after_forward):
    """The same under pipeline parallelism (pp=2 x dp=2, two micro-batches; units gathered once per
    step, or for every micro-batch's forward and backward): the stage's data-parallel ranks serve each
    other's gathers, and the step's one reduce-scatter per unit sends zeros for the unit a rank skipped."""
    model = _Trunk()

    def step_loss(s):
        per_rank = []
        for r, x in enumerate(_trunk_inputs(s)):
            model.blocks[1].skip = s == 1 and r == 1
            per_rank.append(torch.stack([_sq(model(mb), None) for mb in x.chunk(2)]).mean())
        return torch.stack(per_rank).mean()
    ref_losses, ref_norms = reference_steps(model, 3, step_loss, SKIP_MAX_NORM)
    assert min(ref_norms) > SKIP_MAX_NORM
    ref_state = {k: v.detach() for k, v in model.state_dict().items()}
    for rank, (losses, norms, state) in enumerate(pools.run(4, _skip_under_pipeline, schedule, reshard_after_forward,
                                                                  timeout=120)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=f"rank {rank}")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), msg=f"rank {rank}")
        for k, v in state.items():
            torch.testing.assert_close(v, ref_state[k], msg=lambda m: f"rank {rank} {k}: {m}")
