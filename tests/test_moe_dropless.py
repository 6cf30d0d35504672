"""Dropless experts on grouped products: what a dropless MoE layer moves and holds is what its routing says.

With ``capacity_factor=None`` every one of a rank's T*k assignments reaches its expert. Over dp=2 x ep=2
(gloo), for one forward and backward of the layer, read from the counted collective layer and from the
tensors autograd saves:

* the dispatch all-to-all sends exactly sum(counts) * d * 4 bytes (the rows of every assignment, none
  padded), sum(counts) = T*k, and of those the rows for the other rank's experts go on the wire; the
  combine sends back exactly the rows this rank's experts received; the backward moves the same rows
  the other way;
* the experts' saved activations are exactly the received rows: x (M, d), the hidden layer before and
  after GELU (M, h) twice, nothing else of that size, M = the rows routed to this rank's experts (a
  capacity layer would hold E_local * C rows);
* the same layer with a capacity factor moves only its kept rows (sum of its counts, drops excluded).

And the dropless MoE GPT (softmax top-2, auxiliary and z losses) under dp=2 x ep=2 trains three AdamW
steps with clipping as the single-process GPT routing each rank's share of the batch as its own group:
losses, clipped norms and parameters to test_moe's tolerance (assert_close's fp32 defaults).
"""

from __future__ import annotations

import pytest
import torch

from minipar import Mesh
from minipar.moe.layer import MoELayer

from test_moe import _train_gpt, moe_gpt_reference

D, HIDDEN, EXPERTS, TOP_K, TOKENS = 8, 16, 4, 2, 12


def _one_layer_step(ctx, capacity_factor):
    """One forward and backward of an ep=2 layer on this rank's tokens: its counts, the collectives' records
    of each phase, the rows its experts received, the expert computation's saved tensors."""
    mesh = Mesh(dp=2, ep=2)
    layer = MoELayer(D, HIDDEN, EXPERTS, TOP_K, capacity_factor, seed=5)
    layer.shard_experts(mesh.comm, mesh.group("ep"))
    params = {p.data_ptr() for p in layer.parameters()}
    saved, received = [], []
    local_experts = layer._local_experts

    def recording_experts(x, counts):  # the expert computation, its saved tensors recorded
        received.append(x.shape[0])

        def pack(t):
            if t.data_ptr() not in params:
                saved.append((tuple(t.shape), t.is_floating_point()))
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return local_experts(x, counts)
    layer._local_experts = recording_experts
    x = torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(10 + mesh.rank), requires_grad=True)
    with mesh.comm.counting() as fwd:
        out = layer(x)
    with mesh.comm.counting() as bwd:
        out.square().sum().backward()
    grads_exist = all(p.grad is not None for p in layer.parameters())
    records = {phase: [(r.tag, r.bytes, r.wire_bytes) for r in stats.records if r.tag and r.tag.startswith("moe_")]
               for phase, stats in (("fwd", fwd), ("bwd", bwd))}
    counts = layer.last_counts[0].tolist()
    dropped = layer.last_dropped
    mesh.destroy()
    return dict(counts=counts, dropped=dropped, records=records, received=received[0], saved=saved,
                grads_exist=grads_exist)


def _tag(records, tag):
    rows = [(b, w) for t, b, w in records if t == tag]
    assert len(rows) == 1, (tag, records)
    return rows[0]


@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["dropless", "cf0.5"])
def test_bytes_and_activations_are_the_routings_counts(pools, capacity_factor):
    """Each all-to-all carries exactly the routed (kept) rows, and the experts hold exactly the rows they
    received; dropless, every assignment is routed."""
    results = pools.run(2, _one_layer_step, capacity_factor)
    row = D * 4  # fp32 rows of d_model
    per_rank = torch.tensor([r["counts"] for r in results]).view(2, 2, EXPERTS // 2).sum(-1)  # [src, dst ep rank]
    for rank, r in enumerate(results):
        sent, received = int(per_rank[rank].sum()), int(per_rank[:, rank].sum())
        to_other, from_other = int(per_rank[rank, 1 - rank]), int(per_rank[1 - rank, rank])
        if capacity_factor is None:
            assert r["dropped"] == 0 and sent == TOKENS * TOP_K, r
        else:  # the case is one that drops
            assert r["dropped"] > 0 and sent == TOKENS * TOP_K - r["dropped"], r
        assert r["received"] == received, (rank, r["received"], received)
        fwd, bwd = r["records"]["fwd"], r["records"]["bwd"]
        assert _tag(fwd, "moe_dispatch") == (sent * row, to_other * row), (rank, fwd)
        assert _tag(fwd, "moe_combine") == (received * row, from_other * row), (rank, fwd)
        # Backward: the combine's adjoint sends the output gradients of the rows it received back to the experts
        # (sent rows), the dispatch's adjoint the input gradients of the received rows back to their tokens.
        assert _tag(bwd, "moe_combine") == (sent * row, to_other * row), (rank, bwd)
        assert _tag(bwd, "moe_dispatch") == (received * row, from_other * row), (rank, bwd)
        # The experts' saved activations: exactly the received rows, x (M, d) and the hidden layer twice.
        floats = sorted(shape for shape, is_float in r["saved"] if is_float)
        assert floats == sorted([(received, D), (received, HIDDEN), (received, HIDDEN)]), (rank, r["saved"])
        assert all(shape[0] in (received, EXPERTS // 2) for shape, _ in r["saved"]), (rank, r["saved"])
        assert r["grads_exist"]


def test_an_expert_without_rows_gets_a_zero_gradient():
    """A single-process dropless layer whose gate sends every token to experts 0 and 1: experts 2 and 3 run
    on no rows, and their gradients are zeros (not None); the busy ones' are not."""
    layer = MoELayer(D, HIDDEN, EXPERTS, TOP_K, None, seed=1)
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[0], layer.gate.weight[1] = 1.0, 0.5
    x = torch.ones(TOKENS, D)
    layer(x).square().sum().backward()
    assert layer.last_counts[0].tolist() == [TOKENS, TOKENS, 0, 0]
    for name in ("w1", "b1", "w2", "b2"):
        g = getattr(layer, name).grad
        assert g is not None and g[2:].abs().max() == 0 and g[:2].abs().max() > 0, name


def test_dropless_moe_gpt_dp2_ep2_equals_single_process(pools):
    """The dropless MoE GPT under dp=2 x ep=2 equals the single-process GPT: losses, clipped gradient norms,
    parameters after three AdamW steps; no assignment dropped, clipping fires every step."""
    dp = 2
    cfg = dict(vocab_size=16, block_size=6, n_layer=2, n_head=2, n_embd=8, n_experts=4, top_k=2,
               capacity_factor=None, aux_loss_coef=0.1, z_loss_coef=0.01, seed=3)
    data = torch.randint(0, 16, (3, dp * 2, 7), generator=torch.Generator().manual_seed(4))
    ref, ref_losses, ref_norms, _ = moe_gpt_reference(cfg, data, dp)  # (asserts that nothing was dropped)
    for rank, (losses, norms, state, stats) in enumerate(pools.run(2, _train_gpt, dict(dp=2, ep=2), cfg, data, 1, {})):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=lambda s: f"rank {rank}: {s}")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), msg=lambda s: f"rank {rank}: {s}")
        assert stats["dropped"] == 0, stats
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, msg=lambda s: f"rank {rank} {k}: {s}")
