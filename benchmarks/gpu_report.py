"""One command that measures minipar on a GPU, in parts that each fit in ten minutes.

    python benchmarks/gpu_report.py [--part kernels|train|tests|suite|all] [--out results] [--budget 540]

Each part is a list of steps, each a subprocess with its own time limit (one that breaks or hangs is
recorded and the rest still run; a part's limits add up to ten minutes at most):

  kernels  the Triton kernels' tests compiled on the GPU; ``kernels.py``: time, GB/s, against eager and compile.
  train    ``gpt_1gpu.py``: the GPT (350M) in bf16 (and FP8) beside PyTorch's recipe, and three steps of each under
           ``torch.profiler`` (traces in OUT/profile); the main job on a world of one in bf16, reference-checked.
  tests    the main job's reference check per strategy: world 1 over NCCL (fp32 and bf16), and tp=2, pp=2,
           cp=2 and each strategy as two gloo processes sharing the GPU.
  suite    the strategies' equivalence test modules with their ranks on the GPU, in two halves.

``--part all`` runs every step, most important first, skipping one expected (an H100 estimate) to end past
``--budget`` seconds; writes OUT/gpu_report.json and OUT/gpu_report.md (versions, then each step: command,
time, pass/fail, figures), prints the markdown; exit 1 when a step failed. Without CUDA it says so and runs
the same kinds of step at tiny sizes on the CPU: it checks this kit, not a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import tempfile
import time
from xml.etree import ElementTree

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
PARTS = ("kernels", "train", "tests", "suite")
# The strategy tests whose ranks move to the GPU in the tests part (a world of 1 over NCCL, larger
# worlds over gloo with CUDA tensors): each compares its strategy with the single-process run.
STRATEGY_TESTS = ("tests/test_ddp.py", "tests/test_zero.py", "tests/test_hsdp.py", "tests/test_moe.py",
                  "tests/test_tensor_parallel.py", "tests/test_pipeline.py", "tests/test_context_parallel.py")


@dataclasses.dataclass
class Step:
    """One thing the report runs: ``cmd`` under ``env``, killed after ``timeout`` seconds."""

    name: str
    part: str
    cmd: list[str]
    timeout: int                     # hard limit, seconds
    estimate: int                    # expected seconds (an H100 machine): what --budget plans with
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    json_out: str | None = None      # a JSON file the step writes, kept as its figures
    junit: str | None = None         # a pytest JUnit report: counted into passed/failed/skipped


def main_job(label: str, part: str, n: int, out: pathlib.Path, name: str, args: tuple, timeout: int, estimate: int,
             **kw) -> Step:
    """The main job (gpt_tp_pp.py) on ``n`` ranks under torchrun, its results in OUT/name."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           str(BENCH / "gpt_tp_pp.py"), "--out", str(out / name), *args]
    return Step(label, part, cmd, timeout, estimate, json_out=str(out / name / "gpt_tp_pp.json"), **kw)


def bench(label: str, part: str, out: pathlib.Path, script: str, json_name: str, args: tuple, timeout: int,
          estimate: int, **kw) -> Step:
    """A benchmark script run by this interpreter, its figures written to OUT/json_name."""
    path = str(out / json_name)
    return Step(label, part, [sys.executable, str(BENCH / script), *args, "--json", path], timeout, estimate,
                json_out=path, **kw)


def pytest(label: str, part: str, out: pathlib.Path, junit_name: str, args: tuple, timeout: int, estimate: int,
           env: dict) -> Step:
    """Test modules under pytest, counted from their JUnit report OUT/junit_name."""
    junit = str(out / junit_name)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, f"--junitxml={junit}"]
    return Step(label, part, cmd, timeout, estimate, env={**env, "HYPOTHESIS_PROFILE": "ci"}, junit=junit)


