"""The Adam/AdamW step over a flat fp32 shard in one pass, writing the low-precision compute copy as it goes.

Under ZeRO/FSDP the optimizer steps this rank's fp32 master shard and the
compute-dtype (bf16/fp16) shard is refreshed from it afterwards. Here both
happen in one pass over memory. With t = ``step`` (the count after this step
is added, 1 on the first), g the gradient upcast to fp32, gamma = lr,
lambda = weight_decay, elementwise:

    decoupled (AdamW):  theta <- theta * (1 - gamma * lambda)
    L2 (Adam):          g     <- g + lambda * theta
    m     <- m + (1 - beta1) * (g - m)                      torch's lerp_ (from g's end if 1 - beta1 >= 1/2)
    v     <- beta2 * v + (1 - beta2) * g * g
    theta <- theta - (gamma / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    out   <- theta rounded to nearest in out's dtype

(either decay only when lambda != 0). Those are the operations of torch's
single-tensor Adam (``torch.optim.adam._single_tensor_adam``, amsgrad and
maximize off) in its order, with its fp32 roundings: the scalars 1 - beta1^t,
gamma / (1 - beta1^t) and sqrt(1 - beta2^t) in double on the host from the
Python ``step`` (so nothing is read back from the device), then rounded to
fp32 as torch rounds a Python scalar. The PyTorch path issues the very same
torch calls and so equals ``torch.optim.Adam(W)(foreach=False)`` bitwise. The
Triton kernel rounds every operation to fp32 as written (it is compiled
without contraction into multiply-adds), so it computes bit for bit the same
on a GPU, under the interpreter and whatever the grad's dtype; it equals the
PyTorch path to fp32 rounding, as torch's own kernels contract and order
differently (its CPU lerp fuses a multiply-add, its CUDA addcdiv divides before
it scales).

Per element the kernel reads theta, g, m, v and writes theta, m, v and the
copy: 30 bytes with an fp32 gradient and a bf16 copy, against torch's ten-odd
elementwise passes plus a separate copy that reads theta again.

The launcher is a mutating ``torch.library`` custom op (``minipar::adamw_step``),
so a compiled optimizer step keeps the kernel.

``fused_step`` runs a whole ``torch.optim.Adam``/``AdamW`` through this
function and keeps the optimizer's state exactly in torch's format, so
``state_dict``/``load_state_dict`` and a plain ``optimizer.step()`` stay
interchangeable with it.
"""

from __future__ import annotations

import struct

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .dispatch import launch, triton_module, use_triton

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                decoupled: bool = True, out: torch.Tensor | None = None) -> None:
    """One Adam (``decoupled=False``, L2 decay) or AdamW step, in place; ``out`` gets the new param's copy.

    param, exp_avg, exp_avg_sq: fp32; grad: fp32, bf16 or fp16; out: bf16, fp16 or fp32. All contiguous,
    of equal numel, on one device (shapes may differ: they are read as flat). ``step`` >= 1 counts this
    step. No host-device synchronisation.
    """
    _check(param, grad, exp_avg, exp_avg_sq, out, step)
    decay = weight_decay != 0 and decoupled
    l2 = weight_decay != 0 and not decoupled
    # torch's scalars, in torch's expressions, in double.
    bias_correction1 = 1 - beta1 ** step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    if not use_triton(param):
        _adamw_step_torch(param.view(-1), grad.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1),
                          None if out is None else out.view(-1), lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                          weight_decay=weight_decay, decay=decay, l2=l2, step_size=step_size,
                          bias_correction2_sqrt=bias_correction2_sqrt)
        return
    _adamw_step(param, grad, exp_avg, exp_avg_sq, out, float(1 - lr * weight_decay) if decay else 1.0,
                float(weight_decay), float(1 - beta1), float(beta2), float(1 - beta2), float(-step_size),
                float(bias_correction2_sqrt), float(eps), l2)


