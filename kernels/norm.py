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

Triton path (``norm_triton`` has the kernels; the launch shapes are chosen
here, from the width, the dtype and the SM count: `launch_config`,
`backward_config`). Forward: a row that fits one block (up to ``MAX_BLOCK_D``
= 8192 columns) is read once into registers, and its statistics and output
come from that copy; narrow rows go several to a program; warps follow the
width (4 up to 2K columns, 8 at 4K, 16 from 8K). It saves per row the mean, as
the unevaluated fp32 sum mu + c (a (2, rows) tensor), and rstd (rows,) for
the backward. mu is the mean rounded to fp32, so every x - mu is off by that
one rounding, an error rstd amplifies when |mu| is large against the spread.
The kernel measures it as c = mean(x - mu) and uses x - mu - c, with
var = mean((x - mu)^2) - c^2 (the corrected two-pass algorithm): layer_norm
stays at fp32 accuracy on such rows, where PyTorch's fp32 loses digits; the
backward reuses mu and c as saved, never recomputing them.

Backward: a persistent grid (`programs_per_sm` programs per SM, registers
capped so that they fit) loops over the rows, loading the next rows while it
reduces the current ones; each program keeps its rows' sums of dy xhat and dy
in fp32 registers and writes them once, as its row of (programs, D) fp32
partial buffers; one more small kernel sums those over programs and writes dw
and db in their own dtypes. No atomics, so the result is deterministic. Rows
wider than one block loop over column blocks. Empty inputs launch nothing.

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

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .dispatch import launch, sm_count, triton_module, use_triton

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
    if x.numel() == 0:
        return dx, dw.zero_(), db.zero_()
    tk = triton_module("norm_triton")
    config = backward_config(d, x.numel(), x.element_size())
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
        sum_config = grad_sum_config(d, _sms(x.device))
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
    if x.numel() == 0:
        return
    tk = triton_module("norm_triton")
    config = launch_config(d, x.numel())
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


# ----------------------------------------------------------------------------- launch shapes

MAX_BLOCK_D = 8192  # the widest row held in one block; wider rows loop over column blocks
TILE = 2048  # elements per program for narrow rows: ROWS = TILE // BLOCK_D rows (at most MAX_ROWS)
MAX_ROWS = 64
BWD_WARPS_PER_SM = 16  # the backward's resident warps per SM: 64K registers / (16 x 32 threads) = 128 each
BWD_MAX_REGS = 65536 // (BWD_WARPS_PER_SM * 32)  # ptxas's cap (``maxnreg``), so that they all fit


def block_for(d: int) -> int:
    """Columns per block: the whole row (rounded up to a power of 2) up to ``MAX_BLOCK_D``."""
    return min(MAX_BLOCK_D, 1 << max(0, d - 1).bit_length())


def launch_config(d: int, n_elements: int) -> dict:
    """The forward's launch shape for rows of ``d`` columns in a tensor of ``n_elements``: the kernels'
    constexprs BLOCK_D, ROWS, SINGLE (the row fits one block), LONG (64-bit offsets) and ``num_warps``.

    Warps follow the tile: 4 up to 2K elements, 8 at 4K, 16 from 8K, so a thread holds about 16
    values of each tile-sized array (two 16-byte vectors of bf16) and several programs fit an SM.
    """
    block_d = block_for(d)
    single = d <= block_d
    rows = max(1, min(MAX_ROWS, TILE // block_d)) if single else 1
    tile = rows * block_d
    return dict(BLOCK_D=block_d, ROWS=rows, SINGLE=single, LONG=n_elements >= 2**31,
                num_warps=4 if tile <= 2048 else 8 if tile <= 4096 else 16)


def backward_config(d: int, n_elements: int, element_size: int) -> dict:
    """`launch_config` for the backward: warps by the tile's bytes (as bf16's by its elements), capped
    at 16, and registers capped at ``BWD_MAX_REGS`` (``maxnreg``).

    A backward thread holds its share of w, of the dw and db sums and of two tiles of x and dy (the
    current one and the prefetched next) in their storage dtype: at 16 bf16 values per array that is
    ~150 registers uncapped, 128 capped without spills, so two 8-warp programs fit an SM. fp32
    tiles take twice the registers, hence twice the warps; at 8K fp32 columns (16 warps, the
    most that fits at 128 registers) a few spill.
    """
    cfg = launch_config(d, n_elements)
    tile_bytes = cfg["ROWS"] * cfg["BLOCK_D"] * element_size
    cfg["num_warps"] = 4 if tile_bytes <= 4096 else 8 if tile_bytes <= 8192 else 16
    cfg["maxnreg"] = BWD_MAX_REGS
    return cfg


def programs_per_sm(num_warps: int) -> int:
    """Resident backward programs per SM the persistent grid is sized for: ``BWD_WARPS_PER_SM`` warps."""
    return max(1, BWD_WARPS_PER_SM // num_warps)


def grad_sum_config(d: int, n_sm: int) -> dict:
    """norm_grad_sum_kernel's tile, [BLOCK_P partials, BLOCK_C columns]: about one program per SM
    (32 to 1024 columns each), 2048 elements a step."""
    block_c = min(1024, max(32, 1 << max(0, -(-d // n_sm) - 1).bit_length()))
    return dict(BLOCK_C=block_c, BLOCK_P=2048 // block_c, num_warps=4)


def _programs(device: torch.device, num_warps: int) -> int:
    """Programs in the persistent backward: as many as fit on the GPU at once (`programs_per_sm` per SM);
    each loops over rows, and the partial buffers are (this, D). Off a GPU (the interpreter) 4, so each
    still loops over several rows."""
    n_sm = sm_count(device)
    return programs_per_sm(num_warps) * n_sm if n_sm is not None else 4


def _sms(device: torch.device) -> int:
    """The SM count of a GPU; 4 elsewhere (the interpreter, where programs run one after another)."""
    n_sm = sm_count(device)
    return n_sm if n_sm is not None else 4
