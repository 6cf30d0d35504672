"""A Hugging Face Llama, built from a small config (nothing downloaded), trained under ZeRO-3.

    python examples/hf_llama_zero3.py                          # launches 2 CPU processes itself
    python examples/hf_llama_zero3.py --tp 2                   # 4 processes: dp=2 x tp=2, with a tp plan
    torchrun --nproc-per-node 2 examples/hf_llama_zero3.py     # or let torchrun start the ranks

Each decoder layer (an entry of ``model.layers``, an ``nn.ModuleList``) becomes a ZeRO-3 unit: its
parameters live as 1/dp shards and are all-gathered just before its forward and backward. The
model's own output object passes through `ShardedModule` unchanged, so the loss function reads its
``.logits``. Every rank starts from world rank 0's weights, whatever its seed; the losses printed
with and without ``--tp 2`` agree to float32 rounding (same weights, same global batch).

``--tp 2`` passes an explicit plan over the Llama's module names, the way to write one for any
model (the plan tests/test_pipeline_hf.py proves equal to one process); without ``tp_plan=`` minipar
would translate the model's own ``config`` plan (tensor_parallel/hf_plan.py). Needs ``transformers``
(the ``test`` extra).
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import minipar
from minipar import ShardedModule
from minipar.models.data import markov_batch

VOCAB, SEQ, BATCH = 64, 16, 4  # BATCH: sequences per data-parallel rank

LLAMA_TP_PLAN = {"model.embed_tokens": "vocab", "model.layers.*.self_attn": "enter_region",
                 "model.layers.*.self_attn.[qkv]_proj": "colwise_in_region",
                 "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp": "enter_region",
                 "model.layers.*.mlp.gate_proj": "colwise_in_region",
                 "model.layers.*.mlp.up_proj": "colwise_in_region",
                 "model.layers.*.mlp.down_proj": "rowwise", "lm_head": "colwise_gather"}


def build_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)  # the same weights for any --tp (every rank takes rank 0's anyway)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train(rank: int, world: int, tp: int, steps: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)                                  # the ranks share this machine's cores
    mesh = minipar.init(tp=tp)                                # dp = world / tp
    options = dict(tp_plan=LLAMA_TP_PLAN) if tp > 1 else {}
    model = ShardedModule(build_llama(), mesh=mesh, strategy="zero3", **options)
    opt = model.build_optimizer(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    if mesh.rank == 0:
        print(f"Llama under zero3: world {mesh.world_size} = dp {mesh.dp} x tp {mesh.tp}; "
              f"this rank holds {model.memory_stats()['params']} parameter bytes", flush=True)
    start = time.perf_counter()
    for step in range(steps):
        tokens = markov_batch(step, mesh.dp_rank, BATCH, SEQ, VOCAB)  # tp peers share a batch
        loss = model.train_step(tokens[:, :-1], tokens[:, 1:], lm_loss)
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if mesh.rank == 0:
            elapsed = time.perf_counter() - start
            eta = elapsed / (step + 1) * (steps - step - 1)
            print(f"step {step + 1}/{steps}  loss {loss.item():.4f}  ETA {eta:.1f}s", flush=True)
    minipar.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (world = 2 x tp when launched here)")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if "RANK" in os.environ:                                  # started by torchrun: this process is one rank
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.tp, args.steps)
        return
    world = 2 * args.tp
    with socket.socket() as s:                                # a free port for the ranks to meet on
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    mp.spawn(train, args=(world, args.tp, args.steps), nprocs=world)


if __name__ == "__main__":
    main()