def gpu_steps(out: pathlib.Path) -> list[Step]:
    """Every step on a CUDA machine, most important first (the order ``--part all`` runs them in)."""
    # (tests/test_syncs.py stays out: its steps take host batches, which OnDevice would move to the GPU;
    # on a GPU the host syncs are gpt_1gpu.py's to count, through torch.cuda.set_sync_debug_mode.)
    tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_kernels*.py"))
    share = {"MINIPAR_BACKEND": "gloo", "MINIPAR_DEVICE": "cuda"}  # two processes on one GPU (nccl refuses it)
    steps = [
        pytest("kernel tests compiled on the GPU", "kernels", out, "kernel_tests.xml", ("-m", "triton", *tests), 360,
               150, {"MINIPAR_TEST_DEVICE": "cuda"}),
        bench("GPT 350M on one GPU: minipar beside PyTorch", "train", out, "gpt_1gpu.py", "gpt_1gpu.json",
              ("--model", "gpt2-medium", "--modes", "minipar,minipar_fp8,torch,compile,minipar_compile"), 330, 280),
        bench("profile: 3 steps of minipar and of the eager recipe", "train", out, "gpt_1gpu.py", "gpt_1gpu_profile.json",
              ("--model", "gpt2-medium", "--modes", "minipar,torch", "--warmup", "3", "--profile", str(out / "profile")),
              120, 60),
        main_job("main job, world 1, bf16, reference check", "train", 1, out, "main_world1_bf16", (
            "--tp", "1", "--pp", "1", "--model", "small", "--dtype", "bf16", "--steps", "20", "--batch", "16"), 150, 40),
        bench("kernel table (time, GB/s, vs eager and torch.compile)", "kernels", out, "kernels.py", "kernels.json",
              (), 240, 90),
    ]
    for strategy, dtype in (("ddp", "fp32"), ("zero1", "bf16"), ("zero2", "bf16"), ("zero3", "fp32"), ("zero3", "bf16")):
        name = f"main_world1_nccl_{strategy}_{dtype}"
        steps.append(main_job(f"{strategy} {dtype}, world 1, NCCL", "tests", 1, out, name, (
            "--tp", "1", "--pp", "1", "--strategy", strategy, "--dtype", dtype, "--steps", "6"), 45, 20))
    fp32 = ("--dtype", "fp32")
    for label, args in [(f"{s} fp32", ("--tp", "1", "--pp", "1", "--strategy", s, *fp32)) for s in ("ddp", "zero1", "zero2", "zero3")] + \
                       [("tp=2 ddp fp32", ("--tp", "2", "--pp", "1", *fp32)),
                        ("pp=2 1f1b zero1 bf16", ("--tp", "1", "--pp", "2", "--dtype", "bf16")),
                        ("cp=2 ring fp32", ("--tp", "1", "--pp", "1", "--cp", "2", *fp32))]:
        name = "main_world2_gloo_cuda_" + label.replace(" ", "_").replace("=", "")
        steps.append(main_job(f"{label}, world 2 sharing the GPU over gloo", "tests", 2, out, name,
                              (*args, "--steps", "6"), 50, 25, env=share))
    # The suite part in two halves with their own limits, so that one call of ten minutes holds the part
    # and a half that runs out of time still reports the other's results.
    for k, files in enumerate((STRATEGY_TESTS[:4], STRATEGY_TESTS[4:]), start=1):
        names = ", ".join(pathlib.Path(f).stem[5:] for f in files)
        steps.append(pytest(f"strategy tests with their ranks on the GPU ({k}/2: {names})", "suite", out,
                            f"strategy_tests_{k}.xml", ("--maxfail=20", "--durations=10", *files), 280, 150,
                            {"MINIPAR_TEST_DEVICE": "cuda", "MINIPAR_TEST_BACKEND": "nccl"}))
    return steps


