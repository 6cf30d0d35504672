"""Offload levels against none: step time, where the state lives, and what moves per step.

    torchrun --nproc_per_node=2 benchmarks/offload.py [--steps N --warmup W --n-layer L --n-embd E
        --n-head H --vocab V --seq T --batch B --path DIR --chunk-mb C --bf16 --json out.json]

The same GPT (``minipar.models.GPT``) under ``strategy="zero3"`` and each `minipar.Offload` level,
one after the other in one world:

  none             everything on the compute device
  opt=cpu          fp32 masters and AdamW's moments in host memory (ZeRO-Offload)
  opt=nvme         the same in files under --path, stepped in chunks (ZeRO-Infinity)
  opt=cpu,par=cpu  and the parameter shards in host memory, copied in before each gather
  opt=nvme,par=nvme  everything but the gradient shards in files

Columns: the median step time (forward, backward, AdamW step; the slowest rank) and its ratio to
``none``; bytes this rank keeps on the device (params + grads + optimizer from
``memory_stats()``), in host memory and on disk; and the bytes offloading moved in the last step
(``offload_traffic()``: to the device, to the host, read from and written to disk), which
``minipar.offload.offload_traffic`` predicts exactly (the tests prove it). On a GPU the peak
device memory of the step is printed too. The trade-off the table shows: each level moves
state off the device for time spent copying it (and, for nvme, reading and writing it).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import minipar
from minipar.models import GPT, GPTConfig, gpt_loss

LEVELS = [("none", None, None), ("opt=cpu", "cpu", None), ("opt=nvme", "nvme", None),
          ("opt=cpu,par=cpu", "cpu", "cpu"), ("opt=nvme,par=nvme", "nvme", "nvme")]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--path", type=str, default="/tmp/minipar-offload-bench", help="where nvme files go")
    p.add_argument("--chunk-mb", type=float, default=16.0)
    p.add_argument("--bf16", action="store_true", help="bf16 compute (fp32 masters)")
    p.add_argument("--json", type=str, default=None)
    return p.parse_args()


def run(args, mesh, opt_where, params_where) -> dict:
    off = None
    if opt_where is not None:
        nvme = "nvme" in (opt_where, params_where)
        off = minipar.Offload(optimizer=opt_where, params=params_where, path=args.path if nvme else None,
                              chunk_mb=args.chunk_mb)
    precision = minipar.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    model = minipar.ShardedModule(GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer,
                                                n_head=args.n_head, n_embd=args.n_embd, seed=0)),
                                  mesh=mesh, strategy="zero3", offload=off, mixed_precision=precision)
    opt = model.build_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    cuda = mesh.device.type == "cuda"
    times, moved = [], {}
    for s in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(1000 * s + mesh.rank)
        x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(mesh.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(mesh.device)
        before = model.strategy.offload_traffic()
        dist.barrier()
        t0 = time.perf_counter()
        model.train_step(x[:, :-1], x[:, 1:], gpt_loss)
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        after = model.strategy.offload_traffic()
        moved = {k: after[k] - before[k] for k in after}
    mem = model.memory_stats()
    out = dict(times=times[args.warmup:], device=mem["params"] + mem["grads"] + mem["optimizer"],
               host=mem.get("host", 0), disk=mem.get("disk", 0), moved=moved,
               peak=torch.cuda.max_memory_allocated(mesh.device) if cuda else None)
    del model, opt
    gc.collect()
    return out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    Path(args.path).mkdir(parents=True, exist_ok=True)
    mesh = minipar.init()
    rows = []
    for name, opt_where, params_where in LEVELS:
        mine = run(args, mesh, opt_where, params_where)
        every = mesh.comm.all_gather_object(mine["times"], mesh.world, tag="report")
        step_s = statistics.median(max(ts[i] for ts in every) for i in range(args.steps))
        rows.append(dict(level=name, step_s=step_s, **{k: v for k, v in mine.items() if k != "times"}))
    base = rows[0]["step_s"]
    for r in rows:
        r["vs_none"] = r["step_s"] / base
    if mesh.rank == 0:
        n_params = sum(p.numel() for p in GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq,
                                                        n_layer=args.n_layer, n_head=args.n_head,
                                                        n_embd=args.n_embd, seed=0)).parameters())
        print(f"offload levels, zero3 over {mesh.world_size} ranks ({mesh.device.type}), GPT {n_params:,} parameters, "
              f"{'bf16' if args.bf16 else 'fp32'}, batch {args.batch}x{args.seq} per rank; rank 0's bytes")
        head = f"{'level':<19}{'step ms':>9}{'vs none':>9}{'device KiB':>12}{'host KiB':>10}{'disk KiB':>10}" \
               f"{'->dev KiB':>11}{'->host KiB':>11}{'read KiB':>10}{'write KiB':>11}"
        print(head + ("" if rows[0]["peak"] is None else f"{'peak MiB':>10}"))
        for r in rows:
            m = r["moved"]
            line = (f"{r['level']:<19}{r['step_s'] * 1e3:>9.1f}{r['vs_none']:>9.2f}{r['device'] / 1024:>12.1f}"
                    f"{r['host'] / 1024:>10.1f}{r['disk'] / 1024:>10.1f}{m['to_device'] / 1024:>11.1f}"
                    f"{m['to_host'] / 1024:>11.1f}{m['disk_read'] / 1024:>10.1f}{m['disk_write'] / 1024:>11.1f}")
            print(line + ("" if r["peak"] is None else f"{r['peak'] / 2**20:>10.1f}"))
        if args.json:
            Path(args.json).write_text(json.dumps(dict(world=mesh.world_size, device=mesh.device.type,
                                                       params=n_params, rows=rows), indent=1))
    minipar.shutdown()


if __name__ == "__main__":
    main()
