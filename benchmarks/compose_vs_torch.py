"""minipar compositions beside PyTorch's own: ZeRO-3 x pipeline and HSDP, 4 ranks on CPU.

    torchrun --nproc_per_node=4 benchmarks/compose_vs_torch.py [--microbatches 4 --json PATH --smoke]  # --help: all

A GPT (untied head), AdamW, every data-parallel rank its rows of the global batch. zero3_pp: minipar
zero3 with ``schedule="1f1b"`` on ``init(pp=2)`` against ``fully_shard`` over "dp" in each ``GPTStage``
under ``Schedule1F1B``; hsdp: minipar zero3 on ``init(dp_shard=2)`` against ``fully_shard`` on a 2-D
(replicate, shard) mesh (the same ranks per axis, checked). Printed: medians and minipar / torch (goal
<= 1.00), minipar's wire bytes in the last warm-up step by op and axis per rank, the first losses (exit 1
if they differ by more than ``--tolerance``).
"""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import harness
import minipar
from minipar.models import GPT, gpt_loss
from minipar.pipeline import GPTStage
from references import MiniparRunner, PipelineRunner, Runner, fsdp2

COMPARISONS = ("zero3_pp", "hsdp")
SMOKE = dict(steps=2, warmup=1, n_layer=2, n_embd=32, n_head=2, seq=16, batch=8, vocab=128)


def torch_pipeline(cfg, dmesh, m: int, opt_kwargs: dict, device) -> PipelineRunner:
    """FSDP2 over "dp" inside each stage of a 1F1B pipeline."""
    pp_rank, pp = dmesh["pp"].get_local_rank(), dmesh["pp"].size()
    module = GPTStage(GPT(cfg), pp_rank, pp).to(device)
    fsdp2(module, list(module.layers), dmesh["dp"], reshard_after_forward=False)
    stage = PipelineStage(module, pp_rank, pp, device, group=dmesh["pp"].get_group())
    return PipelineRunner(Schedule1F1B(stage, n_microbatches=m, loss_fn=gpt_loss), [module], pp_rank == 0,
                          pp_rank == pp - 1, opt_kwargs)


def hsdp_gpt(cfg, dmesh, device) -> torch.nn.Module:
    """FSDP2 on a 2-D ("replicate", "shard") mesh: HSDP."""
    module = GPT(cfg).to(device)
    return fsdp2(module, list(module.layers), dmesh)


def check_same_ranks(pairs) -> None:
    """Each (name, torch 1-D device mesh, minipar axis group) must hold the same ranks in the same order."""
    for name, torch_dim, axis in pairs:
        torch_ranks = dist.get_process_group_ranks(torch_dim.get_group())
        if torch_ranks != list(axis.ranks) or torch_dim.get_local_rank() != axis.rank:
            raise RuntimeError(f"rank {dist.get_rank()}: {name}: torch's group {torch_ranks} differs from "
                               f"minipar's {list(axis.ranks)}; the two sides would not run the same layout")


def main() -> int:
    ap = harness.parser(__doc__, steps=15, warmup=3, batch=8, seq=128, vocab=2048, n_layer=4,
                        n_embd=256, n_head=4, lr=1e-3, smoke=SMOKE, json=None, microbatches=4, check_steps=3,
                        tolerance=1e-4, help={"warmup": "untimed steps first (>= 1); the last one is counted",
                                              "batch": "sequences per data-parallel rank per step",
                                              "microbatches": "micro-batches per step of zero3_pp"})
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
    opt_kwargs = dict(lr=args.lr, **harness.ADAMW)
    runners = {"zero3_pp/minipar": MiniparRunner(cfg, pp_mesh, opt_kwargs, strategy="zero3", schedule="1f1b",
                                                 microbatches=m),
               "zero3_pp/torch": torch_pipeline(cfg, torch_pp, m, opt_kwargs, device),
               "hsdp/minipar": MiniparRunner(cfg, hsdp_mesh, opt_kwargs, strategy="zero3"),
               "hsdp/torch": Runner(hsdp_gpt(cfg, torch_hsdp, device), opt_kwargs)}
    if pp_mesh.rank == 0:
        print(f"compose_vs_torch: GPT {sum(p.numel() for p in GPT(cfg).parameters()) / 1e6:.2f}M parameters "
              f"(untied), {world} ranks, {dist.get_backend()}, {torch.get_num_threads()} thread/rank, {args.batch} x "
              f"{args.seq} tokens per data-parallel rank, {m} micro-batches (zero3_pp), torch {torch.__version__}")
        print(f"  zero3_pp: pp=2 x dp={pp_mesh.dp} (ZeRO-3), 1F1B; hsdp: dp={hsdp_mesh.dp} = "
              f"{hsdp_mesh.dp_replicate} replicas x shard groups of {hsdp_mesh.dp_shard} (ZeRO-3)", flush=True)
    gc.collect()  # the wrappers' hooks hold reference cycles: collect them before the timed steps

    def rows(step: int, mesh) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel rank's rows of the step's global batch, as (inputs, targets)."""
        mine = slice(mesh.dp_rank * args.batch, (mesh.dp_rank + 1) * args.batch)
        return tuple(t[mine].to(device) for t in harness.markov(step, 0, args, rows=mesh.dp * args.batch))

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
        pairs = {c: (f"{c}/minipar", f"{c}/torch") for c in COMPARISONS}
        ratios = {c: t.ratio(*pairs[c]) for c in COMPARISONS}
        tokens = {c: meshes[c].dp * args.batch * args.seq for c in COMPARISONS}
        print("\n" + harness.ratio_table(t, pairs, tokens))
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
        diffs = harness.agreement(losses, pairs, min(args.check_steps, args.warmup + args.steps), args.tolerance)
        status = int(max(diffs.values()) > args.tolerance)
        harness.write_json(args.json, {
            "args": vars(args), "torch": torch.__version__, "world_size": world,
            "median_step_s": {k: t.median(k) for k in runners}, "ratio_minipar_over_torch": ratios,
            "step_times_s": t.seconds, "losses": losses, "first_losses_max_diff": diffs,
            "minipar_comm_per_rank": [r["comm"] for r in everyone]})
    return harness.finish(status)


if __name__ == "__main__":
    harness.run(main)
