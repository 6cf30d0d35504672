"""Triton kernels for minipar's fused hot paths, installed as ``minipar.kernels``.

Each kernel family is a pair of modules: ``<name>.py`` holds the public
functions, the math, the PyTorch reference and the autograd wiring;
``<name>_triton.py`` holds the ``@triton.jit`` kernels and is imported only
when the dispatch rule (``dispatch.use_triton``: CUDA tensor, or
``TRITON_INTERPRET=1``) first picks Triton. ``import minipar`` never imports triton.

Who uses what: the GPT (``minipar.models``) its norms, activations and loss;
tensor parallelism the vocab-parallel cross-entropy primitives; the ZeRO
stages the fused AdamW step and the gradient scale-and-cast; the MoE layer
permute/unpermute, GELU and the experts' grouped product (``grouped_mm``); the FP8 linear layers (``minipar.fp8``) the
row and tile quantisation (``fp8_cast``).
"""

if __name__ == "minipar.kernels":
    from .activation import gelu, swiglu
    from .add_norm import add_layer_norm, add_rms_norm
    from .adamw import adamw_step_, fused_step, supports as adamw_supports
    from .cross_entropy import cross_entropy, row_stats, xent_grad
    from .dispatch import interpreting, launches, use_triton
    from .fp8_cast import fp8_cast
    from .grouped_mm import grouped_mm
    from .linear_cross_entropy import linear_cross_entropy
    from .norm import layer_norm, rms_norm
    from .permute import permute, unpermute
    from .scale_cast import scale_cast_

    __all__ = ["interpreting", "launches", "use_triton", "permute", "unpermute", "layer_norm", "rms_norm",
               "add_layer_norm", "add_rms_norm",
               "cross_entropy", "row_stats", "xent_grad", "linear_cross_entropy", "gelu", "swiglu", "adamw_step_",
               "fused_step", "adamw_supports", "scale_cast_", "fp8_cast", "grouped_mm"]
else:
    # Imported by its folder's name, `kernels`, because the repository root is on sys.path (`python -m
    # pytest` or a shell started there): transformers probes for Hugging Face's own `kernels` package
    # by importing that name. A second copy of these modules would register minipar's custom ops again,
    # over the first copy's, and split the dispatch state between the two; so this copy stays empty.
    __all__ = []
