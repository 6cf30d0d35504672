"""Parameter server against DDP at the same world size: step time and the busiest rank's bytes.

    torchrun --nproc_per_node=4 benchmarks/ps_vs_ddp.py [--servers 1 --steps N --warmup W
        --n-layer L --n-embd E --n-head H --vocab V --seq T --batch B --staleness K --json out.json]

One world of n processes runs, one after the other, on the same GPT (``minipar.models.GPT``) and
the same per-rank batch size B (so every computing rank does the same work per step):

  ddp        minipar.ShardedModule(strategy="ddp") over all n ranks: n ranks compute, one
             bucketed all-reduce of the gradients per step.
  ps sync    minipar.parameter_server.ParameterServer(servers=S, mode="sync"): S ranks serve,
             n - S compute; every round each worker pushes its gradient and pulls the parameters.
  ps async   the same with mode="async", staleness=K: servers step on each push as it arrives.

Each step is forward, loss, backward, synchronisation, AdamW step. A step's time is the slowest
computing rank's ``time.perf_counter`` interval (median over the timed steps); samples/s counts
the ranks that compute. Bytes are counted with ``mesh.comm.counting()`` on every rank, per step:
``sent`` is what the rank puts on the wire (a send's payload; an all-reduce's ring share
2(n-1)/n x B), ``received`` what it takes in (a recv's payload; the same ring share for an
all-reduce), ``through`` their sum. The busiest rank is the one with the most bytes through:
a server, which takes in W gradients and sends out W copies of its partition every step
(2 W Phi / S), against 4 (n-1)/n Phi on every DDP rank whatever n is. That is the bottleneck
all-reduce removes: the PS server's traffic grows with the number of workers, the ring's does not.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
import torch.distributed as dist

import minipar
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.parameter_server import ParameterServer


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per computing rank")
    p.add_argument("--staleness", type=int, default=1, help="the async run's bound")
    p.add_argument("--json", type=str, default=None)
    return p.parse_args()


def batch(args, step: int, rank: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)


def model_of(args) -> GPT:
    return GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                         n_embd=args.n_embd, seed=0))


def run_ddp(args, mesh) -> tuple[list[float], object]:
    ddp = minipar.ShardedModule(model_of(args), mesh=mesh, strategy="ddp")
    opt = ddp.build_optimizer(torch.optim.AdamW, lr=1e-3)
    times = []
    with mesh.comm.counting() as stats:
        for s in range(args.warmup + args.steps):
            if s == args.warmup:
                stats.records.clear()
            x = batch(args, s, mesh.rank, mesh.device)
            dist.barrier()
            t0 = time.perf_counter()
            ddp.train_step(x[:, :-1], x[:, 1:], gpt_loss)
            opt.step()
            opt.zero_grad()
            if mesh.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return times[args.warmup:], traffic(stats, args.steps, args.steps)


def run_ps(args, mesh, mode: str) -> tuple[list[float], object]:
    staleness = args.staleness if mode == "async" else None
    ps = ParameterServer(model_of(args), mesh, torch.optim.AdamW, servers=args.servers, mode=mode,
                         staleness=staleness, lr=1e-3)
    times = []
    with mesh.comm.counting() as stats:
        if ps.is_server:
            ps.serve()
        else:
            for s in range(args.warmup + args.steps):
                if s == args.warmup:
                    stats.records.clear()
                x = batch(args, s, mesh.rank, mesh.device)
                t0 = time.perf_counter()
                ps.train_step(x[:, :-1], x[:, 1:], gpt_loss)
                if mesh.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            ps.finish()
    if ps.is_server:
        # A server cannot tell warm-up rounds from timed ones (all rounds move the same bytes): it
        # received warmup + steps pushes and one "done" per worker, and sent warmup + steps replies.
        return [], traffic(stats, sent_rounds=args.warmup + args.steps, received_rounds=args.warmup + args.steps + 1)
    return times[args.warmup:], traffic(stats, args.steps, args.steps)


def traffic(stats, sent_rounds: int, received_rounds: int) -> dict[str, float]:
    """This rank's bytes per step: sent (wire), received, and their sum."""
    sent = received = 0.0
    for r in stats.records:
        if r.tag == "ps_done":  # a worker's "done": once per run, not per step
            continue
        if r.op == "recv":
            received += r.bytes / received_rounds
        elif r.op == "send":
            sent += r.wire_bytes / sent_rounds
        else:  # ring collectives: as much comes in as goes out
            sent += r.wire_bytes / sent_rounds
            received += r.wire_bytes / received_rounds
    return {"sent": sent, "received": received, "through": sent + received}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    mesh = minipar.init()
    n, S = mesh.world_size, args.servers
    param_bytes = sum(p.numel() * p.element_size() for p in model_of(args).parameters())
    rows = []
    for name, fn in (("ddp", lambda: run_ddp(args, mesh)), ("ps sync", lambda: run_ps(args, mesh, "sync")),
                     (f"ps async k={args.staleness}", lambda: run_ps(args, mesh, "async"))):
        times, mine = fn()
        every = mesh.comm.all_gather_object((times, mine), mesh.world, tag="report")
        computing = [t for t, _ in every if t]
        step_s = statistics.median(max(ts[i] for ts in computing) for i in range(args.steps))
        busiest = max(range(n), key=lambda r: every[r][1]["through"])
        workers = n if name == "ddp" else n - S
        rows.append(dict(side=name, step_s=step_s, samples_per_s=workers * args.batch / step_s, computing=workers,
                         busiest_rank=busiest, **{f"busiest_{k}": v for k, v in every[busiest][1].items()},
                         through_per_rank=[e[1]["through"] for e in every]))
        dist.barrier()
        gc.collect()
    if mesh.rank == 0:
        mib = 2**20
        print(f"world {n}: DDP on {n} ranks vs parameter server on {S} server(s) + {n - S} workers; "
              f"GPT {param_bytes / mib:.2f} MiB of parameters (Phi), {args.batch} x {args.seq} tokens per "
              f"computing rank, {args.steps} timed steps")
        print(f"{'side':<16}{'step ms':>9}{'samples/s':>11}{'busiest':>9}{'sent MiB':>10}{'recv MiB':>10}"
              f"{'through MiB':>13}{'/ Phi':>7}")
        for r in rows:
            print(f"{r['side']:<16}{1e3 * r['step_s']:>9.1f}{r['samples_per_s']:>11.1f}{r['busiest_rank']:>9}"
                  f"{r['busiest_sent'] / mib:>10.2f}{r['busiest_received'] / mib:>10.2f}"
                  f"{r['busiest_through'] / mib:>13.2f}{r['busiest_through'] / param_bytes:>7.2f}")
        print(f"theory per step: DDP every rank 4(n-1)/n Phi = {4 * (n - 1) / n:.2f} Phi; "
              f"PS busiest server 2 W Phi / S = {2 * (n - S) / S:.2f} Phi (whole tensors: the largest server "
              "holds a little more than Phi / S)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(world=n, servers=S, param_bytes=param_bytes, args=vars(args), rows=rows), f, indent=1)
    minipar.shutdown()


if __name__ == "__main__":
    main()
