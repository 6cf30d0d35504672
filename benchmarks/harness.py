"""What the benchmarks share: the common flags, one timing rule, the slowest rank, tables and JSON.

The timing rule, ``interleave``, is the one every benchmark here times with:

* Variants run interleaved, step by step: step i of every variant runs before step i + 1 of any, and
  the variant that goes first rotates with i (variant i mod k first), so drift of a shared machine
  (clock, other load) hits all alike and no variant always follows the same neighbour.
* A step starts after an untimed barrier over the world (so no rank carries the previous step's lag
  into it) and is timed with ``time.perf_counter``, the GPU synchronised before both readings.
* The first ``warmup`` steps are run and timed like the others and dropped from every figure
  (allocators, lazy optimizer state, compilation).
* A step's time is the slowest rank's: the per-rank times are max-reduced over the world once, after
  the loop (outside anything timed).
* Figures (`Timings`): the median of each variant's timed steps; a comparison a/b is the ratio of
  the medians (the headline), beside the median of the per-step ratios a_i / b_i, each pair having
  run back to back (the figure least moved by load that changes slowly).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

import minipar
from minipar.models import GPTConfig
from minipar.models.data import markov_batch

clock = time.perf_counter  # the tests replace it with a fake clock

# The flags most benchmarks take: name -> (type, help). A script names the ones it has, with its defaults.
FLAGS: dict[str, tuple[Any, str]] = {
    "n_layer": (int, "transformer blocks"), "n_embd": (int, "model width"), "n_head": (int, "attention heads"),
    "vocab": (int, "vocabulary size"), "seq": (int, "tokens per sequence (also the block size)"),
    "batch": (int, "sequences per rank per step"), "steps": (int, "timed steps per variant"),
    "warmup": (int, "steps per variant run first and left out of the figures"), "lr": (float, "learning rate"),
    "seed": (int, "model and data seed"), "json": (str, "also write the figures here as JSON"),
    "smoke": (bool, "tiny sizes and few steps: checks the script, not speed"),
    "check": (bool, "exit 1 when a goal of the benchmark is missed"), "microbatches": (int, "micro-batches per step"),
    "check_steps": (int, "first steps whose losses are compared"), "tolerance": (float, "largest loss difference"),
}
BF16 = minipar.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # bf16 compute, fp32 reduce


class _Format(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


class Flags(argparse.ArgumentParser):
    """An ArgumentParser whose ``--smoke`` turns the ``smoke`` values into the defaults (flags given beside
    it still win)."""

    def __init__(self, doc: str | None, smoke: dict | None = None) -> None:
        super().__init__(description=doc, formatter_class=_Format)
        self.smoke = smoke or {}

    def parse_known_args(self, args=None, namespace=None):
        given = sys.argv[1:] if args is None else list(args)
        if "--smoke" in given:
            self.set_defaults(**self.smoke)
        return super().parse_known_args(given, namespace)


def parser(doc: str | None, *, help: dict | None = None, **defaults) -> Flags:
    """A parser with the common flags named in ``defaults`` (``steps=30`` adds ``--steps``, default 30;
    ``smoke={"steps": 2, ...}`` adds ``--smoke`` standing for those values); ``help`` overrides their help
    texts. Script-specific flags are added to it as to any parser."""
    smoke = defaults.get("smoke")
    ap = Flags(doc, smoke if isinstance(smoke, dict) else None)
    for name, default in defaults.items():
        kind, text = FLAGS[name]
        text = (help or {}).get(name, text)
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            ap.add_argument(flag, action="store_true", help=text + (": " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in default.items()) if isinstance(default, dict) else ""))
        else:
            ap.add_argument(flag, type=kind, default=default, help=text)
    return ap


def init(exact: bool = False, **axes) -> minipar.Mesh:
    """``minipar.init(**axes)``, every rank computing with one thread on a CPU (the ranks share its cores);
    ``exact``: no TF32 on a GPU (a reference check must not round matmul inputs)."""
    if exact:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    mesh = minipar.init(**axes)
    if mesh.device.type == "cpu":
        torch.set_num_threads(1)
    return mesh


def gpt_config(args, **overrides) -> GPTConfig:
    """The GPT of the model size flags (``--vocab --seq --n-layer --n-head --n-embd``)."""
    shape = dict(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                 n_embd=args.n_embd)
    return GPTConfig(**{**shape, **overrides})


def tokens(seed: int, rows: int, args, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of ``rows`` uniformly random sequences of ``args.seq + 1`` tokens drawn from ``seed``."""
    t = torch.randint(args.vocab, (rows, args.seq + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)


def command() -> str:
    """This script's command line, for the JSON."""
    return " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])


def sync() -> None:
    """Wait for the GPU's queued work (nothing on a CPU), so a clock reading covers it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _world() -> bool:
    return dist.is_available() and dist.is_initialized()


def slowest_rank(values: list[float]) -> list[float]:
    """Each entry's largest value over the ranks of the world (a rank with nothing to report passes 0s)."""
    if not _world():
        return list(values)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


@dataclass
class Timings:
    """What `interleave` measured: per variant, every step's seconds (the slowest rank's, warm-up steps
    included) and what each step returned."""

    seconds: dict[str, list[float]]
    results: dict[str, list]
    warmup: int
    wall_s: float = 0.0  # the whole loop's, warm-up and barriers included

    def timed(self, name: str) -> list[float]:
        return self.seconds[name][self.warmup:]

    def median(self, name: str) -> float:
        return statistics.median(self.timed(name))

    def ratio(self, a: str, b: str) -> float:
        """The headline comparison: median of a over median of b."""
        return self.median(a) / self.median(b)

    def paired(self, a: str, b: str) -> list[float]:
        """a's time over b's, step by step."""
        return [x / y for x, y in zip(self.timed(a), self.timed(b))]

    def paired_median(self, a: str, b: str) -> float:
        return statistics.median(self.paired(a, b))


def interleave(variants: dict[str, Callable[[int], Any]], steps: int, warmup: int = 0, *, aligned: bool = True,
               log_every: int = 0, after: Callable[[int], None] | None = None) -> Timings:
    """Run ``variants[name](step)`` for step 0 .. warmup + steps - 1 under the module's timing rule.

    ``aligned=False`` leaves out the barrier and the reduction, for loops some ranks of the world do not
    run (the caller then reduces with `slowest_rank`). ``log_every`` prints this rank's times (and a
    float result, the loss) every that many steps on rank 0; ``after(step)`` runs untimed after each
    step of every variant (a checkpoint)."""
    names = list(variants)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    results: dict[str, list] = {n: [] for n in names}
    aligned = aligned and _world()
    talk = log_every and (not _world() or dist.get_rank() == 0)
    total, start = warmup + steps, time.perf_counter()
    for i in range(total):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            if aligned:
                dist.barrier()
            sync()
            t0 = clock()
            out = variants[name](i)
            sync()
            seconds[name].append(clock() - t0)
            results[name].append(out)
        if talk and (i % log_every == 0 or i == total - 1):
            elapsed = time.perf_counter() - start  # the ETA: the mean step so far times the steps left
            print(f"step {i:4d}  " + "  ".join(
                f"{n} {seconds[n][-1] * 1e3:.1f} ms" + (f" loss {results[n][-1]:.4f}"
                                                         if isinstance(results[n][-1], float) else "")
                for n in names) + f"  [{i + 1}/{total}, {elapsed:.1f} s, "
                f"ETA {elapsed / (i + 1) * (total - i - 1):.1f} s]", flush=True)
        if after is not None:
            after(i)
    if aligned:
        flat = slowest_rank([s for n in names for s in seconds[n]])
        seconds = {n: flat[j * total:(j + 1) * total] for j, n in enumerate(names)}
    return Timings(seconds, results, warmup, time.perf_counter() - start)


def gathered_losses(per_rank: list[dict[str, list]]) -> dict[str, list[float]]:
    """Each variant's loss per step from every rank's ``Timings.results``: the mean over the ranks that
    report one (a pipeline's on its last stage only; each data-parallel rank its own)."""
    return {k: [statistics.fmean(r[k][i] for r in per_rank if r[k][i] is not None) for i in range(len(v))]
            for k, v in per_rank[0].items()}


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def write_json(path: str | None, result: dict) -> None:
    """``result`` to ``path`` (its folder made) as JSON; nothing without a path."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=str)


def finish(status: int | bool = 0) -> int:
    """Every rank leaves with the worst status of any (rank 0 usually decides; the reduction is also the
    last barrier), the process groups shut down."""
    status = int(slowest_rank([int(status)])[0])
    minipar.shutdown()
    return status


ADAMW = dict(betas=(0.9, 0.95), weight_decay=0.1)  # the GPT benchmarks' AdamW, beside their --lr


def markov(step: int, rank: int, args, device=None, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of ``rows`` (default ``args.batch``) sequences of the Markov "language"."""
    t = markov_batch(step, rank, rows or args.batch, args.seq, args.vocab)
    return t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)


