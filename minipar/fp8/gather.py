"""ZeRO-3's parameter all-gather in FP8 (`Float8Config(all_gather=True)`): a unit's FP8 weights travel
as e4m3 bytes, half of bf16's traffic, and arrive as the values their layer would compute with.

A ZeRO-3 unit keeps its FP8 layers' weights in a flat group of their own (`Zero3` splits them from
the unit's other parameters, which gather in the compute dtype as before). Rank r holds the flat
elements [r*S, (r+1)*S); a weight (N, K) may be cut anywhere by that split. One gather:

1. amax: for each scale group of each weight (tensorwise: the whole weight; blockwise: each 128 x 128
   block) the largest |w| among the elements this rank holds, then the max over the shard group, one
   counted all-reduce of G fp32 values (tag ``param_amax``; G = the unit's weights under
   tensorwise, its blocks under blockwise). A tensor-parallel weight's tensorwise amax spans the tp
   shards too (its layer agrees it over tp in forward, `AmaxSync`): a second all-reduce over tp for
   those entries. Blocks never straddle a tp shard (`apply_fp8` checks multiples of 128).
2. scale = `scale_from_amax` (power of two), the shard cast to e4m3 with exactly `quantise`'s
   arithmetic (``(w * scale).clamp(-448, 448)`` cast), every rank holding every scale already.
3. the e4m3 bytes all-gathered as uint8 (tag ``param``; gloo has no float8 type), S bytes a rank.
4. landed: each weight dequantised, ``data * (1 / scale)``, into the unit's full buffer (bf16 or fp32).

Why this equals the layer quantising the bf16 weight itself: the layer's forward and backward quantise
the gathered weight again (W and W^T share their amax: tensorwise one, blockwise the same blocks).
Its scale s' is s or 2s: the largest quantised element d_max lies in (224, 448] since s is the
largest power of two with amax * s <= 448, and s' = pow2floor(448 s / d_max). Either way each value
``d / s`` becomes ``d * (s'/s)``, an e4m3 value again (times 1 or 2, below 448), and dequantises to
``d / s``: the operands of every product are the same numbers, and so are the products. Without
power-of-two scales this fails (1 / s rounds), so `Float8Config` refuses it; rowwise, whose W and W^T
rows differ, is refused too.

The gathered weight then holds FP8 values, which is all an FP8 layer reads; the masters, the shards
and the state dict keep full precision. Bytes per gather (`gather_bytes`): the group's padded numel
(S * n, one byte each: the FP8 weights), plus 4 G for the amaxes, and 4 G_tp more for the entries
agreed over tp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .quantize import TILE, expand, scale_from_amax

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max


def scale_groups(shape: tuple[int, int], form: str) -> tuple[int, ...]:
    """The shape of a weight's per-group scales: () tensorwise, (ceil(N / 128), ceil(K / 128)) blockwise."""
    n, k = shape
    return () if form == "tensor" else (math.ceil(n / TILE), math.ceil(k / TILE))


@dataclass(frozen=True)
class GatheredWeight:
    """One FP8 weight (N, K) of the flat group: where it starts in the full flat buffer, its scale form
    ("tensor" or "block"), where its G amaxes sit in the group's amax vector, and the tp group its
    amax also spans (a tensorwise tensor-parallel weight), or None."""

    start: int
    shape: tuple[int, int]
    form: str
    amax_at: int
    tp: Any = None

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def groups(self) -> tuple[int, ...]:
        return scale_groups(self.shape, self.form)

    @property
    def n_groups(self) -> int:
        return math.prod(self.groups)


