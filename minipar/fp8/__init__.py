"""FP8 training of the linear layers: `Float8Config` (the recipe), `apply_fp8` (convert a model in place),
`fp8_linear` (the function). See docs/fp8.md."""

from .apply import Float8ColumnParallelLinear, Float8RowParallelLinear, apply_fp8, check_fp8
from .config import Float8Config
from .linear import Float8Linear, fp8_linear

__all__ = ["Float8Config", "apply_fp8", "check_fp8", "fp8_linear", "Float8Linear", "Float8ColumnParallelLinear",
           "Float8RowParallelLinear"]
