"""A step's timeline out of the process: the bubble measured on the rows equals the simulator's exact
one, the trace tells F, B, W and chunks apart, and the PNG's title states measured and theory."""

import builtins
import json
import sys

import pytest

from minipar.pipeline import interleaved_1f1b, simulate, zb_v
from minipar.pipeline.timeline import (RankTimeline, chrome_trace, draw_timeline, measured_bubble, parse_action,
                                       timeline_title, write_trace)

SCHEDULES = {"zb_v(2, 4)": zb_v(2, 4), "interleaved_1f1b(2, 4, 2)": interleaved_1f1b(2, 4, 2)}


def simulated_rows(schedule) -> tuple[list[RankTimeline], dict]:
    """simulate's per-rank timelines (Fractions) as the float rows a real job gathers; rank r is stage r."""
    result = simulate(schedule)
    rows = [RankTimeline(rank, rank, [(name, float(s), float(e)) for name, s, e in events])
            for rank, events in enumerate(result["timeline"])]
    return rows, result


@pytest.mark.parametrize("name", SCHEDULES)
def test_measured_bubble_equals_the_simulators_exact_bubble(name):
    rows, result = simulated_rows(SCHEDULES[name])
    assert result["bubble"] > 0
    assert measured_bubble(rows) == pytest.approx(float(result["bubble"]), abs=1e-9)


def test_measured_bubble_counts_only_compute_over_one_row_per_stage():
    """Communication is idle time; a stage's second rank (a tp or dp peer) is not a second row.
    Stage 0 computes 1 s and stage 1 2 s in a 4 s window: 1 - 3 / (2 x 4)."""
    rows = [RankTimeline(0, 0, [("F0", 0.0, 1.0), ("SEND_ACT0", 1.0, 4.0)]),
            RankTimeline(1, 1, [("RECV_ACT0", 0.0, 1.0), ("F0", 1.0, 2.0), ("B0", 2.0, 3.0)]),
            RankTimeline(1, 3, [("F0", 0.0, 4.0)])]  # the peer: busy the whole window, not drawn
    assert measured_bubble(rows) == pytest.approx(1 - 3 / 8)


def test_action_names_parse_as_str_of_action_writes_them():
    assert parse_action("B3c1") == ("B", 3, 1) and parse_action("W12") == ("W", 12, 0)
    assert parse_action("RECV_GRAD0c1") == ("RECV_GRAD", 0, 1) and parse_action("optimizer") is None


@pytest.mark.parametrize("name", SCHEDULES)
def test_chrome_trace_names_kind_microbatch_and_chunk_of_every_action(name, tmp_path):
    rows, _ = simulated_rows(SCHEDULES[name])
    trace = json.loads(open(write_trace(rows, str(tmp_path / "t.json"))).read())["traceEvents"]
    boxes = [e for e in trace if e["ph"] == "X"]
    assert len(boxes) == sum(len(r.events) for r in rows)
    for e in boxes:
        kind, microbatch, chunk = parse_action(e["name"])
        assert e["args"] == {"microbatch": microbatch, "chunk": chunk, "kind": kind}
        assert e["cat"] == {"F": "forward", "B": "backward", "W": "weight"}[kind]
    weights = [e for e in boxes if e["name"].startswith("W")]
    assert (len(weights) > 0) == (name.startswith("zb"))  # every W is a "weight" event, above
    assert any(e["args"]["chunk"] == 1 for e in boxes) and all(e["args"]["chunk"] == 1 for e in boxes
                                                                if e["name"].endswith("c1"))
    # One predefined colour per kind, three distinct ones.
    colours = {kind: {e["cname"] for e in boxes if e["args"]["kind"] == kind} for kind in "FBW"}
    present = [c for c in colours.values() if c]
    assert all(len(c) == 1 for c in present) and len(set().union(*present)) == len(present)


def test_chrome_trace_puts_sends_and_receives_in_comm():
    trace = chrome_trace([RankTimeline(0, 0, [("F0c1", 0.0, 1.0), ("SEND_ACT0c1", 1.0, 1.5),
                                              ("RECV_GRAD0", 1.5, 2.0), ("W0", 2.0, 3.0)])])
    cats = {e["name"]: e["cat"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert cats == {"F0c1": "forward", "SEND_ACT0c1": "comm", "RECV_GRAD0": "comm", "W0": "weight"}


def test_title_states_the_layout_the_measured_and_the_theoretical_bubble():
    rows, result = simulated_rows(zb_v(2, 4))
    title = timeline_title(rows, "pp=2 dp=1, zb_v, m=4", result["bubble"])  # a Fraction, 1/25
    assert title.startswith("pp=2 dp=1, zb_v, m=4")
    assert "measured bubble 4.0% (theory 4.0%)" in title
    assert timeline_title(rows) == "measured bubble 4.0%"  # no theory given: none claimed


def test_draw_timeline_writes_a_png_titled_with_the_bubble(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    rows, result = simulated_rows(interleaved_1f1b(2, 4, 2))
    titles = []
    savefig = plt.Figure.savefig
    monkeypatch.setattr(plt.Figure, "savefig",
                        lambda fig, *a, **k: (titles.append(fig.axes[0].get_title()), savefig(fig, *a, **k))[1])
    path = str(tmp_path / "t.png")
    assert draw_timeline(rows, path, title="pp=2, interleaved_1f1b, m=4", theory_bubble=result["bubble"]) == path
    assert open(path, "rb").read()[:8] == b"\x89PNG\r\n\x1a\n"
    assert titles == [timeline_title(rows, "pp=2, interleaved_1f1b, m=4", result["bubble"])]
    assert "(theory 11.1%)" in titles[0]  # (p-1) / (v m + p-1) = 1/9
    assert draw_timeline(rows, str(tmp_path / "old.png")) == str(tmp_path / "old.png")  # the old call


@pytest.mark.parametrize("how", ["sys.modules", "__import__"])
def test_without_matplotlib_draw_timeline_says_why(tmp_path, monkeypatch, how):
    if how == "sys.modules":
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    else:
        real_import = builtins.__import__

        def no_matplotlib(name, *args, **kwargs):
            if name.split(".")[0] == "matplotlib":
                raise ImportError(f"No module named {name!r}")
            return real_import(name, *args, **kwargs)
        monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    rows, _ = simulated_rows(zb_v(2, 4))
    png = tmp_path / "t.png"
    said = draw_timeline(rows, str(png), title="pp=2, zb_v, m=4", theory_bubble=0.04)
    assert said.startswith("no PNG: matplotlib is not installed") and not png.exists()
