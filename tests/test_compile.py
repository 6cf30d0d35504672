"""torch.compile on minipar's models: the GPT (both forms) traces whole, without a graph break, and a
compiled model trains exactly as the eager one, alone and inside a ShardedModule.

Traced here with the ``aot_eager`` backend: dynamo and AOT autograd see the whole forward and
backward (what a compiler needs), without the C++ build inductor does on a CPU. The kernels take
their PyTorch path on a CPU; on a GPU (their Triton path) ``benchmarks/gpt_1gpu.py`` measures the
compiled modes and ``benchmarks/gpu_report.py`` records whether they run.
"""

from __future__ import annotations

import pytest
import torch

import minipar
from minipar import MixedPrecision, ShardedModule
from minipar.models import GPT, GPTConfig, gpt_loss

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("form", [{}, dict(norm="rmsnorm", mlp="swiglu", pos="rope", tie_weights=False)],
                         ids=["gpt", "llama"])
def test_the_gpt_compiles_whole_and_trains_as_eager(form):
    eager, compiled = GPT(GPTConfig(**CFG, **form)), GPT(GPTConfig(**CFG, **form))
    run = torch.compile(compiled, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break raises
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (eager, compiled)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randint(0, CFG["vocab_size"], (2, 17), generator=gen)
        for model, opt in zip((eager, run), opts):
            gpt_loss(model(x[:, :-1]), x[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q, p, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_compiled_blocks_inside_a_sharded_module_train_as_eager(world_of_one, strategy):
    """Every data-parallel strategy on a world of one, in bf16 where it has mixed precision (ZeRO-1 bf16
    is the single-GPU setting of benchmarks/gpt_1gpu.py): the same losses and fp32 masters with the
    transformer blocks compiled (ZeRO-3's units are the blocks: its gather and reshard hooks run around
    the compiled code)."""
    results = []
    options = {} if strategy == "ddp" else dict(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    for compile_blocks in (False, True):
        model = ShardedModule(GPT(GPTConfig(**CFG)), mesh=minipar.Mesh(), strategy=strategy, **options)
        if compile_blocks:
            for block in model.module.layers:
                block.compile(backend="aot_eager")
        opt = model.build_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        gen, losses = torch.Generator().manual_seed(1), []
        for _ in range(2):
            x = torch.randint(0, CFG["vocab_size"], (2, 17), generator=gen)
            losses.append(model.train_step(x[:, :-1], x[:, 1:], gpt_loss))
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        results.append((torch.stack(losses), model.full_state_dict()))
    (losses, state), (c_losses, c_state) = results
    torch.testing.assert_close(c_losses, losses)
    for k in state:
        torch.testing.assert_close(c_state[k], state[k], msg=lambda m: f"{k}: {m}")
