"""DualPipeV's overlapped pairs hiding the MoE all-to-all: the MoE GPT at pp2 x dp2 x ep2 under
schedule="dualpipe_v", against its synchronous version (`dualpipe.without_overlap`: the same lists with
every receive blocking and no pair run together), and the planner's model of both.

    torchrun --nproc_per_node=4 benchmarks/dualpipe_moe.py [--steps 20 --microbatches 8 --json PATH]  # --help: all

Measured on each rank and step: the seconds this rank is blocked on the expert all-to-all (a synchronous
exchange's whole call, an overlapped one's wait), their median over steps and mean over ranks, and the step
time (slowest rank, paired steps). The planner's `minipar.plan.overlap.dualpipe_v_times` is given the
synchronous run's all-to-all seconds and its compute (the F, B and W spans less the all-to-all inside
them) and predicts the overlapped run's. Exit 1 unless both runs train the same losses (bitwise: the
pairs change the order of work, not its arithmetic).
"""

from __future__ import annotations

import statistics
import time

import torch

import harness
from minipar import ShardedModule
from minipar.models import MoEGPT, MoEGPTConfig
from minipar.pipeline.dualpipe import without_overlap
from minipar.pipeline.timeline import is_compute
from minipar.plan.overlap import dualpipe_v_times

TAGS = ("moe_dispatch", "moe_combine", "moe_counts")


class _Timed:
    """An all-to-all handle whose wait adds its seconds to ``blocked``."""

    def __init__(self, work, blocked: list) -> None:
        self._work, self._blocked = work, blocked

    def wait(self, *args):
        t = time.perf_counter()
        out = self._work.wait(*args)
        self._blocked[0] += time.perf_counter() - t
        return out


def timed_all_to_all(comm, blocked: list):
    """Wrap ``comm.all_to_all`` so that the time this rank is blocked on an MoE exchange adds to ``blocked``."""
    call = comm.all_to_all

    def all_to_all(output, input, group, output_splits=None, input_splits=None, async_op=False, tag=None):
        t = time.perf_counter()
        work = call(output, input, group, output_splits, input_splits, async_op=async_op, tag=tag)
        if tag not in TAGS:
            return work
        if async_op:
            return _Timed(work, blocked)
        blocked[0] += time.perf_counter() - t
        return work
    comm.all_to_all = all_to_all


def main() -> int:
    ap = harness.parser(__doc__, steps=20, warmup=3, batch=16, seq=64, vocab=512, n_layer=4, n_embd=128, n_head=4,
                        lr=1e-3, json=None, microbatches=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    args = ap.parse_args()
    mesh = harness.init(pp=2, dp=2, ep=2)
    cfg = MoEGPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                       n_embd=args.n_embd, n_experts=args.experts, top_k=args.top_k, capacity_factor=None, seed=0)
    blocked = [0.0]
    timed_all_to_all(mesh.comm, blocked)
    models, opts, figures = {}, {}, {}
    for name in ("overlapped", "synchronous"):
        models[name] = ShardedModule(MoEGPT(cfg), mesh=mesh, schedule="dualpipe_v", microbatches=args.microbatches,
                                     record_timeline=True)
        opts[name] = models[name].build_optimizer(torch.optim.AdamW, lr=args.lr)
        figures[name] = {"blocked": [], "compute": []}
    models["synchronous"].pipeline.actions = without_overlap(models["synchronous"].pipeline.actions)
    local = args.batch // mesh.dp
    batches = [tuple(t[mesh.dp_rank * local:(mesh.dp_rank + 1) * local] for t in harness.tokens(s, args.batch, args))
               for s in range(args.warmup + args.steps)]

    def step(name: str, i: int) -> float:
        blocked[0] = 0.0
        loss = models[name].train_step(*batches[i], models[name].cross_entropy)
        opts[name].step()
        opts[name].zero_grad()
        spans = sum(end - start for action, start, end in models[name].timeline if is_compute(action))
        figures[name]["blocked"].append(blocked[0])
        figures[name]["compute"].append(spans - blocked[0])
        return loss.item()
    t = harness.interleave({name: (lambda i, name=name: step(name, i)) for name in models}, args.steps, args.warmup)
    mine = {name: {k: statistics.median(v[args.warmup:]) for k, v in f.items()} for name, f in figures.items()}
    per_rank = mesh.comm.all_gather_object(mine, mesh.world, tag="report")
    status = int(t.results["overlapped"] != t.results["synchronous"])
    if mesh.rank == 0:
        mean = {name: {k: statistics.fmean(r[name][k] for r in per_rank) for k in ("blocked", "compute")} for name in models}
        sync, over = mean["synchronous"], mean["overlapped"]
        model = dualpipe_v_times(2, args.microbatches, sync["compute"], sync["blocked"])
        print(f"dualpipe_moe: MoE GPT, {args.n_layer} layers, {args.experts} experts top-{args.top_k} dropless, "
              f"n_embd {args.n_embd}, batch {args.batch} x seq {args.seq}, m={args.microbatches}, pp2 x dp2 x ep2 "
              f"({torch.distributed.get_backend()})\n")
        print(harness.table(["figure", "synchronous", "overlapped pairs", "overlapped / synchronous"], [
            ["median step (slowest rank)", f"{t.median('synchronous') * 1e3:.1f} ms", f"{t.median('overlapped') * 1e3:.1f} ms",
             f"{t.median('overlapped') / t.median('synchronous'):.2f}"],
            ["all-to-all blocked per step (mean rank)", f"{sync['blocked'] * 1e3:.1f} ms", f"{over['blocked'] * 1e3:.1f} ms",
             f"{over['blocked'] / sync['blocked']:.2f}"],
            ["planner: all-to-all exposed", f"{sync['blocked'] * 1e3:.1f} ms (given)",
             f"{model['exposed_ep_s'] * 1e3:.1f} ms ({model['pairs']} pairs, compute {sync['compute'] * 1e3:.1f} ms)",
             f"{model['exposed_ep_s'] / sync['blocked']:.2f}"],
            ["losses", "", "", "bitwise equal" if not status else "DIFFERENT"]]))
        harness.write_json(args.json, {"args": vars(args), "median_step_s": {k: t.median(k) for k in models},
                                       "blocked_all_to_all_s": {k: mean[k]["blocked"] for k in models},
                                       "compute_s": {k: mean[k]["compute"] for k in models},
                                       "planner": model, "losses_equal": not status})
    return harness.finish(status)


if __name__ == "__main__":
    harness.run(main)
