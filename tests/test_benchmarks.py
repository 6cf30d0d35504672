"""Smoke runs of the comparison benchmarks: each starts under torchrun with two ranks, trains a tiny
GPT for a few steps, exits 0 and prints its table, with the minipar/torch ratio and the bytes
minipar's collective layer counted, which must match the model's parameter bytes (the pipeline
benchmark, pp_vs_torch.py, prints no byte count: its check is the losses agreeing with PyTorch's;
the context-parallel one, cp_long_seq.py, counts attention's bytes against the ring and all-to-all
formulas).

No timing is asserted: speed targets live in the benchmarks (their ``--check``), never in tests.
(``zero_vs_torch.py --model linear20`` is the 80M-parameter model of PyTorch's tutorial, with no
option to shrink it, so the smoke run uses the GPT model at a tiny size instead.)
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from minipar.plan.model_traffic import ring_bytes
from minipar.models import GPT, GPTConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = dict(n_layer=1, n_embd=16, n_head=2, vocab=64, seq=16)
TINY_ARGS = [arg for k, v in TINY.items() for arg in (f"--{k.replace('_', '-')}", str(v))] + ["--batch", "2"]


def _tiny_gpt_param_bytes() -> int:
    """fp32 bytes of the benchmarks' GPT at the TINY size (the tied embedding counted once)."""
    cfg = GPTConfig(vocab_size=TINY["vocab"], block_size=TINY["seq"], n_layer=TINY["n_layer"],
                    n_head=TINY["n_head"], n_embd=TINY["n_embd"])
    return sum(p.numel() * p.element_size() for p in GPT(cfg).parameters() if p.requires_grad)


def _torchrun(script: str, *args: str, nproc: int = 2) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "benchmarks" / script), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, f"{script} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in the output:\n{text}"
    return float(m.group(1).replace(",", ""))


def test_ddp_vs_torch_runs_and_reports_ratio_and_bytes():
    """benchmarks/ddp_vs_torch.py: the ratio of median step times is printed, and the bytes
    all-reduced under the tag "grad" per step equal the parameter bytes (each gradient byte once)."""
    out = _torchrun("ddp_vs_torch.py", *TINY_ARGS, "--steps", "3", "--warmup", "1")
    assert _number(r"ratio minipar/torch \(of medians\): ([\d.]+)", out) > 0
    param_bytes = _tiny_gpt_param_bytes()
    assert _number(r"all_reduce tag 'grad': ([\d,]+) B in", out) == param_bytes
    assert _number(r"parameter bytes ([\d,]+) -> equal", out) == param_bytes


def test_zero_vs_torch_runs_and_reports_ratios_and_bytes():
    """benchmarks/zero_vs_torch.py: both minipar/torch ratios are printed; the communication table
    has every strategy in fp32 and the ZeRO stages in bf16; the parameter count matches the model,
    ZeRO-3's reduce-scatter moves (N-1)/N of the fp32 gradient bytes, and its measured bytes
    relative to DDP's equal the exact expectation the benchmark prints."""
    out = _torchrun("zero_vs_torch.py", "--model", "gpt", *TINY_ARGS, "--steps", "2", "--warmup", "1")
    for pair in ("mp_zero1/torch_zero1", "mp_zero3/torch_fsdp2"):
        assert _number(rf"ratio {pair}: ([\d.]+) of medians", out) > 0
    for precision, strategies in (("fp32", ("ddp", "zero1", "zero2", "zero3")), ("bf16", ("zero1", "zero2", "zero3"))):
        for strategy in strategies:
            assert _number(rf"{precision} {strategy}\s+wire total\s+([\d.]+) MiB", out) > 0
    param_bytes = _tiny_gpt_param_bytes()
    assert _number(r"Φ = ([\d,]+) parameters", out) * 4 == param_bytes
    reduce_scatter = _number(r"\(N-1\)/N\*Φ = [\d,]+ \+ ([\d,]+) = [\d,]+ B/step", out)
    assert reduce_scatter == param_bytes / 2  # N = 2
    measured = _number(r"zero3/ddp wire bytes: measured ([\d.]+)", out)
    assert measured == _number(r"Φ_root [\d,]+; ratio ([\d.]+)", out)


