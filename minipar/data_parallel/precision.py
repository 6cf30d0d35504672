"""Mixed precision: which dtype computes, which reduces, and dynamic loss scaling for fp16.

Master weights and optimizer state are always fp32. The policy says:

* ``param_dtype``: the dtype of the parameters the model computes with (bf16 or
  fp16; fp32 means no mixed precision). Autograd produces gradients in it.
* ``reduce_dtype``: the dtype gradients are communicated and kept in (default:
  ``param_dtype``). fp32 here buys exact averaging for 2 bytes per element more.

With ``param_dtype=torch.float16`` the loss is multiplied by a dynamic scale
before backward; gradients are divided by it before clipping and the step. A
non-finite gradient element on *any* rank skips the step on *every* rank and
halves the scale everywhere (one all-reduce of a flag decides it), so ranks
never diverge; ``growth_interval`` clean steps in a row double it.

``fp8``: a `minipar.fp8.Float8Config`, or None. With one, the model's linear
layers (not the embedding, LM head or MoE router) compute their matmuls in FP8
(`minipar.fp8.apply_fp8`); the parameters the model holds, gradients and
masters are as the rest of the policy says, so every data-parallel strategy is
unchanged. param_dtype must then be bf16 or fp32: FP8 has its own scales, and
fp16's loss scaling on top of them is a combination no recipe uses.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch

from ..fp8.config import Float8Config

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = None
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    fp8: Float8Config | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            v = getattr(self, name)
            if v is not None and v not in _DTYPES:
                raise ValueError(f"MixedPrecision.{name}={v} is not supported; use one of {_DTYPES}")
        scale = self.init_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
            raise ValueError(f"MixedPrecision.init_scale={scale!r} must be a finite number > 0 (the fp16 loss "
                             "scale to start from; 2**16 is usual)")
        interval = self.growth_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"MixedPrecision.growth_interval={interval!r} must be an integer >= 1 (clean steps "
                             "before the loss scale doubles)")
        if self.fp8 is not None and not isinstance(self.fp8, Float8Config):
            raise ValueError(f"MixedPrecision.fp8={self.fp8!r} must be a minipar.fp8.Float8Config or None")
        if self.fp8 is not None and self.uses_loss_scaling:
            raise ValueError("MixedPrecision(fp8=...) with fp16 parameters or gradients: FP8 scales each matmul "
                             "itself; use param_dtype=torch.bfloat16 (or float32) with fp8")

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype

    @property
    def uses_loss_scaling(self) -> bool:
        return self.param_dtype == torch.float16 or self.grad_dtype == torch.float16


FP32 = MixedPrecision(param_dtype=torch.float32)


class LossScaler:
    """Dynamic loss scale; every rank holds the same value because every rank sees the same overflow flag."""

    def __init__(self, init_scale: float, growth_interval: int, enabled: bool) -> None:
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_interval = growth_interval
        self.clean_steps = 0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale *= 0.5
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale *= 2.0
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
