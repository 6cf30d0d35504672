"""``train_step(x, y)`` without a loss function: the model computes its own loss, ``model(x, targets=y)``.

minipar's GPT then runs its LM head and the cross-entropy together in row chunks
(`minipar.kernels.linear_cross_entropy`), never holding the (batch, seq, vocab) logits. Under every
data-parallel strategy (2 ranks, different data, fp32, AdamW with clipping that fires) three steps equal
the same run with ``loss_fn=gpt_loss`` on the logits: losses, clipped norms and parameters. Where the
whole model does not run in one forward (pipeline, tensor and context parallelism) it is refused on every
rank before any collective, saying to pass a loss function; a model whose forward does not return a loss
is refused with the same advice.
"""

from __future__ import annotations

import pytest
import torch

from minipar import Mesh, ShardedModule
from minipar.models import GPT, GPTConfig, gpt_loss

from helpers import EPS, LR, WD

CFG = dict(vocab_size=48, block_size=8, n_layer=2, n_head=2, n_embd=16, seed=5)
MAX_NORM = 0.05


def _data() -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (3, 4, 9), generator=torch.Generator().manual_seed(9))


def _train(ctx, strategy: str, own: bool, tied: bool):
    mesh = Mesh()
    model = ShardedModule(GPT(GPTConfig(**CFG, tie_weights=tied)), mesh=mesh, strategy=strategy, bucket_cap_mb=1e-3)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    losses, norms = [], []
    for batch in _data():
        x = batch[2 * mesh.dp_rank: 2 * mesh.dp_rank + 2]
        loss = model.train_step(x[:, :-1], x[:, 1:]) if own else model.train_step(x[:, :-1], x[:, 1:], gpt_loss)
        losses.append(loss.item())
        norms.append(model.clip_grad_norm_(MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    state = {k: v.float().cpu() for k, v in model.full_state_dict().items()}
    mesh.destroy()
    return losses, norms, state


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_models_own_loss_trains_as_the_logits_loss(pools, strategy, tied):
    own, logits = (pools.run(2, _train, strategy, flag, tied) for flag in (True, False))
    assert min(logits[0][1]) > MAX_NORM  # clipping fires
    for rank, ((l1, n1, s1), (l2, n2, s2)) in enumerate(zip(own, logits)):
        torch.testing.assert_close(torch.tensor(l1), torch.tensor(l2), msg=f"rank {rank}")
        torch.testing.assert_close(torch.tensor(n1), torch.tensor(n2), msg=f"rank {rank}")
        for k, v in s2.items():
            torch.testing.assert_close(s1[k], v, msg=lambda m: f"rank {rank} {k}: {m}")


def _refused(ctx, layout: dict):
    mesh = Mesh(**layout)
    options = {"microbatches": 2} if layout.get("pp", 1) > 1 else {}
    model = ShardedModule(GPT(GPTConfig(**CFG)), mesh=mesh, **options)
    x = _data()[0]
    try:
        with mesh.comm.counting() as stats:
            model.train_step(x[:, :-1], x[:, 1:])
        return None
    except ValueError as e:
        return str(e), len(stats.records)
    finally:
        mesh.destroy()


@pytest.mark.parametrize("layout", [dict(pp=2), dict(tp=2)], ids=["pp2", "tp2"])
def test_without_a_loss_fn_split_models_are_refused_before_any_collective(pools, layout):
    for out in pools.run(2, _refused, layout):
        assert out is not None and "pass a loss_fn" in out[0], out
        assert out[1] == 0, out  # nothing was sent


def test_a_model_that_returns_no_loss_is_refused(world_of_one):
    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)

        def forward(self, x, targets=None):
            return self.emb(x)

    model = ShardedModule(Logits(), mesh=Mesh())
    with pytest.raises(ValueError, match="returns its loss"):
        model.train_step(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
