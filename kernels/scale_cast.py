"""Scale a gradient bucket and cast it, flagging inf/nan: the mixed-precision unscale, in one pass.

With src and dst of equal numel (dst may be src itself), a Python float
``scale`` and a 1-element fp32 ``found_inf`` on src's device:

    dst[i]     = cast_{dst.dtype}( fp32(src[i]) * fp32(scale) )      (round to nearest even)
    found_inf  = max(found_inf, 1)   if any dst[i] is inf or nan,    unchanged otherwise

The flag is judged on the value as stored, so it covers an inf or nan already
in src, an fp32 overflow of the product, and an overflow of the cast itself
(an fp32 value above 65504 becomes inf in fp16). It is only ever raised, never
lowered: one flag can gather every bucket of a step, and a flag set by an
earlier bucket stays set. Nothing synchronises with the host (no ``.item()``);
the caller reads the flag once, after its all-reduce.

The Triton kernel reads src once and writes dst once. Each thread checks its
own elements (``scale_cast_triton`` has how), and only a thread that found an
inf or nan touches the flag, with an atomic max of 1.0. On a clean tensor,
the common case, that is no atomic at all, so the flag costs nothing; on an
overflowing step a few threads race to write the same 1.0, which the max
makes well defined. Per-block flags reduced afterwards would need a scratch
buffer and a second launch on every step to save atomics that almost never
happen. The launcher is a mutating ``torch.library`` custom op
(``minipar::scale_cast``), so a compiled optimizer step keeps the kernel.

src and dst must be contiguous (any flat slice of a bucket is), and dst must
be src itself or not overlap it.
"""

from __future__ import annotations

import torch

from .dispatch import launch, triton_module, use_triton


def scale_cast_(src: torch.Tensor, dst: torch.Tensor, scale: float, found_inf: torch.Tensor) -> None:
    """``dst[:] = (src.float() * scale).to(dst.dtype)``; ``found_inf[0] = 1.0`` if any result is inf/nan."""
    _check(src, dst, found_inf)
    if not use_triton(src):
        scaled = src.reshape(-1).float() * scale  # a new tensor even when src is fp32, so src is never touched
        flat_dst = dst.view(-1)
        flat_dst.copy_(scaled)
        # max with a 0-dim flag: raises found_inf to 1 without reading it back to the host.
        bad = flat_dst.isfinite().logical_not().any()
        torch.maximum(found_inf, bad.to(found_inf.dtype), out=found_inf)
        return
    _scale_cast(None if _same_memory(src, dst) else src, dst, float(scale), found_inf)


@torch.library.custom_op("minipar::scale_cast", mutates_args=("dst", "found_inf"))
def _scale_cast(src: torch.Tensor | None, dst: torch.Tensor, scale: float, found_inf: torch.Tensor) -> None:
    """The Triton launcher, as a mutating custom op; src None: in place (dst is read; an op's inputs
    must not alias what it mutates)."""
    n = dst.numel()
    if n == 0:
        return
    tk = triton_module("scale_cast_triton")
    config = tk.config(n, dst.element_size())
    # found_inf viewed as int32: the kernel raises it with an integer atomic max of 1.0's bits
    launch(tk.scale_cast_kernel, (-(-n // config["BLOCK"]),), dst if src is None else src, dst,
           found_inf.view(torch.int32), n, scale, **config)


@_scale_cast.register_fake
def _(src, dst, scale, found_inf):
    return None


def _same_memory(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether dst is src itself (the in-place case): the same object, or in eager the same memory read
    in the same dtype (a traced tensor has no address; under torch.compile the caller passes src as dst)."""
    if src is dst:
        return True
    return not torch.compiler.is_compiling() and src.dtype == dst.dtype and src.data_ptr() == dst.data_ptr()


def _check(src: torch.Tensor, dst: torch.Tensor, found_inf: torch.Tensor) -> None:
    """Shape, layout and device rules, from metadata only (no host synchronisation)."""
    if src.numel() != dst.numel():
        raise ValueError(f"scale_cast_ needs src and dst of equal numel, got {src.numel()} and {dst.numel()}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("scale_cast_ needs contiguous src and dst (a flat slice of a bucket is); "
                         "call .contiguous() on src, and write into a contiguous dst")
    if not (src.is_floating_point() and dst.is_floating_point()):
        raise ValueError(f"scale_cast_ casts between floating dtypes, got {src.dtype} -> {dst.dtype}")
    if found_inf.numel() != 1 or found_inf.dtype != torch.float32:
        raise ValueError(f"found_inf must be a 1-element fp32 tensor, got {tuple(found_inf.shape)} {found_inf.dtype}; "
                         "make it with torch.zeros(1, device=src.device)")
    if not (dst.device == src.device == found_inf.device):
        raise ValueError(f"scale_cast_ needs src, dst and found_inf on one device, got "
                         f"{src.device}, {dst.device}, {found_inf.device}")
