"""Triton kernels for minipar's fused hot paths, installed as ``minipar.kernels``.

Each kernel family is a pair of modules: ``<name>.py`` holds the public
functions, the math, the PyTorch reference and the autograd wiring;
``<name>_triton.py`` holds the ``@triton.jit`` kernels and is imported only
when the dispatch rule (``dispatch.use_triton``: CUDA tensor, or
``TRITON_INTERPRET=1``) first picks Triton. ``import minipar`` never imports triton.
"""

from .dispatch import interpreting, launches, use_triton
from .permute import permute, unpermute

__all__ = ["interpreting", "launches", "use_triton", "permute", "unpermute"]
