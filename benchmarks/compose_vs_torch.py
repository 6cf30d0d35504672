"""minipar compositions beside PyTorch's own: ZeRO-3 x pipeline and HSDP, 4 ranks on CPU.

    torchrun --nproc_per_node=4 benchmarks/compose_vs_torch.py [--steps 15 --warmup 3 --microbatches 4
        --batch 8 --seq 128 --n-layer 4 --n-embd 256 --n-head 4 --vocab 2048 --lr 1e-3 --json PATH]
    torchrun --nproc_per_node=4 benchmarks/compose_vs_torch.py --smoke      # tiny GPT, 1 + 2 steps

``--smoke`` stands for ``--steps 2 --warmup 1 --n-layer 2 --n-embd 32 --n-head 2 --seq 16 --batch 8
--vocab 128`` (arguments given beside it still win): every code path, the loss check and the exit
status in about half a minute, for tests. Its times mean nothing.

Four CPU processes (gloo, one thread each). Two comparisons, each a minipar
composition against the PyTorch composition of the same two mechanisms, both
training a GPT with untied embedding / LM head (``tie_weights=False``, so the
PyTorch pipeline needs no tied-weight sync), built from one seed on every rank
(the weights start equal), with the same AdamW (no gradient clipping):

* zero3_pp: ZeRO-3 on dp=2 under a 2-stage 1F1B pipeline (rank = pp_rank * 2 + dp_rank):
  minipar ``ShardedModule(GPT(cfg), mesh=minipar.init(pp=2), strategy="zero3",
  schedule="1f1b", microbatches=m)``, ``train_step(x, y, gpt_loss)``; PyTorch:
  each rank's ``minipar.pipeline.GPTStage(GPT(cfg), pp_rank, 2)`` with
  ``fully_shard`` on each block and then the stage over the "dp" dimension of
  ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))``, in a
  ``PipelineStage`` on the "pp" group driven by ``Schedule1F1B(stage, m,
  loss_fn=gpt_loss)`` (it scales gradients by 1/m and FSDP averages over dp,
  so both take the gradient of the global-batch mean loss). Both keep a
  stage's units gathered across the step's micro-batches (minipar's default
  under a pipeline; ``reshard_after_forward=False`` for FSDP2, as torchtitan
  does under PP) and reduce-scatter each gradient once per step.
* hsdp: ZeRO-3 sharded over groups of 2 ranks ({0,1} {2,3}) and replicated
  across them ({0,2} {1,3}): minipar ``ShardedModule(GPT(cfg),
  mesh=minipar.init(dp_shard=2), strategy="zero3")``, ``train_step``; PyTorch:
  ``fully_shard`` on each block and then the root over
  ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))``
  (a 2-D mesh makes it HSDP), forward, ``gpt_loss``, backward.

Every data-parallel rank takes its own ``--batch`` rows of the step's global
batch (Markov-chain tokens). The script checks, before training, that each
PyTorch mesh dimension holds the same ranks as the matching minipar axis.

A step is forward + backward + optimizer step + zero_grad, timed on every rank
from a barrier; its time is the slowest rank's. The four variants run
interleaved, one step each in turn, the starting variant rotating every step,
so drift of the shared machine hits them alike; the first ``--warmup`` steps
are left out of the medians. Printed: the median step times and the ratio
minipar / torch of each comparison (goal <= 1.00); the bytes minipar put on
the wire in one step (the last warm-up step, ``mesh.comm.counting()``) by op
and mesh axis on every rank; and the first ``--check-steps`` global-batch
losses of all four variants, which must agree: exit 1 if a minipar loss
differs from its PyTorch counterpart by more than ``--tolerance``, else 0.
``--json PATH`` writes the figures to PATH.

Note: minipar's ``train_step`` also all-reduces the loss so every rank reports
the global figure (PyTorch's pipeline returns it on the last stage only, and
plain FSDP2 keeps each rank's own): those scalar collectives count in
minipar's time. On this 2-core machine the defaults take about 1-2 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import minipar
from minipar import ShardedModule
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.models.data import markov_batch
from minipar.pipeline import GPTStage

COMPARISONS = ("zero3_pp", "hsdp")
SIDES = ("minipar", "torch")
SMOKE = dict(steps=2, warmup=1, n_layer=2, n_embd=32, n_head=2, seq=16, batch=8, vocab=128)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=15, help="measured steps per variant (after warm-up)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 1); the last one is counted")
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per step of zero3_pp")
    ap.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank per step")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (also the block size)")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--check-steps", type=int, default=3, help="first steps whose losses are compared")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes for a quick test: " +
                    " ".join(f"--{k.replace('_', '-')} {v}" for k, v in SMOKE.items()))
    ap.add_argument("--json", default=None, help="write the results here")
    if "--smoke" in sys.argv[1:]:  # smoke sizes become the defaults, so explicit arguments still win
        ap.set_defaults(**SMOKE)
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be >= 1")
    if args.batch % args.microbatches:
        ap.error(f"--batch {args.batch} must divide into --microbatches {args.microbatches}")
    return args


def adamw_kwargs(lr: float) -> dict:
    return dict(lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


class MiniparRunner:
    """minipar ZeRO-3 on ``mesh``: ``train_step`` returns the global-batch loss on every rank."""

    def __init__(self, cfg: GPTConfig, mesh: minipar.Mesh, lr: float, **layout) -> None:
        self.mesh = mesh
        self.model = ShardedModule(GPT(cfg), mesh=mesh, strategy="zero3", **layout)
        self.opt = self.model.build_optimizer(torch.optim.AdamW, **adamw_kwargs(lr))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        loss = self.model.train_step(x, y, gpt_loss)
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()


class TorchPipelineRunner:
    """FSDP2 over the "dp" dimension inside each stage of a torch.distributed.pipelining 1F1B pipeline.
    ``step`` returns this rank's mean micro-batch loss on the last stage, None elsewhere."""

    def __init__(self, cfg: GPTConfig, dmesh, m: int, lr: float, device: torch.device) -> None:
        pp_rank, pp = dmesh["pp"].get_local_rank(), dmesh["pp"].size()
        self.module = GPTStage(GPT(cfg), pp_rank, pp).to(device)
        for block in self.module.layers:
            fully_shard(block, mesh=dmesh["dp"], reshard_after_forward=False)
        fully_shard(self.module, mesh=dmesh["dp"], reshard_after_forward=False)
        self.first, self.last = pp_rank == 0, pp_rank == pp - 1
        stage = PipelineStage(self.module, pp_rank, pp, device, group=dmesh["pp"].get_group())
        self.schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=gpt_loss)
        self.opt = torch.optim.AdamW(self.module.parameters(), **adamw_kwargs(lr))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        loss = None
        if self.first:
            self.schedule.step(x)
        elif self.last:
            losses: list = []
            self.schedule.step(target=y, losses=losses)
            loss = torch.stack([l.detach() for l in losses]).mean().item()
        else:
            self.schedule.step()
        self.opt.step()
        self.opt.zero_grad()
        return loss