def setting(mesh) -> str:
    """Where a run ran, for its first line."""
    return (f"world {mesh.world_size}, {dist.get_backend()} on {mesh.device}, {torch.get_num_threads()} "
            f"thread(s)/rank, torch {torch.__version__}")


def shape(args) -> str:
    return f"GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} vocab={args.vocab} seq={args.seq}"


def run_info(args, mesh) -> dict:
    """The start of a comparison's JSON: the command, versions, the world and the flags."""
    return {"command": command(), "torch": torch.__version__, "backend": dist.get_backend(), "device": str(mesh.device),
            "world_size": mesh.world_size, "threads_per_rank": torch.get_num_threads(),
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "check")}}


def compare(t: Timings, a: str, b: str, goal: float = 1.0, limit: float | None = None) -> dict:
    """a against b: the ratio of the medians (the headline, held to ``limit``) and the per-step paired ratios."""
    pair, r = t.paired(a, b), t.ratio(a, b)
    q = statistics.quantiles(pair, n=4) if len(pair) >= 2 else [pair[0]] * 3
    return {"median_s": [t.median(a), t.median(b)], "ratio_of_medians": r, "paired_median": statistics.median(pair),
            "paired_quartiles": [q[0], q[2]], "paired_min_max": [min(pair), max(pair)],
            "ratio_of_minima": min(t.timed(a)) / min(t.timed(b)), "goal": goal, "limit": limit,
            "goal_met": r <= goal, "ok": limit is None or r <= limit}


