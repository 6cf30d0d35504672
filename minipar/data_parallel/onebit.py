"""1-bit Adam: Adam whose communication, after a warm-up, is the momentum compressed to signs.

Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
Speed" (2021). The observation: Adam's variance ``v`` stops changing much after a short warm-up.
Freeze it, and the update ``m / (sqrt(v) + eps)`` is linear in the momentum ``m``, so the ranks can
average ``m`` instead of the gradient, and ``m`` (a smoothed quantity) survives 1-bit compression
with error feedback. Used as::

    model = ShardedModule(GPT(cfg), mesh=mesh, strategy="ddp")
    opt = model.build_optimizer(minipar.OneBitAdam, lr=3e-3, freeze_step=K)

Steps 1..K (warm-up) are torch's AdamW, on gradients DDP all-reduced in fp32. At the end of step K
the optimizer freezes the variance and turns DDP's gradient synchronisation off
(``strategy.grad_sync_off``): from the next backward on, gradients stay local. Each later step::

    m_local <- b1 m + (1 - b1) g_local                        (every rank its own gradient)
    m       <- compressed_allreduce(m_local)                  (~1/32 of the fp32 bytes)
    p       <- p (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v_K / (1 - b2^K)) + eps)

``v_K`` is the variance frozen at the end of the warm-up, with the bias correction of that step, so
the switch does not change the step size; the decay is AdamW's (decoupled). The denominator is then a
constant, computed once at the freeze (``state["denom"]``, which replaces ``exp_avg_sq``).

Gradient clipping after the warm-up (``model.clip_grad_norm_``) clips each rank's *local* gradient
by its *local* norm, before it enters the momentum; the norm returned is that local one and differs
between ranks. (The variance no longer moves, so clipping only bounds one rank's contribution.)

Copies of one parameter stay equal. The exchange runs over the data-parallel group of each tensor-
parallel rank and pipeline stage, and its result for a tensor depends on everything else in the
flat buffer (the scale blocks it shares, the error feedback), so two copies of one parameter that
sit in different buffers would come out of it different and drift apart step by step: a parameter
replicated over tp (norms, biases of row-parallel layers, anything the plan does not split), and the
two copies of a tied embedding/head under pipeline parallelism (the first stage's embedding, the
last stage's head). Their local gradients are equal (or summed over the copies, `sync_tied_grads`),
so their momentum is too until the exchange; after it each such momentum is averaged over its copies
(an all-reduce over tp of the tp-replicated ones, uncompressed: norms and biases are small; one over
pp of the tied weight, as its gradient is every step), so every copy takes the same step. Expert
parallelism is refused: the data-parallel ranks of an ep group hold different experts, and the
exchange would average them together.

ZeRO is refused, as DeepSpeed does: the exchange compresses the whole momentum, which ZeRO shards.
Checkpoints (`minipar.checkpoint`) keep the per-parameter state as for AdamW (after the warm-up the
momentum and the frozen denominator) and, per rank, the phase and the error-feedback buffers
(`rank_state`): a run resumes bit for bit under the layout it was saved with (the buffers are per
rank and sized by the world), and another layout is refused.

The compressed all-reduce (`compressed_allreduce`), for n ranks and a flat tensor of L elements cut
into n chunks of c elements (zero-padded to whole blocks; padding is never sent as data), each chunk
into blocks of b elements (``SCALE_BLOCK`` = 2048) that share one scale:

1. worker: ``x = tensor + e_worker``; per block k, ``C(x_k) = s_k sign(x_k)`` with
   ``s_k = mean |x_k|`` over the block's real elements (the scale that minimises
   ``|x_k - s sign(x_k)|^2``); ``e_worker <- x - C(x)``. A compressed block travels as b/8 bytes of
   signs (bit i of byte j is element 8j + i, 1 for >= 0) followed by the 4 bytes of its fp32 scale.
2. all-to-all: rank j receives every rank's compressed chunk j.
3. server (each rank for the chunk it owns): ``y = mean_i C(x_ij) + e_server``;
   ``e_server <- y - C(y)``; its compressed ``C(y)`` is all-gathered.
4. every rank decompresses the n chunks: the same result, bitwise, everywhere.

Error feedback telescopes: over T calls the sum of the results equals the sum of the exact averages
minus (mean over ranks of e_worker) minus e_server, so what compression drops is not lost but
delayed, and stays bounded (sign compression with the mean-|x| scale is a contraction:
``|x - C(x)|^2 = |x|^2 - |x|_1^2 / b <= (1 - 1/b) |x|^2``). Bytes each rank puts on the wire:
2 (n-1) (c/8 + 4 c/b), about 1/31 of an fp32 ring all-reduce's 2 (n-1)/n 4L. One scale per block
rather than per chunk: a chunk spans many tensors of very different magnitudes, and in the benchmark
one scale per chunk left 1-bit Adam's final loss 5% behind AdamW's; per 2048 elements, 0.15%.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..core.comm import AxisGroup, Comm
from .ddp import DDP
from ..core.placement import placement_of

_SCALE_BYTES = 4  # one fp32 scale after each block's signs
SCALE_BLOCK = 2048  # elements sharing one scale: 4 bytes per 256 bytes of signs (wire ratio ~1/31.5)


class OneBitAdam(torch.optim.AdamW):
    """AdamW for ``freeze_step`` steps, then frozen variance and a 1-bit compressed momentum exchange.

    Built by ``model.build_optimizer(OneBitAdam, lr=..., freeze_step=K)`` under ``strategy="ddp"``,
    which passes ``strategy`` (the `minipar.data_parallel.ddp.DDP` whose gradient sync it takes over).
    Parameters must be fp32. Memory beyond AdamW: the error-feedback buffers, 1 + 1/n copies of the
    parameters (padded)."""

    binds_strategy = True  # DDP.build_optimizer passes strategy=itself

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, freeze_step: int,
                 strategy: DDP | None = None) -> None:
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(f"freeze_step={freeze_step!r} must be an int >= 1: the variance is frozen after that "
                             "many full AdamW steps (the paper warms up for ~15-25% of training)")
        if not isinstance(strategy, DDP):
            raise ValueError("OneBitAdam communicates the momentum itself and needs the DDP strategy: build it "
                             "with model.build_optimizer(minipar.OneBitAdam, lr=..., freeze_step=...) on a "
                             "ShardedModule(..., strategy='ddp'). ZeRO (zero1/zero2/zero3) is refused, as in "
                             "DeepSpeed: the compressed exchange needs the whole momentum, which ZeRO shards; "
                             "use strategy='ddp' or torch.optim.AdamW")
        mesh = strategy.mesh
        if mesh.ep > 1:
            raise ValueError(f"OneBitAdam averages the momentum over the data-parallel ranks, but with ep={mesh.ep} "
                             "the ranks of an expert-parallel group hold different experts: the exchange would "
                             "average unrelated experts together. Use ep=1, or torch.optim.AdamW")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        odd = {p.dtype for g in self.param_groups for p in g["params"] if p.dtype != torch.float32}
        if odd:
            raise ValueError(f"OneBitAdam steps fp32 parameters only; got {sorted(map(str, odd))}")
        self.freeze_step = freeze_step
        self.strategy = strategy
        # Copies of one parameter whose momentum is averaged after every exchange (module docstring):
        # those replicated over tp, and a pipeline's tied embedding/head (its copy on the first and on
        # the last stage; a middle stage adds zeros of its shape, as for the gradient).
        self.tp_replicated = [p for p in self._params() if mesh.tp > 1 and not placement_of(p).tensor_parallel]
        stage = strategy.module
        self.tied_stage = stage if mesh.pp > 1 and getattr(stage, "tied", False) else None
        if self.tied_stage is not None:
            full = stage.tied_shape
            self.tied_shape = (full[0] // mesh.tp,) + tuple(full[1:])  # its tp rank's rows, as under tp
        self.steps_taken = 0
        # built by _freeze at the end of step freeze_step:
        self.momentum: torch.Tensor | None = None  # every exp_avg is a view of this flat buffer
        self.momentum_of: dict[torch.nn.Parameter, torch.Tensor] = {}  # each parameter's view of it
        self.worker_error: torch.Tensor | None = None
        self.server_error: torch.Tensor | None = None
        self.real_mask: torch.Tensor | None = None  # which elements of the padded exchange are data (`real_mask`)

    @property
    def frozen(self) -> bool:
        """The warm-up is over: the variance is frozen and gradients stay local."""
        return self.steps_taken >= self.freeze_step

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        if closure is not None:
            raise ValueError("OneBitAdam.step takes no closure")
        if self.frozen:
            self._compressed_step()
        else:
            super().step()
        self.steps_taken += 1
        if self.steps_taken == self.freeze_step:
            self._freeze()
            self.strategy.grad_sync_off = True  # from the next backward on, DDP keeps gradients local

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def _stepped(self, group: dict) -> list[torch.nn.Parameter]:
        """The group's parameters that have Adam state. One no rank ever gave a gradient during the
        warm-up has none (no v to divide by) and keeps its value."""
        return [p for p in group["params"] if self.state[p]]

    def _freeze(self) -> None:
        """End of the warm-up: gather every exp_avg into one flat buffer (they become views of it),
        replace exp_avg_sq by the constant denominator sqrt(v_K / (1 - b2^K)) + eps, and size the
        error buffers and the padding mask of the exchange."""
        params = self._params()
        n = self.strategy.group.size
        self.momentum = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
        views = dict(zip(params, self.momentum.split([p.numel() for p in params])))
        self.momentum_of = {p: v.view_as(p) for p, v in views.items()}
        for group in self.param_groups:
            beta2, eps = group["betas"][1], group["eps"]
            for p in self._stepped(group):
                state = self.state[p]
                views[p].copy_(state["exp_avg"].reshape(-1))
                state["exp_avg"] = views[p].view_as(p)
                if "denom" in state:  # loaded from a checkpoint taken after the freeze
                    continue
                bias2 = 1 - beta2 ** float(state["step"])  # of step K, this parameter's last AdamW step
                state["denom"] = (state.pop("exp_avg_sq").sqrt() / bias2 ** 0.5).add_(eps)  # as AdamW's
        chunk = chunk_size(self.momentum.numel(), n)
        self.worker_error = torch.zeros(n * chunk, dtype=torch.float32, device=self.momentum.device)
        self.server_error = torch.zeros(chunk, dtype=torch.float32, device=self.momentum.device)
        self.real_mask = real_mask(self.momentum.numel(), n, SCALE_BLOCK, self.momentum.device)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's; state saved after the warm-up (a ``denom`` in place of ``exp_avg_sq``) freezes this
        optimizer again: one flat momentum buffer, DDP's gradient sync off. `load_rank_state` then
        restores the step count and the error-feedback buffers."""
        super().load_state_dict(state_dict)
        if any("denom" in self.state[p] for p in self._params()):
            self.steps_taken = max(self.steps_taken, self.freeze_step)
            self._freeze()
            self.strategy.grad_sync_off = True

    def rank_state(self) -> dict:
        """What a checkpoint keeps per rank beside ``state_dict``: the optimizer steps taken, and after
        the warm-up this rank's error-feedback buffers (they differ between ranks)."""
        return {"steps_taken": self.steps_taken,
                "worker_error": self.worker_error.clone() if self.worker_error is not None else None,
                "server_error": self.server_error.clone() if self.server_error is not None else None}

    def load_rank_state(self, state: dict) -> None:
        self.steps_taken = state["steps_taken"]
        if (state["worker_error"] is None) != (self.worker_error is None):
            raise ValueError("OneBitAdam.load_rank_state: the phase of the rank state (warm-up or frozen) is not "
                             "the phase of the optimizer state loaded with it")
        if self.worker_error is not None:
            self.worker_error.copy_(state["worker_error"])
            self.server_error.copy_(state["server_error"])

    def _compressed_step(self) -> None:
        for group in self.param_groups:  # m <- b1 m + (1 - b1) g_local: this rank's gradient only
            beta1, stepped = group["betas"][0], self._stepped(group)
            if not stepped:
                continue
            torch._foreach_mul_([self.state[p]["exp_avg"] for p in stepped], beta1)
            with_grad = [p for p in stepped if p.grad is not None]
            if with_grad:
                torch._foreach_add_([self.state[p]["exp_avg"] for p in with_grad], [p.grad for p in with_grad],
                                    alpha=1 - beta1)
        compressed_allreduce(self.momentum, self.worker_error, self.server_error,
                             self.strategy.comm, self.strategy.group, mask=self.real_mask)
        self._average_copies()
        for group in self.param_groups:  # p <- p (1 - lr wd) - lr / (1 - b1^t) m / denom
            lr, beta1, wd = group["lr"], group["betas"][0], group["weight_decay"]
            stepped = self._stepped(group)
            if not stepped:
                continue
            states = [self.state[p] for p in stepped]
            torch._foreach_add_([s["step"] for s in states], 1)
            torch._foreach_mul_(stepped, 1 - lr * wd)
            torch._foreach_addcdiv_(stepped, [s["exp_avg"] for s in states], [s["denom"] for s in states],
                                    [-lr / (1 - beta1 ** float(s["step"])) for s in states])

    def _average_copies(self) -> None:
        """Each copied parameter's momentum <- its mean over the copies (module docstring), so that
        every copy takes the same step: over tp for the tp-replicated parameters, over the first and
        last stage for a tied embedding/head. The same collectives on every rank, in this order."""
        mesh, comm = self.strategy.mesh, self.strategy.comm
        if self.tp_replicated:
            views = [self.momentum_of[p] for p in self.tp_replicated]
            flat = torch.cat([v.reshape(-1) for v in views])
            comm.all_reduce(flat, mesh.group("tp"), tag="onebit_copies")
            flat.div_(mesh.tp)
            torch._foreach_copy_(views, [f.view_as(v) for f, v in zip(flat.split([v.numel() for v in views]), views)])
        if self.tied_stage is not None:
            w = self.tied_stage.tied_weight()
            mine = self.momentum_of[w] if w is not None else None
            buf = mine.clone() if mine is not None else torch.zeros(self.tied_shape, dtype=torch.float32,
                                                                    device=self.momentum.device)
            comm.all_reduce(buf, mesh.group("pp"), tag="onebit_copies")  # the two copies; others add 0
            if mine is not None:
                mine.copy_(buf.div_(2))


