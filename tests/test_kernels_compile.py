"""Every Triton kernel compiles to Hopper (sm_90) machine code, on a machine without a GPU.

The interpreter proves the kernels' arithmetic, but it does not type-check them the way the
compiler does, nor lower them: a kernel can pass every interpreted test and still fail to
compile for a GPU. Triton compiles for a target named up front, with the ptxas it ships, so
CI compiles each kernel here, with bf16 and fp32 data, through the code generation a GPU would
use (``triton.compile`` of an ``ASTSource``; the same call works on triton 3.6 and 3.9).
"""

from __future__ import annotations

import importlib
import pathlib

import pytest

from minipar import kernels

from kernel_testing import INTERPRETING

I64, F32 = "i64", "fp32"


def _signatures(data: str) -> dict[str, tuple[dict[str, str], dict[str, object]]]:
    """kernel name -> (argument types, constexpr values); ``data`` is the element type of the activations."""
    p = f"*{data}"
    return {
        "permute_triton.gather_rows_kernel": (dict(x_ptr=p, index_ptr="*i64", out_ptr=p, D=I64), dict(BLOCK_D=256)),
        "permute_triton.segment_sum_rows_kernel": (
            dict(y_ptr=p, order_ptr="*i64", start_ptr="*i64", count_ptr="*i64", out_ptr=p, D=I64), dict(BLOCK_D=256)),
        "norm_triton.layer_norm_fwd_kernel": (
            dict(x_ptr=p, w_ptr=p, b_ptr=p, y_ptr=p, mean_ptr="*fp32", rstd_ptr="*fp32", D=I64, eps=F32),
            dict(HAS_W=True, HAS_B=True, BLOCK_D=1024)),
        "norm_triton.rms_norm_fwd_kernel": (
            dict(x_ptr=p, w_ptr=p, y_ptr=p, rstd_ptr="*fp32", D=I64, eps=F32), dict(HAS_W=True, BLOCK_D=1024)),
        "norm_triton.layer_norm_bwd_kernel": (
            dict(x_ptr=p, w_ptr=p, dy_ptr=p, mean_ptr="*fp32", rstd_ptr="*fp32", dx_ptr=p, dw_part_ptr="*fp32",
                 db_part_ptr="*fp32", n_rows=I64, D=I64, rows_per_program=I64),
            dict(HAS_W=True, HAS_B=True, BLOCK_D=1024)),
        "norm_triton.rms_norm_bwd_kernel": (
            dict(x_ptr=p, w_ptr=p, dy_ptr=p, rstd_ptr="*fp32", dx_ptr=p, dw_part_ptr="*fp32", n_rows=I64, D=I64,
                 rows_per_program=I64), dict(HAS_W=True, BLOCK_D=1024)),
        "cross_entropy_triton.row_stats_kernel": (
            dict(z_ptr=p, t_ptr="*i64", m_ptr="*fp32", s_ptr="*fp32", zt_ptr="*fp32", sz_ptr="*fp32", V=I64,
                 stride_row=I64, vocab_start=I64), dict(BLOCK_V=4096)),
        "cross_entropy_triton.xent_grad_kernel": (
            dict(z_ptr=p, lse_ptr="*fp32", t_ptr="*i64", coef_ptr="*fp32", g_ptr=p, V=I64, stride_row=I64,
                 vocab_start=I64, smooth=F32, hit=F32), dict(BLOCK_V=4096)),
        "activation_triton.gelu_fwd_kernel": (dict(x_ptr=p, y_ptr=p, n=I64), dict(BLOCK=1024)),
        "activation_triton.gelu_bwd_kernel": (dict(x_ptr=p, dy_ptr=p, dx_ptr=p, n=I64), dict(BLOCK=1024)),
        "activation_triton.swiglu_fwd_kernel": (dict(g_ptr=p, v_ptr=p, y_ptr=p, n=I64), dict(BLOCK=1024)),
        "activation_triton.swiglu_bwd_kernel": (
            dict(g_ptr=p, v_ptr=p, dy_ptr=p, dg_ptr=p, dv_ptr=p, n=I64), dict(BLOCK=1024)),
        "scale_cast_triton.scale_cast_kernel": (
            dict(src_ptr="*fp32", dst_ptr=p, found_ptr="*fp32", n=I64, scale=F32), dict(BLOCK=4096)),
        "adamw_triton.adamw_step_kernel": (
            dict(param_ptr="*fp32", grad_ptr=p, exp_avg_ptr="*fp32", exp_avg_sq_ptr="*fp32", out_ptr=p, n=I64,
                 **{k: F32 for k in ("decay", "weight_decay", "lerp_weight", "beta2", "one_minus_beta2",
                                     "neg_step_size", "bias_correction2_sqrt", "eps")}),
            dict(L2=False, HAS_OUT=True, BLOCK=1024)),
    }


KERNELS = sorted(_signatures("bf16"))


def test_every_kernel_is_in_the_table():
    """Every ``*_kernel`` of every ``kernels/*_triton.py`` is in the table: a new kernel must be
    added, or CI would never compile it."""
    folder = pathlib.Path(kernels.__file__).parent
    found = set()
    for path in folder.glob("*_triton.py"):
        m = importlib.import_module(f"minipar.kernels.{path.stem}")
        found |= {f"{path.stem}.{n}" for n, f in vars(m).items() if n.endswith("_kernel") and hasattr(f, "fn")}
    assert found == set(KERNELS), sorted(found ^ set(KERNELS))


@pytest.mark.skipif(INTERPRETING, reason="the kernels were defined for the interpreter in this process; "
                                         "the parent pytest compiles them")
@pytest.mark.parametrize("data", ["bf16", "fp32"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_compiles_for_sm90(kernel, data, tmp_path, monkeypatch):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, not from a cache
    module, name = kernel.split(".")
    fn = getattr(importlib.import_module(f"minipar.kernels.{module}"), name)
    types, constexprs = _signatures(data)[kernel]
    if "INTERPRETED" in fn.arg_names:  # what dispatch.launch passes on a GPU
        constexprs = {**constexprs, "INTERPRETED": False}
    signature = {p.name: "constexpr" if p.is_constexpr else types[p.name] for p in fn.params}
    compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"], f"{kernel} produced no machine code"
