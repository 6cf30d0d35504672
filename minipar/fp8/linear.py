"""``y = x W^T (+ b)`` with FP8 matmuls: the forward and the two backward products, as one autograd function.

For x (M, K) (the tokens of any leading shape, flattened), W (N, K), dY (M, N):

    forward:   Y  = X  W^T       operands X (M, K) and W (N, K),       contracted over K
    backward:  dX = dY W         operands dY (M, N) and W^T (K, N),    contracted over N
               dW = dY^T X       operands dY^T (N, M) and X^T (K, M),  contracted over M

Each product is ``quantize.matmul(a, b) = a @ b^T`` of two operands quantised
along the dimension it contracts (`minipar.fp8.quantize`): X, W and W^T in e4m3,
dY and dY^T in the recipe's gradient format. Per recipe (`Float8Config`):

    tensorwise: every operand "tensor"; a tensor and its transpose share one amax
    rowwise:    every operand "row" (X per token, W per output feature in forward,
                per input feature in backward, dY^T and X^T per feature over the tokens)
    blockwise:  activations and gradients "tile" (1 x 128 along the contraction),
                weights "block" (128 x 128), as DeepSeek-V3 trains

X and W are saved in their own (bf16 or fp32) dtype and quantised again in
backward, in the layout each product needs; dX and dW come back in x's and W's
dtypes, the products accumulated in fp32. The bias is added outside, in x's dtype.

Under tensor parallelism an operand's scale group may span the shards of the
tp ranks (`AmaxSync`): its amax is then the max over the group, one counted
all-reduce (tag ``fp8_amax``) per such amax, so every rank quantises its shard
exactly as one process quantises the whole tensor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import Float8Config
from .quantize import amax_of, matmul, quantise

# recipe -> (form of activations and gradients, form of weights)
FORMS = {"tensorwise": ("tensor", "tensor"), "rowwise": ("row", "row"), "blockwise": ("tile", "block")}


class AmaxSync(NamedTuple):
    """A tensor-parallel layer's weight is split over ``group`` along ``split``: "out" (column-parallel: W's
    rows, so dY's features, N) or "in" (row-parallel: W's columns, so X's features, K).

    Which amaxes span shards: tensorwise, that of every split tensor (column: W and dY; row: X and W);
    rowwise, the rows of the product contracted over the split dimension (column: dX's operands dY and
    W^T, contracted over N; row: the forward's X and W, contracted over K); blockwise, none: tiles and
    blocks of 128 never straddle a shard (`apply_fp8` checks the shard sizes are multiples of 128)."""
    comm: object
    group: object
    split: str

    def reducer(self, scaling: str, tensor: str, contracted: str):
        """The in-place max over the group for ``tensor`` ("x", "w", "dy") contracted over ``contracted``
        ("K", "N", "M"), or None when its amax is already whole on this rank."""
        split_tensors, split_dim = {"out": (("w", "dy"), "N"), "in": (("x", "w"), "K")}[self.split]
        if scaling == "tensorwise":
            spans = tensor in split_tensors
        else:
            spans = scaling == "rowwise" and contracted == split_dim
        if not spans or self.group.size == 1:
            return None
        return lambda amax: self.comm.all_reduce(amax, self.group, op="max", tag="fp8_amax")


def _reducer(sync: AmaxSync | None, scaling: str, tensor: str, contracted: str):
    return None if sync is None else sync.reducer(scaling, tensor, contracted)


def _tensor_amax(t: torch.Tensor, reduce) -> torch.Tensor:
    """A tensorwise amax, agreed over the tp group when ``reduce`` says so; shared by t and t^T."""
    amax = amax_of(t, "tensor")
    if reduce is not None:
        reduce(amax)
    return amax


class Fp8Matmul(torch.autograd.Function):
    """x2d (M, K) @ weight (N, K)^T in FP8 -> (M, N) in x's dtype; backward dX = dY W, dW = dY^T X in FP8."""

    @staticmethod
    def forward(ctx, x2d: torch.Tensor, weight: torch.Tensor, config: Float8Config, sync: AmaxSync | None):
        act, wform = FORMS[config.scaling]
        amax_x = amax_w = None
        if config.scaling == "tensorwise":  # one amax per tensor, reused by its transpose in backward
            amax_x = _tensor_amax(x2d, _reducer(sync, "tensorwise", "x", "K"))
            amax_w = _tensor_amax(weight, _reducer(sync, "tensorwise", "w", "K"))
        qx = quantise(x2d, "e4m3", act, config.pow2_scales, amax_x, _reducer(sync, config.scaling, "x", "K"))
        qw = quantise(weight, "e4m3", wform, config.pow2_scales, amax_w, _reducer(sync, config.scaling, "w", "K"))
        ctx.save_for_backward(x2d, weight, amax_x, amax_w)
        ctx.config, ctx.sync = config, sync
        return matmul(qx, qw).to(x2d.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2d, weight, amax_x, amax_w = ctx.saved_tensors
        config, sync, scaling, pow2 = ctx.config, ctx.sync, ctx.config.scaling, ctx.config.pow2_scales
        act, wform = FORMS[scaling]
        gfmt = config.grad_format
        dy = dy.contiguous()
        amax_dy = _tensor_amax(dy, _reducer(sync, scaling, "dy", "N")) if scaling == "tensorwise" else None
        # dX = dY W: both operands contracted over N (W^T's rows are W's columns)
        qdy = quantise(dy, gfmt, act, pow2, amax_dy, _reducer(sync, scaling, "dy", "N"))
        qwt = quantise(weight.t().contiguous(), "e4m3", wform, pow2, amax_w, _reducer(sync, scaling, "w", "N"))
        dx = matmul(qdy, qwt).to(x2d.dtype)
        # dW = dY^T X: both operands contracted over the tokens M
        qdyt = quantise(dy.t().contiguous(), gfmt, act, pow2, amax_dy, _reducer(sync, scaling, "dy", "M"))
        qxt = quantise(x2d.t().contiguous(), "e4m3", act, pow2, amax_x, _reducer(sync, scaling, "x", "M"))
        dw = matmul(qdyt, qxt).to(weight.dtype)
        return dx, dw, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: Float8Config,
               sync: AmaxSync | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the matmul in FP8. x: (..., K), weight (N, K) -> (..., N)."""
    k = x.shape[-1]
    if x.is_cuda and x.numel() // k % 16:
        raise ValueError(f"fp8 linear: {x.numel() // k} tokens; torch._scaled_mm on a GPU contracts dW over the "
                         "tokens and needs a multiple of 16: choose batch * sequence a multiple of 16")
    y = Fp8Matmul.apply(x.reshape(-1, k), weight, config, sync)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def check_gathered(layer: nn.Module) -> None:
    """An FP8 layer whose recipe says all_gather=True must have its weight gathered by ZeRO-3
    (`minipar.fp8.gather.fp8_weights` marks it): elsewhere the option would do nothing, silently."""
    if layer.fp8_config.all_gather and not getattr(layer, "gathered_in_fp8", False):
        raise ValueError(f"Float8Config(all_gather=True) on a {type(layer).__name__} whose weight no ZeRO-3 "
                         "strategy gathers: the FP8 all-gather is ZeRO-3's parameter gather; use strategy='zero3' "
                         "(HSDP too: a mesh with dp_shard), or Float8Config(all_gather=False)")


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmul runs in FP8 (`apply_fp8` turns a Linear into one in place, keeping its
    parameters, their names and hooks). ``fp8_config``: the recipe."""

    fp8_config: Float8Config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_gathered(self)
        return fp8_linear(x, self.weight, self.bias, self.fp8_config)


class LinearInFp8(torch.overrides.TorchFunctionMode):
    """Inside it, ``F.linear(x, weight, bias)`` with this ``weight`` runs `fp8_linear`; every other call
    is untouched. How a layer whose forward calls ``F.linear`` among other things (the tensor-parallel
    layers' regions) gets an FP8 matmul without its code changing."""

    def __init__(self, weight: torch.Tensor, config: Float8Config, sync: AmaxSync | None) -> None:
        super().__init__()
        self.weight, self.config, self.sync = weight, config, sync

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and args[1] is self.weight:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return fp8_linear(args[0], self.weight, bias, self.config, self.sync)
        return func(*args, **kwargs)
