"""Context parallelism: causal attention over a sequence whose tokens are split across the C ranks of a group.

Two ways to attend when each rank holds only T/C of the tokens (shapes (B, H, T/C, D) throughout):

* **Ring attention** (`ring_attention`). Queries stay where they are; the K/V blocks travel around the
  ring r -> r+1 (C-1 hops), each rank attending to the block in hand while the next one is in flight.
  The partial results of the blocks merge exactly by their log-sum-exps (below). The backward recomputes
  the scores block by block from the saved output and lse (flash-attention style) and passes K/V around
  again, each block's dK/dV accumulator travelling with it and finally returning to its owner; a rank
  computes its part of a block's dK/dV while that block's accumulator is still in flight to it.
* **Ulysses** (`ulysses_attention`). An all-to-all turns "my tokens, all heads" into "all tokens, my
  H/C heads" (`minipar.core.regions.seq_to_heads`); each rank runs ordinary causal attention on its heads and
  a fourth all-to-all turns the output back. Needs H divisible by C.

Zig-zag balance. Under a causal mask a token at position p attends to p + 1 keys, so with the sequence
cut into C contiguous pieces the last rank does about 2C-1 times the work of the first. Ring attention
cuts it into 2C chunks of length n = T/(2C) instead, and rank r holds chunks r and 2C-1-r: the two
chunks' work, n²(r + 2C-1-r) + n(n+1), is the same on every rank (`score_elements` shows it).

A query chunk a meets a key chunk b in one of three ways: b > a, fully masked (skipped, never computed);
b < a, fully visible (no mask); b == a, the causal diagonal (only in the rank's own block).

Merging by log-sum-exp. For one query row with scores s over the keys, split into sets A and B, let
o_X = softmax(s_X) V_X and l_X = logsumexp(s_X). Then the attention over A ∪ B is::

    l = log(e^{l_A} + e^{l_B}),    o = e^{l_A - l} o_A + e^{l_B - l} o_B.

Backward, for one (query, key) block, with the row's full l and output O saved (exact, because the
block's P is that block's slice of the full softmax row)::

    P = exp(S - l),  dV = Pᵀ dO,  dP = dO Vᵀ,  Δ = rowsum(dO ∘ O),  dS = P ∘ (dP - Δ),
    dQ = scale · dS K,  dK = scale · dSᵀ Q.

Scores, softmax and accumulators are fp32 whatever the input dtype; K/V and dK/dV travel in the input
dtype (that is what `minipar.plan.model_traffic.ring_bytes` counts). Plain PyTorch: matmul, exp, logsumexp.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..core.comm import AxisGroup, Comm, ring_pass
from ..core.regions import heads_to_seq, seq_to_heads


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, group: AxisGroup,
                   seq_len: int, scale: float | None = None) -> torch.Tensor:
    """Causal attention over the whole sequence; each rank holds its zig-zag tokens.

    q, k, v: (B, H, seq_len // C, D), the tokens at ``zigzag_positions(seq_len, C, group.rank)``.
    Returns this rank's (B, H, seq_len // C, D) output. ``scale`` defaults to 1/sqrt(D).
    Raises ValueError (before any communication) if the shapes or seq_len do not fit.
    """
    C = group.size
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"ring_attention: q, k, v must all be (B, H, T/C, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)} (repeat grouped K/V heads before calling)")
    if q.shape[2] * C != seq_len:
        raise ValueError(f"ring_attention: each of the cp = {C} ranks must hold seq_len / cp = {seq_len} / {C} "
                         f"tokens, but q has {q.shape[2]}")
    _positions(seq_len, C, group.rank)  # raises unless 2C divides seq_len
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, comm, group, seq_len, scale)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, group: AxisGroup,
                      scale: float | None = None) -> torch.Tensor:
    """Causal attention when each rank holds contiguous tokens (``contiguous_positions``): (B, H, T/C, D) each.

    Three all-to-alls give every rank all T tokens of its H/C heads, causal SDPA runs on them, a fourth
    returns the output to (B, H, T/C, D). The backward is the same four exchanges reversed; the local
    attention's output is recomputed there rather than saved (`_CoreAttention` says why).
    """
    C, heads = group.size, q.shape[1]
    if heads % C:
        raise ValueError(f"ulysses_attention: heads must divide by cp: {heads} heads on cp = {C} ranks (with "
                         f"tensor parallelism, the heads per tp rank). Choose cp dividing the head count, or "
                         f"use ring attention")
    q, k, v = (seq_to_heads(t, comm, group, tag="cp_ulysses") for t in (q, k, v))
    return heads_to_seq(_CoreAttention.apply(q, k, v, scale), comm, group, tag="cp_ulysses")


class _CoreAttention(torch.autograd.Function):
    """Causal SDPA whose output is recomputed in backward instead of saved (Ulysses' local attention).

    forward:  out = softmax(q kᵀ · scale + causal mask) v, saving q, k, v only.
    backward: out is recomputed from the saved q, k, v under autograd and (dq, dk, dv) =
              ∂out/∂(q, k, v)ᵀ · dout.

    Why: without context parallelism the attention output and the output projection's input are one
    tensor in memory (a free transpose), saved once. Under Ulysses they are in different layouts (H/C
    heads of all tokens, all heads of T/C tokens), so saving both would keep a full copy more: cp = 2
    would keep 0.6 of cp = 1's attention activations instead of 0.5. Recomputing costs one attention
    forward on H/C heads per layer in backward and no communication.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale):
        ctx.save_for_backward(q, k, v)
        ctx.scale = scale
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    @staticmethod
    def backward(ctx, dout):
        inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = F.scaled_dot_product_attention(*inputs, is_causal=True, scale=ctx.scale)
        return (*torch.autograd.grad(out, inputs, dout), None)


def zigzag_positions(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """int64 (seq_len // cp,): the positions rank ``cp_rank`` holds, chunks r and 2cp-1-r of 2cp."""
    if cp < 1 or seq_len % (2 * cp):
        raise ValueError(f"zig-zag context parallelism cuts the sequence into 2 * cp = {2 * cp} equal chunks, "
                         f"but seq_len = {seq_len} is not divisible by {2 * cp}: use a sequence length that "
                         f"is a multiple of {2 * cp} (or pad it)")
    n = seq_len // (2 * cp)
    last = 2 * cp - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * n, (cp_rank + 1) * n, device=device),
                      torch.arange(last * n, (last + 1) * n, device=device)])


