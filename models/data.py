"""Synthetic training data: a fixed random Markov chain, so examples need no download.

Every token has four likely successors, so a model's loss falls from
ln(vocab) towards ln(4) as it learns the transitions.
"""

from __future__ import annotations

import torch


def markov_batch(step: int, rank: int, batch: int, seq: int, vocab: int, seed: int = 1234) -> torch.Tensor:
    """(batch, seq + 1) token ids from the shared chain; different for every (step, rank)."""
    chain = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=chain)
    g = torch.Generator().manual_seed(seed + 1 + 1_000_003 * step + rank)
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    picks = torch.randint(0, 4, (batch, seq), generator=g)
    for t in range(seq):
        tokens[:, t + 1] = successors[tokens[:, t], picks[:, t]]
    return tokens
