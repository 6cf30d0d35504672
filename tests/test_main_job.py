"""The README's main job runs, passes its own reference check and writes its trace."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_gpt_tp_pp_main_job(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(ROOT / "benchmarks" / "gpt_tp_pp.py"), "--steps", "5", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "reference check (first 3 steps)" in out.stdout and ": ok |" in out.stdout
    result = json.loads((tmp_path / "gpt_tp_pp.json").read_text())
    assert result["reference_max_diff"] <= 1e-4
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    stages = {e["tid"] for e in trace}
    assert len(stages) == 4 and {e["name"][0] for e in trace} >= {"F", "B"}
