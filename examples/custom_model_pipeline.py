"""Your own model, cut into two pipeline stages with a `StageSpec`, trained with the 1F1B schedule.

    python examples/custom_model_pipeline.py                        # launches 2 CPU processes itself
    torchrun --nproc-per-node 2 examples/custom_model_pipeline.py   # or let torchrun start the ranks

minipar recognises its own GPT and Hugging Face GPT-2 and Llama-family models; any other model shaped
as embedding -> list of blocks -> head says where those parts are with a `StageSpec`. Rank 0 then
holds the embedding and the first half of the blocks, rank 1 the rest and the head; activations go
forward and their gradients back by send/recv, four micro-batches per step. Before training, the
same model is trained in this one process on the same batches, and each step's pipelined loss is
printed beside that reference (they agree to float32 rounding).
"""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import minipar
from minipar import PipelineConfig, ShardedModule, StageSpec
from minipar.models.data import markov_batch

VOCAB, SEQ, BATCH, WIDTH, STEPS = 64, 16, 8, 32, 6


class Block(nn.Module):
    """A pre-norm residual MLP: (batch, seq, width) -> (batch, seq, width)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.norm(h))


class TinyLM(nn.Module):
    """No built-in spec knows this model: an embedding, a list of blocks, a norm and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.trunk = nn.ModuleList(Block() for _ in range(4))
        self.final_norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embedding(ids)
        for block in self.trunk:
            h = block(h)
        return self.head(self.final_norm(h))


# Where the parts live (dotted paths) and how to call the ends; ``s`` is a stage, which keeps the
# model's attribute names. Wrapping checks the spec by running the stages in sequence in one process
# against the model's own forward, so a module left out (say the final norm) is refused there.
SPEC = StageSpec(blocks="trunk", first=("embedding",), last=("final_norm", "head"), hidden_size=WIDTH,
                 embed=lambda s, ids: s.embedding(ids), head=lambda s, h: s.head(s.final_norm(h)))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def reference_losses(dp: int) -> list[float]:
    """The same model in one process on the global batch (every data-parallel rank's), same optimizer."""
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        tokens = torch.cat([markov_batch(step, r, BATCH, SEQ, VOCAB) for r in range(dp)])
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train(rank: int, world: int, reference: list[float]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    mesh = minipar.init(pp=2)                                    # dp = world / 2
    model = ShardedModule(TinyLM(), mesh=mesh, strategy="ddp",
                          pipeline=PipelineConfig(schedule="1f1b", microbatches=4, stage_spec=SPEC))
    opt = model.build_optimizer(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    start = time.perf_counter()
    for step in range(STEPS):
        tokens = markov_batch(step, mesh.dp_rank, BATCH, SEQ, VOCAB)  # both stages are given the batch
        loss = model.train_step(tokens[:, :-1], tokens[:, 1:], lm_loss)  # the global loss on every stage
        model.clip_grad_norm_(1.0)                               # one norm over both stages
        opt.step()
        opt.zero_grad()
        if mesh.rank == 0:
            eta = (time.perf_counter() - start) / (step + 1) * (STEPS - step - 1)
            print(f"step {step + 1}/{STEPS}  loss {loss.item():.6f}  one process {reference[step]:.6f}  "
                  f"ETA {eta:.1f}s", flush=True)
    minipar.shutdown()


def main() -> None:
    if "RANK" in os.environ:                                     # started by torchrun
        world = int(os.environ["WORLD_SIZE"])
        train(int(os.environ["RANK"]), world, reference_losses(world // 2))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    mp.spawn(train, args=(2, reference_losses(1)), nprocs=2)


if __name__ == "__main__":
    main()
