"""A loss that cannot read vocab-parallel logits is refused (issue 31): `minipar.loss_check`.

Under tensor parallelism minipar's GPT plan leaves the LM head 'colwise', so each tp rank's logits
hold V / tp vocabulary columns. An ordinary cross-entropy on them raised IndexError on the last
stage (while the other stages waited for the timeout) or, when every target fell inside the first
slice, trained silently wrong. Specification:

* which head a plan splits, and which loss functions are known to read split logits (marked with
  `vocab_parallel`, through partials, bound methods and wrappers), without processes;
* through the front door at tp=2 (pp=1 and pp=2): ``gpt_loss`` and ``F.cross_entropy`` are refused
  with ValueError on every rank, before any collective of the step, naming ``model.cross_entropy``;
* a loss of one's own marked with ``@vocab_parallel`` (and a partial of
  ``vocab_parallel_cross_entropy``) trains at tp=2 x pp=2 to the single-process run's losses,
  gradient norms and parameters after three clipped AdamW steps with weight decay.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from minipar import Mesh, ShardedModule
from minipar.loss_check import check_loss, is_vocab_parallel, vocab_parallel, vocab_split_head
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.tensor_parallel import vocab_parallel_cross_entropy

from helpers import EPS, LR, WD, reference_steps, train_rows

CFG = dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.0, seed=5)
MAX_NORM = 0.05  # small enough that clipping fires on every step (asserted below)


# -- which head is split, which loss reads split logits (no processes) ------------------------------

def test_the_gpt_plan_splits_the_lm_head_unless_it_gathers_the_logits():
    model = GPT(GPTConfig(**CFG))
    assert vocab_split_head(model, model.tp_plan(2)) == ("lm_head", 16)
    assert vocab_split_head(model, model.tp_plan(2, gather_logits=True)) is None
    assert vocab_split_head(model, None) is None


class _NoConfig(nn.Module):
    """A model without a config: the vocabulary is the 'vocab' embedding's; an MLP exactly as wide
    as the vocabulary comes before the head and is not taken for it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.fc = nn.Linear(8, 32)
        self.proj = nn.Linear(32, 8)
        self.head = nn.Linear(8, 32)


@pytest.mark.parametrize("plan, head", [
    ({"emb": "vocab", "fc": "colwise", "proj": "rowwise", "head": "colwise"}, ("head", 32)),
    ({"emb": "vocab", "fc": "colwise", "proj": "rowwise", "head": "colwise_gather"}, None),
    ({"fc": "colwise", "proj": "rowwise"}, None),  # no vocabulary known, no head split
])
def test_the_head_is_the_last_linear_as_wide_as_the_vocabulary(plan, head):
    assert vocab_split_head(_NoConfig(), plan) == head


@vocab_parallel
def _marked(logits, targets):
    return logits.sum()


class _Holder:
    @vocab_parallel
    def loss(self, logits, targets):
        return logits.sum()


@functools.wraps(_marked)
def _wrapper(logits, targets):
    return _marked(logits, targets) * 2


@pytest.mark.parametrize("fn, known", [
    (vocab_parallel_cross_entropy, True),
    (functools.partial(vocab_parallel_cross_entropy, comm=None, group=None), True),
    (_marked, True),
    (_Holder().loss, True),
    (_wrapper, True),
    (functools.partial(_wrapper), True),
    (gpt_loss, False),
    (F.cross_entropy, False),
    (lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, None, None), False),  # unmarked
    (functools.partial(gpt_loss), False),
])
def test_which_losses_are_known_to_read_vocab_parallel_logits(fn, known):
    assert is_vocab_parallel(fn) is known


