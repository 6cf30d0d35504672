"""Why a training step takes the time it takes: a ``torch.profiler`` trace of a few steps, summarised.

    summary = profile_steps(step, batches, "results/profile_minipar.json.gz")

``step(x)`` runs one training step on batch ``x``, each of ``batches`` one profiled step (warm up first).
The trace is written for Perfetto (gzipped for ``.gz``) and summarised: ``gpu_busy`` (the share of the
steps' window some kernel ran: the union of the kernels' intervals), ``kernels_per_step``,
``host_ms_per_step`` (the steps' annotated ranges), ``top_kernels`` (name, ms and launches per step).
On a CPU, without kernel events, ``gpu_busy`` is None and the ATen operators stand in (``ops_per_step``).
"""

from __future__ import annotations

import gzip
import json
import os
from collections import defaultdict
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

STEP = "minipar_profiled_step"


def profile_steps(step: Callable[[torch.Tensor], object], batches: list, trace_path: str, top: int = 12) -> dict:
    """Profile ``step`` on each batch; write the trace to ``trace_path``; return the summary."""
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for x in batches:
            with record_function(STEP):
                step(x)
        if cuda:
            torch.cuda.synchronize()
    os.makedirs(os.path.dirname(os.path.abspath(trace_path)), exist_ok=True)
    prof.export_chrome_trace(trace_path)
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        trace = json.load(f)
    summary = summarise(trace["traceEvents"] if isinstance(trace, dict) else trace, len(batches), top)
    summary["trace"] = os.path.basename(trace_path)
    return summary


def summarise(events: list[dict], n_steps: int, top: int = 12) -> dict:
    """The summary of the module docstring, from a chrome trace's events."""
    steps = [e for e in events if e.get("name") == STEP and e.get("ph") == "X" and e.get("cat") != "gpu_user_annotation"]
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    host_ms = sum(e["dur"] for e in steps) / 1e3 / max(1, n_steps)
    if kernels:
        start = min(e["ts"] for e in steps) if steps else min(e["ts"] for e in kernels)
        end = max(max(e["ts"] + e["dur"] for e in kernels), max((e["ts"] + e["dur"] for e in steps), default=0))
        busy = _union(sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)) / max(1e-9, end - start)
        rows = kernels
    else:
        busy, rows = None, [e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"]
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in rows:
        per_name[e["name"]][0] += e["dur"]
        per_name[e["name"]][1] += 1
    ranked, n = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top], max(1, n_steps)
    return {"steps": n_steps, "gpu_busy": busy, "host_ms_per_step": host_ms,
            "kernels_per_step": len(kernels) / n if kernels else None, "ops_per_step": None if kernels else len(rows) / n,
            "top_kernels": [{"name": name[:120], "ms_per_step": total / 1e3 / n, "launches_per_step": count / n}
                            for name, (total, count) in ranked]}


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by sorted intervals (overlaps counted once: kernels on several streams)."""
    covered, cur_start, cur_end = 0.0, None, None
    for s, e in intervals:
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                covered += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    return covered + (cur_end - cur_start if cur_end is not None else 0.0)


def table(profiles: dict[str, dict]) -> str:
    """Markdown: one line per mode, then each mode's top kernels."""
    lines = ["| mode | GPU busy | kernels/step | host ms/step |", "|---|---|---|---|"]
    for mode, p in profiles.items():
        if "error" in p:
            lines.append(f"| {mode} | failed: {p['error']} | | |")
            continue
        busy = f"{p['gpu_busy']:.1%}" if p["gpu_busy"] is not None else "n/a (CPU)"
        launches = f"{p['kernels_per_step']:.0f}" if p["kernels_per_step"] is not None else f"{p['ops_per_step']:.0f} ops"
        lines.append(f"| {mode} | {busy} | {launches} | {p['host_ms_per_step']:.1f} |")
    for mode, p in ((m, p) for m, p in profiles.items() if "error" not in p):
        lines += ["", f"{mode}: top kernels (ms per step, launches per step)"]
        lines += [f"  {k['ms_per_step']:8.3f} ms {k['launches_per_step']:6.1f}x  {k['name']}" for k in p["top_kernels"]]
    return "\n".join(lines)