class TorchHSDPRunner:
    """FSDP2 on a 2-D ("replicate", "shard") mesh, i.e. HSDP. ``step`` returns this rank's loss."""

    def __init__(self, cfg: GPTConfig, dmesh, lr: float, device: torch.device) -> None:
        self.module = GPT(cfg).to(device)
        for block in self.module.layers:
            fully_shard(block, mesh=dmesh)
        fully_shard(self.module, mesh=dmesh)
        self.opt = torch.optim.AdamW(self.module.parameters(), **adamw_kwargs(lr))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        loss = gpt_loss(self.module(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()


def check_same_ranks(pairs: list[tuple[str, Any, minipar.AxisGroup]]) -> None:
    """Each (name, torch 1-D device mesh, minipar axis group) must hold the same ranks in the same
    order (this rank's index in both too), on every rank."""
    for name, torch_dim, axis in pairs:
        torch_ranks = dist.get_process_group_ranks(torch_dim.get_group())
        minipar_ranks = list(axis.ranks)
        if torch_ranks != minipar_ranks or torch_dim.get_local_rank() != axis.rank:
            raise RuntimeError(f"rank {dist.get_rank()}: {name}: torch's group {torch_ranks} differs from "
                               f"minipar's {minipar_ranks}; the two sides would not run the same layout")


def local_rows(step: int, mesh: minipar.Mesh, args) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's ``args.batch`` rows of the step's global batch, as (inputs, targets)."""
    tokens = markov_batch(step, 0, mesh.dp * args.batch, args.seq, args.vocab)
    mine = tokens[mesh.dp_rank * args.batch:(mesh.dp_rank + 1) * args.batch].to(mesh.device)
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def comm_table(summary: dict) -> dict[str, dict[str, int]]:
    """``CommStats.summary()`` with "op/axis" keys (JSON wants strings)."""
    return {f"{op}/{axis}": row for (op, axis), row in sorted(summary.items())}


def main() -> int:
    args = parse_args()
    pp_mesh = minipar.init(pp=2)
    torch.set_num_threads(1)
    world, device = dist.get_world_size(), pp_mesh.device
    if world % 2 or world < 4:
        raise SystemExit(f"compose_vs_torch needs an even world of at least 4 ranks (written for 4); got {world}")
    hsdp_mesh = minipar.init(dp_shard=2)
    main_rank = pp_mesh.rank == 0
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd, tie_weights=False, seed=0)
    m = args.microbatches

    # PyTorch's meshes, checked against minipar's groups: the grid (pp, dp) with dp fastest, and
    # dp split into (replicate, shard) with shard fastest.
    torch_pp_mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("pp", "dp"))
    torch_hsdp_mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    check_same_ranks([("pp", torch_pp_mesh["pp"], pp_mesh.group("pp")),
                      ("dp", torch_pp_mesh["dp"], pp_mesh.group("dp")),
                      ("shard", torch_hsdp_mesh["shard"], hsdp_mesh.group("dp_shard")),
                      ("replicate", torch_hsdp_mesh["replicate"], hsdp_mesh.group("dp_replicate"))])

    meshes = {"zero3_pp": pp_mesh, "hsdp": hsdp_mesh}
    runners = {
        ("zero3_pp", "minipar"): MiniparRunner(cfg, pp_mesh, args.lr, schedule="1f1b", microbatches=m),
        ("zero3_pp", "torch"): TorchPipelineRunner(cfg, torch_pp_mesh, m, args.lr, device),
        ("hsdp", "minipar"): MiniparRunner(cfg, hsdp_mesh, args.lr),
        ("hsdp", "torch"): TorchHSDPRunner(cfg, torch_hsdp_mesh, args.lr, device),
    }
    keys = list(runners)
    if main_rank:
        n = sum(p.numel() for p in GPT(cfg).parameters())
        print(f"compose_vs_torch: GPT {n / 1e6:.2f}M parameters (untied), {world} ranks, {dist.get_backend()}, "
              f"{torch.get_num_threads()} thread/rank, {args.batch} x {args.seq} tokens per data-parallel rank, "
              f"{m} micro-batches (zero3_pp), torch {torch.__version__}", flush=True)
        print(f"  zero3_pp: pp=2 x dp={pp_mesh.dp} (ZeRO-3), 1F1B; hsdp: dp={hsdp_mesh.dp} = "
              f"{hsdp_mesh.dp_replicate} replicas x shard groups of {hsdp_mesh.dp_shard} (ZeRO-3)", flush=True)
    gc.collect()  # the wrappers' hooks hold reference cycles: collect them before the timed steps

    times: dict = {k: [] for k in keys}
    losses: dict = {k: [] for k in keys}
    comm: dict = {}
    total = args.warmup + args.steps
    for step in range(total):
        batches = {c: local_rows(step, meshes[c], args) for c in COMPARISONS}
        k0 = step % len(keys)
        for key in keys[k0:] + keys[:k0]:
            x, y = batches[key[0]]
            runner = runners[key]
            counted = step == args.warmup - 1 and key[1] == "minipar"  # in warm-up: the medians leave it out
            dist.barrier()  # aligned start, not timed
            with runner.mesh.comm.counting() if counted else contextlib.nullcontext() as stats:
                t0 = time.perf_counter()
                loss = runner.step(x, y)
                times[key].append(time.perf_counter() - t0)
            if counted:
                comm[key[0]] = comm_table(stats.summary())
            losses[key].append(loss)
        if main_rank and (step % 5 == 0 or step == total - 1):
            print(f"step {step:3d}  " + "  ".join(f"{c} {s} {times[(c, s)][-1] * 1e3:7.1f} ms" for c, s in keys),
                  flush=True)

    # Every rank's times, losses and counters, on rank 0.
    everyone = [None] * world
    dist.all_gather_object(everyone, {"times": times, "losses": losses, "comm": comm})
    status = 0
    if main_rank:
        # A step's time is the slowest rank's (each rank timed from the same barrier).
        step_times = {k: [max(r["times"][k][i] for r in everyone) for i in range(total)] for k in keys}
        med = {k: statistics.median(v[args.warmup:]) for k, v in step_times.items()}
        ratios = {c: med[(c, "minipar")] / med[(c, "torch")] for c in COMPARISONS}
        # Global-batch losses: minipar's is on every rank; torch's is the mean of the ranks that
        # hold one (the last stage of each pipeline; every rank under HSDP), each over its own rows.
        global_losses = {}
        for k in keys:
            per_step = [[r["losses"][k][i] for r in everyone if r["losses"][k][i] is not None] for i in range(total)]
            global_losses[k] = [statistics.fmean(v) for v in per_step]
        nchk = min(args.check_steps, total)
        diffs = {c: max(abs(global_losses[(c, "minipar")][i] - global_losses[(c, "torch")][i]) for i in range(nchk))
                 for c in COMPARISONS}
        status = 0 if max(diffs.values()) <= args.tolerance else 1

        print("\n| comparison | minipar median step | torch median step | minipar / torch | minipar tok/s | "
              "torch tok/s |")
        print("|---|---|---|---|---|---|")
        for c in COMPARISONS:
            a, b = med[(c, "minipar")], med[(c, "torch")]
            tokens = meshes[c].dp * args.batch * args.seq
            print(f"| {c} | {a * 1e3:.1f} ms | {b * 1e3:.1f} ms | {ratios[c]:.2f} | {tokens / a:.0f} | "
                  f"{tokens / b:.0f} |")

        mib = 2**20
        print(f"\nminipar's wire bytes in one step (warm-up step {args.warmup - 1}; ring figures, MiB sent by "
              "each rank), by op / mesh axis:")
        for c in COMPARISONS:
            rows = sorted({row for r in everyone for row in r["comm"].get(c, {})})
            print(f"  {c + ':':46}" + "".join(f"{'rank ' + str(i):>10}" for i in range(world)))
            for row in rows + ["total"]:
                cells = []
                for r in everyone:
                    table = r["comm"].get(c, {})
                    w = sum(v["wire_bytes"] for v in table.values()) if row == "total" else \
                        table.get(row, {}).get("wire_bytes", 0)
                    cells.append(f"{w / mib:10.3f}")
                calls = everyone[0]["comm"].get(c, {}).get(row, {}).get("calls")
                label = f"{row} ({calls} on rank 0)" if calls is not None else row
                print(f"    {label:44}" + "".join(cells))

        print(f"\nfirst {nchk} steps' global-batch losses:")
        for k in keys:
            print(f"  {k[0]:8s} {k[1]:7s} " + "  ".join(f"{v:.6f}" for v in global_losses[k][:nchk]))
        for c in COMPARISONS:
            print(f"largest difference minipar vs torch, {c}: {diffs[c]:.2e} "
                  f"({'ok' if diffs[c] <= args.tolerance else 'MISMATCH'}, tolerance {args.tolerance:g})")
        print("last step losses: " + ", ".join(f"{c} {s} {global_losses[(c, s)][-1]:.4f}" for c, s in keys))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "torch": torch.__version__, "world_size": world,
                           "median_step_s": {f"{c}/{s}": v for (c, s), v in med.items()},
                           "ratio_minipar_over_torch": ratios,
                           "step_times_s": {f"{c}/{s}": v for (c, s), v in step_times.items()},
                           "losses": {f"{c}/{s}": v for (c, s), v in global_losses.items()},
                           "first_losses_max_diff": diffs,
                           "minipar_comm_per_rank": [r["comm"] for r in everyone]}, f, indent=2)
            print(f"results: {args.json}")
    verdict = [status]
    dist.broadcast_object_list(verdict, src=0)
    minipar.shutdown()
    return int(verdict[0])


if __name__ == "__main__":
    code = main()
    gc.collect()  # free what reference cycles hold (process groups) before interpreter teardown
    sys.exit(code)
