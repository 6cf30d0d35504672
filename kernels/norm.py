"""LayerNorm and RMSNorm over the last dimension, forward and backward.

For each row x (D,) of x (..., D), with weight w (D,) and bias b (D,), either
of which may be absent (w = 1, b = 0), all in fp32 whatever the storage dtype:

    layer_norm   mu = mean(x)    rstd = 1 / sqrt(mean((x - mu)^2) + eps)    y = (x - mu) rstd w + b
    rms_norm     mu = 0          rstd = 1 / sqrt(mean(x^2) + eps)           y = x rstd w

With xhat = (x - mu) rstd, dy the gradient of y (..., D) and g = dy w:

    dx = rstd (g - xhat mean(g xhat) - mean(g))        rms_norm: no mean(g) term
    dw = sum over rows of dy xhat  (D,)                db = sum over rows of dy  (D,)

(dx: y depends on x directly and through rstd, and for layer_norm through mu;
the two mean terms are those paths, projecting g off xhat and off the constant.)

y is returned in x.dtype, and each gradient in its input's dtype; x may be
non-contiguous (it is copied) and of any leading shape.

Triton path (``norm_triton`` has the kernels and their layout). Forward: a
row that fits one block (up to 8192 columns) is read once into registers,
and its statistics and output come from that copy; narrow rows go several
to a program. It saves per row the mean, as the unevaluated fp32 sum
mu + c (a (2, rows) tensor), and rstd (rows,) for the backward. mu is the
mean rounded to fp32, so every x - mu is off by that one rounding, an error
rstd amplifies when |mu| is large against the spread. The kernel measures it
as c = mean(x - mu) and uses x - mu - c, with var = mean((x - mu)^2) - c^2
(the corrected two-pass algorithm): layer_norm stays at fp32 accuracy on such
rows, where PyTorch's fp32 loses digits; the backward reuses mu and c as saved.

Backward: a persistent grid (a few programs per SM) loops over the rows,
loading the next rows while it reduces the current ones; each program keeps
its rows' sums of dy xhat and dy in fp32 registers and writes them once, as
its row of (programs, D) partial buffers; one more small kernel sums those
over programs and writes dw and db in their own dtypes. No atomics, so the
result is deterministic. Rows wider than one block loop over column blocks.
Empty inputs launch nothing.

Each launcher is a ``torch.library`` custom op (``minipar::norm_fwd``,
``minipar::add_norm_fwd``, ``minipar::norm_bwd``, with fake implementations
giving the shapes), called by the autograd Functions, so ``torch.compile``
traces the norms with fullgraph and keeps the kernels. ``add_norm`` (the
residual add fused in front of a norm) has its public functions there and
its launchers here, beside the norms' own.

PyTorch path (``use_triton`` false, or a dtype the fp32 kernels would lose
precision on, such as fp64): ``F.layer_norm``, and the rms_norm formula above
in fp32 torch ops (fp64 in fp64), both differentiated by autograd.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .dispatch import launch, triton_module, use_triton

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm(x, (D,), weight, bias, eps)``: x (..., D), weight and bias (D,) or None -> (..., D), x.dtype."""
    _check_shapes(x, weight=weight, bias=bias)
    if not _triton_for(x):
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return _TritonNorm.apply(x, weight, bias, eps, False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` in fp32: x (..., D), weight (D,) or None -> (..., D), x.dtype."""
    _check_shapes(x, weight=weight)
    if not _triton_for(x):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32, or fp64 kept as is
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (y if weight is None else y * weight.to(xf.dtype)).to(x.dtype)
    return _TritonNorm.apply(x, weight, None, eps, True)


def _check_shapes(x: torch.Tensor, **params: torch.Tensor | None) -> None:
    for name, p in params.items():
        if p is not None and p.shape != x.shape[-1:]:
            raise ValueError(f"{name} has shape {tuple(p.shape)}; it must be ({x.shape[-1]},), the last dimension of x")


def _triton_for(x: torch.Tensor) -> bool:
    """The dispatch rule, for the dtypes the fp32-math kernels are exact enough for."""
    return use_triton(x) and x.dtype in _KERNEL_DTYPES


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) as a contiguous (rows, D) tensor: a view when x is contiguous, else a copy."""
    return x.contiguous().view(math.prod(x.shape[:-1]), x.shape[-1])


class _TritonNorm(torch.autograd.Function):
    """layer_norm (rms False) or rms_norm (rms True, bias None) through the Triton kernels."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        x2d = rows_of(x)
        y, mean, rstd = norm_fwd(x2d, weight, bias, eps, rms)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.rms = rms
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(x.shape)

    @staticmethod
    @once_differentiable  # the backward is a kernel, not torch ops: a double backward must fail loudly
    def backward(ctx, dy):
        x2d, weight, mean, rstd = ctx.saved_tensors
        # contiguous also materialises the stride-0 gradient that y.sum().backward() sends
        dx, dw, db = norm_bwd(dy.contiguous().view(x2d.shape), None, x2d, weight, ctx.bias_dtype, mean, rstd,
                              ctx.rms)
        return dx.view(dy.shape), dw if weight is not None else None, db if ctx.bias_dtype is not None else None, \
            None, None


# ----------------------------------------------------------------------------- the launchers, as custom ops

@torch.library.custom_op("minipar::norm_fwd", mutates_args=())
def norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
             rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (rows, D) contiguous -> y (rows, D) in x's dtype, mean (2, rows) fp32 (the unevaluated sum
    mu + c; (0,) for rms) and rstd (rows,) fp32."""
    y, mean, rstd = _fwd_outputs(x, rms)
    _launch_fwd(x, None, None, weight, bias, y, mean, rstd, eps, rms)
    return y, mean, rstd


@torch.library.custom_op("minipar::add_norm_fwd", mutates_args=())
def add_norm_fwd(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 eps: float, rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, delta (rows, D) contiguous, one dtype -> h = x + delta (rounded once to x's dtype), then
    y, mean, rstd of h as ``norm_fwd``."""
    h = torch.empty_like(x)
    y, mean, rstd = _fwd_outputs(x, rms)
    _launch_fwd(x, delta, h, weight, bias, y, mean, rstd, eps, rms)
    return h, y, mean, rstd


@torch.library.custom_op("minipar::norm_bwd", mutates_args=())
def norm_bwd(dy: torch.Tensor, dh: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor | None,
             bias_dtype: torch.dtype | None, mean: torch.Tensor, rstd: torch.Tensor,
             rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy (rows, D) and x (rows, D), the input the forward normalised, contiguous; dh like dy or None.
    -> dx (rows, D) in x's dtype (plus dh, rounded once), dw (D,) in weight's dtype and db (D,) in
    ``bias_dtype``; each of dw, db empty (0,) where that parameter is absent (a custom op returns tensors)."""
    n_rows, d = x.shape
    dx = torch.empty_like(x)
    dw = torch.empty(d if weight is not None else 0, dtype=x.dtype if weight is None else weight.dtype,
                     device=x.device)
    db = torch.empty(d if bias_dtype is not None else 0, dtype=bias_dtype or x.dtype, device=x.device)
    if n_rows == 0:
        return dx, dw.zero_(), db.zero_()
    tk = triton_module("norm_triton")
    config = tk.backward_config(d, x.numel(), x.element_size())
    n_tiles = -(-n_rows // config["ROWS"])
    n_programs = min(n_tiles, _programs(x.device, config["num_warps"]))  # every program gets a tile
    has_w, has_b = weight is not None, bias_dtype is not None
    dw_part = torch.empty(n_programs, d, dtype=torch.float32, device=x.device) if has_w else x
    db_part = torch.empty(n_programs, d, dtype=torch.float32, device=x.device) if has_b else x
    w = _or_placeholder(weight, x)
    if rms and dh is None:
        launch(tk.rms_norm_bwd_kernel, (n_programs,), x, w, dy, rstd, dx, dw_part, n_rows, d, HAS_W=has_w, **config)
    elif rms:
        launch(tk.add_rms_norm_bwd_kernel, (n_programs,), x, w, dy, dh, rstd, dx, dw_part, n_rows, d,
               HAS_W=has_w, **config)
    elif dh is None:
        launch(tk.layer_norm_bwd_kernel, (n_programs,), x, w, dy, mean, rstd, dx, dw_part, db_part, n_rows, d,
               HAS_W=has_w, HAS_B=has_b, **config)
    else:
        launch(tk.add_layer_norm_bwd_kernel, (n_programs,), x, w, dy, dh, mean, rstd, dx, dw_part, db_part, n_rows, d,
               HAS_W=has_w, HAS_B=has_b, **config)
    if has_w or has_b:
        sum_config = tk.grad_sum_config(d, _sms(x.device))
        launch(tk.norm_grad_sum_kernel, (-(-d // sum_config["BLOCK_C"]),), dw_part, db_part, dw if has_w else x,
               db if has_b else x, n_programs, d, HAS_W=has_w, HAS_B=has_b, LONG=n_programs * d >= 2**31,
               **sum_config)
    return dx, dw, db


@norm_fwd.register_fake
def _(x, weight, bias, eps, rms):
    return _fwd_outputs(x, rms)


@add_norm_fwd.register_fake
def _(x, delta, weight, bias, eps, rms):
    return (torch.empty_like(x), *_fwd_outputs(x, rms))


@norm_bwd.register_fake
def _(dy, dh, x, weight, bias_dtype, mean, rstd, rms):
    d = x.shape[1]
    return (torch.empty_like(x), x.new_empty(0) if weight is None else torch.empty_like(weight),
            x.new_empty(0) if bias_dtype is None else x.new_empty(d, dtype=bias_dtype))


def _fwd_outputs(x: torch.Tensor, rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y like x, mean (2, rows) fp32 ((0,) for rms), rstd (rows,) fp32, uninitialised."""
    n_rows = x.shape[0]
    mean = x.new_empty((0,) if rms else (2, n_rows), dtype=torch.float32)
    return torch.empty_like(x), mean, x.new_empty(n_rows, dtype=torch.float32)


def _launch_fwd(x, delta, h, weight, bias, y, mean, rstd, eps, rms) -> None:
    """The forward kernel for x (rows, D) (h = x + delta first when delta is given) into y, mean, rstd (and h)."""
    n_rows, d = x.shape
    if n_rows == 0:
        return
    tk = triton_module("norm_triton")
    config = tk.config(d, x.numel())
    grid = (-(-n_rows // config["ROWS"]),)
    w, b = _or_placeholder(weight, x), _or_placeholder(bias, x)
    has_w, has_b = weight is not None, bias is not None
    if rms and delta is None:
        launch(tk.rms_norm_fwd_kernel, grid, x, w, y, rstd, n_rows, d, eps, HAS_W=has_w, **config)
    elif rms:
        launch(tk.add_rms_norm_fwd_kernel, grid, x, delta, h, w, y, rstd, n_rows, d, eps, HAS_W=has_w, **config)
    elif delta is None:
        launch(tk.layer_norm_fwd_kernel, grid, x, w, b, y, mean, rstd, n_rows, d, eps, HAS_W=has_w, HAS_B=has_b,
               **config)
    else:
        launch(tk.add_layer_norm_fwd_kernel, grid, x, delta, h, w, b, y, mean, rstd, n_rows, d, eps,
               HAS_W=has_w, HAS_B=has_b, **config)


def _or_placeholder(t: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """``t`` made contiguous, or, when absent, a tensor for a pointer argument that its HAS_ flag keeps unread."""
    return placeholder if t is None else t.contiguous()


def _programs(device: torch.device, num_warps: int) -> int:
    """Programs in the persistent backward: as many as fit on the GPU at once (``norm_triton.programs_per_sm``
    per SM); each loops over rows, and the partial buffers are (this, D)."""
    if device.type != "cuda":
        return 4  # the interpreter: few programs, so each loops over several rows, as on a GPU
    return triton_module("norm_triton").programs_per_sm(num_warps) * _sms(device)


def _sms(device: torch.device) -> int:
    """The SM count of a CUDA device; 4 elsewhere (the interpreter, where programs run one after another)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