def cpu_steps(out: pathlib.Path) -> list[Step]:
    """The smoke path: the same kinds of step at tiny sizes on the CPU (it tests the kit, not a GPU)."""
    tiny = ("--model", "tiny", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--vocab", "64", "--seq", "16",
            "--batch", "2", "--steps", "4")
    return [
        pytest("kernel tests (interpreted: no GPU)", "kernels", out, "kernel_tests.xml",
               ("-m", "triton", "tests/test_kernels_scale_cast.py"), 300, 10, {"TRITON_INTERPRET": "1"}),
        # interpreted: minipar's kernels take their GPU branch, so its host syncs are a GPU run's
        bench("GPT on one device (smoke, kernels interpreted)", "train", out, "gpt_1gpu.py", "gpt_1gpu.json",
              ("--smoke", "--modes", "minipar,torch,minipar_fp8"), 180, 20, env={"TRITON_INTERPRET": "1"}),
        bench("profile (smoke, kernels interpreted)", "train", out, "gpt_1gpu.py", "gpt_1gpu_profile.json",
              ("--smoke", "--profile", str(out / "profile")), 180, 20, env={"TRITON_INTERPRET": "1"}),
        main_job("main job, world 1, reference check", "train", 1, out, "main_world1", ("--tp", "1", "--pp", "1", *tiny),
                 180, 10),
        bench("kernel table (smoke)", "kernels", out, "kernels.py", "kernels.json", ("--smoke",), 180, 5),
        main_job("zero3 fp32, world 2 over gloo", "tests", 2, out, "main_world2_zero3",
                 ("--tp", "1", "--pp", "1", "--strategy", "zero3", *tiny), 180, 15),
    ]


def versions() -> dict:
    try:
        import triton
        version = triton.__version__
    except ImportError as e:
        version = f"not importable: {e}"
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA)",
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "triton": version}


def junit_counts(path: str) -> dict:
    if not os.path.exists(path):
        return {"error": "no JUnit report (pytest did not get to write one)"}
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        verdict = next((el for el in case if el.tag in ("failure", "error", "skipped")), None)
        kind = "passed" if verdict is None else "skipped" if verdict.tag == "skipped" else "failed"
        counts[kind] += 1
        if kind == "failed":
            message = (verdict.get("message") or "").splitlines()
            counts["failures"].append(f"{case.get('classname')}::{case.get('name')}: {message[0][:300] if message else ''}")
    return counts


def run_step(step: Step) -> dict:
    """Run one step; a step past its limit is stopped with everything it started (torchrun's workers
    and test pools run in its session), so nothing of it holds the GPU while the next step runs."""
    for stale in (step.json_out, step.junit):  # a step that dies early must not report the last run's figures
        if stale and os.path.exists(stale):
            os.remove(stale)
    env = dict(os.environ, **step.env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH), env.get("PYTHONPATH")]))
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(step.cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=step.timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):  # torchrun passes SIGTERM on
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=grace)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        log.seek(0)
        output = log.read() + (f"\n[stopped after its limit of {step.timeout} s]" if rc == "timeout" else "")
    row = {"name": step.name, "part": step.part, "cmd": " ".join(step.cmd[step.cmd[0] == sys.executable:]),
           "env": step.env, "seconds": round(time.monotonic() - t0, 1), "rc": rc, "ok": rc == 0, "tail": output[-3000:]}
    if step.json_out and os.path.exists(step.json_out):
        row["figures"] = json.loads(pathlib.Path(step.json_out).read_text())
    if step.junit:
        row["tests"] = junit_counts(step.junit)
    return row


