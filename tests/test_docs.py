"""The documentation is true: the examples and the code blocks that claim to run do run, every link
resolves, the API page is what the code gives, and the layout page names every module.

A code block claims to run when the line before its opening fence is ``<!-- runs -->`` (README.md and
docs/*.md): it is written to a file and run as ``python FILE`` in a new process, which must exit 0.
Every script in examples/ is run the same way (each starts its own gloo ranks on the CPU). The
timeouts only turn a hang into a failure: each takes seconds on an idle 2-core machine.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# (script, its arguments): each example as the README runs it; under HYPOTHESIS_PROFILE=long also the
# Llama with tensor parallelism (4 processes: too heavy for every CI run on 2 cores)
EXAMPLE_RUNS = [(p, []) for p in EXAMPLES] + (
    [(ROOT / "examples" / "hf_llama_zero3.py", ["--tp", "2"])] if os.environ.get("HYPOTHESIS_PROFILE") == "long" else [])
TIMEOUT = 300  # seconds; a loaded CI machine starting several processes may take a minute

RUNS = re.compile(r"^<!-- runs -->\n```python\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # the scripts start their own ranks when no launcher set these
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)


def _blocks() -> list[tuple[str, int, str]]:
    """(page, line, code) of every block marked to run."""
    out = []
    for page in PAGES:
        if not page.exists():
            continue
        text = page.read_text()
        for m in RUNS.finditer(text):
            out.append((page.relative_to(ROOT).as_posix(), text[:m.start()].count("\n") + 2, m.group(1)))
    return out


def test_the_readme_has_a_first_example_that_runs():
    assert any(page == "README.md" for page, _, _ in _blocks()), "README.md lost its <!-- runs --> example"


@pytest.mark.parametrize("page, line, code", _blocks(), ids=[f"{page}:{line}" for page, line, _ in _blocks()])
def test_a_marked_code_block_runs_as_written(tmp_path, page, line, code):
    script = tmp_path / "block.py"
    script.write_text(code)
    out = _run([str(script)], tmp_path)
    assert out.returncode == 0, f"{page}, the block at line {line}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


def _progress(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if re.search(r"step \d+/\d+ .*loss [\d.]+.*ETA [\d.]+s", line)]


@pytest.mark.parametrize("script, args", EXAMPLE_RUNS, ids=[" ".join([p.name, *a]) for p, a in EXAMPLE_RUNS])
def test_an_example_runs_and_prints_its_progress(tmp_path, script, args):
    if script.name.startswith("hf_") and importlib.util.find_spec("transformers") is None:
        print(f"{script.name} needs transformers (pip install -e '.[test]'); not run")  # the reason, printed
        pytest.skip("transformers is not installed: pip install -e '.[test]'")
    out = _run([str(script), *args], tmp_path)
    assert out.returncode == 0, f"{script.name}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert _progress(out.stdout), f"{script.name} printed no 'step i/n ... loss ... ETA' line:\n{out.stdout}"
    if script.name == "resume_from_checkpoint.py":
        assert "the resumed losses equal the uninterrupted ones bit for bit" in out.stdout, out.stdout
    if script.name == "custom_model_pipeline.py":
        # the pipelined loss beside the one-process loss: the same float32 sums in another order,
        # after a few AdamW steps (printed to 6 decimals; a wrong gradient is off by far more)
        pairs = [tuple(map(float, re.search(r"loss ([\d.]+)\s+one process ([\d.]+)", line).groups()))
                 for line in _progress(out.stdout)]
        assert pairs and all(abs(a - b) <= 1e-5 for a, b in pairs), pairs


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_link_in_the_docs_resolves():
    """Relative links (README.md, CHANGELOG.md, docs/*.md) name a file or folder of the repository,
    and an anchor names a heading of that page. Web links are not fetched."""
    broken = []
    for page in PAGES:
        if not page.exists():
            continue
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_doc_page_is_listed_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f"(docs/{p.name})" not in readme]
    assert not missing, f"add these pages to README.md's Documentation list: {missing}"


def test_the_api_page_is_current():
    """docs/api.md is exactly what docs/gen_api.py writes from the code now."""
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    gen_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_api)
    assert (ROOT / "docs" / "api.md").read_text() == gen_api.render(), \
        "docs/api.md is out of date: run python docs/gen_api.py and commit docs/api.md"


def _layout_sections() -> dict[str, str]:
    """docs/architecture.md's Layout block cut by folder: {"minipar": the lines about its top-level
    modules, "minipar/core": those of core/, ..., "models": ...}. A line starting a folder
    ("minipar/", "  core/") opens its section; the lines after it, up to the next folder, belong to it."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    layout = page[page.index("## Layout"):]
    block = layout[layout.index("```") + 3:layout.index("```", layout.index("```") + 3)]
    sections, top, current = {}, "", ""
    for line in block.splitlines():
        folder = re.match(r"^( *)(\w+)/(\s|$)", line)
        if folder:
            if folder.group(1):
                current = f"{top}/{folder.group(2)}"
            else:
                top = current = folder.group(2)
        if current:
            sections[current] = sections.get(current, "") + line + "\n"
    return sections


def test_the_layout_page_names_every_module():
    """docs/architecture.md's Layout names every module under minipar/ and models/ in its own folder's
    lines (by file name, with or without .py), and names no module that is gone."""
    sections = _layout_sections()
    missing = []
    for path in sorted((ROOT / "minipar").rglob("*.py")) + sorted((ROOT / "models").glob("*.py")):
        folder = path.parent.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" and folder not in ("minipar/checkpoint", "minipar/plan"):
            continue  # a package's __init__ is its folder (checkpoint's and plan's hold code: named)
        if path.stem not in set(re.findall(r"\w+", sections.get(folder, ""))):
            missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, f"docs/architecture.md's Layout does not mention these in their folder's lines: {missing}"
    for folder, text in sections.items():
        if not folder.startswith(("minipar", "models")):
            continue  # the other folders' lines name files elsewhere (tests/test_docs.py)
        for name in re.findall(r"\b(\w+)\.py\b", text):
            assert (ROOT / folder / f"{name}.py").exists(), \
                f"docs/architecture.md's Layout names {folder}/{name}.py, which does not exist"


def test_the_readmes_test_command_is_what_ci_runs():
    """.ci/run installs what the README's second command installs and then runs its `pytest`."""
    readme = (ROOT / "README.md").read_text()
    command = 'pip install torch==2.13.0 && pip install -e ".[test,plot]" && pytest'
    assert command in readme, f"README.md lost its test command: {command}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install --quiet torch==2.13.0" in ci and 'pip install --quiet -e ".[test,plot]"' in ci, \
        ".ci/run installs something other than the README's test command"
    assert ci.rstrip().splitlines()[-1] == "pytest", ".ci/run's last line is not the README's pytest"
