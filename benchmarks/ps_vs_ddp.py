"""Parameter server against DDP at the same world size: step time and the busiest rank's bytes.

    torchrun --nproc_per_node=4 benchmarks/ps_vs_ddp.py [--servers 1 --staleness K --json out.json]  # --help: all

The same GPT and per-rank batch under ``ddp`` (all n ranks compute), ``ps sync`` and ``ps async``
(`ParameterServer`: S servers, n - S workers, timed unaligned: the servers reach no barrier). Printed:
step time, samples/s, the busiest rank's bytes per step: a server moves 2 W Phi / S, a DDP rank 4 (n-1)/n Phi.
"""

from __future__ import annotations

import gc
import statistics

import torch
import torch.distributed as dist

import harness
import minipar
from minipar.models import GPT, gpt_loss
from minipar.data_parallel.parameter_server import ParameterServer


def traffic(stats, sent_rounds: int, received_rounds: int) -> dict[str, float]:
    """This rank's bytes per step: sent (wire), received, and their sum."""
    records = [r for r in stats.records if r.tag != "ps_done"]  # a worker's "done": once per run, not per step
    sent = sum(r.wire_bytes for r in records if r.op != "recv") / sent_rounds
    # a recv takes in its payload; a ring collective takes in as much as it sends
    received = sum(r.bytes if r.op == "recv" else r.wire_bytes for r in records if r.op != "send") / received_rounds
    return {"sent": sent, "received": received, "through": sent + received}


def run(args, mesh, mode: str | None) -> tuple[list[float], dict]:
    """(each step's time, the slowest computing rank's; this rank's traffic) of DDP (mode None) or the
    parameter server in ``mode``."""
    model = GPT(harness.gpt_config(args, seed=0))
    if mode is None:
        train = minipar.ShardedModule(model, mesh=mesh, strategy="ddp")
        opt = train.build_optimizer(torch.optim.AdamW, lr=1e-3)
    else:
        train = ParameterServer(model, mesh, torch.optim.AdamW, servers=args.servers, mode=mode,
                                staleness=args.staleness if mode == "async" else None, lr=1e-3)
    total, server = args.warmup + args.steps, mode is not None and train.is_server

    def step(i: int) -> None:
        if i == args.warmup:
            stats.records.clear()
        x, y = harness.tokens(1000 * i + mesh.rank, args.batch, args, mesh.device)
        train.train_step(x, y, gpt_loss)
        if mode is None:
            opt.step()
            opt.zero_grad()

    with mesh.comm.counting() as stats:
        if server:
            train.serve()
        else:
            t = harness.interleave({"step": step}, args.steps, args.warmup, aligned=mode is None)
            if mode is not None:
                train.finish()
    times = [0.0] * args.steps if server else t.timed("step")
    if mode is not None:  # a server's zeros leave the maximum to the computing ranks
        times = harness.slowest_rank(times)
    # a server received warmup + steps pushes and one "done" per worker, and sent warmup + steps replies
    return times, traffic(stats, total, total + 1) if server else traffic(stats, args.steps, args.steps)


def main() -> None:
    ap = harness.parser(__doc__, steps=10, warmup=2, n_layer=2, n_embd=128, n_head=4, vocab=2048, seq=64, batch=4,
                        json=None, help={"batch": "sequences per computing rank"})
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--staleness", type=int, default=1, help="the async run's bound")
    args = ap.parse_args()
    mesh = harness.init()
    n, S, mib = mesh.world_size, args.servers, 2**20
    param_bytes = sum(p.numel() * p.element_size() for p in GPT(harness.gpt_config(args, seed=0)).parameters())
    rows = []
    for name, mode in (("ddp", None), ("ps sync", "sync"), (f"ps async k={args.staleness}", "async")):
        times, mine = run(args, mesh, mode)
        every = mesh.comm.all_gather_object(mine, mesh.world, tag="report")
        step_s = statistics.median(times)
        busiest = max(range(n), key=lambda r: every[r]["through"])
        workers = n if mode is None else n - S
        rows.append(dict(side=name, step_s=step_s, samples_per_s=workers * args.batch / step_s, computing=workers,
                         busiest_rank=busiest, **{f"busiest_{k}": v for k, v in every[busiest].items()},
                         through_per_rank=[e["through"] for e in every]))
        dist.barrier()
        gc.collect()
    if mesh.rank == 0:
        print(f"world {n}: DDP on {n} ranks vs parameter server on {S} server(s) + {n - S} workers; "
              f"GPT {param_bytes / mib:.2f} MiB of parameters (Phi), {args.batch} x {args.seq} tokens per "
              f"computing rank, {args.steps} timed steps")
        print(harness.table(["side", "step ms", "samples/s", "busiest", "sent MiB", "recv MiB", "through MiB", "/ Phi"], [
            [r["side"], f"{1e3 * r['step_s']:.1f}", f"{r['samples_per_s']:.1f}", r["busiest_rank"],
             f"{r['busiest_sent'] / mib:.2f}", f"{r['busiest_received'] / mib:.2f}", f"{r['busiest_through'] / mib:.2f}",
             f"{r['busiest_through'] / param_bytes:.2f}"] for r in rows]))
        print(f"theory per step: DDP every rank 4(n-1)/n Phi = {4 * (n - 1) / n:.2f} Phi; "
              f"PS busiest server 2 W Phi / S = {2 * (n - S) / S:.2f} Phi (whole tensors: the largest server "
              "holds a little more than Phi / S)")
        harness.write_json(args.json, dict(world=n, servers=S, param_bytes=param_bytes, args=vars(args), rows=rows))
    minipar.shutdown()


if __name__ == "__main__":
    harness.run(main)
