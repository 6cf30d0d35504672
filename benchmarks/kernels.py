"""minipar's Triton kernels against PyTorch eager and torch.compile, on one GPU.

    python benchmarks/kernels.py [--dtype bf16] [--reps 50] [--json results/kernels.json]

For each memory-bound kernel: its time (median of ``--reps`` CUDA-event timed runs after warm-up: a
microbenchmark's rule, not `harness.interleave`'s), the bytes it must move (each input read once, each
output written once), that bandwidth and its fraction of the measured device-to-device copy bandwidth;
beside it PyTorch eager and ``torch.compile`` and the speed-ups (forward and backward together where the
kernel has a backward). Goal: >= 85% of copy bandwidth and faster than both. Without CUDA it says so
and exits 0; ``--smoke`` runs tiny sizes on the CPU (the interpreter under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import harness
from minipar import kernels


@dataclass
class Case:
    name: str
    nbytes: int                       # the minimum traffic: every input read once, every output written once
    impls: dict[str, Callable[[], object]]


def parse_args() -> argparse.Namespace:
    ap = harness.parser(__doc__, json=None, smoke=dict(rows=8, hidden=32, vocab=64, shard=1000, reps=2),
                        help={"smoke": "tiny sizes on the CPU: exercises the script only"})
    for flag, default, text in (("--rows", 16384, "tokens (rows) for norms, activations, loss"), ("--hidden", 4096, ""),
                                ("--vocab", 32768, ""), ("--shard", 64 * 2**20, "elements of the optimizer shard"),
                                ("--reps", 50, "")):
        ap.add_argument(flag, type=int, default=default, help=text or None)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="activation dtype")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    return ap.parse_args()


def timer(device: torch.device, reps: int) -> Callable[[Callable[[], object]], float]:
    """Median seconds of ``fn()`` over ``reps`` runs after 3 warm-ups (CUDA events on a GPU)."""
    def run(fn: Callable[[], object]) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    return run


def fwd_bwd(fn: Callable, *inputs: torch.Tensor) -> Callable[[], None]:
    """A closure running ``fn(*inputs)`` forward and backward with a fixed upstream gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    with torch.no_grad():
        dy = torch.randn_like(fn(*inputs).float()).to(inputs[0].dtype)

    def step() -> None:
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(dy)
    return step


