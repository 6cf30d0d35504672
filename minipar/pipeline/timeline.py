"""A pipeline step's timeline, out of the process: a Chrome/Perfetto trace, a PNG and its bubble.

``ShardedModule(..., record_timeline=True)`` keeps, on every rank, the
(action, start, end) of each action of the last pipeline step
(``sharded.timeline``; seconds of ``time.perf_counter``, or CUDA-event times
on a GPU). Gather the ranks' timelines (``Comm.all_gather_object``) into
`RankTimeline` rows, then:

* `chrome_trace` / `write_trace`: the Trace Event Format that chrome://tracing
  and ui.perfetto.dev open. One process, one thread per rank (numeric ids, as
  the format wants), named "stage s (rank r)" and sorted by stage, so each row
  is one stage and the gaps in a row are that stage's bubble.
* `draw_timeline`: one bar row per stage as a PNG with matplotlib, an optional
  dependency (``pip install "minipar[plot]"``); without it nothing is drawn and
  the returned line says why. Its title (`timeline_title`) gives the
  `measured_bubble` of the rows drawn beside the theory, when given one.

Colours, the same in both: F blue, B orange, W green (the trace's predefined
cnames "rail_response", "rail_idle", "rail_load"); in the PNG each model chunk
of a rank is its own shade of its kind's hue, so a chunk-1 forward is still
recognisably a forward.

Clocks: ranks on one machine share ``perf_counter``'s clock; on several
machines the rows are each rank's own clock (shift them to a common start
before drawing if that matters).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fractions import Fraction

COMPUTE = ("F", "B", "W")
CATEGORY = {"F": "forward", "B": "backward", "W": "weight"}
# Trace Event Format cnames are a fixed palette of the viewer; these three are blue, orange and
# green, the hues of the PNG. Communication is grey ("generic_work").
CNAME = {"F": "rail_response", "B": "rail_idle", "W": "rail_load"}
COMM_CNAME = "generic_work"
# Shades of each kind's hue, one per chunk, dark then light so neighbouring chunks differ most.
SHADES = {"F": ("#2166ac", "#92c5de", "#053061", "#d1e5f0"),
          "B": ("#e66101", "#fdb863", "#7f2704", "#fee0b6"),
          "W": ("#1b7837", "#a6dba0", "#00441b", "#d9f0d3")}
_ACTION = re.compile(r"([A-Z_]+)(\d+)(?:c(\d+))?")


@dataclass(frozen=True)
class RankTimeline:
    stage: int
    rank: int
    events: list  # (action name, start s, end s), as ShardedModule.timeline holds them


def parse_action(name) -> tuple[str, int, int] | None:
    """(kind, micro-batch, chunk) of an action name as ``str(Action)`` writes it: "B3c1" ->
    ("B", 3, 1), "SEND_ACT0" -> ("SEND_ACT", 0, 0); None for any other name."""
    match = _ACTION.fullmatch(str(name))
    if match is None:
        return None
    kind, microbatch, chunk = match.groups()
    return kind, int(microbatch), int(chunk or 0)


def stage_rows(rows: list[RankTimeline]) -> list[RankTimeline]:
    """One row per stage, the stage's lowest rank (its tp and dp peers run the same schedule),
    sorted by stage: the rows `draw_timeline` draws and `measured_bubble` measures."""
    first: dict[int, RankTimeline] = {}
    for r in sorted(rows, key=lambda r: r.rank):
        first.setdefault(r.stage, r)
    return [first[s] for s in sorted(first)]


def measured_bubble(rows: list[RankTimeline]) -> float:
    """The idle share of the step over the stage rows (`stage_rows`)::

        bubble = 1 - sum of F/B/W durations / (stage rows x (latest end - earliest start))

    The window is the whole step as recorded, first to last action of any stage row,
    communication included; sends and receives count as idle (a receive is a wait). On
    `simulate`'s timelines (compute only, unit costs) this is its "bubble" exactly."""
    drawn = stage_rows(rows)
    events = [ev for r in drawn for ev in r.events]
    if not events:
        raise ValueError("measured_bubble needs at least one recorded action; the rows are empty")
    window = max(e for _, _, e in events) - min(s for _, s, _ in events)
    compute = sum(e - s for name, s, e in events if is_compute(name))
    if window <= 0:
        raise ValueError(f"measured_bubble: the actions span {window} s; nothing to measure a bubble in")
    return float(1 - Fraction(compute) / (len(drawn) * Fraction(window)))


def timeline_title(rows: list[RankTimeline], title: str | None = None,
                   theory_bubble: float | Fraction | None = None) -> str:
    """The PNG's title: ``title`` (the layout and schedule, e.g. "pp=4 dp=2, zb_v, m=8"), then
    "measured bubble X% (theory Y%)", the theory only when given."""
    line = f"measured bubble {measured_bubble(rows):.1%}"
    if theory_bubble is not None:
        line += f" (theory {float(theory_bubble):.1%})"
    return f"{title}\n{line}" if title else line


