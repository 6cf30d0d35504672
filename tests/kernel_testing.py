"""What every kernel test module shares: the interpreter child run, the launch check, error measures.

Triton decides interpreter-or-compiler when a ``@triton.jit`` function is
*defined*, from ``TRITON_INTERPRET``. So each kernel test module marks its
Triton tests ``interpreted`` and has one parent test,
``run_interpreted(__file__)``, which runs that module again in a child pytest
with ``TRITON_INTERPRET=1`` set before anything imports triton. In the parent
the marked tests are skipped with that reason; the child must pass them all,
skip none, and each asserts that a Triton kernel really launched, so a silent
fall-back to PyTorch fails. One child pytest runs every kernel module whose
parent test the session selected (conftest's ``pytest_collection_finish`` lists
them in `SESSION_FILES`), once: a child per module paid its interpreter, torch,
triton and collection start-up (~4 CPU-s) seven times. Each parent test still
judges its own module's tests, from the child's JUnit report.

bf16 is judged against an fp32 reference (`lowp_ok`): the kernel's error may be
at most PyTorch's own bf16 error on the same input, or one rounding of the
exact result to bf16 where PyTorch is luckier, plus a small absolute term.

On a GPU (``MINIPAR_TEST_DEVICE=cuda``, what ``benchmarks/gpu_report.py`` sets)
the same tests run compiled, not interpreted: select them with ``-m triton``.
Each builds its inputs on the CPU as everywhere else (the same values, from the
same CPU generators) and `OnDevice` moves every tensor a factory function
creates to the GPU, so the kernels, the PyTorch path they are compared with and
the references all run there.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import tempfile
from unittest import mock
from xml.etree import ElementTree

import pytest
import torch
from torch.overrides import TorchFunctionMode

from minipar import kernels

INTERPRETING = kernels.interpreting()
ON_GPU = os.environ.get("MINIPAR_TEST_DEVICE") == "cuda"
if INTERPRETING:
    # Define every kernel for the interpreter now: triton fixes the choice when a @triton.jit function is
    # defined, and a test's `pytorch_path` block (TRITON_INTERPRET=0 inside) must never be the first to.
    import importlib
    for _module in sorted(pathlib.Path(kernels.__file__).parent.glob("*_triton.py")):
        importlib.import_module(f"minipar.kernels.{_module.stem}")
if ON_GPU and not torch.cuda.is_available():
    raise RuntimeError("MINIPAR_TEST_DEVICE=cuda, but torch sees no GPU: unset it to test on the CPU")
_ONLY_THERE = pytest.mark.skipif(not (INTERPRETING or ON_GPU),
                                 reason="runs in this module's TRITON_INTERPRET=1 child pytest "
                                        "(test_triton_kernels_under_interpreter), or compiled with "
                                        "MINIPAR_TEST_DEVICE=cuda -m triton on a GPU")


def interpreted(test):
    """Marks a test of the Triton kernels: it runs under the interpreter (the child pytest) or compiled
    on a GPU (``-m triton``), never on the parent's PyTorch path."""
    return pytest.mark.triton(_ONLY_THERE(test))


# The kernel test modules whose parent test this session runs (conftest.pytest_collection_finish).
SESSION_FILES: list[str] = []
# module stem -> [(test name, "passed" | "failed" | "skipped", message)] of the child runs so far
_OUTCOMES: dict[str, list[tuple[str, str, str]]] = {}
_REPORTS: dict[str, str] = {}  # module stem -> the tail of the output of the child run that ran it


def run_interpreted(test_file: str) -> None:
    """``test_file``'s tests, run in a child pytest with TRITON_INTERPRET=1 (one child for every
    kernel module of the session, started by the first parent test): all pass, none skip."""
    if INTERPRETING or ON_GPU:
        pytest.skip("this is the child process already" if INTERPRETING else "compiled on the GPU instead (-m triton)")
    stem = pathlib.Path(test_file).stem
    if stem not in _REPORTS:
        _run_child(sorted({test_file, *(f for f in SESSION_FILES if pathlib.Path(f).stem not in _REPORTS)}))
    mine, report = _OUTCOMES.get(stem, []), _REPORTS[stem]
    bad = [f"{outcome.upper()} {name}: {message}" for name, outcome, message in mine if outcome != "passed"]
    assert mine and not bad, "\n".join(bad) + "\n" + report