def cases(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, compile_: bool) -> list[Case]:
    n, d, v = args.rows, args.hidden, args.vocab
    s = torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, d, device=device, dtype=dtype, generator=gen)
    w = torch.ones(d, device=device, dtype=dtype)
    b = torch.zeros(d, device=device, dtype=dtype)
    logits = torch.randn(n, v, device=device, dtype=dtype, generator=gen)
    targets = torch.randint(0, v, (n,), device=device, generator=gen)
    cmp = torch.compile if compile_ else None

    def trio(name: str, nbytes: int, mine: Callable, ref: Callable, *inputs: torch.Tensor, backward: bool = True):
        impls = {"minipar": fwd_bwd(mine, *inputs) if backward else (lambda: mine(*inputs)),
                 "eager": fwd_bwd(ref, *inputs) if backward else (lambda: ref(*inputs))}
        if cmp is not None:
            compiled = cmp(ref)
            impls["torch.compile"] = fwd_bwd(compiled, *inputs) if backward else (lambda: compiled(*inputs))
        return Case(name, nbytes, impls)

    out = [
        # forward: read x, write y; backward: read x and dy, write dx (weights and row stats are negligible)
        trio(f"layer_norm fwd+bwd ({n}x{d})", 5 * n * d * s,
             lambda t: kernels.layer_norm(t, w, b), lambda t: F.layer_norm(t, (d,), w, b), x),
        trio(f"rms_norm fwd+bwd ({n}x{d})", 5 * n * d * s,
             lambda t: kernels.rms_norm(t, w), lambda t: F.rms_norm(t, (d,), w, 1e-6), x),
        trio(f"gelu fwd+bwd ({n}x{d})", 5 * n * d * s, kernels.gelu, lambda t: F.gelu(t, approximate="tanh"), x),
        trio(f"swiglu fwd+bwd ({n}x{d})", 8 * n * d * s, kernels.swiglu, lambda g, u: F.silu(g) * u, x, x.flip(0)),
        # forward reads the logits; backward reads them again and writes their gradient
        trio(f"cross_entropy fwd+bwd ({n}x{v})", 3 * n * v * s,
             lambda z: kernels.cross_entropy(z, targets), lambda z: F.cross_entropy(z.float(), targets), logits),
    ]
    # MoE permute (a gather of rows) and unpermute (its scatter-add adjoint)
    index = torch.randint(0, n, (2 * n,), device=device, generator=gen)
    out.append(trio(f"permute ({2 * n} rows of {d})", 2 * 2 * n * d * s,
                    lambda t: kernels.permute(t, index), lambda t: t.index_select(0, index), x, backward=False))
    y = torch.randn(2 * n, d, device=device, dtype=dtype, generator=gen)
    out.append(trio(f"unpermute ({2 * n} -> {n} rows of {d})", (2 * n + n) * d * s,
                    lambda t: kernels.unpermute(t, index, n),
                    lambda t: torch.zeros(n, d, device=device, dtype=dtype).index_add_(0, index, t), y,
                    backward=False))
    out.append(grouped_mm_case(n, d, device, dtype, gen, trio))
    # FP8 operand quantisation (issue 33): amax of each 1 x 128 tile, scale, cast; read x, write e4m3 bytes
    # and one fp32 scale a tile. Eager is the same arithmetic in torch ops (the kernel's PyTorch path).
    from minipar.kernels.fp8_cast import _fp8_cast_torch
    if hasattr(torch, "float8_e4m3fn"):
        out.append(trio(f"fp8_cast 1x128 tiles ({n}x{d})", n * d * (s + 1) + n * -(-d // 128) * 4,
                        lambda t: kernels.fp8_cast(t, torch.float8_e4m3fn, 128),
                        lambda t: _fp8_cast_torch(t, torch.float8_e4m3fn, 128, True), x, backward=False))
    # gradient unscale-and-cast with the inf/nan flag: read fp32, write the low-precision copy
    m = args.shard
    g32 = torch.randn(m, device=device, generator=gen)
    g_low = torch.empty(m, device=device, dtype=dtype)
    flag = torch.zeros(1, device=device)

    def eager_scale_cast(src: torch.Tensor) -> None:
        scaled = src * (1.0 / 1024)
        g_low.copy_(scaled)
        flag.copy_(torch.maximum(flag, (~torch.isfinite(scaled)).any().float()))
    out.append(trio(f"scale_cast fp32->{args.dtype} ({m})", m * (4 + s),
                    lambda src: kernels.scale_cast_(src, g_low, 1.0 / 1024, flag), eager_scale_cast, g32,
                    backward=False))
    out.append(adamw_case(m, device, dtype, gen, cmp))
    return out


def grouped_mm_case(n: int, d: int, device: torch.device, dtype: torch.dtype, gen, trio) -> Case:
    """A dropless MoE's expert product, forward and backward: ``n`` rows sorted over 8 experts of uneven load
    (one idle), (d, d) each. Compute-bound, so its GB/s goal does not apply: compare the times. Eager is the
    loop of ``torch.mm`` over the experts (the layer's form before the grouped product); "torch path" is
    grouped_mm's PyTorch path (``torch._grouped_mm`` where it applies)."""
    from unittest import mock
    from minipar.kernels.grouped_mm import grouped_mm
    s = torch.tensor([], dtype=dtype).element_size()
    share = torch.tensor([3, 1, 0, 5, 2, 4, 1, 2], dtype=torch.float64)
    counts = (share / share.sum() * n).floor().long()
    counts[0] += n - counts.sum()
    rows = counts.tolist()
    counts = counts.to(device)
    x = torch.randn(n, d, device=device, dtype=dtype, generator=gen)
    w = torch.randn(8, d, d, device=device, dtype=dtype, generator=gen) / d ** 0.5

    def loop(a, b):
        return torch.cat([r @ b[g] for g, r in enumerate(a.split(rows))])

    def torch_path(a, b):
        with mock.patch.dict("os.environ", {"MINIPAR_KERNELS": "torch"}):
            return grouped_mm(a, b, counts)
    case = trio(f"grouped_mm fwd+bwd ({n} rows, 8 experts of {d}x{d}; compute-bound)",
                (3 * n * d + 2 * 8 * d * d + 2 * n * d) * s, lambda a, b: grouped_mm(a, b, counts), loop, x, w)
    case.impls["torch path"] = fwd_bwd(torch_path, x, w)
    return case


def adamw_case(m: int, device: torch.device, dtype: torch.dtype, gen, cmp) -> Case:
    """One AdamW step over an fp32 shard of ``m`` elements, writing the low-precision copy: read param,
    grad, m, v (16 B), write param, m, v (12 B) and the copy."""
    s = torch.tensor([], dtype=dtype).element_size()

    def make(**kw):
        p = torch.nn.Parameter(torch.randn(m, device=device, generator=gen))
        p.grad = torch.randn(m, device=device, generator=gen)
        return p, torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, **kw), torch.empty(m, device=device, dtype=dtype)

    p1, opt1, low1 = make()
    p2, opt2, low2 = make(foreach=True)
    impls = {"minipar": lambda: kernels.fused_step(opt1, {id(p1): low1}),
             "eager": lambda: (opt2.step(), low2.copy_(p2))}
    if device.type == "cuda":  # PyTorch's own fused CUDA AdamW, plus the copy it cannot fuse
        p3, opt3, low3 = make(fused=True)
        impls["torch fused AdamW"] = lambda: (opt3.step(), low3.copy_(p3))
    if cmp is not None:
        p4, opt4, low4 = make(foreach=True)
        compiled = cmp(lambda: (opt4.step(), low4.copy_(p4)))
        impls["torch.compile"] = compiled
    return Case(f"AdamW step + {str(dtype).split('.')[-1]} copy ({m})", m * (28 + s), impls)


