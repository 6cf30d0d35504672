"""The README's main job runs, passes its own reference check and writes its trace."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch

from minipar.plan.model_traffic import ring_bytes

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _main_job(tmp_path, *flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(ROOT / "benchmarks" / "gpt_tp_pp.py"), *flags, "--out", str(tmp_path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_gpt_tp_pp_main_job(tmp_path):
    """The README's command, unchanged (the timeout only turns a hang into a failure: a loaded CI
    machine may take minutes): its reference check passed, every
    rank's memory and the bubble (a median over the steady steps, beside the theory) reported, the
    trace written; the PNG too when matplotlib is importable, else the job says why it has none."""
    out = _main_job(tmp_path, timeout=420)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "| reference check (first 3 steps, this run) | largest loss difference" in out.stdout
    assert ": ok |" in out.stdout and "MISMATCH" not in out.stdout
    result = json.loads((tmp_path / "gpt_tp_pp.json").read_text())
    assert result["reference_max_diff"] <= 1e-4 and result["dtype"] == "fp32"  # the CPU default
    assert sorted(result["memory"]) == ["0", "1", "2", "3"]
    assert all(mem["params"] > 0 and mem["optimizer"] > 0 for mem in result["memory"].values())
    assert len(result["bubble_per_step"]) == 30 - 3  # every steady step, warm-up excluded
    assert result["bubble_theory"] == 1 / 5  # (p - 1) / (m + p - 1) with p = 2, m = 4
    assert 0 < result["bubble"] < 1 and "beside (p-1)/(m+p-1) = 0.200" in out.stdout
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert len({e["tid"] for e in trace}) == 4 and {e["name"][0] for e in trace} >= {"F", "B"}
    png = tmp_path / "timeline.png"
    try:
        import matplotlib  # noqa: F401  (the job runs in this interpreter's environment)
    except ImportError:
        assert "no PNG: matplotlib is not installed" in out.stdout and not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_job_without_a_pipeline_with_ring_context_parallelism(tmp_path, monkeypatch, capsys):
    """--pp 1 --cp 2 (ring) as dp=2 x cp=2. Without a pipeline there is no schedule, so no bubble and
    no timeline, and the job says so. Each pair of cp ranks is given the same sequences and splits
    them zig-zag; the losses still equal the one-process replay of the two replicas' batches, and the
    K/V blocks each rank sends per step are ring_bytes' count for every layer. A sequence the zig-zag
    chunks do not divide is refused by the job's argument check, before any process group starts,
    with the fix in the message.

    (One job for both: the job's pp=1 path is the same whatever splits the other ranks. Its run as
    dp=2 x tp=2 added only the tensor-parallel layout, which test_tensor_parallel's dp=2 x tp=2 tests
    prove equal to one process for every strategy, and which the README job above runs with tp=2.)"""
    out = _main_job(tmp_path, "--tp", "1", "--pp", "1", "--cp", "2", "--steps", "3")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "dp=2 tp=1 pp=1 cp=2 (ring)" in out.stdout and ": ok |" in out.stdout
    assert "| busy fractions, bubble | n/a: pp=1, no pipeline |" in out.stdout
    assert "timeline: none written (pp=1" in out.stdout and not (tmp_path / "trace.json").exists()
    result = json.loads((tmp_path / "gpt_tp_pp.json").read_text())
    assert result["reference_max_diff"] <= 1e-4
    a = result["args"]
    ring = ring_bytes(a["batch"], a["n_head"], a["seq"], a["n_embd"] // a["n_head"], 2, torch.float32)
    assert result["comm"]["send/cp"]["bytes"] == a["n_layer"] * (ring["forward"] + ring["backward"])
    # The job's own argument check, in this process (a new interpreter would only add torch's import).
    spec = importlib.util.spec_from_file_location("gpt_tp_pp_job", ROOT / "benchmarks" / "gpt_tp_pp.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    monkeypatch.setattr(sys, "argv", ["gpt_tp_pp.py", "--cp", "2", "--seq", "66"])
    with pytest.raises(SystemExit) as refused:
        job.parse_args()
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "--seq 66 must be a multiple of 4" in err, err


def test_main_job_in_bf16_and_its_bubble_check(tmp_path):
    """--dtype bf16: the strict reference check runs on an fp32 run of the layout, the bf16 run is
    compared with the same reference at bf16's tolerance. --check-bubble 0 allows no difference from
    the theory at all, so the job reports the bubble check failed and exits 1, its results written."""
    out = _main_job(tmp_path, "--tp", "1", "--dtype", "bf16", "--steps", "4", "--batch", "4",
                    "--microbatches", "2", "--check-bubble", "0")
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "FAILED: the bubble is" in out.stdout and "beyond --check-bubble 0%" in out.stdout
    assert "| reference check (first 3 steps, an fp32 run of this layout) |" in out.stdout
    result = json.loads((tmp_path / "gpt_tp_pp.json").read_text())
    assert result["dtype"] == "bf16" and result["reference_max_diff"] <= 1e-4
    assert 0 < result["bf16_max_rel_diff"] <= 1.6e-2  # bf16 rounding shows, within bf16's tolerance


def test_main_job_trains_the_moe_gpt_with_experts_across_data_parallel_ranks(tmp_path):
    """--moe --strategy zero2: dp=2 x pp=2 with the experts split over the two data-parallel ranks
    (ep=2) and ZeRO-2 sharding dense and expert state; the reference check replays the steps in one
    process routing each rank's micro-batches as groups."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(ROOT / "benchmarks" / "gpt_tp_pp.py"), "--moe", "--strategy", "zero2", "--tp", "1", "--steps", "4",
           "--seq", "32", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "MoE GPT (4 experts, top-2, ep=2)" in out.stdout and ": ok |" in out.stdout
    result = json.loads((tmp_path / "gpt_tp_pp.json").read_text())
    assert result["reference_max_diff"] <= 1e-4 and result["strategy"] == "zero2"
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
