"""Exposed communication with and without overlap: tensor-parallel matmuls under collective matmul
(async TP), and the expert-parallel all-to-all inside DualPipeV's overlapped pairs.

A sequence-parallel linear layer at tensor-parallel size n moves (n-1)/n of a (tokens, features)
tensor per rank under the ring algorithm: n-1 hops of one (tokens/n, features) chunk each, c seconds
apiece. The synchronous layer waits for all of them and then multiplies; collective matmul
(`minipar.tensor_parallel.collective_matmul`) multiplies one chunk, m seconds, while each hop is in
flight, so every hop shows only what its matmul does not cover:

    exposed(sync)    = (n - 1) · c
    exposed(overlap) = (n - 1) · max(0, c - m)

All n-1 hops have a matmul to hide behind: the all-gather ring starts with the rank's own chunk (hop
h flies during the matmul of step h), the reduce-scatter ring ends with it (hop h, the running sum of
step h, flies during the matmul of step h+1). The model leaves out what a real machine adds: a
hop's latency, and the compute slowdown when both share memory bandwidth (the CPU benchmark,
benchmarks/tp_vs_torch.py, measures the sum of those).

With c = bytes of one chunk / bandwidth and m = 2 · (tokens/n) · in · out / n FLOPs / FLOP rate,
the column-parallel layer's hop is a chunk of its *input* (in features) and the row-parallel
layer's a chunk of its *output* (out features): `tp_matmul_exposed`. The planner
(`minipar.plan`) ranks layouts with tp traffic exposed in full (minipar does not overlap q/k/v's
shared gather) and reports beside it, as ``exposed_tp_async_s`` and in ``--explain``, this bound
with the linear layers' compute as the chunks' matmuls.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

from ..pipeline.dualpipe import dualpipe_v
from ..pipeline.simulator import simulate


def exposed_comm_s(chunks: int, comm_chunk_s: float, compute_chunk_s: float, overlap: bool = True) -> float:
    """Seconds of communication not hidden behind compute, for a ring of ``chunks`` ranks whose hops
    each take ``comm_chunk_s`` and whose chunk matmuls each take ``compute_chunk_s``."""
    hops = max(chunks - 1, 0)
    return hops * (max(0.0, comm_chunk_s - compute_chunk_s) if overlap else comm_chunk_s)


def tp_matmul_exposed(tokens: int, in_features: int, out_features: int, tp: int, bytes_per_element: int,
                      flops_per_s: float, bytes_per_s: float, overlap: bool = True, layer: str = "column") -> float:
    """Exposed seconds of one sequence-parallel linear layer (full ``in_features`` x ``out_features``,
    split over ``tp``) on ``tokens`` tokens: the column-parallel layer's input all-gather, or with
    ``layer="row"`` the row-parallel layer's output reduce-scatter, overlapped or not."""
    if layer not in ("column", "row"):
        raise ValueError(f"layer={layer!r}: use 'column' (all-gather-matmul) or 'row' (matmul-reduce-scatter)")
    hop_features = in_features if layer == "column" else out_features
    comm_chunk_s = tokens / tp * hop_features * bytes_per_element / bytes_per_s
    compute_chunk_s = 2 * tokens / tp * in_features * out_features / tp / flops_per_s
    return exposed_comm_s(tp, comm_chunk_s, compute_chunk_s, overlap)


@lru_cache(maxsize=256)
def _dualpipe_v_shape(stages: int, microbatches: int) -> tuple[Fraction, int]:
    """(bubble fraction with F = B = W, the fewest overlapped pairs on any rank) of `dualpipe_v`."""
    schedule = dualpipe_v(stages, microbatches)
    pairs = min(len(rank_pairs) for rank_pairs in schedule.pairs)
    if microbatches >= 2 * stages:  # the steady state exists: ZB-V's ramp (tests/test_dualpipe.py)
        return Fraction(stages - 1, 6 * microbatches + stages - 1), pairs
    return Fraction(simulate(schedule, {"F": 1, "B": 1, "W": 1})["bubble"]), pairs


def dualpipe_v_times(stages: int, microbatches: int, compute_s: float, ep_s: float) -> dict:
    """DualPipeV on the planner's clock: its bubble, and the expert-parallel all-to-all its pairs hide.

    A rank's step is 2m chunk passes of F, B and W, each u = compute_s / (6m) (compute_s: the step's
    compute on one rank). The bubble is the simulator's with F = B = W: with m >= 2p ZB-V's ramp,
    (p-1) / (6m + p-1) of the step, so (p-1)·u seconds. The all-to-all (ep_s per step) splits evenly
    over the 4m halves that make it (F and B of each chunk pass: dispatch and combine, or their
    adjoints), a = ep_s / (4m) each. In an overlapped pair each half's exchanges fly during the other
    half's compute (`minipar.core.interleave`); a half outside a pair waits for its own:

        exposed = (4m - 2·pairs)·a + 2·pairs·max(0, a - u)

    with pairs the fewest of any rank (the slowest rank sets the step). Left out, as in the rest of
    the planner: an exchange's latency and the slowdown of compute sharing the memory bus with it."""
    m = microbatches
    bubble, pairs = _dualpipe_v_shape(stages, m)
    u, a = compute_s / (6 * m), ep_s / (4 * m)
    exposed = (4 * m - 2 * pairs) * a + 2 * pairs * max(0.0, a - u)
    return {"bubble": float(bubble), "bubble_s": float(bubble / (1 - bubble)) * compute_s,
            "pairs": pairs, "exposed_ep_s": exposed}