GOAL_OF_COPY = 0.85  # of the measured device-to-device copy bandwidth, for these memory-bound kernels


def copy_bandwidth(device: torch.device, run, nbytes: int) -> float:
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / run(lambda: dst.copy_(src))


def main() -> int:
    args = parse_args()
    if args.smoke:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("benchmarks/kernels.py: no CUDA device here; the kernels are timed on a GPU only "
              "(run with --smoke to exercise the script on the CPU)")
        return 0
    else:
        device = torch.device("cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    compile_ = not (args.no_compile or args.smoke)
    run = timer(device, args.reps)
    copy_bw = copy_bandwidth(device, run, 2**30 if device.type == "cuda" else 2**20)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke run: not a measurement)"
    print(f"{where}; torch {torch.__version__}; Triton path: {kernels.use_triton(torch.empty(0, device=device))}; "
          f"{args.dtype}; device-to-device copy {copy_bw / 1e9:,.0f} GB/s\n")
    print("| kernel | minipar | GB/s | of copy BW | eager | compile | vs eager | vs compile | goal | other |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows, missed = [], 0
    for case in cases(args, device, dtype, compile_):
        t = {name: run(fn) for name, fn in case.impls.items()}
        mine = t["minipar"]
        bw = case.nbytes / mine
        other = "; ".join(f"{k} {v * 1e6:,.1f} us" for k, v in t.items() if k not in ("minipar", "eager", "torch.compile"))
        comp = t.get("torch.compile")
        short = [why for why, bad in ((f"< {GOAL_OF_COPY:.0%} of copy", bw / copy_bw < GOAL_OF_COPY),
                                      ("slower than eager", t["eager"] < mine),
                                      ("slower than compile", comp is not None and comp < mine)) if bad]
        missed += bool(short)
        print(f"| {case.name} | {mine * 1e6:,.1f} us | {bw / 1e9:,.0f} | {bw / copy_bw:.0%} | {t['eager'] * 1e6:,.1f} us | "
              f"{f'{comp * 1e6:,.1f} us' if comp else 'n/a'} | {t['eager'] / mine:.2f}x | "
              f"{f'{comp / mine:.2f}x' if comp else 'n/a'} | {'; '.join(short) or 'met'} | {other or '-'} |")
        rows.append({"kernel": case.name, "bytes": case.nbytes, "seconds": t, "gb_per_s": bw / 1e9,
                     "fraction_of_copy": bw / copy_bw, "goal_missed": short})
    print(f"\ngoal (>= {GOAL_OF_COPY:.0%} of copy bandwidth, faster than eager and torch.compile): met by "
          f"{len(rows) - missed} of {len(rows)} kernels" + (" (smoke run: CPU, not a measurement)" if args.smoke else ""))
    harness.write_json(args.json, {"device": where, "dtype": args.dtype, "copy_gb_per_s": copy_bw / 1e9, "kernels": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