def contiguous_positions(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """int64 (seq_len // cp,): positions r·T/cp ... (r+1)·T/cp - 1 (the split Ulysses uses)."""
    if cp < 1 or seq_len % cp:
        raise ValueError(f"context parallelism splits the sequence into cp = {cp} equal pieces, but seq_len = "
                         f"{seq_len} is not divisible by {cp}: use a multiple of {cp} (or pad it)")
    n = seq_len // cp
    return torch.arange(cp_rank * n, (cp_rank + 1) * n, device=device)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries at q_pos over keys at k_pos (key visible iff k_pos <= q_pos).

    q (B, H, Tq, D), k/v (B, H, Tk, D) -> (out (B, H, Tq, D) in q's dtype, lse (B, H, Tq) fp32, the
    log-sum-exp of the scaled masked scores). A row with no visible key gives out 0 and lse -inf.
    """
    out, lse = _attend(q.float(), k.float(), v.float(), q_pos, k_pos, scale, masked=True)
    return out.to(q.dtype), lse


def score_elements(seq_len: int, cp: int, cp_rank: int, split: str = "zigzag") -> int:
    """The (query, key) pairs this rank's causal attention leaves unmasked: Σ (p + 1) over its positions p."""
    if split == "zigzag":
        pos = zigzag_positions(seq_len, cp, cp_rank)
    elif split == "contiguous":
        pos = contiguous_positions(seq_len, cp, cp_rank)
    else:
        raise ValueError(f"split must be 'zigzag' or 'contiguous', not {split!r}")
    return int((pos + 1).sum())


# -- the ring ---------------------------------------------------------------------------------------


class _RingAttention(torch.autograd.Function):
    """o = softmax(causal(scale · Q Kᵀ)) V over the whole sequence, K/V passed around the ring;
    backward: dQ, dK, dV by the flash-attention recurrences (module docstring), K/V passed around again
    with the dK/dV accumulators, which end at their owners."""

    @staticmethod
    def forward(ctx, q, k, v, comm, group, seq_len, scale):
        C, r = group.size, group.rank
        q_chunks, q_pos = _chunks(seq_len, C, r), _positions(seq_len, C, r, q.device)
        qf = q.float()
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # K and V in one contiguous buffer: one message per hop
        for step in range(C):
            src = (r - step) % C  # whose K/V we hold now
            if step < C - 1:  # launch the next block's transfer before computing on this one (overlap)
                kv_next = torch.empty_like(kv)
                works = ring_pass(comm, group, kv, kv_next, "cp_kv")
            k_pos = _positions(seq_len, C, src, q.device)
            for qs, ks, masked in _visible(q_chunks, _chunks(seq_len, C, src)):
                o_b, l_b = _attend(qf[:, :, qs], kv[0][:, :, ks].float(), kv[1][:, :, ks].float(),
                                   q_pos[qs], k_pos[ks], scale, masked)
                _merge(out[:, :, qs], lse[:, :, qs], o_b, l_b)
            if step < C - 1:
                for w in works:
                    w.wait()
                kv = kv_next
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.group, ctx.seq_len, ctx.scale = comm, group, seq_len, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        comm, group, seq_len, scale = ctx.comm, ctx.group, ctx.seq_len, ctx.scale
        C, r = group.size, group.rank
        q_chunks, q_pos = _chunks(seq_len, C, r), _positions(seq_len, C, r, q.device)
        qf, do = q.float(), dout.float()
        delta = (do * out.float()).sum(-1)  # Δ = rowsum(dO ∘ O), one per query row
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v])
        # The dK/dV accumulator of a block travels with it. The one for the block in hand arrives
        # while this rank computes its own contribution to that block; only then is it waited for,
        # added, and sent on (so its transfer overlaps a compute too). After C hops it is home.
        incoming = None  # (works, buffer): the accumulator of the block in hand, in flight
        for step in range(C):
            src = (r - step) % C
            kv_works = []
            if step < C - 1:  # K/V do not change: send them on before computing (overlap)
                kv_next = torch.empty_like(kv)
                kv_works = ring_pass(comm, group, kv, kv_next, "cp_kv")
            k_pos = _positions(seq_len, C, src, q.device)
            mine = torch.zeros_like(kv, dtype=torch.float32)  # this rank's part of the block's dK/dV
            for qs, ks, masked in _visible(q_chunks, _chunks(seq_len, C, src)):
                dq_b, dk_b, dv_b = _attend_backward(qf[:, :, qs], kv[0][:, :, ks].float(), kv[1][:, :, ks].float(),
                                                    do[:, :, qs], lse[:, :, qs], delta[:, :, qs],
                                                    q_pos[qs], k_pos[ks], scale, masked)
                dq[:, :, qs] += dq_b
                mine[0][:, :, ks] += dk_b
                mine[1][:, :, ks] += dv_b
            if incoming is not None:
                for w in incoming[0]:
                    w.wait()
                mine += incoming[1].float()
            dkv = mine.to(kv.dtype)
            if C > 1:
                dkv_next = torch.empty_like(dkv)
                incoming = (ring_pass(comm, group, dkv, dkv_next, "cp_kv_grad"), dkv_next)
            for w in kv_works:
                w.wait()
            if step < C - 1:
                kv = kv_next
        if incoming is not None:  # the C-th hop: our own block's accumulator, home
            for w in incoming[0]:
                w.wait()
            dkv = incoming[1]
        return dq.to(q.dtype), dkv[0], dkv[1], None, None, None, None


