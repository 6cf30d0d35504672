"""What a user installs: `minipar` with `minipar.models` and `minipar.kernels`, and no top-level
`models` or `kernels` package."""

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
