"""`Float8Config`: which FP8 recipe the model's linear layers train with.

Three recipes, named by how a scale is shared (each operand of each of the
three matmuls of a linear layer is quantised along its contraction dimension,
see `minipar.fp8.quantize`):

* ``"tensorwise"``: one scale per tensor (torchao's default, Transformer
  Engine's delayed recipe made dynamic). Gradients in e5m2 by default: a wider
  range for values that one scale must cover end to end.
* ``"rowwise"``: one scale per row of each operand, i.e. per token for
  activations and per output feature for weights (torchao's rowwise). e4m3
  everywhere: a row's scale already follows its range.
* ``"blockwise"``: DeepSeek-V3's fine-grained recipe: activations and
  gradients in 1 x 128 tiles along the contraction dimension, weights in
  128 x 128 blocks; e4m3 everywhere.

Scales are dynamic: each is computed from the current amax (largest magnitude)
of the tensor, row or tile, ``scale = fp8_max / amax``, rounded down to a power
of two with ``pow2_scales`` (the default), so that dequantising multiplies by an
exact power of two and a scale computed on another rank or in another order
cannot differ by a rounding. Master weights stay fp32 (the optimizer's, as under
`MixedPrecision`); fp8 copies live only inside one matmul.

``all_gather=True`` (ZeRO-3 only, HSDP's zero3 form included): each unit's FP8
weights travel in its parameter all-gather as e4m3 bytes, quantised on their
owner's shard with the scales the layer would use (`minipar.fp8.gather`), half
of bf16's traffic. Exact for tensorwise and blockwise with power-of-two scales;
rowwise quantises W per output feature in forward and per input feature in
backward, which one gathered copy cannot serve, so it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALINGS = ("tensorwise", "rowwise", "blockwise")
# The recipe's gradient format when grad_dtype is not given.
DEFAULT_GRAD_DTYPE = {"tensorwise": "e5m2", "rowwise": "e4m3", "blockwise": "e4m3"}
FORMATS = ("e4m3", "e5m2")


def float8_dtype(name: str) -> torch.dtype:
    """"e4m3" -> torch.float8_e4m3fn, "e5m2" -> torch.float8_e5m2."""
    return {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[name]


def float8_missing() -> str | None:
    """None when this torch can train in FP8; otherwise what it lacks."""
    lacking = [n for n in ("float8_e4m3fn", "float8_e5m2", "_scaled_mm") if not hasattr(torch, n)]
    return f"torch {torch.__version__} has no {', '.join('torch.' + n for n in lacking)}" if lacking else None


@dataclass(frozen=True)
class Float8Config:
    """FP8 matmuls in the model's linear layers.

    Args:
        scaling: "tensorwise", "rowwise" or "blockwise" (see the module docstring).
        grad_dtype: "e4m3" or "e5m2", the format of the output gradient dY in backward; default per
            recipe (e5m2 for tensorwise, e4m3 otherwise). Activations and weights are always e4m3.
        pow2_scales: round each scale down to a power of two (exact dequantisation).
        all_gather: under ZeRO-3, gather the FP8 layers' weights in FP8 (see the module docstring).
    """
    scaling: str = "tensorwise"
    grad_dtype: str | None = None
    pow2_scales: bool = True
    all_gather: bool = False

    def __post_init__(self) -> None:
        missing = float8_missing()
        if missing is not None:
            raise ValueError(f"Float8Config: FP8 training needs float8 dtypes and torch._scaled_mm, but {missing}; "
                             "install torch >= 2.4, or train without fp8 (MixedPrecision(fp8=None))")
        if self.scaling not in SCALINGS:
            raise ValueError(f"Float8Config.scaling={self.scaling!r}; choose one of {SCALINGS}")
        if self.grad_dtype is not None and self.grad_dtype not in FORMATS:
            raise ValueError(f"Float8Config.grad_dtype={self.grad_dtype!r}; choose one of {FORMATS} or None "
                             "(the recipe's default)")
        if not isinstance(self.pow2_scales, bool):
            raise ValueError(f"Float8Config.pow2_scales={self.pow2_scales!r} must be True or False")
        if not isinstance(self.all_gather, bool):
            raise ValueError(f"Float8Config.all_gather={self.all_gather!r} must be True or False")
        if self.all_gather and self.scaling == "rowwise":
            raise ValueError("Float8Config(all_gather=True, scaling='rowwise'): rowwise scales W per output feature "
                             "in forward and per input feature in backward, so one gathered FP8 copy cannot serve "
                             "both exactly; use scaling='tensorwise' or 'blockwise' with all_gather, or "
                             "all_gather=False")
        if self.all_gather and not self.pow2_scales:
            raise ValueError("Float8Config(all_gather=True, pow2_scales=False): a gathered FP8 weight is "
                             "dequantised and quantised again by its layer, exactly only when the scales are powers "
                             "of two; use pow2_scales=True with all_gather, or all_gather=False")

    @property
    def grad_format(self) -> str:
        return self.grad_dtype or DEFAULT_GRAD_DTYPE[self.scaling]

    @property
    def tile(self) -> int:
        """The multiple every weight dimension (per tensor-parallel shard) must be: 128 for blockwise (tiles and
        blocks must not straddle a shard), 16 otherwise (what ``_scaled_mm`` needs of K and N on a GPU)."""
        return 128 if self.scaling == "blockwise" else 16
