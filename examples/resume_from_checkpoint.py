"""Train, save a checkpoint, resume in new processes: the losses continue exactly as without the stop.

    python examples/resume_from_checkpoint.py          # launches 2 CPU processes itself, twice

The first run trains 6 steps and saves a checkpoint after step 3 (every rank writes its own shard;
rank 0 publishes the manifest last, so ``find_latest`` only ever names a complete checkpoint). The
second run is new processes, as after a crash: it finds the latest checkpoint, loads it (weights,
ZeRO-2 optimizer shards, every rank's RNG states, so dropout draws the same masks) and trains steps
4 to 6. Its losses equal the first run's bit for bit, which the script checks.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

import minipar
from minipar import ShardedModule, checkpoint
from minipar.models import GPT, GPTConfig, gpt_loss
from minipar.models.data import markov_batch

STEPS, SAVE_AFTER, WORLD = 6, 3, 2


def train(rank: int, root: str) -> None:
    """Train from the latest checkpoint under ``root`` (or from scratch) up to step STEPS, saving after
    step SAVE_AFTER; rank 0 writes {step: loss} to root/losses_<first step>.json."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    torch.manual_seed(100 + rank)                    # dropout masks differ per rank, restored on resume
    mesh = minipar.init()
    model = ShardedModule(GPT(GPTConfig(vocab_size=64, block_size=32, dropout=0.1)), mesh=mesh, strategy="zero2")
    opt = model.build_optimizer(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    path = checkpoint.find_latest(root)              # None: nothing saved yet, start at step 0
    first = checkpoint.load(path, model, opt)["step"] if path is not None else 0
    if rank == 0:
        print(f"{'resumed from ' + str(path) if path else 'fresh start'}: steps {first + 1} to {STEPS}",
              flush=True)
    losses, start = {}, time.perf_counter()
    for step in range(first, STEPS):
        tokens = markov_batch(step, mesh.rank, batch=4, seq=32, vocab=64)
        loss = model.train_step(tokens[:, :-1], tokens[:, 1:], gpt_loss)
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses[step + 1] = loss.item()
        if step + 1 == SAVE_AFTER:
            checkpoint.save(checkpoint.step_path(root, step + 1), model, opt, extra_state={"step": step + 1})
        if rank == 0:
            done = step + 1 - first
            eta = (time.perf_counter() - start) / done * (STEPS - step - 1)
            saved = "  (checkpoint saved)" if step + 1 == SAVE_AFTER else ""
            print(f"step {step + 1}/{STEPS}  loss {loss.item():.6f}  ETA {eta:.1f}s{saved}", flush=True)
    if rank == 0:
        (Path(root) / f"losses_{first}.json").write_text(json.dumps(losses))
    minipar.shutdown()


def run(root: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    mp.spawn(train, args=(root,), nprocs=WORLD)


def main() -> int:
    with tempfile.TemporaryDirectory() as root:
        print("run 1: new processes, trained without stopping", flush=True)
        run(root)
        print("run 2: new processes, as after a crash", flush=True)
        run(root)
        uninterrupted = json.loads((Path(root) / "losses_0.json").read_text())
        resumed = json.loads((Path(root) / f"losses_{SAVE_AFTER}.json").read_text())
    for step, loss in resumed.items():
        print(f"step {step}: uninterrupted {uninterrupted[step]:.6f}  resumed {loss:.6f}")
    same = all(uninterrupted[step] == loss for step, loss in resumed.items())
    print("the resumed losses equal the uninterrupted ones bit for bit" if same else "MISMATCH")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
