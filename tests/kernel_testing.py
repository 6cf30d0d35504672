"""What every kernel test module shares: the interpreter child run, the launch check, error measures.

Triton decides interpreter-or-compiler when a ``@triton.jit`` function is
*defined*, from ``TRITON_INTERPRET``. So each kernel test module marks its
Triton tests ``interpreted`` and has one parent test,
``run_interpreted(__file__)``, which runs that module again in a child pytest
with ``TRITON_INTERPRET=1`` set before anything imports triton. In the parent
the marked tests are skipped with that reason; the child must pass them all,
skip none, and each asserts that a Triton kernel really launched, so a silent
fall-back to PyTorch fails.

bf16 is judged against an fp32 reference (`lowp_ok`): the kernel's error may be
at most PyTorch's own bf16 error on the same input, or one rounding of the
exact result to bf16 where PyTorch is luckier, plus a small absolute term.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from minipar import kernels

INTERPRETING = kernels.interpreting()
interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in this module's TRITON_INTERPRET=1 child pytest "
                                                          "(test_triton_kernels_under_interpreter)")


def run_interpreted(test_file: str) -> None:
    """Run ``test_file``'s tests in a child pytest with TRITON_INTERPRET=1; all must pass, none skip."""
    if INTERPRETING:
        pytest.skip("this is the child process already")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file,
           "-k", "not test_triton_kernels_under_interpreter"]
    child = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    report = child.stdout[-12000:] + child.stderr[-4000:]
    assert child.returncode == 0, report
    summary = child.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary and "failed" not in summary, report


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
