"""The GPT on one GPU: minipar's training step beside PyTorch's own recipe, in tokens/s and MFU.

    python benchmarks/gpt_1gpu.py [--model gpt2-medium --modes minipar,torch,compile --fp8 --profile DIR --json PATH]

Every mode trains the same GPT (fused q/k/v, the same weights and batches) in bf16. minipar: ``ShardedModule``
on a world of one, ZeRO-1 with bf16 parameters and fp32 masters, its Triton kernels, the head and loss in row
chunks, host batches. minipar_fp8 (``--fp8 [SCALING]`` adds it): the same with the block linears in FP8
(``MixedPrecision(fp8=Float8Config(SCALING))``, default tensorwise; goal >= 1.3x minipar's tokens/s). torch: PyTorch's recipe (its ops, ``autocast(bfloat16)``, ``F.cross_entropy``,
``AdamW(fused=True)``); compile: that under ``torch.compile``; minipar_compile: minipar's GPT compiled whole.
The timed steps run back to back between one CUDA-event pair (no host sync between them: how far the host
stays ahead is the point, so not `harness.interleave`'s rule). Per mode: step time, tokens/s, MFU (as the
main job's), peak memory, first and last loss, one step's host syncs (``minipar.core.syncs``: would wait;
``torch.cuda.set_sync_debug_mode``: did). Goal on an H100: MFU >= 0.50 for minipar, at least eager's
tokens/s. ``--profile DIR``: three steps per mode under ``torch.profiler`` (``step_profile.py``) instead.
Without CUDA: says so and runs ``--smoke`` (tiny, CPU, minipar and torch), which checks the script only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from dataclasses import replace
from unittest import mock

import torch
import torch.nn.functional as F

import minipar
from minipar import ShardedModule
from minipar.models import GPT, GPTConfig
from minipar.models.data import markov_batch
from minipar.core.syncs import count_host_syncs
from minipar.fp8 import Float8Config
from minipar.plan import Layout, evaluate
from minipar.plan.presets import H100, ModelShape

import harness
from gpt_tp_pp import model_flops, peak_flops
from step_profile import profile_steps, table

PRESETS = {
    "tiny": dict(n_layer=1, n_embd=16, n_head=2, vocab=64, seq=16),
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, vocab=50304, seq=1024),          # 124M
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16, vocab=50304, seq=1024),  # 350M
}
MODES = ("minipar", "torch", "compile", "minipar_compile", "minipar_fp8")
FP8_GOAL = 1.3  # issue 33: an H100/H200 trains the 350M GPT in FP8 at >= 1.3x minipar's own bf16 tokens/s


def parse_args(argv=None) -> argparse.Namespace:
    ap = harness.parser(__doc__, batch=16, seq=None, steps=20, warmup=5, lr=3e-4, smoke=False, json=None,
                        help={"seq": "default: the preset's", "smoke": "tiny model on the CPU: checks the script only"})
    ap.add_argument("--model", default="gpt2-medium", choices=sorted(PRESETS))
    ap.add_argument("--modes", default="minipar,torch,compile", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--peak-tflops", type=float, default=None, help="one GPU's peak bf16 TFLOP/s, for the MFU")
    ap.add_argument("--profile", default=None, metavar="DIR", help="profile 3 steps per mode instead of timing")
    ap.add_argument("--fp8", nargs="?", const="tensorwise", default=None, choices=("tensorwise", "rowwise", "blockwise"),
                    help="also run minipar_fp8 (and minipar, its baseline) with this FP8 recipe")
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.fp8:
        args.modes += [m for m in ("minipar", "minipar_fp8") if m not in args.modes]
    if unknown := [m for m in args.modes if m not in MODES]:
        ap.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    if args.smoke:
        args.model, args.steps, args.warmup, args.batch = "tiny", min(args.steps, 3), 1, min(args.batch, 2)
        args.modes = [m for m in args.modes if "compile" not in m] or ["minipar"]
    args.seq = args.seq or PRESETS[args.model]["seq"]
    return args


def config(args) -> GPTConfig:
    p = PRESETS[args.model]
    # fused_qkv: one projection for q, k and v, as nanoGPT and llm.c have it (every mode trains this model)
    return GPTConfig(vocab_size=p["vocab"], block_size=args.seq, n_layer=p["n_layer"], n_head=p["n_head"],
                     n_embd=p["n_embd"], fused_qkv=True, seed=0)


def fp8_bound(cfg: GPTConfig, seq: int) -> float:
    """The planner's FP8 speedup of this GPT's compute on one H100 (`minipar.plan`, docs/planner.md "FP8"):
    its bf16 compute time over its FP8 one, the nn.Linear matmuls at the FP8 peak, casts not charged."""
    shape = ModelShape("gpt", cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head, 4 * cfg.n_embd, cfg.vocab_size, seq,
                       tied=cfg.tie_weights, gated=False)
    one = replace(H100, name="1 GPU", gpus_per_node=1)
    bf16, fp8 = (evaluate(shape, one, 1, Layout(1, 1, 1, strategy="zero1"), f)["compute_s"]
                 for f in (None, Float8Config()))
    return bf16 / fp8


class Runner:
    """One mode's model, optimizer and step: ``step(x)`` -> loss tensor (never read back here)."""

    def __init__(self, mode: str, cfg: GPTConfig, mesh, lr: float, device: torch.device, fp8: str | None = None) -> None:
        self.mode, self.device = mode, device
        self.torch_ops = mode in ("torch", "compile")
        if self.torch_ops:
            self.model = GPT(cfg).to(device)
            fused = device.type == "cuda"
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.1, fused=fused)
            self.forward = torch.compile(self.model) if mode == "compile" else self.model
            self.autocast = torch.autocast(device.type, dtype=torch.bfloat16)
        else:
            policy = harness.BF16
            if mode == "minipar_fp8":
                policy = replace(policy, fp8=Float8Config(fp8 or "tensorwise"))
            self.model = ShardedModule(GPT(cfg), mesh=mesh, strategy="zero1", mixed_precision=policy)
            if mode == "minipar_compile":
                self.model.module.compile(fullgraph=True)
            self.opt = self.model.build_optimizer(torch.optim.AdamW, lr=lr, weight_decay=0.1)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        if self.torch_ops:
            x = x.to(self.device, non_blocking=True)
            with self.autocast:
                logits = self.forward(x[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        else:
            loss = self.model.train_step(x[:, :-1], x[:, 1:])  # the GPT's own loss: head + loss in chunks
            self.model.clip_grad_norm_(1.0)
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()

    def host_tensors(self) -> list[torch.Tensor]:
        """Tensors that live on the host by design (a torch optimizer's step counts)."""
        inner = getattr(self.opt, "optimizer", self.opt)
        return [s["step"] for s in inner.state.values() if "step" in s and s["step"].device.type == "cpu"]


def sync_counts(runner: Runner, x: torch.Tensor) -> dict:
    """One step's host syncs: the calls that would wait (minipar.core.syncs; on CUDA only reads of device
    tensors) and, on CUDA, the ones torch saw wait (set_sync_debug_mode "warn" makes each a warning). The
    step runs twice and the second is counted: counting changes what a compiled model's guards see, and
    the first pass may recompile."""
    cuda = runner.device.type == "cuda"
    with count_host_syncs(runner.host_tensors(), device_only=cuda):
        runner.step(x)
    with count_host_syncs(runner.host_tensors(), device_only=cuda) as syncs, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            runner.step(x)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    waited = [w for w in seen if "synchroniz" in str(w.message).lower()]
    return {"would_wait": syncs.total, "would_wait_at": syncs.report() if syncs.total else "",
            "cuda_waited": len(waited) if cuda else None}


def flash_attention_runs(cfg: GPTConfig, device: torch.device) -> str:
    """Whether the GPT's own attention module runs with SDPA's flash kernel alone, in bf16 here."""
    if device.type != "cuda":
        return "n/a on CPU"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from minipar.models.gpt import CausalSelfAttention
    attn = CausalSelfAttention(cfg).to(device, torch.bfloat16)
    x = torch.randn(2, min(cfg.block_size, 256), cfg.n_embd, device=device, dtype=torch.bfloat16)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            attn(x).sum().backward()
        return "yes"
    except RuntimeError as e:
        return f"no: {str(e).splitlines()[0]}"


def run_mode(mode: str, args, cfg: GPTConfig, mesh, device: torch.device, flops_per_token: float,
             peak: float | None) -> dict:
    """One mode's row; with ``--profile``, three steps under the profiler (``step_profile``) instead. The torch
    modes run under MINIPAR_KERNELS=torch (PyTorch's ops on CUDA), the environment restored after."""
    torch.manual_seed(0)
    with mock.patch.dict(os.environ, {"MINIPAR_KERNELS": "torch"} if mode in ("torch", "compile") else {}):
        runner = Runner(mode, cfg, mesh, args.lr, device, args.fp8)
        steps, cuda = 3 if args.profile else args.steps, device.type == "cuda"
        batches = [markov_batch(s, 0, args.batch, args.seq, cfg.vocab_size) for s in range(args.warmup + steps)]
        if cuda:  # every mode copies its batches from pinned memory: nothing waits for them
            batches = [x.pin_memory() for x in batches]
        losses = [runner.step(x) for x in batches[:args.warmup]]
        if args.profile:
            return profile_steps(runner.step, batches[args.warmup:], os.path.join(args.profile, f"trace_{mode}.json.gz"))
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        losses += [runner.step(x) for x in batches[args.warmup:]]
        host_s = time.perf_counter() - t0  # how long the host took to queue the steps
        if cuda:
            end.record()
            end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 if cuda else host_s
        tokens_per_s, values = args.batch * args.seq * steps / seconds, torch.stack(losses).float().tolist()
        return {"mode": mode, "step_ms": seconds / steps * 1e3, "host_ms_per_step": host_s / steps * 1e3,
                "tokens_per_s": tokens_per_s, "mfu": flops_per_token * tokens_per_s / peak if peak else None,
                "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
                "first_loss": values[0], "last_loss": values[-1], **sync_counts(runner, batches[-1])}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, cuda = parse_args(argv), torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("gpt_1gpu: no CUDA device here; running the CPU smoke path (--smoke): tiny model, no timing claims")
        args = parse_args([*argv, "--smoke"])
    mesh = minipar.init()
    device, cfg = mesh.device, config(args)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # what a training run would use
    n_params, flops_per_token = model_flops(GPT(cfg), args.seq)
    (peak, peak_note), flash = peak_flops(args, not cuda), flash_attention_runs(cfg, device)
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"gpt_1gpu: GPT '{args.model}' {n_params / 1e6:.1f}M parameters, batch {args.batch} x seq {args.seq}, "
          f"bf16, on {name}; torch {torch.__version__}; flash attention: {flash}", flush=True)
    result = {"device": name, "torch": torch.__version__, "model": args.model, "parameters": n_params,
              "batch": args.batch, "seq": args.seq, "flops_per_token": flops_per_token, "peak": peak_note,
              "flash_attention": flash}
    runs: dict[str, dict] = {}
    for mode in args.modes:
        try:
            runs[mode] = run_mode(mode, args, cfg, mesh, device, flops_per_token, peak)
        except Exception as e:  # noqa: BLE001 -- one mode failing must not hide the others' figures
            runs[mode] = {"mode": mode, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        if cuda:
            torch.cuda.empty_cache()  # the mode's model is gone: the next one starts from an empty cache
        if not args.profile:
            print(f"  {mode}: " + (runs[mode].get("error") or f"{runs[mode]['tokens_per_s']:,.0f} tokens/s"), flush=True)
        result.update({"profiles": runs} if args.profile else {"rows": list(runs.values())})
        harness.write_json(args.json, result)  # after every mode: a run stopped at its limit keeps what it measured
    rows = list(runs.values())
    base = next((r for r in rows if r.get("mode") == "torch" and "error" not in r), None)
    print(table(runs) if args.profile else "\n" + harness.table([
        "mode", "step ms", "host ms/step", "tokens/s", "vs torch", "MFU", "peak memory", "loss first -> last",
        "syncs/step (would wait / CUDA saw)"], [[r["mode"], f"failed: {r['error']}"] + [""] * 7 if "error" in r else [
            r["mode"], f"{r['step_ms']:.1f}", f"{r['host_ms_per_step']:.1f}", f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "n/a",
            f"{r['mfu']:.1%}" if r["mfu"] is not None else peak_note,
            f"{r['peak_memory_bytes'] / 2**30:.2f} GiB" if r["peak_memory_bytes"] is not None else "n/a",
            f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}",
            f"{r['would_wait']} / {r['cuda_waited'] if r['cuda_waited'] is not None else 'n/a'}"] for r in rows]))
    fp8, bf16 = (next((r for r in rows if r.get("mode") == m and "error" not in r), None)
                 for m in ("minipar_fp8", "minipar"))
    if fp8 and bf16 and not args.profile:
        result["fp8_vs_bf16"] = fp8["tokens_per_s"] / bf16["tokens_per_s"]
        result["fp8_planner_bound"] = fp8_bound(cfg, args.seq)
        print(f"minipar_fp8 ({args.fp8 or 'tensorwise'}) / minipar bf16 tokens/s: {result['fp8_vs_bf16']:.2f} "
              f"(goal >= {FP8_GOAL} on an H100/H200; the planner's compute bound {result['fp8_planner_bound']:.2f}"
              f"{'; CPU: not a measurement' if not cuda else ''})")
    if not args.profile:
        for r in rows:
            if r.get("would_wait"):
                print(f"{r['mode']}: host syncs per step at\n{r['would_wait_at']}")
        result["median_tokens_per_s"] = statistics.median([r["tokens_per_s"] for r in rows if "error" not in r] or [0])
        harness.write_json(args.json, result)
    minipar.shutdown()
    return 1 if any("error" in r for r in runs.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