def _chunks(seq_len: int, cp: int, cp_rank: int) -> list[tuple[int, slice]]:
    """(chunk index of 2cp, its slice of the rank's local tokens), in local order; cp = 1: one chunk."""
    if cp == 1:
        return [(0, slice(0, seq_len))]
    n = seq_len // (2 * cp)
    return [(cp_rank, slice(0, n)), (2 * cp - 1 - cp_rank, slice(n, 2 * n))]


def _positions(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global positions of a rank's local tokens, matching `_chunks` (any seq_len when cp = 1)."""
    return torch.arange(seq_len, device=device) if cp == 1 else zigzag_positions(seq_len, cp, cp_rank, device)


def _visible(q_chunks, k_chunks):
    """The blocks worth computing: for each query chunk a, (its slice, the slice of the key chunks b <= a,
    whether a mask is needed). b > a is fully masked and skipped; b < a is fully visible; only b == a
    (the diagonal) needs the mask. A block has at most two chunks, adjacent locally, so the visible
    ones form one slice."""
    for a, qs in q_chunks:
        seen = [(b, ks) for b, ks in k_chunks if b <= a]
        if seen:
            yield qs, slice(seen[0][1].start, seen[-1][1].stop), any(b == a for b, _ in seen)


def _scores(q, k, q_pos, k_pos, scale, masked: bool) -> torch.Tensor:
    """S = scale · Q Kᵀ (fp32), -inf where k_pos > q_pos when ``masked``."""
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if masked:
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], -math.inf)
    return s


def _attend(q, k, v, q_pos, k_pos, scale, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, l) of one block in fp32: l = logsumexp(S), o = exp(S - l) V."""
    s = _scores(q, k, q_pos, k_pos, scale, masked)
    lse = torch.logsumexp(s, dim=-1)
    # A row that sees no key has l = -inf; subtracting 0 instead keeps its P at exp(-inf) = 0, not NaN.
    p = torch.exp(s - lse.masked_fill(lse == -math.inf, 0.0)[..., None])
    return torch.matmul(p, v), lse


def _attend_backward(q, k, v, do, lse, delta, q_pos, k_pos, scale, masked: bool):
    """(dQ, dK, dV) of one block from the rows' full lse and Δ (module docstring)."""
    s = _scores(q, k, q_pos, k_pos, scale, masked)
    p = torch.exp(s - lse[..., None])  # every row of the ring sees at least itself, so lse is finite
    dv = torch.matmul(p.transpose(-2, -1), do)
    ds = p * (torch.matmul(do, v.transpose(-2, -1)) - delta[..., None])
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv


def _merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """In place: (out, lse) <- the attention over both key sets, l = log(e^l + e^l_b),
    o = e^(l_old - l) o + e^(l_b - l) o_b. Rows that have seen nothing on either side stay (0, -inf)."""
    new = torch.logaddexp(lse, lse_b)
    ref = new.masked_fill(new == -math.inf, 0.0)  # avoids -inf - (-inf) = NaN
    out.mul_(torch.exp(lse - ref)[..., None]).add_(out_b * torch.exp(lse_b - ref)[..., None])
    lse.copy_(new)