def chrome_trace(rows: list[RankTimeline]) -> dict:
    """The rows as a Trace Event Format dict (times in microseconds from the earliest start).
    Compute events have category forward/backward/weight, a cname of their kind's hue and args
    {"microbatch", "chunk", "kind"}; sends and receives are category "comm" with the same args."""
    starts = [s for r in rows for _, s, _ in r.events]
    t0 = min(starts) if starts else 0.0
    events = []
    for r in sorted(rows, key=lambda r: (r.stage, r.rank)):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r.rank,
                       "args": {"name": f"stage {r.stage} (rank {r.rank})"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r.rank,
                       "args": {"sort_index": r.stage * 1_000_000 + r.rank}})
        for name, s, e in r.events:
            event = {"name": str(name), "cat": "other", "ph": "X", "pid": 0, "tid": r.rank,
                     "ts": float(s - t0) * 1e6, "dur": float(e - s) * 1e6}
            action = parse_action(name)
            if action is not None:
                kind, microbatch, chunk = action
                computes = kind in COMPUTE
                event.update(cat=CATEGORY[kind] if computes else "comm",
                             cname=CNAME[kind] if computes else COMM_CNAME,
                             args={"microbatch": microbatch, "chunk": chunk, "kind": kind})
            events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(rows: list[RankTimeline], path: str) -> str:
    with open(path, "w") as f:
        json.dump(chrome_trace(rows), f)
    return path


def draw_timeline(rows: list[RankTimeline], path: str, title: str | None = None,
                  theory_bubble: float | Fraction | None = None) -> str:
    """The F/B/W boxes of each stage row (`stage_rows`) as a PNG at ``path``, coloured by kind and
    shaded by chunk, with a legend of those present and `timeline_title` above. Returns the path
    written, or a line saying why nothing was."""
    try:
        import matplotlib
    except ImportError:
        return 'no PNG: matplotlib is not installed (pip install "minipar[plot]"; the PNG is its only use)'
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = stage_rows(rows)
    t0 = min(s for r in drawn for _, s, _ in r.events)
    boxes: dict[tuple[str, int], list[tuple[int, float, float, int]]] = {}  # (kind, chunk) -> (stage, left, width, mb)
    for r in drawn:
        for name, s, e in r.events:
            action = parse_action(name)
            if action is not None and action[0] in COMPUTE:
                kind, microbatch, chunk = action
                boxes.setdefault((kind, chunk), []).append((r.stage, float(s - t0), float(e - s), microbatch))
    chunks = 1 + max((c for _, c in boxes), default=0)
    split = any(kind == "W" for kind, _ in boxes)
    most_per_row = max(sum(1 for name, _, _ in r.events if is_compute(name)) for r in drawn)

    # Wider for more boxes, so 16+ micro-batches keep boxes a few points wide.
    fig, ax = plt.subplots(figsize=(min(24.0, max(10.0, 4 + 0.14 * most_per_row)), 1.5 + 0.6 * len(drawn)))
    span = float(max(e for r in drawn for _, _, e in r.events) - t0)  # the window measured_bubble divides by
    points_per_second = ax.get_window_extent().width / fig.dpi * 72 / span
    for kind, chunk in sorted(boxes, key=lambda k: (COMPUTE.index(k[0]), k[1])):
        group = boxes[(kind, chunk)]
        colour = SHADES[kind][chunk % len(SHADES[kind])]
        # White edges keep back-to-back boxes of one colour apart.
        ax.barh([st for st, _, _, _ in group], [w for _, _, w, _ in group], left=[lf for _, lf, _, _ in group],
                height=0.8, color=colour, edgecolor="white", linewidth=0.4,
                label=_legend_label(kind, chunk, chunks, split))
        for stage, left, width, microbatch in group:
            label = str(microbatch)  # the kind and chunk are the colour
            if width * points_per_second >= 6 * 0.65 * len(label) + 2:  # only where the digits fit
                ax.text(left + width / 2, stage, label, fontsize=6, ha="center", va="center",
                        color=_text_colour(colour))
    ax.set_xlim(0, span)
    ax.set_xlabel("seconds into the step")
    ax.set_yticks([r.stage for r in drawn], [f"stage {r.stage}\n(rank {r.rank})" for r in drawn])
    ax.invert_yaxis()
    ax.set_title(timeline_title(rows, title, theory_bubble), fontsize=10)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def is_compute(name) -> bool:
    """Whether a timeline entry is a compute action (F, B or W), not a message or a wait."""
    action = parse_action(name)
    return action is not None and action[0] in COMPUTE


def _legend_label(kind: str, chunk: int, chunks: int, split: bool) -> str:
    what = {"F": "forward", "B": "backward, input grad" if split else "backward", "W": "weight grad"}[kind]
    return f"{kind} {what}" + (f", chunk {chunk}" if chunks > 1 else "")


def _text_colour(hex_colour: str) -> str:
    """Black on light shades, white on dark ones (relative luminance of the sRGB bytes)."""
    red, green, blue = (int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    return "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 150 else "white"
