"""Triton kernels for minipar's fused hot paths, installed as ``minipar.kernels``.

Empty for now: the kernels land with the Triton issue, each beside its PyTorch
reference. Triton is imported lazily there, so this package imports on any
machine.
"""
