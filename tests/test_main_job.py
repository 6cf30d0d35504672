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


def test_main_job_trains_the_moe_gpt_with_experts_across_data_parallel_ranks(tmp_path):
    """--moe: dp=2 x pp=2 with the experts split over the two data-parallel ranks (ep=2); the
    reference check replays the steps in one process routing each rank's micro-batches as groups."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(ROOT / "benchmarks" / "gpt_tp_pp.py"), "--moe", "--tp", "1", "--steps", "4", "--seq", "32",
           "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "MoE GPT (4 experts, top-2, ep=2)" in out.stdout and ": ok |" in out.stdout
    result = json.loads((tmp_path / "gpt_tp_pp.json").read_text())
    assert result["reference_max_diff"] <= 1e-4
    assert result["comm"]["all_to_all/ep"]["calls"] > 0  # tokens really travelled between ranks


def test_moe_ep_benchmark_bytes_match_the_routing(tmp_path):
    """benchmarks/moe_ep.py: the all-to-all bytes counted equal what the routing implies, and the
    expert-parallel outputs equal the one-process layer's (it exits 1 otherwise)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "benchmarks" / "moe_ep.py"), "--tokens", "64", "--d-model", "16", "--d-hidden", "32",
           "--capacity-factor", "0.75", "--steps", "2", "--warmup", "1", "--json", str(tmp_path / "moe.json")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "moe.json").read_text())
    assert all(r["sent"] == r["implied"] > 0 for r in result["bytes"])
    assert sum(r["dropped"] for r in result["bytes"]) > 0  # capacity factor 0.75 drops assignments


def test_activation_checkpointing_benchmark_reports_less_memory():
    """benchmarks/activation_checkpointing.py on a small GPT: its table reports a lower peak of
    activation memory with recomputation (ratio < 1) for a ZeRO-3 run on two ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "benchmarks" / "activation_checkpointing.py"), "--strategy", "zero3", "--n-layer", "4",
           "--n-embd", "32", "--n-head", "2", "--vocab", "64", "--seq", "32", "--batch", "2", "--steps", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ratio = float(out.stdout.split("peak activation memory on / off:")[1].split(";")[0])
    assert 0 < ratio < 0.7, out.stdout
