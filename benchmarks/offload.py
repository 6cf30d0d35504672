"""Offload levels against none: step time, where the state lives, and what moves per step.

    torchrun --nproc_per_node=2 benchmarks/offload.py [--path DIR --chunk-mb C --bf16 --json out.json]  # --help: all

The same GPT under zero3 and each `minipar.Offload` level (LEVELS: optimizer state in host memory or in
files under --path, and the parameter shards too). Columns: the median step and its ratio to none; bytes
on the device, in host memory, on disk; what offloading moved in the last step; on a GPU the peak.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

import harness
import minipar
from minipar.models import GPT, gpt_loss

LEVELS = [("none", None, None), ("opt=cpu", "cpu", None), ("opt=nvme", "nvme", None),
          ("opt=cpu,par=cpu", "cpu", "cpu"), ("opt=nvme,par=nvme", "nvme", "nvme")]


def run(args, mesh, name: str, opt_where, params_where) -> dict:
    nvme = "nvme" in (opt_where, params_where)
    off = None if opt_where is None else minipar.Offload(optimizer=opt_where, params=params_where,
                                                         path=args.path if nvme else None, chunk_mb=args.chunk_mb)
    model = minipar.ShardedModule(GPT(harness.gpt_config(args, seed=0)), mesh=mesh, strategy="zero3", offload=off,
                                  mixed_precision=harness.BF16 if args.bf16 else None)
    opt = model.build_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    cuda, moved = mesh.device.type == "cuda", {}

    def step(i: int) -> None:
        x, y = harness.tokens(1000 * i + mesh.rank, args.batch, args, mesh.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(mesh.device)
        before = model.strategy.offload_traffic()
        model.train_step(x, y, gpt_loss)
        opt.step()
        opt.zero_grad()
        moved.update({k: v - before[k] for k, v in model.strategy.offload_traffic().items()})

    t = harness.interleave({name: step}, args.steps, args.warmup)
    mem = model.memory_stats()
    out = dict(level=name, step_s=t.median(name), device=mem["params"] + mem["grads"] + mem["optimizer"],
               host=mem.get("host", 0), disk=mem.get("disk", 0), moved=moved,
               peak=torch.cuda.max_memory_allocated(mesh.device) if cuda else None)
    del model, opt
    gc.collect()
    return out


def main() -> None:
    ap = harness.parser(__doc__, steps=5, warmup=2, n_layer=4, n_embd=256, n_head=4, vocab=4096, seq=128, batch=4,
                        json=None)
    ap.add_argument("--path", type=str, default="/tmp/minipar-offload-bench", help="where nvme files go")
    ap.add_argument("--chunk-mb", type=float, default=16.0)
    ap.add_argument("--bf16", action="store_true", help="bf16 compute (fp32 masters)")
    args = ap.parse_args()
    Path(args.path).mkdir(parents=True, exist_ok=True)
    mesh = harness.init()
    rows = [run(args, mesh, *level) for level in LEVELS]
    for r in rows:
        r["vs_none"] = r["step_s"] / rows[0]["step_s"]
    if mesh.rank == 0:
        n_params = sum(p.numel() for p in GPT(harness.gpt_config(args, seed=0)).parameters())
        print(f"offload levels, zero3 over {mesh.world_size} ranks ({mesh.device.type}), GPT {n_params:,} parameters, "
              f"{'bf16' if args.bf16 else 'fp32'}, batch {args.batch}x{args.seq} per rank; rank 0's bytes")
        kib = lambda n: f"{n / 1024:.1f}"  # noqa: E731
        peak = rows[0]["peak"] is not None
        print(harness.table(["level", "step ms", "vs none", "device KiB", "host KiB", "disk KiB", "->dev KiB",
                             "->host KiB", "read KiB", "write KiB"] + (["peak MiB"] if peak else []), [
            [r["level"], f"{r['step_s'] * 1e3:.1f}", f"{r['vs_none']:.2f}", kib(r["device"]), kib(r["host"]),
             kib(r["disk"])] + [kib(r["moved"][k]) for k in ("to_device", "to_host", "disk_read", "disk_write")]
            + ([f"{r['peak'] / 2**20:.1f}"] if peak else []) for r in rows]))
        harness.write_json(args.json, dict(world=mesh.world_size, device=mesh.device.type, params=n_params, rows=rows))
    minipar.shutdown()


if __name__ == "__main__":
    harness.run(main)
