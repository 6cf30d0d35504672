"""minipar without triton: a CPU-only machine, macOS or Windows has no wheel of it or no use for it.

A child process hides triton from every import (a meta-path finder that refuses it), then imports
minipar and trains the GPT a step under DDP on a world of one: every kernel takes its PyTorch path, and
nothing imported triton. Asking for the interpreter there (TRITON_INTERPRET=1) is an error that says
what to install, not an ImportError from deep inside a kernel module.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

HIDE = textwrap.dedent("""
    import sys

    class _NoTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, _NoTriton())
""")

TRAIN = textwrap.dedent("""
    import sys, torch, minipar
    from minipar import ShardedModule
    from minipar.models import GPT, GPTConfig, gpt_loss
    mesh = minipar.init()
    model = ShardedModule(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)), mesh=mesh)
    opt = model.build_optimizer(torch.optim.AdamW, lr=1e-3)
    x = torch.randint(0, 32, (2, 9))
    first = model.train_step(x[:, :-1], x[:, 1:], gpt_loss).item()
    opt.step(); opt.zero_grad()
    second = model.train_step(x[:, :-1], x[:, 1:], gpt_loss).item()
    assert second < first, (first, second)
    assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules), "triton was imported"
    print("trained without triton", first, second)
    minipar.shutdown()
""")


def _run(tmp_path, script: str, interpret: bool) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(HIDE)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MINIPAR_KERNELS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29581", WORLD_SIZE="1", RANK="0")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


def test_minipar_imports_and_trains_without_triton(tmp_path):
    out = _run(tmp_path, TRAIN, interpret=False)
    assert out.returncode == 0 and "trained without triton" in out.stdout, out.stdout + out.stderr[-3000:]


def test_asking_for_the_interpreter_without_triton_says_what_to_install(tmp_path):
    out = _run(tmp_path, "import torch; from minipar import kernels; kernels.gelu(torch.ones(3))", interpret=True)
    assert out.returncode != 0 and "pip install 'minipar[triton]'" in out.stderr, out.stderr[-3000:]
