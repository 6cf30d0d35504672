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

Every kernel that stores a low-precision result declares a constexpr
``INTERPRETED``; `launch` sets it from `interpreting`, so the GPU build never
contains the interpreter's exactness workaround (see ``common_triton.round_to``)
and the choice costs nothing at run time.

`recording` is how the static checks (``tests/test_kernels_sass.py``) see the
launches a public function makes: inside it the Triton path is taken for any
tensor and each launch is recorded, with its grid and arguments, instead of run.
"""

from __future__ import annotations

import importlib
import os
import contextlib
import functools
from collections import Counter
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Iterator

import torch

# kernel name -> number of launches in this process; tests read it to prove the Triton path ran.
launches: Counter = Counter()

_TRUE = ("1", "true", "on", "yes")  # the spellings triton itself accepts for a boolean variable


@dataclass
class Launch:
    """One recorded launch: the kernel, its grid, and the arguments it was given."""
    kernel: Any
    grid: tuple
    args: tuple
    kwargs: dict


# Set only inside `recording`: the list its launches go to (instead of running), and the SM count
# the launchers size their grids for there.
_recorded: list[Launch] | None = None
_recorded_sms: int | None = None


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` is set: Triton kernels run on CPU through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def use_triton(tensor: torch.Tensor) -> bool:
    """The dispatch rule: Triton for a CUDA tensor or under the interpreter, PyTorch otherwise, or
    everywhere with ``MINIPAR_KERNELS=torch``. triton is an optional dependency (CPU-only machines,
    macOS and Windows have no use for it): without it a CUDA tensor takes the PyTorch path too, and
    asking for the interpreter is an error that says what to install."""
    if os.environ.get("MINIPAR_KERNELS", "triton").strip().lower() == "torch":
        return False
    if not (tensor.is_cuda or interpreting() or _recorded is not None):
        return False
    if _triton_missing() is None:
        return True
    if interpreting():
        raise RuntimeError(f"TRITON_INTERPRET=1 asks for minipar's Triton kernels under the interpreter, but triton "
                           f"cannot be imported ({_triton_missing()}): pip install 'minipar[triton]', or unset "
                           "TRITON_INTERPRET to use the PyTorch path")
    return False


@functools.lru_cache(maxsize=None)
def _triton_missing() -> str | None:
    """None when triton imports; otherwise why not (checked once, at the first tensor that could use it)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def triton_module(name: str) -> ModuleType:
    """Import ``minipar.kernels.<name>`` (a module of ``@triton.jit`` kernels) at its first use."""
    return importlib.import_module(f"{__package__}.{name}")


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, counted in ``launches`` under the kernel's name; a kernel with
    an ``INTERPRETED`` constexpr is told whether it runs under the interpreter."""
    launches[kernel.__name__] += 1
    if "INTERPRETED" in kernel.arg_names:
        kwargs["INTERPRETED"] = interpreting()
    if _recorded is not None:
        _recorded.append(Launch(kernel, tuple(grid), args, kwargs))
        return
    kernel[grid](*args, **kwargs)


def sm_count(device: torch.device) -> int | None:
    """The streaming multiprocessors a launch on ``device`` can fill (persistent kernels size their grid
    by it): a CUDA device's, the one `recording` was given, or None (the interpreter: programs run one
    after another, so a launcher picks a small fixed number)."""
    if _recorded_sms is not None:
        return _recorded_sms
    if device.type != "cuda":
        return None
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@contextlib.contextmanager
def recording(sm_count: int | None = None) -> Iterator[list[Launch]]:
    """Inside: every public kernel function takes its Triton path, whatever the tensors' device, and
    its launches are appended to the list yielded instead of running (outputs stay unwritten); with
    ``sm_count`` the launchers size their grids for a GPU of that many SMs (an H100 has 132). For
    reading what a launcher passes (``tests/test_kernels_compile.py``); not for computing anything."""
    global _recorded, _recorded_sms
    outer = _recorded, _recorded_sms
    _recorded, _recorded_sms = [], sm_count
    try:
        yield _recorded
    finally:
        _recorded, _recorded_sms = outer