def test_kernel_benchmark_without_a_gpu_says_so_and_its_smoke_run_covers_every_kernel():
    """benchmarks/kernels.py times kernels on a GPU only: without one it says so and exits 0. Its
    --smoke run (tiny CPU sizes, the Triton interpreter) goes through every row of the table, so
    the GPU run is not the first time the script's code paths execute."""
    script = str(ROOT / "benchmarks" / "kernels.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "no CUDA device here" in out.stdout, out.stdout + out.stderr[-2000:]
    smoke = subprocess.run([sys.executable, script, "--smoke"], capture_output=True, text=True, timeout=600,
                           env={**env, "TRITON_INTERPRET": "1"})
    assert smoke.returncode == 0, smoke.stdout[-3000:] + smoke.stderr[-3000:]
    assert "Triton path: True" in smoke.stdout
    for kernel in ("layer_norm", "rms_norm", "gelu", "swiglu", "cross_entropy", "permute", "unpermute",
                   "scale_cast", "AdamW step"):
        assert f"| {kernel}" in smoke.stdout, (kernel, smoke.stdout)


def test_pp_vs_torch_runs_and_reports_ratios_and_agreeing_losses(tmp_path):
    """benchmarks/pp_vs_torch.py (pp=2, four layers: one block per piece under the two-chunk
    schedules; four micro-batches, as many as DualPipeV's pieces): for each of the six schedules the
    minipar/torch ratio is printed (and written to --json alike), the first steps' losses of every
    variant are printed, and minipar's agree with torch.distributed.pipelining's (ScheduleGPipe,
    Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
    ScheduleDualPipeV) within the benchmark's tolerance (it would exit 1 otherwise)."""
    args = {**TINY, "n_layer": 4}
    flags = [arg for k, v in args.items() for arg in (f"--{k.replace('_', '-')}", str(v))]
    result = tmp_path / "pp.json"
    out = _torchrun("pp_vs_torch.py", *flags, "--batch", "4", "--microbatches", "4", "--steps", "2",
                    "--warmup", "1", "--json", str(result))
    figures = json.loads(result.read_text())
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v"):
        ratio = _number(rf"\| {schedule} \| [\d.]+ ms \| [\d.]+ ms \| ([\d.]+) \|", out)
        assert ratio > 0
        assert round(figures["ratio_minipar_over_torch"][schedule], 2) == ratio
        for side in ("minipar", "torch"):
            assert re.search(rf"^  {side}\s+{schedule}\s+(\d+\.\d+\s*){{3}}$", out, re.M), (side, schedule, out)
    diff = _number(r"largest difference minipar vs torch: ([\d.e+-]+) \(ok, tolerance", out)
    assert diff <= 1e-4 and figures["first_losses_max_diff"] <= 1e-4  # printed to 3 digits, stored exactly


def test_dualpipe_moe_runs_and_reports_the_all_to_all_blocked_beside_the_planner(tmp_path):
    """benchmarks/dualpipe_moe.py (pp2 x dp2 x ep2, tiny): the overlapped and the synchronous DualPipeV
    train bitwise the same losses (it would exit 1 otherwise), and each run's blocked all-to-all time,
    its compute and the planner's prediction are printed and written to --json."""
    result = tmp_path / "dualpipe_moe.json"
    out = _torchrun("dualpipe_moe.py", "--n-layer", "4", "--n-embd", "16", "--n-head", "2", "--seq", "8",
                    "--vocab", "32", "--batch", "8", "--steps", "2", "--warmup", "1", "--json", str(result), nproc=4)
    figures = json.loads(result.read_text())
    assert figures["losses_equal"] and "bitwise equal" in out, out
    assert set(figures["blocked_all_to_all_s"]) == {"overlapped", "synchronous"}
    assert figures["planner"]["pairs"] == 3 and "planner: all-to-all exposed" in out, out


def test_compose_vs_torch_runs_and_reports_ratios_and_agreeing_losses(tmp_path):
    """benchmarks/compose_vs_torch.py on 4 ranks: zero3 x pp against fully_shard + pipelining, and
    HSDP against fully_shard on a 2-D mesh. Both ratios printed and written to --json; the first
    steps' losses agree with PyTorch's (the benchmark exits 1 otherwise); the HSDP side all-reduces
    over dp_replicate and reduce-scatters over dp_shard, and nothing of the zero3 x pp side crosses
    a dp_shard or dp_replicate group."""
    result = tmp_path / "compose.json"
    out = _torchrun("compose_vs_torch.py", "--smoke", "--json", str(result), nproc=4)
    figures = json.loads(result.read_text())
    for name in ("zero3_pp", "hsdp"):
        ratio = _number(rf"\| {name} \| [\d.]+ ms \| [\d.]+ ms \| ([\d.]+) \|", out)
        assert ratio > 0 and round(figures["ratio_minipar_over_torch"][name], 2) == ratio
        diff = _number(rf"largest difference minipar vs torch, {name}: ([\d.e+-]+) \(ok", out)
        assert diff <= 1e-4
    hsdp = out[out.index("  hsdp:"):]
    assert re.search(r"all_reduce/dp_replicate \(\d+ on rank 0\)", hsdp) and "reduce_scatter/dp_shard" in hsdp
    zero3_pp = out[out.index("  zero3_pp:"):out.index("  hsdp:")]
    assert "dp_shard" not in zero3_pp and "dp_replicate" not in zero3_pp


def test_soak_runs_and_reports_rss_growth_and_the_batch_check_share(tmp_path):
    """benchmarks/soak.py --smoke on the main job's layout (4 ranks, tp=2 x pp=2): one RSS line per
    sample with every rank's MiB, the growth after the warm-up per rank and its largest, and the
    batch check's share of the step, the same figures in --json. No goal is asserted (20 steps say
    nothing about a leak, and the share is a timing): the 1000-step run is the measurement."""
    result = tmp_path / "soak.json"
    out = _torchrun("soak.py", "--smoke", "--json", str(result), nproc=4)
    figures = json.loads(result.read_text())
    assert sorted(map(int, figures["rss_bytes"])) == [0, 2, 5, 10, 15, 20]  # every 5, the warm-up (10%), the end
    for done, rss in figures["rss_bytes"].items():
        assert len(rss) == 4 and all(b > 0 for b in rss)
        assert re.search(rf"^\s*{done}" + r"\s+[\d.]+" * 4 + "$", out, re.M), (done, out)
    growth = _number(r"RSS growth after warm-up: max ([+-][\d.]+)% \(goal < 2%\): (?:met|NOT met)", out)
    assert round(figures["rss_growth_max"] * 100, 2) == growth == round(max(figures["rss_growth"]) * 100, 2)
    share = _number(r"batch check: [\d.]+ ms = ([\d.]+)% of the step", out)
    assert share > 0 and round(max(figures["batch_check_share"]) * 100, 2) == share


def test_cp_long_seq_reports_memory_per_rank_and_attention_bytes_equal_to_the_theory(tmp_path):
    """benchmarks/cp_long_seq.py --smoke on 2 ranks: one row per layout (cp=1, cp=2 ring, cp=2 Ulysses)
    with every rank's attention memory against cp=1's (below 1; the goals are for the long-sequence
    run, not asserted), tokens/s, and the attention bytes each rank sent per step, which equal the
    theory computed here: ring_bytes per layer forward and backward, Ulysses 8 all-to-alls of
    (C-1)/C of B·H·(T/C)·D fp32. Ring and Ulysses see the same data and weights, so their first
    losses agree. torch's context_parallel is either timed or its exception printed."""
    result = tmp_path / "cp.json"
    out = _torchrun("cp_long_seq.py", "--smoke", "--json", str(result))
    figures = json.loads(result.read_text())
    a = figures["args"]
    batch, heads, seq, n_layer, head_dim = a["batch"], a["n_head"], a["seq"], a["n_layer"], a["n_embd"] // a["n_head"]
    ring = ring_bytes(batch, heads, seq, head_dim, 2, torch.float32)
    theory = {(1, None): 0, (2, "ring"): n_layer * (ring["forward"] + ring["backward"]),
              (2, "ulysses"): n_layer * 8 * batch * heads * (seq // 2) * head_dim * 4 // 2}
    rows = {(r["cp"], r["form"]): r for r in figures["runs"]}
    assert sorted(rows, key=str) == sorted(theory, key=str)
    for (cp, form), row in rows.items():
        assert row["cp_bytes_counted"] == [theory[(cp, form)]] * 2, (cp, form, row)
        assert row["cp_bytes_theory"] == theory[(cp, form)] and row["tokens_per_s"] > 0
        name = "cp=1 (baseline)" if cp == 1 else f"cp={cp} {form}"
        line = next(ln for ln in out.splitlines() if ln.startswith(f"| minipar {name} |"))
        assert f"| {theory[(cp, form)]:,} = |" in line, line
        assert all(0 < r < 1 for r in row["attention_ratio"]) if cp > 1 else row["attention_ratio"] == [1.0, 1.0]
        assert all(b > 0 for b in row["model_saved_bytes"])
    assert abs(rows[(2, "ring")]["first_loss"] - rows[(2, "ulysses")]["first_loss"]) < 1e-5
    assert "cp=2: first-step loss ring" in out
    (torch_cp,) = figures["torch"]
    if torch_cp["ran"]:
        assert _number(r"minipar ring step / torch step = ([\d.]+)", out) > 0
    else:
        assert re.search(r"torch context_parallel cp=2: does not run here \(\w+/\w+\): " + re.escape(torch_cp["error"]),
                         out), out


def test_dp_vs_ddp_runs_and_reports_the_ratio_the_phases_and_the_bytes(tmp_path):
    """benchmarks/dp_vs_ddp.py (one command: DataParallel over 2 CPU threads here, minipar DDP in 2
    spawned processes): the DataParallel/DDP ratio is printed and written to --json alike, every
    phase of DataParallel's step has a row, the gradient sum copies the second replica's gradients
    (the parameter bytes), DDP all-reduces the parameter bytes under "grad", and the three variants
    train the same thing (losses agree with the one-thread run)."""
    result = tmp_path / "dp.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "dp_vs_ddp.py"), *TINY_ARGS, "--workers", "2",
           "--steps", "2", "--warmup", "0", "--json", str(result)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, f"dp_vs_ddp.py exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    out, figures = run.stdout, json.loads(result.read_text())
    ratio = _number(r"ratio DataParallel/DDP \(of medians\): ([\d.]+)", out)
    assert ratio > 0 and round(figures["ratio_dp_over_ddp"], 2) == ratio
    for phase in ("scatter", "replicate", "forward", "gather", "loss", "gather (backward)", "replicas' backward",
                  "reduce (backward)", "optimizer"):
        assert re.search(rf"^\| {re.escape(phase)} \| [\d.]+ \| \d+% \|", out, re.M), (phase, out)
    param_bytes = _tiny_gpt_param_bytes()
    assert figures["dp_bytes_copied_per_step"]["reduce (backward)"] == param_bytes  # k - 1 = 1 replica's grads
    assert figures["ddp_all_reduce_bytes_per_step"] == param_bytes
    assert max(figures["loss_max_diff_from_one"].values()) < 1e-5


def test_onebit_adam_runs_and_reports_the_wire_ratio(tmp_path):
    """benchmarks/onebit_adam.py on 2 ranks, a short run: both optimizers train, the table and --json
    report the losses and the bytes, and after the warm-up 1-bit Adam puts at most 1/25 of AdamW's
    bytes on the wire (counted by the collective layer). A smoke run: 12 steps cannot reach the
    benchmark's own loss goal (within 2% of AdamW after 200 steps, its exit check, recorded in
    docs/results.md), so --tolerance 1 turns that check off here."""
    result = tmp_path / "onebit.json"
    out = _torchrun("onebit_adam.py", "--steps", "12", "--freeze-step", "4", "--tolerance", "1",
                    "--json", str(result))
    figures = json.loads(result.read_text())
    assert "| 1-bit Adam |" in out and "| AdamW |" in out
    assert 0 < figures["wire_ratio"] <= 1 / 25
    assert figures["wire_bytes_per_step_onebit_after_warmup"] * 25 <= figures["wire_bytes_per_step_adamw"]


def test_ps_vs_ddp_runs_and_reports_the_busiest_rank(tmp_path):
    """benchmarks/ps_vs_ddp.py on 3 ranks (1 server + 2 workers beside 3-rank DDP), a few steps: the
    table and --json carry every side; the server is the busiest rank, carrying about 2·W·Φ/S per
    step against DDP's 4(n−1)/n·Φ per rank (whole tensors per server: within 2%)."""
    result = tmp_path / "ps.json"
    out = _torchrun("ps_vs_ddp.py", "--steps", "3", "--warmup", "1", "--n-embd", "16", "--vocab", "64", "--seq", "16",
                    "--batch", "2", "--json", str(result), nproc=3)
    figures = json.loads(result.read_text())
    rows = {r["side"]: r for r in figures["rows"]}
    assert {"ddp", "ps sync"} <= set(rows) and "ps sync" in out
    phi = figures["param_bytes"]
    assert abs(rows["ddp"]["busiest_through"] - 4 * 2 / 3 * phi) <= 0.02 * phi * 4
    assert rows["ps sync"]["busiest_rank"] == 0  # the server
    assert abs(rows["ps sync"]["busiest_through"] - 2 * 2 * phi) <= 0.02 * 4 * phi


def test_offload_benchmark_runs_every_level(tmp_path):
    """benchmarks/offload.py on 2 ranks, a small GPT: every level is reported; each level keeps less
    on the device than the one before it; opt=nvme keeps on disk what opt=cpu keeps in host memory
    (less the step counters, which stay in memory) and reads and writes all of it every step."""
    result = tmp_path / "offload.json"
    out = _torchrun("offload.py", "--steps", "2", "--warmup", "1", "--n-layer", "2", "--n-embd", "32", "--vocab",
                    "128", "--seq", "16", "--batch", "2", "--path", str(tmp_path / "nvme"), "--chunk-mb", "0.01",
                    "--json", str(result))
    rows = {r["level"]: r for r in json.loads(result.read_text())["rows"]}
    assert list(rows) == ["none", "opt=cpu", "opt=nvme", "opt=cpu,par=cpu", "opt=nvme,par=nvme"] and "vs none" in out
    assert rows["none"]["host"] == rows["none"]["disk"] == 0 and rows["none"]["vs_none"] == 1.0
    assert rows["none"]["device"] > rows["opt=cpu"]["device"] > rows["opt=cpu,par=cpu"]["device"] > 0
    assert 0 < rows["opt=cpu"]["host"] - rows["opt=nvme"]["disk"] < 1024  # the 4-byte step counters
    nvme = rows["opt=nvme"]
    assert nvme["moved"]["disk_read"] == nvme["moved"]["disk_write"] == nvme["disk"]
    assert rows["opt=nvme,par=nvme"]["disk"] > nvme["disk"] and rows["opt=nvme,par=nvme"]["host"] < 1024


def test_gpu_report_without_a_gpu_says_so_and_its_smoke_path_runs_every_kind_of_step(tmp_path):
    """benchmarks/gpu_report.py on a machine without CUDA: it says so and runs its smoke path (a kernel
    module interpreted, the single-device GPT with minipar's kernels interpreted beside PyTorch's, the
    main job at world 1 and 2 with their reference checks, the kernel table), writing the JSON and the
    markdown. The single-device step under the interpreter makes no host sync in minipar's mode: the
    GPU run's claim, seen on a CPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MINIPAR_KERNELS")}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_report.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    assert "no CUDA device here" in out.stdout and "| part | step | result |" in out.stdout
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    assert not report["cuda"] and report["info"]["torch"] == torch.__version__ and report["info"]["triton"]
    steps = {s["part"]: [] for s in report["steps"]}
    for s in report["steps"]:
        steps[s["part"]].append(s)
        assert s["ok"], (s["name"], s["tail"])
    assert set(steps) == {"kernels", "train", "tests"}
    kernel_tests = next(s for s in steps["kernels"] if "tests" in s)["tests"]
    assert kernel_tests["passed"] > 0 and kernel_tests["failed"] == 0 and kernel_tests["skipped"] == 0
    gpt = next(s for s in steps["train"] if "rows" in s.get("figures", {}))["figures"]
    modes = {r["mode"]: r for r in gpt["rows"]}
    assert set(modes) == {"minipar", "torch", "minipar_fp8"} and modes["minipar"]["would_wait"] == 0
    assert gpt["fp8_vs_bf16"] > 0 and 1 < gpt["fp8_planner_bound"] < 2  # FP8's measured ratio beside the planner's
    assert "the planner's bound" in (tmp_path / "gpu_report.md").read_text()
    assert abs(modes["minipar"]["first_loss"] - modes["torch"]["first_loss"]) < 0.05  # same model, bf16 both
    profiles = next(s for s in steps["train"] if "profiles" in s.get("figures", {}))["figures"]["profiles"]
    assert set(profiles) == {"minipar", "torch"}, profiles
    for mode, p in profiles.items():  # on a CPU: no kernel events, the ATen operators instead
        assert p["gpu_busy"] is None and p["ops_per_step"] > 0 and p["top_kernels"], (mode, p)
        assert (tmp_path / "profile" / p["trace"]).exists(), p["trace"]
    for s in steps["train"] + steps["tests"]:
        if "reference_max_diff" in s.get("figures", {}):
            assert s["figures"]["reference_max_diff"] <= 1e-4, s["name"]
    assert (tmp_path / "gpu_report.md").read_text().startswith("# minipar GPU report")


def test_gpu_report_plan_fits_the_device_limits():
    """On a GPU (planned here without one): every part's steps together are limited to ten minutes, the
    most a device command may take; each step's estimate is within its limit; and --part all starts
    with what matters most when GPU time is short: the kernels' correctness, then the single-GPU GPT."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    steps = gpu_report.gpu_steps(pathlib.Path("/nonexistent"))
    assert {s.part for s in steps} == set(gpu_report.PARTS)
    for part in gpu_report.PARTS:
        assert sum(s.timeout for s in steps if s.part == part) <= 600, part
    assert all(0 < s.estimate <= s.timeout for s in steps)
    assert [s.name for s in steps[:2]] == ["kernel tests compiled on the GPU", "GPT 350M on one GPU: minipar beside PyTorch"]
    strategies = " ".join(s.name for s in steps if s.part == "tests")
    for what in ("ddp", "zero1", "zero2", "zero3", "world 1, NCCL", "world 2 sharing the GPU", "tp=2", "pp=2", "cp=2"):
        assert what in strategies, what


def test_step_profile_summary_of_gpu_kernel_events():
    """benchmarks/step_profile.py's summary of a GPU trace (synthetic events, as a CUDA trace has them):
    the busy share is the union of the kernels' intervals over the steps' window (overlapping kernels on
    two streams counted once), kernels per step and the top kernels per step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from step_profile import STEP, summarise
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    events = [{"name": STEP, "ph": "X", "cat": "user_annotation", "ts": 0, "dur": 40},
              {"name": STEP, "ph": "X", "cat": "user_annotation", "ts": 50, "dur": 30},
              {"name": "gemm", "ph": "X", "cat": "kernel", "ts": 10, "dur": 30},   # 10..40
              {"name": "norm", "ph": "X", "cat": "kernel", "ts": 30, "dur": 20},   # 30..50: overlaps the gemm
              {"name": "gemm", "ph": "X", "cat": "kernel", "ts": 70, "dur": 30},   # 70..100
              {"name": "aten::mm", "ph": "X", "cat": "cpu_op", "ts": 1, "dur": 5}]
    s = summarise(events, n_steps=2)
    assert s["gpu_busy"] == pytest.approx((50 - 10 + 30) / 100)  # window 0..100, covered 10..50 and 70..100
    assert s["kernels_per_step"] == 1.5 and s["host_ms_per_step"] == pytest.approx(0.035)
    assert [k["name"] for k in s["top_kernels"]] == ["gemm", "norm"]
    assert s["top_kernels"][0]["ms_per_step"] == pytest.approx(0.03) and s["top_kernels"][0]["launches_per_step"] == 1


def test_step_ops_counts_a_one_device_step():
    """benchmarks/step_ops.py runs and reports the operators of one step: at 2 and 4 blocks the count
    grows by the blocks' own operators, well under two per parameter (what minipar's bucket copies cost)."""
    counts = {}
    for n_layer in (2, 4):
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_ops.py"), "--n-layer", str(n_layer)],
                             capture_output=True, text=True, timeout=300,
                             env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
        assert out.returncode == 0, out.stderr[-3000:]
        m = re.search(r"step_ops: (\d+) operators per step \((\d+) blocks, (\d+) parameters", out.stdout)
        assert m, out.stdout
        counts[n_layer] = (int(m.group(1)), int(m.group(3)))
    more_ops, more_params = counts[4][0] - counts[2][0], counts[4][1] - counts[2][1]
    assert 0 < more_ops < 3 * more_params, counts  # 2 blocks' ops (~34 each); the old bucket copies added 2 per parameter


def test_harness_timing_rule_on_fake_timings(monkeypatch):
    """benchmarks/harness.py's one rule, on a fake clock in one process (no barrier, no reduction to do):
    the variants run step by step with the one going first rotating (a b, b a, a b, ...); every step is
    timed and the warm-up steps are kept in ``seconds`` but left out of every figure; the headline is the
    ratio of the medians, beside the median of the per-step paired ratios (here they differ)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import harness
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    now, order = [0.0], []
    durations = {"a": [9.0, 1.0, 2.0, 3.0, 10.0], "b": [9.0, 2.0, 4.0, 1.0, 4.0]}  # step 0: the warm-up

    def variant(name):
        def step(i):
            order.append((i, name))
            now[0] += durations[name][i]
            return float(i)
        return step

    monkeypatch.setattr(harness, "clock", lambda: now[0])
    t = harness.interleave({"a": variant("a"), "b": variant("b")}, steps=4, warmup=1)
    assert order == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b"), (3, "b"), (3, "a"), (4, "a"), (4, "b")]
    assert t.seconds == durations and t.timed("a") == [1.0, 2.0, 3.0, 10.0] and t.results["b"] == [0, 1, 2, 3, 4]
    assert t.median("a") == 2.5 and t.median("b") == 3.0 and t.ratio("a", "b") == pytest.approx(2.5 / 3.0)
    assert t.paired("a", "b") == [0.5, 0.5, 3.0, 2.5] and t.paired_median("a", "b") == 1.5
    # a variant's loss: the mean over the ranks that report one (a pipeline's last stage only)
    assert harness.gathered_losses([{"a": [1.0, None]}, {"a": [3.0, 2.0]}]) == {"a": [2.0, 2.0]}
    assert harness.table(["x", "y"], [[1, "2"]]) == "| x | y |\n|---|---|\n| 1 | 2 |"