# -- the compressed all-reduce ------------------------------------------------------------


def chunk_size(numel: int, world: int, block: int = SCALE_BLOCK) -> int:
    """Elements per rank's chunk: ceil(numel / world) rounded up to whole scale blocks."""
    return block * max(1, -(-numel // (block * world)))


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """(..., 8k) float -> (..., k) uint8: bit i of byte b is 1 where x[..., 8b + i] >= 0."""
    bits = (x >= 0).to(torch.uint8).unflatten(-1, (-1, 8))
    shifts = torch.arange(8, dtype=torch.uint8, device=x.device)
    return (bits << shifts).sum(-1, dtype=torch.uint8)  # distinct bits: the sum is an OR


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """(..., k) uint8 -> (..., 8k) float32 of +1 / -1 (the inverse of `pack_signs`)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2).to(torch.float32).mul_(2).sub_(1)


def compress(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """(rows, c) float32, zero past each row's ``real`` elements -> (rows, c/8 + 4) uint8:
    each row's signs, then its scale mean|x| over the real elements (fp32 bytes)."""
    scale = x.abs().sum(1, keepdim=True) / real.clamp(min=1).unsqueeze(1)
    return torch.cat([pack_signs(x), scale.view(torch.uint8)], dim=1)


def decompress(rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(rows, c/8 + 4) uint8 -> (rows, c) float32: scale * sign, zero where ``mask`` (rows, c) is False."""
    scale_bytes = torch.empty((rows.shape[0], _SCALE_BYTES), dtype=torch.uint8, device=rows.device)
    scale = scale_bytes.copy_(rows[:, -_SCALE_BYTES:]).view(torch.float32)  # (rows, 1); fresh: fp32-aligned
    return (unpack_signs(rows[:, :-_SCALE_BYTES]) * scale).masked_fill_(~mask, 0.0)


def real_mask(numel: int, world: int, block: int = SCALE_BLOCK, device: torch.device | str = "cpu") -> torch.Tensor:
    """(world c / block, block) bool, c = ``chunk_size(numel, world, block)``: True on the ``numel`` real
    elements of the padded exchange, False on the padding. Rows are scale blocks; rank j's chunk is
    rows j c/block:(j+1) c/block."""
    chunk = chunk_size(numel, world, block)
    return (torch.arange(world * chunk, device=device) < numel).view(world * chunk // block, block)


def compressed_allreduce(tensor: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                         comm: Comm, group: AxisGroup, block: int = SCALE_BLOCK,
                         mask: torch.Tensor | None = None) -> None:
    """In place: tensor <- the 1-bit compressed mean over the group (module docstring, steps 1-4).

    tensor: fp32, L elements; worker_error: (n c,) fp32; server_error: (c,) fp32, with
    c = ``chunk_size(L, n, block)``; both updated in place (start them at zero). ``block`` (a multiple
    of 8): elements per scale. ``mask``: ``real_mask(L, n, block)``, built here when not given (a
    caller exchanging the same size every step builds it once). Two collectives, both counted: an
    all-to-all and an all-gather of n c / block rows of block/8 + 4 bytes."""
    n, r, numel = group.size, group.rank, tensor.numel()
    if block % 8:
        raise ValueError(f"block={block} must be a multiple of 8 (whole bytes of signs)")
    chunk = chunk_size(numel, n, block)
    if worker_error.shape != (n * chunk,) or server_error.shape != (chunk,):
        raise ValueError(f"compressed_allreduce: error buffers must be ({n * chunk},) and ({chunk},) for {numel} "
                         f"elements over {n} ranks; got {tuple(worker_error.shape)} and {tuple(server_error.shape)}")
    per = chunk // block  # blocks per chunk; rows below are blocks, rank j's chunk is rows j*per:(j+1)*per
    if mask is None:
        mask = real_mask(numel, n, block, tensor.device)
    elif mask.shape != (n * per, block):
        raise ValueError(f"compressed_allreduce: mask must be real_mask({numel}, {n}, {block}), of shape "
                         f"{(n * per, block)}; got {tuple(mask.shape)}")
    real = mask.sum(1)
    own = slice(r * per, (r + 1) * per)

    # 1. worker: compress tensor + its error, keep what compression dropped (in place: the error
    #    buffer holds x, then x - C(x); its padding stays zero, as C(x) is zero there too)
    worker_error[:numel] += tensor.reshape(-1)
    x = worker_error.view(n * per, block)
    sent = compress(x, real)
    x.sub_(decompress(sent, mask))

    # 2. all-to-all: chunk j goes to rank j; received chunk i is rank i's compressed version of chunk r
    received = torch.empty_like(sent)
    comm.all_to_all(received, sent, group, tag="onebit")

    # 3. server: average chunk r over ranks, add its error, recompress
    y = decompress(received, mask[own].repeat(n, 1)).view(n, chunk).sum(0)
    y.div_(n).add_(server_error)
    owned = compress(y.view(per, block), real[own])
    server_error.copy_(y - decompress(owned, mask[own]).view(-1))

    # 4. all-gather the compressed chunks; every rank decompresses the same bytes
    gathered = torch.empty((n * per, owned.shape[1]), dtype=torch.uint8, device=tensor.device)
    comm.all_gather(gathered, owned, group, tag="onebit")
    tensor.copy_(decompress(gathered, mask).view(-1)[:numel].view_as(tensor))
