"""The one rule that picks a kernel's implementation, and the counter of Triton launches.

Every kernel in ``minipar.kernels`` asks ``use_triton(tensor)``: Triton when the
tensor is on CUDA or when ``TRITON_INTERPRET=1`` is set (Triton's interpreter
runs the same kernels on CPU tensors, slowly, which is how CI tests them),
PyTorch otherwise. ``MINIPAR_KERNELS=torch`` takes the PyTorch path
everywhere, CUDA included: the baseline the GPU benchmarks compare with, and
the first thing to try when a kernel is suspected. The rule is read at every call, so a test can flip
the environment variables to compare both paths in one process.

Triton fixes the interpreter-or-compiler choice when a ``@triton.jit`` function
is *defined*, so the Triton modules (``*_triton.py``) are imported only here,
at their first use: ``import minipar`` neither imports triton nor freezes that
choice.
"""

from __future__ import annotations

import importlib
import os
from collections import Counter
from types import ModuleType

import torch

# kernel name -> number of launches in this process; tests read it to prove the Triton path ran.
launches: Counter = Counter()

_TRUE = ("1", "true", "on", "yes")  # the spellings triton itself accepts for a boolean variable


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` is set: Triton kernels run on CPU through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def use_triton(tensor: torch.Tensor) -> bool:
    """The dispatch rule: Triton for a CUDA tensor or under the interpreter, PyTorch otherwise, or
    everywhere with ``MINIPAR_KERNELS=torch``."""
    if os.environ.get("MINIPAR_KERNELS", "triton").strip().lower() == "torch":
        return False
    return tensor.is_cuda or interpreting()


def triton_module(name: str) -> ModuleType:
    """Import ``minipar.kernels.<name>`` (a module of ``@triton.jit`` kernels) at its first use."""
    return importlib.import_module(f"{__package__}.{name}")


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, counted in ``launches`` under the kernel's name."""
    launches[kernel.__name__] += 1
    kernel[grid](*args, **kwargs)
