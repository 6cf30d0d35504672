"""minipar compositions beside PyTorch's own: ZeRO-3 x pipeline and HSDP, 4 ranks on CPU.

    torchrun --nproc_per_node=4 benchmarks/compose_vs_torch.py [--steps 15 --warmup 3 --microbatches 4
        --batch 8 --seq 128 --n-layer 4 --n-embd 256 --n-head 4 --vocab 2048 --lr 1e-3 --json PATH] [--smoke]

Both train a GPT (untied head) with AdamW, every data-parallel rank its rows of the global batch.
zero3_pp: minipar ``ShardedModule(strategy="zero3", schedule="1f1b")`` on ``init(pp=2)`` against
``fully_shard`` over "dp" in each ``GPTStage`` driven by ``Schedule1F1B``; hsdp: minipar zero3 on
``init(dp_shard=2)`` against ``fully_shard`` on a 2-D (replicate, shard) mesh (the same ranks per axis,
checked). Timed by `harness.interleave`. Printed: medians and minipar / torch (goal <= 1.00), minipar's
wire bytes in the last warm-up step by op and axis per rank, the first losses: exit 1 if they differ
by more than ``--tolerance``.
"""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import harness
import minipar
from minipar import ShardedModule
from minipar.models import GPT, gpt_loss
from minipar.models.data import markov_batch
from minipar.pipeline import GPTStage

COMPARISONS = ("zero3_pp", "hsdp")
SMOKE = dict(steps=2, warmup=1, n_layer=2, n_embd=32, n_head=2, seq=16, batch=8, vocab=128)


ADAMW = dict(betas=(0.9, 0.95), weight_decay=0.1)


class Runner:
    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """One training step: the loss this rank sees (None where it has none), then AdamW."""
        loss = self.loss(x, y)
        self.opt.step()
        self.opt.zero_grad()
        return loss


class MiniparRunner(Runner):
    """minipar ZeRO-3 on ``mesh``: ``train_step`` returns the global-batch loss on every rank."""

    def __init__(self, cfg, mesh: minipar.Mesh, lr: float, **layout) -> None:
        self.model = ShardedModule(GPT(cfg), mesh=mesh, strategy="zero3", **layout)
        self.opt = self.model.build_optimizer(torch.optim.AdamW, lr=lr, **ADAMW)

    def loss(self, x, y) -> float:
        return self.model.train_step(x, y, gpt_loss).item()


class TorchPipelineRunner(Runner):
    """FSDP2 over "dp" inside each stage of a 1F1B pipeline: the mean micro-batch loss on the last stage."""

    def __init__(self, cfg, dmesh, m: int, lr: float, device) -> None:
        pp_rank, pp = dmesh["pp"].get_local_rank(), dmesh["pp"].size()
        self.module = GPTStage(GPT(cfg), pp_rank, pp).to(device)
        for unit in [*self.module.layers, self.module]:
            fully_shard(unit, mesh=dmesh["dp"], reshard_after_forward=False)
        self.first, self.last = pp_rank == 0, pp_rank == pp - 1
        stage = PipelineStage(self.module, pp_rank, pp, device, group=dmesh["pp"].get_group())
        self.schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=gpt_loss)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=lr, **ADAMW)

    def loss(self, x, y) -> float | None:
        losses: list = []
        self.schedule.step(*((x,) if self.first else ()), **(dict(target=y, losses=losses) if self.last else {}))
        return torch.stack([loss.detach() for loss in losses]).mean().item() if self.last else None


class TorchHSDPRunner(Runner):
    """FSDP2 on a 2-D ("replicate", "shard") mesh, i.e. HSDP: this rank's loss."""

    def __init__(self, cfg, dmesh, lr: float, device) -> None:
        self.module = GPT(cfg).to(device)
        for unit in [*self.module.layers, self.module]:
            fully_shard(unit, mesh=dmesh)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=lr, **ADAMW)

    def loss(self, x, y) -> float:
        loss = gpt_loss(self.module(x), y)
        loss.backward()
        return loss.item()