@torch.library.custom_op("minipar::adamw_step", mutates_args=("param", "exp_avg", "exp_avg_sq", "out"))
def _adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                out: torch.Tensor | None, decay: float, weight_decay: float, lerp_weight: float, beta2: float,
                one_minus_beta2: float, neg_step_size: float, bias_correction2_sqrt: float, eps: float,
                l2: bool) -> None:
    """The Triton launcher, as a mutating custom op (the scalars as the kernel takes them)."""
    n = param.numel()
    if n == 0:
        return
    tk = triton_module("adamw_triton")
    config = tk.config(n)
    # torch's lerp_ picks its formula by comparing the weight, as an fp32 scalar, with 0.5: so here, on the host
    # (a constexpr: no branch, and no comparison a compiler could make in fp64 from an fp64 argument).
    lerp_from_g = _round_to_dtype(lerp_weight, torch.float32) >= 0.5
    # Every scalar a float: an int (Adam's default weight_decay=0) would be typed, and specialised on, as an
    # integer, compiling another variant of the kernel.
    launch(tk.adamw_step_kernel, (-(-n // config["BLOCK"]),), param, grad, exp_avg, exp_avg_sq,
           param if out is None else out, n, decay, weight_decay, lerp_weight, beta2, one_minus_beta2,
           neg_step_size, bias_correction2_sqrt, eps, L2=l2, LERP_FROM_G=lerp_from_g, HAS_OUT=out is not None,
           **config)


@_adamw_step.register_fake
def _(param, grad, exp_avg, exp_avg_sq, out, decay, weight_decay, lerp_weight, beta2, one_minus_beta2,
      neg_step_size, bias_correction2_sqrt, eps, l2):
    return None


def supports(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``fused_step`` can step every group of ``optimizer`` exactly as its own ``step()`` would.

    Exactly torch.optim.AdamW or torch.optim.Adam (a subclass may change the
    update), without amsgrad, maximize, differentiable or capturable (whose
    step counts live on the device and feed a different formula), with no AMP
    grad scale attached, Python-number hyperparameters (a tensor lr or beta
    would have to be read back) and real, dense, contiguous float32 params.
    """
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        return False
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return False
    for group in optimizer.param_groups:
        if any(group.get(flag, False) for flag in ("amsgrad", "maximize", "differentiable", "capturable")):
            return False
        if not all(_is_number(x) for x in (group["lr"], *group["betas"], group["eps"], group["weight_decay"])):
            return False
        for p in group["params"]:
            if p.dtype != torch.float32 or p.layout != torch.strided or not p.is_contiguous():
                return False
    return True


@torch.no_grad()
def fused_step(optimizer: torch.optim.Optimizer, outs: dict[int, torch.Tensor] | None = None,
               grads: dict[int, torch.Tensor] | None = None) -> None:
    """``optimizer.step()`` through ``adamw_step_``, for an optimizer that ``supports`` accepts.

    Every param with a gradient is stepped: ``grads[id(param)]`` if given (any
    of fp32/bf16/fp16, same numel: a reduced low-precision gradient needs no
    fp32 copy), else ``param.grad``. ``outs`` maps ``id(param)`` to the
    low-precision copy (same numel) to write in the same pass. The state is
    torch's own: ``step`` a scalar float tensor (on the CPU, or on the param's
    device for a fused optimizer) advanced by 1, ``exp_avg`` and
    ``exp_avg_sq`` created as zeros on first use. Step hooks registered on the
    optimizer are not run.
    """
    if not supports(optimizer):
        raise ValueError(f"fused_step steps torch.optim.Adam/AdamW with fp32 contiguous params, Python-number "
                         f"hyperparameters, and amsgrad, maximize, differentiable and capturable off; this "
                         f"{type(optimizer).__name__} is not one (check supports() first and call "
                         f"optimizer.step() otherwise)")
    outs, grads = outs or {}, grads or {}
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        decoupled = type(optimizer) is torch.optim.AdamW or bool(group.get("decoupled_weight_decay", False))
        for p in group["params"]:
            grad = grads.get(id(p), p.grad)
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("Adam does not support sparse gradients, please consider SparseAdam instead")
            state = optimizer.state[p]
            if len(state) == 0:
                _init_state(state, p, bool(group.get("fused")))
            step = _advance(state["step"])
            adamw_step_(p, grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], step=step,
                        lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"], decoupled=decoupled, out=outs.get(id(p)))


# ----------------------------------------------------------------------------- the PyTorch path

def _adamw_step_torch(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      out: torch.Tensor | None, *, lr: float, beta1: float, beta2: float, eps: float,
                      weight_decay: float, decay: bool, l2: bool, step_size: float,
                      bias_correction2_sqrt: float) -> None:
    """The reference: ``_single_tensor_adam``'s calls, one for one, on flat views."""
    grad = grad.float()  # the same tensor when already fp32; never written to
    if decay:
        param.mul_(1 - lr * weight_decay)
    elif l2:
        grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if out is not None:
        out.copy_(param)  # copy_ rounds to nearest even


# ----------------------------------------------------------------------------- torch's state, kept in its format

def _init_state(state: dict, p: torch.Tensor, fused: bool) -> None:
    """What ``Adam._init_group`` creates on a param's first step (amsgrad and capturable being off)."""
    if fused:  # a fused optimizer keeps its count on the param's device, in fp32
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
    else:  # otherwise on the CPU, in the default float dtype's precision
        dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        state["step"] = torch.tensor(0.0, dtype=dtype)
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


# step tensor -> (its version counter, its value) as of fused_step's last increment. Held weakly, by identity.
_host_steps = WeakIdKeyDictionary()


def _advance(step_t: torch.Tensor) -> int:
    """``step_t += 1``, returning the new count as a Python number without reading the device when possible.

    The kernel needs t on the host for its bias corrections. A non-fused
    optimizer keeps ``step_t`` on the CPU, where ``item()`` is free; a fused
    one keeps it on the GPU, where ``item()`` waits for the device, once per
    param per step. So the count fused_step last wrote is remembered with the
    tensor's version counter, which every in-place change bumps: while the
    tensor is unchanged since (same object, same version) the remembered count
    is its value. A plain ``optimizer.step()``, ``fill_``/``copy_``, or a
    ``load_state_dict`` (new tensors) in between makes fused_step read it once
    again. Changes through ``.data`` bypass version counters and are not seen.
    """
    known = _host_steps.get(step_t)
    count = known[1] if known is not None and known[0] == step_t._version else step_t.item()
    step_t += 1
    count = _round_to_dtype(count + 1, step_t.dtype)  # past 2**24 an fp32 count stops where torch's does
    _host_steps[step_t] = (step_t._version, count)
    return int(count)


def _round_to_dtype(x: float, dtype: torch.dtype) -> float:
    if dtype == torch.float32:
        return struct.unpack("f", struct.pack("f", x))[0]
    return x if dtype == torch.float64 else torch.tensor(x, dtype=dtype).item()


# ----------------------------------------------------------------------------- checks

def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           out: torch.Tensor | None, step: int) -> None:
    """Shapes, dtypes and devices, from metadata only (no device reads)."""
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32:
            raise ValueError(f"adamw_step_: {name} must be float32 (the master copy and its state), got {t.dtype}")
    if grad.dtype not in _GRAD_DTYPES:
        raise ValueError(f"adamw_step_: grad must be float32, bfloat16 or float16, got {grad.dtype}")
    if out is not None and out.dtype not in _OUT_DTYPES:
        raise ValueError(f"adamw_step_: out must be bfloat16, float16 or float32, got {out.dtype}")
    tensors = [param, grad, exp_avg, exp_avg_sq] + ([] if out is None else [out])
    if any(t.numel() != param.numel() for t in tensors):
        raise ValueError(f"adamw_step_: all tensors must have param's numel {param.numel()}, got "
                         f"{[t.numel() for t in tensors]}")
    if any(t.device != param.device for t in tensors):
        raise ValueError(f"adamw_step_: all tensors must be on {param.device}, got {[str(t.device) for t in tensors]}")
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("adamw_step_ reads its tensors as flat memory: pass contiguous tensors (.contiguous())")
    if step < 1:
        raise ValueError(f"adamw_step_: step counts this step and starts at 1, got {step}")