def print_comparison(c: dict, a: str = "minipar", b: str = "torch") -> None:
    (ma, mb), (lo, hi), (q1, q3) = c["median_s"], c["paired_min_max"], c["paired_quartiles"]
    print(f"\nmedian step: {a} {ma * 1e3:.2f} ms, {b} {mb * 1e3:.2f} ms")
    print(f"ratio {a}/{b} (of medians): {c['ratio_of_medians']:.3f}  (goal <= {c['goal']:.2f}"
          + (f", limit {c['limit']:.2f}: {'OK' if c['ok'] else 'OVER'})" if c["limit"] else ")"))
    print(f"per-step paired ratios: median {c['paired_median']:.3f}, quartiles {q1:.3f} .. {q3:.3f}, range "
          f"{lo:.3f} .. {hi:.3f}; ratio of the fastest steps {c['ratio_of_minima']:.3f}")


def step_table(t: Timings, a: str, b: str, **columns: list) -> str:
    """Each timed step of a and b side by side, their ratio, then ``columns`` (header: one value per step)."""
    return table(["step", f"{a} ms", f"{b} ms", "ratio", *columns], [
        [i, f"{x * 1e3:.2f}", f"{y * 1e3:.2f}", f"{x / y:.3f}", *row] for i, (x, y, *row) in
        enumerate(zip(t.timed(a), t.timed(b), *columns.values()))])


def ratio_table(t: Timings, pairs: dict[str, tuple[str, str]], tokens: dict[str, int], first: str = "comparison",
                extra: dict[str, dict] | None = None) -> str:
    """Per pair (name: (minipar's variant, torch's)): the two medians, their ratio and tokens/s (of
    ``tokens[name]`` per step); ``extra``: more columns, header: {name: cell}."""
    extra = extra or {}
    return table([first, "minipar median step", "torch median step", "minipar / torch", "minipar tok/s",
                  "torch tok/s", *extra], [
        [n, f"{t.median(a) * 1e3:.1f} ms", f"{t.median(b) * 1e3:.1f} ms", f"{t.ratio(a, b):.2f}",
         f"{tokens[n] / t.median(a):.0f}", f"{tokens[n] / t.median(b):.0f}", *(c[n] for c in extra.values())]
        for n, (a, b) in pairs.items()])


def per_op_tag(records, steps: int = 1) -> dict[str, dict[str, float]]:
    """{"op" and "op/tag": {"calls", "bytes", "wire_bytes"} per step} of comm records."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        for key in (r.op, f"{r.op}/{r.tag}"):
            row = out.setdefault(key, {"calls": 0, "bytes": 0, "wire_bytes": 0})
            for k, v in (("calls", 1), ("bytes", r.bytes), ("wire_bytes", r.wire_bytes)):
                row[k] += v / steps
    return dict(sorted(out.items()))


def agreement(losses: dict[str, list], pairs: dict[str, tuple[str, str]], steps: int, tolerance: float,
              each: bool = True) -> dict:
    """The first ``steps`` losses of each pair (name: (minipar's key, torch's)) printed, and the largest
    difference per pair (``each``) or over all, each line saying ok or MISMATCH."""
    diffs = {name: max(abs(x - y) for x, y in zip(losses[a][:steps], losses[b][:steps])) for name, (a, b) in pairs.items()}
    print(f"\nfirst {steps} steps' losses:\n" + "\n".join(
        f"  {k.split('/')[0]:8s} {k.split('/')[1]:16s} " + "  ".join(f"{x:.6f}" for x in losses[k][:steps])
        for ab in pairs.values() for k in ab))
    for name, d in diffs.items() if each else [("", max(diffs.values()))]:
        print(f"largest difference minipar vs torch{', ' + name if name else ''}: {d:.2e} "
              f"({'ok' if d <= tolerance else 'MISMATCH'}, tolerance {tolerance:g})")
    print("last step losses: " + ", ".join(f"{k.replace('/', ' ')} {losses[k][-1]:.4f}" for ab in pairs.values() for k in ab))
    return diffs


def run(main: Callable[[], int | None]) -> None:
    """Run ``main`` and exit with its status, after freeing what reference cycles hold (process groups)
    before the interpreter's teardown."""
    code = main()
    gc.collect()
    sys.exit(code or 0)
