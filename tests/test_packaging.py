"""What a user installs: `minipar` with `minipar.models` and `minipar.kernels`, and no top-level
`models` or `kernels` package."""

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_public_api_imports_and_top_level_folders_do_not():
    code = (
        "import minipar, minipar.models, minipar.kernels\n"
        "from minipar import ShardedModule, init, Mesh\n"
        "import importlib.util as u\n"
        "print(u.find_spec('models'), u.find_spec('kernels'))\n"
    )
    # Run from an unrelated directory so the repository root is not on sys.path.
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None None"


def test_wheel_installs_models_and_kernels_inside_minipar(tmp_path):
    src = tmp_path / "src"  # build from a copy: setuptools leaves build/ behind in the tree it builds
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(src)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("minipar-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.startswith("minipar-")}
    assert top_level == {"minipar"}
    assert "minipar/models/gpt.py" in names and "minipar/kernels/__init__.py" in names
    sources = {f"minipar/{f.relative_to(ROOT / 'minipar')}" for f in (ROOT / "minipar").glob("**/*.py")}
    sources |= {f"minipar/{d}/{f.relative_to(ROOT / d)}" for d in ("models", "kernels") for f in (ROOT / d).glob("**/*.py")}
    missing = sorted(n for n in sources if "__pycache__" not in n and n not in names)
    assert not missing, f"source files left out of the wheel (list their package in pyproject.toml): {missing}"


def test_import_and_a_cpu_training_step_leave_triton_unimported():
    """kernels/dispatch.py: triton is imported only at a Triton kernel's first use, so `import minipar` and a
    CPU training step of the GPT (layer/RMS norm, GELU/SwiGLU, cross-entropy; the MoE GPT's permute and
    unpermute) never import it. In a fresh interpreter, with TRITON_INTERPRET unset. The update is by hand:
    a torch.optim step imports torch._dynamo, which imports triton itself."""
    code = (
        "import sys, torch, minipar, minipar.models, minipar.kernels\n"
        "torch.manual_seed(0)\n"
        "assert 'triton' not in sys.modules, 'import minipar imported triton'\n"
        "from minipar.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig, gpt_loss\n"
        "small = dict(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)\n"
        "for model in (GPT(GPTConfig(**small)), GPT(GPTConfig(**small, norm='rmsnorm', mlp='swiglu')),\n"
        "              MoEGPT(MoEGPTConfig(**small, n_experts=2, top_k=1))):\n"
        "    idx = torch.randint(0, 64, (2, 8))\n"
        "    loss = gpt_loss(model(idx), torch.roll(idx, -1, 1))\n"
        "    loss.backward()\n"
        "    with torch.no_grad():\n"
        "        for p in model.parameters():\n"
        "            if p.grad is not None:\n"
        "                p -= 0.1 * p.grad\n"
        "    assert torch.isfinite(loss) and model.wte.weight.grad is not None\n"
        "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "[]", f"triton was imported: {out.stdout.strip()[:500]}"


def test_each_mechanism_lives_in_one_place():
    """The end-of-backward callback and the per-parameter gradient hooks of the bucketed strategies
    are written once (minipar/data_parallel/buckets.py; ZeRO-3's per-unit hooks in zero3.py), as is the
    gradient norm (minipar/core/grad_norm.py): a second copy would be a second place to get them wrong."""
    sources = {f.relative_to(ROOT).as_posix(): f.read_text() for d in ("minipar", "kernels", "models")
               for f in (ROOT / d).glob("**/*.py")}
    where = lambda text: sorted(n for n, s in sources.items() if text in s)  # noqa: E731
    assert where("queue_callback(") == ["minipar/data_parallel/buckets.py"]
    assert where("register_post_accumulate_grad_hook(") == sorted(["minipar/data_parallel/zero3.py",
                                                                    "minipar/data_parallel/buckets.py"])
    assert where("_foreach_norm(") == ["minipar/core/grad_norm.py"]
    too_long = {n: s.count("\n") for n, s in sources.items() if s.count("\n") > 400}
    assert not too_long, f"modules over 400 lines (split them by concern): {too_long}"


def _module_imports() -> dict[str, set[str]]:
    """minipar's modules (kernels and models under their installed names) -> the minipar modules each
    imports, at the top or inside a function alike (a lazy import that closes a loop still ties the
    two modules together: one cannot be read, moved or tested without the other)."""
    import ast
    roots = {"minipar": ROOT / "minipar", "minipar.kernels": ROOT / "kernels", "minipar.models": ROOT / "models"}
    files = {}
    for package, folder in roots.items():
        for f in folder.glob("**/*.py"):
            parts = [package, *f.relative_to(folder).with_suffix("").parts]
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in files.items():
        here = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def test_no_import_cycles():
    """No module of minipar imports, directly or through others, a module that imports it back: lazy
    imports inside functions count (they were how cycles hid), and so does a package's __init__."""
    graph, state, cycles = _module_imports(), {}, []

    def visit(u, path):
        state[u] = "open"
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                cycles.append(path[path.index(v):] + [v])
            elif v not in state:
                visit(v, path + [v])
        state[u] = "done"
    for u in sorted(graph):
        if u not in state:
            visit(u, [u])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_kernels_folder_imported_by_its_own_name_stays_empty():
    """With the repository root on sys.path (`python -m pytest`, a shell there), `import kernels` finds
    this folder: transformers probes for Hugging Face's `kernels` package that way. That copy must not
    register minipar's custom ops a second time (it did: the ops then ran the copy's functions, whose
    dispatch state `minipar.kernels.dispatch.recording` cannot see)."""
    code = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import torch
import minipar.kernels as mine
import kernels
assert kernels is not mine and kernels.__all__ == [] and not hasattr(kernels, "layer_norm"), dir(kernels)
from minipar.kernels import dispatch
with dispatch.recording() as launched:
    torch.ops.minipar.norm_fwd(torch.randn(4, 64), torch.ones(64), torch.zeros(64), 1e-5, False)
assert launched, "the custom op ran another copy's launcher"
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
