"""A pipeline step's timeline, out of the process: a Chrome/Perfetto trace and a PNG.

``ShardedModule(..., record_timeline=True)`` keeps, on every rank, the
(action, start, end) of each action of the last pipeline step
(``sharded.timeline``; seconds of ``time.perf_counter``, or CUDA-event times
on a GPU). Gather the ranks' timelines (``Comm.all_gather_object``) into
`RankTimeline` rows, then:

* `chrome_trace` / `write_trace`: the Trace Event Format that chrome://tracing
  and ui.perfetto.dev open. One process, one thread per rank (numeric ids, as
  the format wants), named "stage s (rank r)" and sorted by stage, so each row
  is one stage and the gaps in a row are that stage's bubble.
* `draw_timeline`: the same as a PNG with matplotlib, an optional dependency
  (``pip install "minipar[plot]"``); without it nothing is drawn and the
  returned line says why.

Clocks: ranks on one machine share ``perf_counter``'s clock; on several
machines the rows are each rank's own clock (shift them to a common start
before drawing if that matters).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class RankTimeline:
    stage: int
    rank: int
    events: list  # (action name, start s, end s), as ShardedModule.timeline holds them


def chrome_trace(rows: list[RankTimeline]) -> dict:
    """The rows as a Trace Event Format dict (times in microseconds from the earliest start)."""
    starts = [s for r in rows for _, s, _ in r.events]
    t0 = min(starts) if starts else 0.0
    events = []
    for r in sorted(rows, key=lambda r: (r.stage, r.rank)):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r.rank,
                       "args": {"name": f"stage {r.stage} (rank {r.rank})"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r.rank,
                       "args": {"sort_index": r.stage * 1_000_000 + r.rank}})
        for name, s, e in r.events:
            kind = {"F": "forward", "B": "backward"}.get(str(name)[:1], "other")
            events.append({"name": str(name), "cat": kind, "ph": "X", "pid": 0, "tid": r.rank,
                           "ts": (s - t0) * 1e6, "dur": (e - s) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(rows: list[RankTimeline], path: str) -> str:
    with open(path, "w") as f:
        json.dump(chrome_trace(rows), f)
    return path


def draw_timeline(rows: list[RankTimeline], path: str) -> str:
    """Forwards (blue) and backwards (orange) per stage, one bar row per stage (the first rank of
    each stage); returns the path written, or a line saying why nothing was."""
    try:
        import matplotlib
    except ImportError:
        return 'no PNG: matplotlib is not installed (pip install "minipar[plot]"; the PNG is its only use)'
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    first = {}
    for r in sorted(rows, key=lambda r: r.rank):
        first.setdefault(r.stage, r)
    starts = [s for r in first.values() for _, s, _ in r.events]
    t0 = min(starts) if starts else 0.0
    fig, ax = plt.subplots(figsize=(10, 1 + len(first)))
    for stage, r in first.items():
        for name, s, e in r.events:
            kind = str(name)[:1]
            if kind in ("F", "B"):
                ax.barh(stage, e - s, left=s - t0, color="tab:blue" if kind == "F" else "tab:orange")
                ax.text(s - t0, stage, str(name), fontsize=6, va="center")
    ax.set_xlabel("seconds into the step")
    ax.set_ylabel("stage")
    ax.set_yticks(sorted(first))
    ax.invert_yaxis()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
