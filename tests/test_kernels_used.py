"""minipar's own code goes through the kernels, and the result does not depend on the path.

Run under ``TRITON_INTERPRET=1`` (the child pytest of ``test_triton_kernels_under_interpreter``),
where the dispatch rule picks Triton for CPU tensors exactly as it does for CUDA tensors on a
GPU; switching the variable off inside the same process picks the PyTorch path, so the two can
be compared step for step:

* the GPT (LayerNorm + GELU, and RMSNorm + SwiGLU): a training step launches the norm,
  activation and cross-entropy kernels, and gives the PyTorch path's loss, gradients and
  AdamW-updated parameters;
* ZeRO (2 ranks; fp32, and fp16 with loss scaling): the optimizer step goes through the fused
  AdamW kernel (which also writes the fp16 compute shard) and the scale-and-cast kernel, and
  three steps equal the PyTorch path's;
* tensor parallelism (tp=2): the vocab-parallel cross-entropy launches its row-statistics and
  gradient kernels, equal to the PyTorch path;
* the MoE layer: permute, unpermute and GELU kernels, equal to the PyTorch path.
"""

from __future__ import annotations

import contextlib

import torch

from minipar import Mesh, MixedPrecision, ShardedModule, kernels
from minipar.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig, gpt_loss

from helpers import EPS, LR, WD  # eps 1e-6: see helpers.py (AdamW amplifies rounding noise by lr / eps)
from kernel_testing import interpreted, pytorch_path, run_interpreted


def test_triton_kernels_under_interpreter():
    """This module's interpreted tests, in a TRITON_INTERPRET=1 child: all pass, none skip."""
    run_interpreted(__file__)


def _launched_during(fn):
    before = dict(kernels.launches)
    out = fn()
    return out, {k for k, v in kernels.launches.items() if v > before.get(k, 0)}


def _gpt_step(cfg: GPTConfig):
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    x = torch.randint(0, cfg.vocab_size, (3, 8), generator=torch.Generator().manual_seed(0))
    loss = gpt_loss(model(x[:, :-1]), x[:, 1:])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@interpreted
def test_gpt_step_goes_through_the_kernels_and_matches_pytorch():
    for norm, mlp, expected in [("layernorm", "gelu", {"layer_norm_fwd_kernel", "layer_norm_bwd_kernel",
                                                       "gelu_fwd_kernel", "gelu_bwd_kernel"}),
                                ("rmsnorm", "swiglu", {"rms_norm_fwd_kernel", "rms_norm_bwd_kernel",
                                                       "swiglu_fwd_kernel", "swiglu_bwd_kernel"})]:
        cfg = GPTConfig(vocab_size=24, block_size=8, n_layer=2, n_head=2, n_embd=16, norm=norm, mlp=mlp,
                        tie_weights=True)
        (loss, grads, params), used = _launched_during(lambda: _gpt_step(cfg))
        assert expected | {"row_stats_kernel", "xent_grad_kernel"} <= used, (norm, mlp, used)
        with pytorch_path():
            (ref_loss, ref_grads, ref_params), ref_used = _launched_during(lambda: _gpt_step(cfg))
        assert not ref_used
        torch.testing.assert_close(loss, ref_loss)
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], msg=lambda m: f"{norm}/{mlp} grad {k}: {m}")
            torch.testing.assert_close(params[k], ref_params[k], msg=lambda m: f"{norm}/{mlp} param {k}: {m}")


@interpreted
def test_the_gpt_with_the_kernels_compiles_whole_and_trains_as_eager():
    """The GPT on minipar's Triton path (both forms, the residual add fused with the norm, the LM head and
    its loss in chunks) under ``torch.compile(fullgraph=True)``: the kernels are custom operators Dynamo
    traces through (a graph break would raise), they still launch, and two AdamW steps give eager's
    parameters. (aot_eager: Dynamo and AOT autograd trace the whole forward and backward, as for Inductor,
    without a C++ build on the CPU.)"""
    torch._dynamo.reset()
    for form in (dict(), dict(norm="rmsnorm", mlp="swiglu", pos="rope", tie_weights=False, fused_qkv=True)):
        cfg = GPTConfig(vocab_size=24, block_size=8, n_layer=2, n_head=2, n_embd=16, **form)
        eager, compiled = GPT(cfg), GPT(cfg)
        run = torch.compile(compiled, backend="aot_eager", fullgraph=True)
        opts = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, eps=EPS) for m in (eager, compiled)]
        gen = torch.Generator().manual_seed(0)
        for _ in range(2):
            x = torch.randint(0, 24, (3, 8), generator=gen)
            for forward, opt in zip((eager, run), opts):
                _, used = _launched_during(lambda: forward(x[:, :-1], targets=x[:, 1:]).backward())
                assert {"xent_loss_grad_kernel"} <= used and any("add_" in k for k in used), (form, used)
                opt.step()
                opt.zero_grad()
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(q, p, msg=lambda m: f"{form} {name}: {m}")
    torch._dynamo.reset()