def check_same_ranks(pairs) -> None:
    """Each (name, torch 1-D device mesh, minipar axis group) must hold the same ranks in the same order."""
    for name, torch_dim, axis in pairs:
        torch_ranks = dist.get_process_group_ranks(torch_dim.get_group())
        if torch_ranks != list(axis.ranks) or torch_dim.get_local_rank() != axis.rank:
            raise RuntimeError(f"rank {dist.get_rank()}: {name}: torch's group {torch_ranks} differs from "
                               f"minipar's {list(axis.ranks)}; the two sides would not run the same layout")


def main() -> int:
    ap = harness.parser(__doc__, steps=15, warmup=3, batch=8, seq=128, vocab=2048, n_layer=4,
                        n_embd=256, n_head=4, lr=1e-3, smoke=SMOKE, json=None,
                        help={"warmup": "untimed steps first (>= 1); the last one is counted",
                              "batch": "sequences per data-parallel rank per step"})
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per step of zero3_pp")
    ap.add_argument("--check-steps", type=int, default=3, help="first steps whose losses are compared")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be >= 1")
    if args.batch % args.microbatches:
        ap.error(f"--batch {args.batch} must divide into --microbatches {args.microbatches}")
    pp_mesh = harness.init(pp=2)
    world, device = pp_mesh.world_size, pp_mesh.device
    if world % 2 or world < 4:
        raise SystemExit(f"compose_vs_torch needs an even world of at least 4 ranks (written for 4); got {world}")
    hsdp_mesh = minipar.init(dp_shard=2)
    cfg = harness.gpt_config(args, tie_weights=False, seed=0)
    m = args.microbatches
    # PyTorch's meshes: (pp, dp) with dp fastest, and dp as (replicate, shard) with shard fastest.
    torch_pp = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("pp", "dp"))
    torch_hsdp = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    check_same_ranks([("pp", torch_pp["pp"], pp_mesh.group("pp")), ("dp", torch_pp["dp"], pp_mesh.group("dp")),
                      ("shard", torch_hsdp["shard"], hsdp_mesh.group("dp_shard")),
                      ("replicate", torch_hsdp["replicate"], hsdp_mesh.group("dp_replicate"))])
    meshes = {"zero3_pp": pp_mesh, "hsdp": hsdp_mesh}
    runners = {"zero3_pp/minipar": MiniparRunner(cfg, pp_mesh, args.lr, schedule="1f1b", microbatches=m),
               "zero3_pp/torch": TorchPipelineRunner(cfg, torch_pp, m, args.lr, device),
               "hsdp/minipar": MiniparRunner(cfg, hsdp_mesh, args.lr),
               "hsdp/torch": TorchHSDPRunner(cfg, torch_hsdp, args.lr, device)}
    if pp_mesh.rank == 0:
        print(f"compose_vs_torch: GPT {sum(p.numel() for p in GPT(cfg).parameters()) / 1e6:.2f}M parameters "
              f"(untied), {world} ranks, {dist.get_backend()}, {torch.get_num_threads()} thread/rank, {args.batch} x "
              f"{args.seq} tokens per data-parallel rank, {m} micro-batches (zero3_pp), torch {torch.__version__}")
        print(f"  zero3_pp: pp=2 x dp={pp_mesh.dp} (ZeRO-3), 1F1B; hsdp: dp={hsdp_mesh.dp} = "
              f"{hsdp_mesh.dp_replicate} replicas x shard groups of {hsdp_mesh.dp_shard} (ZeRO-3)", flush=True)
    gc.collect()  # the wrappers' hooks hold reference cycles: collect them before the timed steps

    def rows(step: int, mesh) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel rank's rows of the step's global batch, as (inputs, targets)."""
        tokens = markov_batch(step, 0, mesh.dp * args.batch, args.seq, args.vocab)
        mine = tokens[mesh.dp_rank * args.batch:(mesh.dp_rank + 1) * args.batch].to(device)
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()

    batches = [{c: rows(s, meshes[c]) for c in COMPARISONS} for s in range(args.warmup + args.steps)]
    comm: dict = {}

    def step(key: str, i: int) -> float | None:
        comparison, side = key.split("/")
        counted = i == args.warmup - 1 and side == "minipar"  # in warm-up: the medians leave it out
        with meshes[comparison].comm.counting() if counted else contextlib.nullcontext() as stats:
            loss = runners[key].step(*batches[i][comparison])
        if counted:
            comm[comparison] = {f"{op}/{axis}": row for (op, axis), row in sorted(stats.summary().items())}
        return loss

    t = harness.interleave({k: (lambda i, k=k: step(k, i)) for k in runners}, args.steps, args.warmup, log_every=5)
    everyone = pp_mesh.comm.all_gather_object({"losses": t.results, "comm": comm}, pp_mesh.world, tag="report")
    losses = harness.gathered_losses([r["losses"] for r in everyone])  # global-batch losses
    status = 0
    if pp_mesh.rank == 0:
        ratios = {c: t.ratio(f"{c}/minipar", f"{c}/torch") for c in COMPARISONS}
        nchk = min(args.check_steps, args.warmup + args.steps)
        diffs = {c: max(abs(a - b) for a, b in zip(losses[f"{c}/minipar"][:nchk], losses[f"{c}/torch"][:nchk]))
                 for c in COMPARISONS}
        status = 0 if max(diffs.values()) <= args.tolerance else 1
        table = []
        for c in COMPARISONS:
            a, b, tokens = t.median(f"{c}/minipar"), t.median(f"{c}/torch"), meshes[c].dp * args.batch * args.seq
            table.append([c, f"{a * 1e3:.1f} ms", f"{b * 1e3:.1f} ms", f"{ratios[c]:.2f}", f"{tokens / a:.0f}",
                          f"{tokens / b:.0f}"])
        print("\n" + harness.table(["comparison", "minipar median step", "torch median step", "minipar / torch",
                                    "minipar tok/s", "torch tok/s"], table))
        print(f"\nminipar's wire bytes in one step (warm-up step {args.warmup - 1}; ring figures, MiB sent by "
              "each rank), by op / mesh axis:")
        for c in COMPARISONS:
            print(f"  {c + ':':46}" + "".join(f"{'rank ' + str(i):>10}" for i in range(world)))
            for row in sorted({row for r in everyone for row in r["comm"].get(c, {})}) + ["total"]:
                tables = [r["comm"].get(c, {}) for r in everyone]
                wire = [sum(v["wire_bytes"] for v in tb.values()) if row == "total" else
                        tb.get(row, {}).get("wire_bytes", 0) for tb in tables]
                calls = tables[0].get(row, {}).get("calls")
                label = f"{row} ({calls} on rank 0)" if calls is not None else row
                print(f"    {label:44}" + "".join(f"{w / 2**20:10.3f}" for w in wire))
        print(f"\nfirst {nchk} steps' global-batch losses:\n" + "\n".join(
            f"  {k.split('/')[0]:8s} {k.split('/')[1]:7s} " + "  ".join(f"{v:.6f}" for v in losses[k][:nchk])
            for k in runners))
        for c in COMPARISONS:
            print(f"largest difference minipar vs torch, {c}: {diffs[c]:.2e} "
                  f"({'ok' if diffs[c] <= args.tolerance else 'MISMATCH'}, tolerance {args.tolerance:g})")
        print("last step losses: " + ", ".join(f"{k.replace('/', ' ')} {v[-1]:.4f}" for k, v in losses.items()))
        harness.write_json(args.json, {
            "args": vars(args), "torch": torch.__version__, "world_size": world,
            "median_step_s": {k: t.median(k) for k in runners}, "ratio_minipar_over_torch": ratios,
            "step_times_s": t.seconds, "losses": losses, "first_losses_max_diff": diffs,
            "minipar_comm_per_rank": [r["comm"] for r in everyone]})
    status = harness.agree(status)
    minipar.shutdown()
    return status


if __name__ == "__main__":
    harness.run(main)