def test_check_loss_refuses_with_the_fixes_and_passes_what_is_safe():
    with pytest.raises(ValueError) as info:
        check_loss(gpt_loss, ("lm_head", 16), 2)
    message = str(info.value)
    for fix in ("loss_fn=gpt_loss", "'lm_head' 'colwise'", "8 of the 16", "loss_fn=model.cross_entropy",
                "minipar.tensor_parallel.vocab_parallel_cross_entropy", "@minipar.loss_check.vocab_parallel",
                "'colwise_gather'", "gather_logits=True"):
        assert fix in message, (fix, message)
    check_loss(gpt_loss, ("lm_head", 16), 1)  # no tensor parallelism: whole logits
    check_loss(gpt_loss, None, 2)             # the plan gathers the logits
    check_loss(_marked, ("lm_head", 16), 2)


# -- through the front door ------------------------------------------------------------------------

def _data(steps: int, rows: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, CFG["vocab_size"], (steps, rows, CFG["block_size"] + 1), generator=g)


def _plain_loss_refused(ctx, pp: int, which: str):
    mesh = Mesh(tp=2, pp=pp)
    model = ShardedModule(GPT(GPTConfig(**CFG)), mesh=mesh, **({"microbatches": 2} if pp > 1 else {}))
    x = _data(1)[0] % (CFG["vocab_size"] // 2)  # every target in the first slice: the silent case
    loss_fn = gpt_loss if which == "gpt_loss" else lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())
    with mesh.comm.counting() as stats:
        with pytest.raises(ValueError) as info:
            model.train_step(x[:, :-1], x[:, 1:], loss_fn)
    mesh.destroy()
    return str(info.value), stats.calls()


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("which", ["gpt_loss", "F.cross_entropy"])
def test_a_plain_cross_entropy_on_vocab_parallel_logits_is_refused_on_every_rank(pools, pp, which):
    assert is_vocab_parallel(ShardedModule.cross_entropy)  # the front door's own loss passes the check
    for rank, (message, collectives) in enumerate(pools.run(2 * pp, _plain_loss_refused, pp, which, timeout=60)):
        assert "is not known to take vocab-parallel logits" in message and "model.cross_entropy" in message, \
            (rank, message)
        assert collectives == 0, f"rank {rank}: {collectives} collectives ran before the refusal"


def _own_loss(mesh: Mesh, kind: str):
    if kind == "partial":
        return functools.partial(vocab_parallel_cross_entropy, comm=mesh.comm, group=mesh.group("tp"))

    @vocab_parallel
    def loss(logits, targets):  # a user's own: the tp ranks' slices combined by the library's function
        return vocab_parallel_cross_entropy(logits, targets, mesh.comm, mesh.group("tp"))
    return loss


def _train_own_loss(ctx, kind: str, data: torch.Tensor):
    mesh = Mesh(tp=2, pp=2)
    model = ShardedModule(GPT(GPTConfig(**CFG)), mesh=mesh, microbatches=2)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    losses, norms = train_rows(model, opt, data, MAX_NORM, loss_fn=_own_loss(mesh, kind))
    state = {k: v.float().cpu() for k, v in model.full_state_dict().items()}
    mesh.destroy()
    return losses, norms, state


@pytest.mark.parametrize("kind", ["marked", "partial"])
def test_a_marked_loss_of_ones_own_trains_like_one_process(pools, kind):
    """fp32 throughout; default assert_close tolerances (rtol 1.3e-6, atol 1e-5): the same sums in
    another order (the vocabulary's two slices, two micro-batches), which AdamW's eps=1e-6 keeps small."""
    data = _data(3)
    reference = GPT(GPTConfig(**CFG))
    ref_losses, ref_norms = reference_steps(
        reference, 3, lambda s: gpt_loss(reference(data[s][:, :-1]), data[s][:, 1:]), MAX_NORM)
    assert all(n > MAX_NORM for n in ref_norms), ref_norms  # clipping fires
    for rank, (losses, norms, state) in enumerate(pools.run(4, _train_own_loss, kind, data, timeout=120)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=f"rank {rank} losses")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), msg=f"rank {rank} norms")
        for k, v in reference.state_dict().items():
            torch.testing.assert_close(state[k], v, msg=lambda s: f"rank {rank} {k}: {s}")