def _zero_steps(ctx, strategy: str, precision: str, triton: bool):
    with contextlib.nullcontext() if triton else pytorch_path():
        mesh = Mesh()
        # No biases: a k_proj bias has an exactly-zero gradient in exact arithmetic, so its gradient is
        # rounding noise that Adam's g / sqrt(v) turns into a full-size, path-dependent step.
        cfg = GPTConfig(vocab_size=24, block_size=8, n_layer=2, n_head=2, n_embd=16, bias=False)
        policy = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32, init_scale=2.0**10) \
            if precision == "fp16" else None
        model = ShardedModule(GPT(cfg), mesh=mesh, strategy=strategy, mixed_precision=policy, bucket_cap_mb=1e-3)
        opt = model.build_optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
        gen = torch.Generator().manual_seed(ctx.rank)
        before = dict(kernels.launches)
        losses = []
        for _ in range(3):
            x = torch.randint(0, 24, (2, 8), generator=gen)
            losses.append(model.train_step(x[:, :-1], x[:, 1:], gpt_loss).item())
            model.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()
        used = {k for k, v in kernels.launches.items() if v > before.get(k, 0)}
        state = {k: v.clone() for k, v in model.full_state_dict().items()}  # the fp32 masters
        # zero1 keeps full compute-dtype parameters: after the step they must be the masters, rounded.
        copies_exact = strategy != "zero1" or all(
            torch.equal(p.detach(), state[n].to(p.dtype)) for n, p in model.module.named_parameters())
        mesh.destroy()
    return losses, state, copies_exact, used


@interpreted
def test_zero_step_goes_through_fused_adamw_and_scale_cast(pools):
    """fp32 (zero3): the fused AdamW step equals torch's AdamW at fp32 tolerance. fp16 with loss
    scaling (zero1): scale-and-cast unscales and flags, the fused step writes the fp16 compute
    copies (exactly the masters rounded), and the run equals the PyTorch path to a tenth of one
    Adam step (the norms, activations and loss run in fp16 by different kernels on the two paths).

    Every stage steps through the same ``ShardedState.fused_step``; its two paths are an fp32
    master that *is* the compute shard (nothing to write) and a master apart from it (the step
    writes the compute shard): one stage for each. (zero1 in fp32 took the first path as zero3
    does, over buckets instead of units.)"""
    for strategy, precision in (("zero3", "fp32"), ("zero1", "fp16")):
        fused = pools.run(2, _zero_steps, strategy, precision, True)
        plain = pools.run(2, _zero_steps, strategy, precision, False)
        # fp16: the two paths' forwards round differently, which moves Adam's normalised update
        # (at most lr per step) by a small fraction of lr; a tenth of one step bounds it.
        tol = {} if precision == "fp32" else dict(rtol=1e-3, atol=0.1 * LR)
        expected = {"adamw_step_kernel"} | ({"scale_cast_kernel"} if precision == "fp16" else set())
        for rank, ((losses, state, exact, used), (ref_losses, ref_state, ref_exact, ref_used)) in \
                enumerate(zip(fused, plain)):
            assert expected <= used and not ref_used, (strategy, precision, rank, used, ref_used)
            assert exact and ref_exact, (strategy, precision, rank)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
            for k in ref_state:
                torch.testing.assert_close(state[k], ref_state[k], **tol,
                                           msg=lambda m: f"{strategy} {precision} rank {rank} {k}: {m}")


def _tp_cross_entropy(ctx, triton: bool):
    with contextlib.nullcontext() if triton else pytorch_path():
        mesh = Mesh(tp=2)
        cfg = GPTConfig(vocab_size=24, block_size=8, n_layer=1, n_head=2, n_embd=16, tie_weights=False)
        model = ShardedModule(GPT(cfg), mesh=mesh)
        x = torch.randint(0, 24, (2, 8), generator=torch.Generator().manual_seed(3))
        before = dict(kernels.launches)
        loss = model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy)
        used = {k for k, v in kernels.launches.items() if v > before.get(k, 0)}
        grad = model.module.lm_head.weight.grad.clone()
        mesh.destroy()
    return loss.item(), grad, used


@interpreted
def test_vocab_parallel_cross_entropy_goes_through_the_kernels(pools):
    for (loss, grad, used), (ref_loss, ref_grad, ref_used) in zip(pools.run(2, _tp_cross_entropy, True),
                                                                 pools.run(2, _tp_cross_entropy, False)):
        assert {"row_stats_kernel", "xent_grad_kernel"} <= used and not ref_used
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(grad, ref_grad)


@interpreted
def test_moe_layer_goes_through_the_kernels():
    def run():
        model = MoEGPT(MoEGPTConfig(vocab_size=24, block_size=8, n_layer=1, n_head=2, n_embd=16, n_experts=4,
                                    top_k=2, capacity_factor=1.0))
        x = torch.randint(0, 24, (2, 8), generator=torch.Generator().manual_seed(4))
        loss = gpt_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (loss, grads), used = _launched_during(run)
    assert {"gather_rows_kernel", "segment_sum_rows_kernel", "gelu_fwd_kernel", "gelu_bwd_kernel",
            "grouped_mm_kernel", "grouped_mm_weight_grad_kernel"} <= used, used
    with pytorch_path():
        ref_loss, ref_grads = run()
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], msg=lambda m: f"{k}: {m}")
