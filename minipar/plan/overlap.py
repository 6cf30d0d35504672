"""Exposed communication of tensor-parallel matmuls with and without collective matmul (async TP).

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