class Fp8Gather:
    """The FP8 all-gather of one flat group of FP8 weights (the module docstring).

    ``weights``: (start in the flat buffer, shape (N, K), the layer's tp (comm, group) or None), in flat
    order; ``scaling``: "tensorwise" or "blockwise"; ``lo``/``shard_size``: this rank's shard."""

    def __init__(self, weights: list[tuple[int, tuple[int, int], Any]], scaling: str, lo: int,
                 shard_size: int) -> None:
        if scaling not in ("tensorwise", "blockwise"):
            raise ValueError(f"the FP8 all-gather takes tensorwise or blockwise scaling, not {scaling!r}")
        form = "tensor" if scaling == "tensorwise" else "block"
        tp_of = lambda tp: tp if form == "tensor" and tp is not None and tp[1].size > 1 else None  # noqa: E731
        # the entries agreed over tp first, so that they are one contiguous slice of the amax vector
        ordered = sorted(weights, key=lambda w: tp_of(w[2]) is None)
        self.weights, at = [], 0
        for start, shape, tp in ordered:
            w = GatheredWeight(start, tuple(shape), form, at, tp_of(tp))
            self.weights.append(w)
            at += w.n_groups
        self.n_amax = at
        self.n_tp_amax = sum(w.n_groups for w in self.weights if w.tp is not None)
        self.lo, self.shard_size = lo, shard_size

    def gather(self, comm, full: torch.Tensor, shard: torch.Tensor, group) -> "_Landing":
        """Start gathering ``shard`` (this rank's (S,) elements, compute dtype) into ``full`` ((n S,),
        compute dtype) in FP8; the handle's ``wait()`` lands it (dequantised into ``full``)."""
        amax = self.local_amax(shard)
        comm.all_reduce(amax, group, op="max", tag="param_amax")
        if self.n_tp_amax:
            tp_comm, tp_group = self.weights[0].tp
            tp_comm.all_reduce(amax[: self.n_tp_amax], tp_group, op="max", tag="param_amax")
        scale = scale_from_amax(amax, "e4m3", True)
        data_shard = self.quantise_shard(shard, scale)
        data_full = torch.empty(full.numel(), dtype=torch.uint8, device=full.device)
        work = comm.all_gather(data_full, data_shard.view(torch.uint8), group, async_op=True, tag="param")
        return _Landing(work, lambda: self.dequantise(data_full.view(E4M3), scale.reciprocal(), full))

    # -- the three steps on this rank ------------------------------------------------------------

    def _pieces(self):
        """(weight, a, b) for each weight overlapping this rank's shard: its elements [a, b) in the
        weight's own row-major order."""
        hi = self.lo + self.shard_size
        for w in self.weights:
            a, b = max(w.start, self.lo), min(w.start + w.numel, hi)
            if a < b:
                yield w, a - w.start, b - w.start

    def _group_ids(self, w: GatheredWeight, a: int, b: int, device) -> torch.Tensor | None:
        """Each element's scale group (blockwise), or None (tensorwise: one group)."""
        if w.form == "tensor":
            return None
        k = w.shape[1]
        idx = torch.arange(a, b, device=device)
        return (idx // k // TILE) * w.groups[1] + (idx % k) // TILE

    def local_amax(self, shard: torch.Tensor) -> torch.Tensor:
        """(G,) fp32: each scale group's largest |w| among this rank's elements (0 where it has none)."""
        amax = torch.zeros(self.n_amax, dtype=torch.float32, device=shard.device)
        for w, a, b in self._pieces():
            piece = shard[w.start + a - self.lo: w.start + b - self.lo].detach().abs().float()
            ids = self._group_ids(w, a, b, shard.device)
            if ids is None:
                amax[w.amax_at] = piece.amax()
            else:
                amax[w.amax_at: w.amax_at + w.n_groups].scatter_reduce_(0, ids, piece, "amax")
        return amax

    def quantise_shard(self, shard: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """(S,) e4m3: this rank's elements times their group's scale, clamped and cast as `quantise`
        does (padding and elements of no weight stay 0)."""
        data = torch.zeros(shard.numel(), dtype=E4M3, device=shard.device)
        for w, a, b in self._pieces():
            ids = self._group_ids(w, a, b, shard.device)
            s = scale[w.amax_at] if ids is None else scale[w.amax_at + ids]
            piece = shard[w.start + a - self.lo: w.start + b - self.lo].float()
            data[w.start + a - self.lo: w.start + b - self.lo] = (piece * s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        return data

    def dequantise(self, data_full: torch.Tensor, inv_scale: torch.Tensor, full: torch.Tensor) -> None:
        """Each weight's e4m3 bytes times its inverse scales (exact: powers of two) into ``full``."""
        for w in self.weights:
            data = data_full[w.start: w.start + w.numel].view(w.shape).float()
            inv = inv_scale[w.amax_at: w.amax_at + w.n_groups].view(w.groups)
            full[w.start: w.start + w.numel].view(w.shape).copy_(data * expand(inv, w.form, data.shape))

    # -- the formula -------------------------------------------------------------------------------

    def gather_bytes(self, world: int) -> dict[str, int]:
        """`all_gather_bytes` of this group (numel: the flat group's, padding included)."""
        return all_gather_bytes(self.shard_size * world, self.n_amax, world, self.n_tp_amax)


def all_gather_bytes(fp8_numel: int, n_amax: int, world: int, n_tp_amax: int = 0) -> dict[str, int]:
    """The payload bytes one FP8 gather of a unit's FP8 weights records (`minipar.core.comm`: an
    all-gather counts its full output, an all-reduce its tensor), for the planner:

        "param":      ceil(fp8_numel / world) * world        (one e4m3 byte per element, padding included)
        "param_amax": 4 * n_amax  (0 when world = 1)  + 4 * n_tp_amax

    ``n_amax``: the scale groups (tensorwise: the number of FP8 weights; blockwise: their 128 x 128
    blocks); ``n_tp_amax``: those agreed over tp as well (tensorwise tensor-parallel weights, tp > 1).
    bf16 moves 2 * ceil(fp8_numel / world) * world for the same weights: the ratio is 1/2 plus the amaxes."""
    return {"param": max(1, math.ceil(fp8_numel / world)) * world,
            "param_amax": 4 * n_amax * (world > 1) + 4 * n_tp_amax}


class _Landing:
    """The handle of an FP8 gather: wait for the bytes, then dequantise them (once)."""

    def __init__(self, work, land) -> None:
        self._work, self._land = work, land

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._land()
        return True


def fp8_weights(module: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """{id(weight): its layer} for every FP8 layer of ``module`` (`apply_fp8` gave it an ``fp8_config``)
    whose recipe gathers in FP8; each such layer is marked ``gathered_in_fp8`` (its forward refuses
    all_gather=True without it: `minipar.fp8.linear.check_gathered`)."""
    out = {}
    for m in module.modules():
        config = getattr(m, "fp8_config", None)
        if config is not None and config.all_gather:
            m.gathered_in_fp8 = True
            out[id(m.weight)] = m
    return out


def split_fp8(params: list, layers: dict[int, torch.nn.Module]) -> list[list]:
    """``params`` as [FP8 weights, the rest], leaving out an empty list: the flat groups of a unit."""
    fp8 = [p for p in params if id(p) in layers]
    rest = [p for p in params if id(p) not in layers]
    return [ps for ps in (fp8, rest) if ps]


def fp8_gather_of(params: list, layers: dict[int, torch.nn.Module], layout, scaling: str) -> Fp8Gather | None:
    """The `Fp8Gather` of a flat group (``layout``) of FP8 weights, or None for a group of other parameters."""
    if not params or id(params[0]) not in layers:
        return None
    weights = []
    for p in params:
        layer = layers[id(p)]
        tp = (layer.comm, layer.group) if hasattr(layer, "group") else None  # a tensor-parallel layer
        weights.append((layout.span(p)[0], tuple(p.shape), tp))
    return Fp8Gather(weights, scaling, layout.lo, layout.shard_size)