def summary(row: dict) -> str:
    """A step's headline figures, for the markdown table."""
    fig = row.get("figures") or {}
    if "tests" in row:
        t = row["tests"]
        return t.get("error") or f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped"
    if "profiles" in fig:  # gpt_1gpu --profile
        return "; ".join(f"{mode} " + (f"failed ({p['error']})" if "error" in p else (
            f"GPU busy {p['gpu_busy']:.0%}, {p['kernels_per_step']:.0f} kernels/step" if p["gpu_busy"] is not None
            else f"{p['ops_per_step']:.0f} ops/step (CPU)") + f", host {p['host_ms_per_step']:.1f} ms/step"
            + (f", top: {p['top_kernels'][0]['name'][:40]}" if p["top_kernels"] else ""))
            for mode, p in fig["profiles"].items())
    if "rows" in fig:  # gpt_1gpu
        return "; ".join(f"{r['mode']} " + (f"failed ({r['error']})" if "error" in r else
                         f"{r['tokens_per_s']:,.0f} tok/s" + (f", MFU {r['mfu']:.1%}" if r.get("mfu") else "")
                         + f", {r['would_wait']} syncs/step") for r in fig["rows"]) + f"; flash: {fig.get('flash_attention')}" + (
                             f"; fp8/bf16 {fig['fp8_vs_bf16']:.2f} (the planner's bound {fig['fp8_planner_bound']:.2f})"
                             if "fp8_vs_bf16" in fig else "")
    if "kernels" in fig:  # kernels.py
        met = sum(not k["goal_missed"] for k in fig["kernels"])
        return f"copy {fig['copy_gb_per_s']:,.0f} GB/s; goal met by {met} of {len(fig['kernels'])} kernels"
    if "tokens_per_s" in fig:  # the main job
        return (f"{fig['tokens_per_s']:,.0f} tok/s" + (f", MFU {fig['mfu']:.1%}" if fig.get("mfu") else "")
                + f"; reference diff {fig['reference_max_diff']:.1e}" + (
                    f", bf16 rel {fig['bf16_max_rel_diff']:.1e}" if fig.get("bf16_max_rel_diff") is not None else ""))
    tail = row["tail"].strip()
    return tail.splitlines()[-1][:200] if tail and not row["ok"] else ""


def markdown(info: dict, rows: list[dict], skipped: list[str]) -> str:
    lines = [f"# minipar GPU report, {info['date']}", "", f"{info['device']}; torch {info['torch']} (CUDA "
             f"{info['cuda']}); triton {info['triton']}; Python {info['python']}", "",
             "| part | step | result | seconds | figures |", "|---|---|---|---|---|"]
    for r in rows:
        verdict = "ok" if r["ok"] else ("timed out" if r["rc"] == "timeout" else f"FAILED (exit {r['rc']})")
        lines.append(f"| {r['part']} | {r['name']} | {verdict} | {r['seconds']} | {summary(r)} |")
    lines += [f"| | {name} | skipped: past --budget | | |" for name in skipped]
    for r in rows:
        if failures := (r.get("tests") or {}).get("failures"):
            lines += ["", f"## {r['name']}: failures", ""] + [f"- {f}" for f in failures[:40]]
        elif not r["ok"]:
            lines += ["", f"## {r['name']}: output tail", "", "```", r["tail"][-1500:], "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="all", choices=(*PARTS, "all"))
    ap.add_argument("--out", default="results")
    ap.add_argument("--budget", type=float, default=540.0,
                    help="seconds: a step expected to end past this is skipped (default 540)")
    args = ap.parse_args(argv)
    out, info, cuda = pathlib.Path(args.out).resolve(), versions(), torch.cuda.is_available()
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu_report: {info['device']}; torch {info['torch']} (CUDA {info['cuda']}); triton {info['triton']}"
          + ("" if cuda else "\ngpu_report: no CUDA device here: running the smoke path on the CPU (tiny sizes: it "
             "checks the kit, not a GPU)"), flush=True)
    start, rows, skipped = time.monotonic(), [], []
    for step in [s for s in (gpu_steps(out) if cuda else cpu_steps(out)) if args.part in ("all", s.part)]:
        if time.monotonic() - start + step.estimate > args.budget:
            skipped.append(step.name)
            print(f"-- {step.name}: skipped (expected to take {step.estimate} s: past --budget {args.budget:g} s)")
            continue
        print(f"-- {step.name} ...", flush=True)
        rows.append(run_step(step))
        print(f"   {'ok' if rows[-1]['ok'] else 'FAILED'} in {rows[-1]['seconds']} s: {summary(rows[-1])}", flush=True)
    report = {"info": info, "cuda": cuda, "part": args.part, "steps": rows, "skipped": skipped}
    (out / "gpu_report.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_report.md").write_text(md := markdown(info, rows, skipped))
    print(f"\n{md}\ngpu_report: wrote {out / 'gpu_report.json'} and {out / 'gpu_report.md'}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
