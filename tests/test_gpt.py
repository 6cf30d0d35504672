"""The reference GPT: shapes, deterministic initialisation, tied weights, causality, it learns."""

import pytest
import torch

from minipar.models import GPT, GPTConfig, gpt_loss


def test_same_seed_same_weights_other_seed_other_weights():
    cfg = GPTConfig(vocab_size=31, block_size=6, n_layer=2, n_head=2, n_embd=8)
    torch.manual_seed(123)  # the global RNG must not matter
    a = GPT(cfg).state_dict()
    torch.manual_seed(456)
    b = GPT(cfg).state_dict()
    c = GPT(GPTConfig(**{**cfg.__dict__, "seed": 1})).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.q_proj.weight"], c["layers.0.attn.q_proj.weight"])


@pytest.mark.parametrize("tie", [True, False])
def test_tied_head_shares_the_embedding(tie):
    m = GPT(GPTConfig(vocab_size=11, block_size=4, n_layer=1, n_head=1, n_embd=4, tie_weights=tie))
    assert (m.lm_head.weight is m.wte.weight) == tie
    n_tensors = len(list(m.parameters()))
    assert n_tensors == len(dict(m.named_parameters(remove_duplicate=False))) - (1 if tie else 0)


def test_shapes_and_causality():
    cfg = GPTConfig(vocab_size=13, block_size=7, n_layer=2, n_head=3, n_embd=12)
    m = GPT(cfg).eval()
    x = torch.randint(0, 13, (2, 7))
    logits = m(x)
    assert logits.shape == (2, 7, 13)
    y = x.clone()
    y[:, 4:] = (y[:, 4:] + 1) % 13  # changing the future must not change the past
    torch.testing.assert_close(m(y)[:, :4], logits[:, :4])
    assert not torch.allclose(m(y)[:, 4:], logits[:, 4:])


def test_too_long_sequence_and_bad_heads_raise():
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(n_embd=10, n_head=3)
    with pytest.raises(ValueError, match="exceeds block_size=4"):
        GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=4))(torch.zeros(1, 5, dtype=torch.long))


def test_loss_ignores_minus_100_and_learns():
    cfg = GPTConfig(vocab_size=17, block_size=8, n_layer=1, n_head=2, n_embd=16)
    m = GPT(cfg)
    x = torch.arange(9).repeat(4, 1) % 17
    tgt = x[:, 1:].clone()
    tgt[:, :3] = -100
    full = torch.nn.functional.cross_entropy(m(x[:, :-1])[:, 3:].reshape(-1, 17), tgt[:, 3:].reshape(-1))
    torch.testing.assert_close(gpt_loss(m(x[:, :-1]), tgt), full)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss = gpt_loss(m(x[:, :-1]), x[:, 1:])
        first = first or loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.5 * first