def _run_child(files: list[str]) -> None:
    """One child pytest over ``files``; records each module's outcomes from its JUnit XML report."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    with tempfile.TemporaryDirectory() as tmp:
        xml = pathlib.Path(tmp) / "interpreted.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files,
               "-k", "not test_triton_kernels_under_interpreter", f"--junitxml={xml}"]
        child = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900 * len(files))
        cases = ElementTree.parse(xml).getroot().iter("testcase") if xml.exists() else []
        stems = {pathlib.Path(f).stem for f in files}
        for stem in stems:
            _OUTCOMES[stem] = []
        for case in cases:
            stem = next((part for part in case.get("classname", "").split(".") if part in stems), None)
            if stem is None:
                continue
            verdict = next((el for el in case if el.tag in ("failure", "error", "skipped")), None)
            outcome = "passed" if verdict is None else "skipped" if verdict.tag == "skipped" else "failed"
            message = "" if verdict is None else (verdict.get("message") or "")[:2000]
            _OUTCOMES[stem].append((case.get("name"), outcome, message))
    report = f"child pytest exited {child.returncode}:\n" + child.stdout[-12000:] + child.stderr[-4000:]
    for stem in stems:
        _REPORTS[stem] = report
        if child.returncode not in (0, 1):  # interrupted, internal error, usage error: trust no outcome
            _OUTCOMES[stem].append(("<child run>", "failed", f"exit status {child.returncode}"))


_FACTORIES = {torch.randn, torch.rand, torch.randint, torch.randperm, torch.zeros, torch.ones, torch.empty,
              torch.full, torch.arange, torch.linspace, torch.eye, torch.tensor, torch.as_tensor, torch.from_numpy,
              torch.empty_strided}


class OnDevice(TorchFunctionMode):
    """Every tensor a factory function makes without a ``device=`` goes to ``device`` (a leaf stays
    a leaf: ``requires_grad`` is set after the move)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = torch.device(device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func not in _FACTORIES or kwargs.get("device") is not None:
            return func(*args, **kwargs)
        requires_grad = kwargs.pop("requires_grad", False)
        out = func(*args, **kwargs)
        if torch.is_tensor(out) and out.device != self.device:
            out = out.to(self.device)
        return out.requires_grad_(requires_grad) if requires_grad else out


@contextlib.contextmanager
def pytorch_path():
    """Inside: the dispatch rule picks PyTorch for every tensor, in the interpreted child and on a GPU
    alike (TRITON_INTERPRET=0, MINIPAR_KERNELS=torch; it reads them at every call); on leaving,
    asserts that no Triton kernel launched."""
    before = sum(kernels.launches.values())
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "0", "MINIPAR_KERNELS": "torch"}):
        yield
    assert sum(kernels.launches.values()) == before, "the PyTorch path launched a Triton kernel"


class launched:
    """``with launched("kernel_name"):`` asserts that the block launched that Triton kernel at least once."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.before = kernels.launches[self.name]

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            assert kernels.launches[self.name] > self.before, f"{self.name} was not launched: the PyTorch path ran"


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference, in fp32; 0 for empty tensors."""
    assert got.shape == want.shape, (got.shape, want.shape)
    return (got.float() - want.float()).abs().max().item() if got.numel() else 0.0


def lowp_ok(got: torch.Tensor, torch_lowp: torch.Tensor, want: torch.Tensor, atol: float = 1e-6) -> bool:
    """A bf16/fp16 kernel result judged against the fp32 reference ``want``.

    Its error may be at most PyTorch's own error in that dtype (``torch_lowp``)
    or, where PyTorch happens to be closer, the error of rounding ``want`` once
    to that dtype (no result stored in bf16 can do better), plus ``atol``.
    """
    bound = max(max_err(torch_lowp, want), max_err(want.to(got.dtype), want)) + atol
    return max_err(got, want) <= bound
