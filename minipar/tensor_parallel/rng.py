"""Dropout randomness under tensor parallelism: one stream per kind of activation.

Replicated activations (the residual stream without sequence parallelism) must
get the *same* dropout mask on every tp rank, or the replicas drift apart.
Sharded activations (attention heads, MLP features, and under sequence
parallelism the sequence slices) must get *different* masks, or each
position/feature would be dropped in lock-step with its counterpart on the
other ranks. `TPRandom` keeps two generator states, "replicated" (seeded
alike on every tp rank) and "sharded" (seeded per tp rank), and swaps one in
around each dropout site, leaving the global RNG as it was.

Both streams differ between data-parallel replicas and pipeline stages: each
replica trains on other samples, which must not share masks. Every stream's
seed is derived from the user's seed and the rank's coordinates by a hash, so
no two streams collide (seed + rank arithmetic would make replica 1's
"replicated" stream replica 0's "sharded" one).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator

import torch

from ..core.mesh import Mesh


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def stream_seed(seed: int, region: str, *coordinates: int) -> int:
    """A 63-bit seed for one stream, different for every (seed, region, coordinates)."""
    text = f"{seed}/{region}/" + "/".join(map(str, coordinates))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


class TPRandom:
    """Two RNG streams: "replicated" (per dp replica and stage, equal over tp) and "sharded" (per rank)."""

    def __init__(self, mesh: Mesh, seed: int) -> None:
        self.device = mesh.device
        saved = _get_state(self.device)
        self.states: dict[str, torch.Tensor] = {}
        where = (mesh.pp_rank, mesh.dp_rank) + ((mesh.cp_rank,) if mesh.cp > 1 else ())  # cp ranks: other tokens
        for region, s in (("replicated", stream_seed(seed, "replicated", *where)),
                          ("sharded", stream_seed(seed, "sharded", *where, mesh.tp_rank))):
            torch.manual_seed(s) if self.device.type == "cpu" else torch.cuda.manual_seed(s)
            self.states[region] = _get_state(self.device)
        _set_state(self.device, saved)
        self._stack: list[tuple[str, torch.Tensor]] = []

    def enter(self, region: str) -> None:
        self._stack.append((region, _get_state(self.device)))
        _set_state(self.device, self.states[region])

    def exit(self) -> None:
        region, saved = self._stack.pop()
        self.states[region] = _get_state(self.device)  # the stream moves on: the next mask is new
        _set_state(self.device, saved)

    @contextlib.contextmanager
    def fork(self, region: str) -> Iterator[None]:
        self.enter(region)
        try:
            yield
        finally:
            self.exit()

    def attach(self, module: torch.nn.Module, region: str) -> None:
        """Run ``module``'s forward inside ``region``'s stream."""
        module.register_forward_pre_hook(lambda m, args: self.enter(region))
        module.register_forward_hook(lambda m, args, out: self.exit())