def test_rotary_is_the_complex_rotation_and_depends_on_relative_position():
    """pos="rope": feature pairs (i, i + d/2) of q and k are rotated by pos * base^(-2i/d), i.e.
    multiplied as complex numbers x_i + j x_{i+d/2} by e^{j pos theta_i} (checked against that
    formula); so q_m . k_n depends on m - n only, and a shifted sequence gives the same scores."""
    from minipar.models.gpt import Rotary, apply_rotary
    d, base = 8, 100.0
    rot = Rotary(d, base)
    x = torch.randn(3, 5, d, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 1, 4, 9, 30])
    cos, sin = rot(pos)
    got = apply_rotary(x, cos, sin)
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[..., :d // 2].double(), x[..., d // 2:].double()) * torch.polar(
        torch.ones(5, d // 2, dtype=torch.float64), pos[:, None].double() * theta)
    torch.testing.assert_close(got, torch.cat([z.real, z.imag], dim=-1).float())
    q, k = torch.randn(2, d, generator=torch.Generator().manual_seed(1))

    def score(m, n):
        c, s = rot(torch.tensor([m, n]))
        return (apply_rotary(q, c[0], s[0]) * apply_rotary(k, c[1], s[1])).sum()
    torch.testing.assert_close(score(7, 3), score(24, 20))
    assert not torch.allclose(score(7, 3), score(7, 4))


def test_rope_model_has_no_position_table_and_uses_positions():
    """The Llama-style GPT (rmsnorm, swiglu, rope) keeps no wpe and no state-dict entry for the
    rotary tables. Positions reach it only through the rotation: swapping two earlier tokens
    changes the last token's logits, and would not with the rotation taken out (causal attention
    without positions is blind to the order of the keys)."""
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8, norm="rmsnorm", mlp="swiglu",
                    pos="rope")
    model = GPT(cfg)
    assert model.wpe is None and not any("wpe" in k or "inv_freq" in k for k in model.state_dict())
    a, b = torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([[2, 1, 3, 4, 5]])
    assert not torch.allclose(model(a)[0, -1], model(b)[0, -1], atol=1e-6)
    for block in model.layers:
        block.attn.rotary = None
    torch.testing.assert_close(model(a)[0, -1], model(b)[0, -1])
    with pytest.raises(ValueError, match="must be even"):
        GPTConfig(n_embd=6, n_head=2, pos="rope")
    with pytest.raises(ValueError, match="pos='alibi'"):
        GPTConfig(pos="alibi")


def test_attention_asks_sdpa_for_its_flash_form():
    """What SDPA needs to pick its flash kernel on a GPU: causal by flag (is_causal, no mask tensor),
    no dropout in eval, q/k/v contiguous in the head dimension. (benchmarks/gpt_1gpu.py runs the
    module with flash alone on a GPU and reports whether it could.)"""
    from unittest import mock

    import torch.nn.functional as F
    model = GPT(GPTConfig(n_layer=1, dropout=0.1)).eval()
    seen = []

    def spy(q, k, v, *args, **kwargs):
        seen.append((args, kwargs, [t.stride(-1) for t in (q, k, v)]))
        return real(q, k, v, *args, **kwargs)

    real = F.scaled_dot_product_attention
    with mock.patch("torch.nn.functional.scaled_dot_product_attention", spy):
        model(torch.randint(0, 512, (2, 16)))
    assert len(seen) == 1
    args, kwargs, strides = seen[0]
    assert not args and kwargs.get("attn_mask") is None and kwargs["is_causal"] is True
    assert kwargs.get("dropout_p", 0.0) == 0.0 and strides == [1, 1, 1]


@pytest.mark.parametrize("bias", [True, False])
def test_fused_qkv_is_the_three_projections_in_one(bias):
    """GPTConfig(fused_qkv=True) with the q, k, v weights stacked (rows q, then k, then v) computes the
    separate projections' model: the same logits, and its qkv gradient is theirs stacked. The tensor-
    parallel plan refuses it (a column split would cut across q, k and v)."""
    cfg = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=bias)
    apart, fused = GPT(GPTConfig(**cfg)), GPT(GPTConfig(**cfg, fused_qkv=True))
    names = ("q_proj", "k_proj", "v_proj")
    with torch.no_grad():
        for a, f in zip(apart.layers, fused.layers):
            f.attn.qkv_proj.weight.copy_(torch.cat([getattr(a.attn, n).weight for n in names]))
            if bias:
                f.attn.qkv_proj.bias.copy_(torch.cat([getattr(a.attn, n).bias for n in names]))
        fused.load_state_dict({k: v for k, v in apart.state_dict().items() if "_proj" not in k or "o_proj" in k},
                              strict=False)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for m in (apart, fused):
        gpt_loss(m(x[:, :-1]), x[:, 1:]).backward()
    torch.testing.assert_close(fused(x), apart(x))
    for a, f in zip(apart.layers, fused.layers):
        torch.testing.assert_close(f.attn.qkv_proj.weight.grad, torch.cat([getattr(a.attn, n).weight.grad for n in names]))
        torch.testing.assert_close(f.attn.o_proj.weight.grad, a.attn.o_proj.weight.grad)
    with pytest.raises(ValueError, match="fused_qkv"):
        fused.tp_plan(2)
