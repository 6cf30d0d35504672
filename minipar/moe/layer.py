"""Mixture of experts with expert parallelism: a top-k router with capacity, and experts spread
over the mesh's ``ep`` axis, tokens moved to them and back by all-to-all.

One MoE layer, forward, on one rank of an expert-parallel group of ``P`` ranks
holding ``E / P`` experts each (expert ``e`` lives on ep rank ``e // (E / P)``)::

    route      logits = x W_g; scores softmax or sigmoid; top-k experts per token, their weights
               (`minipar.moe.router`); capacity C = ceil(cf * T * k / E) slots per expert;
               assignments beyond C are dropped (zero output for that choice), none when cf = None
    permute    kept (token, expert) assignments sorted by expert: x_perm = x[token_of_assignment]
    counts     all-to-all of the per-expert counts, so every rank knows what it will receive
    dispatch   all-to-all of x_perm with uneven splits (rows for ep rank j go to rank j)
    compute    received rows regrouped by local expert; expert j: y = gelu(x W1_j + b1_j) W2_j + b2_j,
               every local expert at once in two grouped products (`minipar.moe.experts`), no padding
    combine    the inverse all-to-all; out[t] = sum over t's kept choices of weight * y
    shared     with S shared experts, out[t] += the dense MLP of width S * d_hidden on x[t]

Backward runs the same exchanges in reverse (the all-to-all's adjoint is the
all-to-all with the splits swapped, `minipar.core.regions.all_to_all`). While a
dispatch or combine (or an adjoint) is in flight the layer runs ``in_flight``:
nothing, or inside a DualPipeV pair the other half's compute (`minipar.core.interleave`).

Drop policy (documented, and the single-process reference makes the same
decisions): an expert's C slots go first to first choices, then to second
choices; within a choice rank, to tokens in order. A dropped assignment adds
nothing; a token whose every choice is dropped leaves the layer as zero, so
the block's residual connection passes it through unchanged. Renormalised
weights are computed before dropping (a dropped second choice does not
enlarge the first choice's weight).

Routing groups. Capacity, drops and the auxiliary losses are computed per
routing group: the tokens one rank routes in one forward. The single-process
reference of ``R`` ranks' data sets ``route_groups = R`` and routes each
rank's contiguous share of the batch separately, which is what makes the two
equal (GShard's "groups"). Under sequence parallelism each tensor-parallel
rank routes its own slice of the sequence: the reference also sets
``route_seq_chunks = tp`` and routes each (batch share, sequence slice) apart.
There the layer's parameters are placed ``sequence_parallel`` (their gradients
summed over tp, as a norm's) and ``sequence_shards = tp`` divides each rank's
auxiliary-loss gradient, so that the sum over tp is the mean over groups.
Under context parallelism each cp rank routes its own tokens of the sequence
(ring attention's zig-zag chunks, or Ulysses' contiguous piece): the reference
sets ``route_seq_order`` to the positions as the cp ranks hold them, rank after
rank, and ``route_seq_chunks`` to cp (times tp under sequence parallelism).
Gradients are averaged over dp x cp there, so the auxiliary loss needs no
extra scale.

Auxiliary losses (per group, then averaged over groups):

    load balancing  aux = E * sum_e f_e * P_e, f_e = share of the T*k assignments (before
                    drops) that chose e, P_e = mean router probability of e (Switch/GShard)
    router z-loss   z = mean_t (logsumexp_e logits[t, e])^2 (ST-MoE)

They do not appear in the model's output. Each layer adds
``aux_loss_coef * aux + z_loss_coef * z`` to the training loss through its
backward only (`_AddAuxLoss`: identity forward, gradient ``scale`` into the
auxiliary term), so they train correctly wherever the layer sits (a pipeline
stage included) without threading a second loss through the model.
``aux_scale`` multiplies that gradient: a loss averaged over ``m``
micro-batches sets it to ``1/m``. The last values are in ``layer.last_aux``
and ``layer.last_z`` for logging.

DeepSeekMoE (docs/moe_deepseek.md): ``n_shared_experts`` dense experts every token passes
through (one MLP of S times the hidden width, replicated over ep: their gradients are averaged
over dp like any dense parameter's); fine-grained experts are only arguments (many experts, a
small ``d_hidden``, a larger ``top_k``); ``gate="sigmoid"``; ``balance="bias"``
(`minipar.moe.balance`: the layer counts each expert's load, the bias moves after each step);
``capacity_factor=None`` (dropless: the all-to-all carries exactly the routed rows, its splits
uneven as always); ``route_limit`` groups out of ``expert_groups`` (node-limited routing).

Expert parameters are placed ``expert=True`` (`minipar.core.placement`): the data-parallel
strategy averages their gradients over the replicas of the same experts (the
``edp`` group) but divides by the whole data-parallel size, because each
expert's gradient already sums the contributions of every rank of its
expert-parallel group.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from einops import rearrange

from ..core import regions
from ..core.interleave import WhileInFlight
from ..core.placement import place
from ..kernels import gelu, permute, unpermute
from .experts import expert_mlp
from .router import capacity, check_moe_config, route

__all__ = ["MoELayer", "SharedExperts", "check_moe_config", "moe_layers"]


class _AddAuxLoss(torch.autograd.Function):
    """out = x; dL/dx = dL/dout and dL/d(aux) = scale: adds ``scale * aux`` to whatever loss
    ``out`` flows into, through backward only."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dout):
        shape, dtype, device = ctx.aux_meta
        return dout, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class MoELayer(nn.Module):
    """A top-k mixture of GELU-MLP experts, expert-parallel over ``ep_group`` when one is set.

    Args:
        d_model: width of the tokens; d_hidden: each expert's hidden width.
        n_experts: total expert count E; top_k: any k <= E.
        capacity_factor: > 0, slots per expert are ceil(cf * T * k / E); None: dropless.
        aux_loss_coef, z_loss_coef: weights of the load-balancing loss and the router z-loss.
        seed: initialisation from its own generator (equal weights on every rank).
        n_shared_experts: S dense experts every token passes through (one MLP, hidden S * d_hidden).
        gate: "softmax" or "sigmoid" scores; route_scale multiplies the combine weights.
        balance: "aux" (the loss) or "bias" (`minipar.moe.balance`, with aux_loss_coef = 0),
            the bias moving by bias_update_rate per step.
        expert_groups, route_limit: each token's experts come from at most route_limit of the
            expert_groups blocks of consecutive experts (set expert_groups to ep, or to the nodes).

    The weights are stacked over experts, ``w1: (E, d_model, d_hidden)`` and so on; under
    expert parallelism this rank holds ``E / ep`` of them (`shard_experts`).
    """

    def __init__(self, d_model: int, d_hidden: int, n_experts: int, top_k: int = 2,
                 capacity_factor: float | None = 1.25, aux_loss_coef: float = 0.01, z_loss_coef: float = 0.0,
                 seed: int = 0, *, n_shared_experts: int = 0, gate: str = "softmax", route_scale: float = 1.0,
                 balance: str = "aux", bias_update_rate: float = 1e-3, expert_groups: int = 1,
                 route_limit: int | None = None) -> None:
        super().__init__()
        self.options = dict(gate=gate, balance=balance, aux_loss_coef=aux_loss_coef, route_scale=route_scale,
                            bias_update_rate=bias_update_rate, expert_groups=expert_groups,
                            route_limit=route_limit, n_shared_experts=n_shared_experts)
        check_moe_config(n_experts, top_k, capacity_factor, **self.options)
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.score, self.route_scale, self.balance = gate, route_scale, balance
        self.bias_update_rate, self.expert_groups, self.route_limit = bias_update_rate, expert_groups, route_limit
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, d_hidden))
        self.b1 = nn.Parameter(torch.zeros(n_experts, d_hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_hidden, d_model))
        self.b2 = nn.Parameter(torch.zeros(n_experts, d_model))
        for p in (self.w1, self.b1, self.w2, self.b2):
            place(p, expert=True)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in (self.gate.weight, self.w1, self.w2):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        # Drawn after the routed experts, so a layer without shared experts is initialised as before.
        self.shared = SharedExperts(d_model, n_shared_experts * d_hidden, gen) if n_shared_experts else None
        if balance == "bias":  # a persistent buffer: checkpoints and full_state_dict carry it
            self.register_buffer("expert_bias", torch.zeros(n_experts))
        self.load = torch.zeros(n_experts, dtype=torch.float64)  # assignments per expert since the bias moved
        self.load_groups: list = []    # the axes whose ranks route other tokens (`apply_experts`)
        self.route_groups = 1          # > 1 only in a single-process reference of several ranks
        self.route_seq_chunks = 1      # the same, for ranks that hold slices of the sequence
        self.route_seq_order = None    # the same, for cp ranks holding zig-zag chunks: the positions in rank order
        self.aux_scale = 1.0           # 1/m when the loss is a mean over m micro-batches
        self.sequence_shards = 1       # tp under sequence parallelism: the ranks routing one sequence
        self.comm = self.ep_group = None
        # what runs while this layer's all-to-alls are in flight: set by a DualPipe pair to its other half
        self.in_flight = WhileInFlight()
        self.ep_rank, self.ep_size = 0, 1
        self.last_aux = self.last_z = None
        self.last_dropped = 0
        self.last_counts = []

    @property
    def local_experts(self) -> int:
        return self.w1.shape[0]

    def shard_experts(self, comm, ep_group) -> None:
        """Keep only this ep rank's experts (a contiguous block of E / ep) and route through ``ep_group``."""
        check_moe_config(self.n_experts, self.top_k, self.capacity_factor, ep_group.size, **self.options)
        n_local = self.n_experts // ep_group.size
        lo = ep_group.rank * n_local
        for name in ("w1", "b1", "w2", "b2"):
            full = getattr(self, name)
            setattr(self, name, place(nn.Parameter(full.detach()[lo:lo + n_local].clone()), expert=True))
        self.comm, self.ep_group = comm, ep_group
        self.ep_rank, self.ep_size = ep_group.rank, ep_group.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., d_model) -> (..., d_model); each token the weighted sum of its kept experts' outputs."""
        order = self.route_seq_order
        if order is not None:  # the sequence as the cp ranks hold it (routed in that order, put back below)
            order = torch.as_tensor(order, device=x.device)
            x = x.index_select(1, order)
        shape = x.shape
        g, s = self.route_groups, self.route_seq_chunks
        if s > 1:  # (batch share, sequence slice) groups, as the ranks of a sequence-parallel run hold them
            groups = rearrange(x, "(g b) (s t) d -> (g s) (b t) d", g=g, s=s).unbind(0)
        else:
            tokens = x.reshape(-1, shape[-1])
            groups = tokens.chunk(g) if g > 1 else (tokens,)
        outs, auxes, zs, dropped = [], [], [], 0
        self.last_counts: list[torch.Tensor] = []  # per routing group: kept rows per expert
        for group in groups:
            out, aux, z, n_dropped = self._forward_group(group)
            outs.append(out)
            auxes.append(aux)
            zs.append(z)
            dropped += n_dropped
        if s > 1:
            out = rearrange(torch.stack(outs), "(g s) (b t) d -> (g b) (s t) d", g=g, s=s, t=shape[1] // s)
        else:
            out = torch.cat(outs) if len(outs) > 1 else outs[0]
        aux, z = torch.stack(auxes).mean(), torch.stack(zs).mean()
        self.last_aux, self.last_z, self.last_dropped = aux.detach(), z.detach(), dropped
        if self.training and torch.is_grad_enabled():
            extra = self.aux_loss_coef * aux + self.z_loss_coef * z
            out = _AddAuxLoss.apply(out, extra, self.aux_scale / self.sequence_shards)
        out = out.reshape(shape)
        if self.shared is not None:  # every token, whatever its routing (and with its own gradient)
            out = out + self.shared(x)
        return out if order is None else out.index_select(1, order.argsort())

    def _forward_group(self, x: torch.Tensor):
        n_tokens = x.shape[0]
        logits = self.gate(x).float()
        cap = capacity(n_tokens, self.n_experts, self.top_k, self.capacity_factor)
        expert, weight, keep, aux, z, load = route(
            logits, self.top_k, cap, gate=self.score, bias=getattr(self, "expert_bias", None),
            expert_groups=self.expert_groups, route_limit=self.route_limit, route_scale=self.route_scale)
        if self.training and self.balance == "bias":  # evaluation and probing forwards do not count
            self.load = self.load.to(load.device) + load
        token = torch.arange(n_tokens, device=x.device).repeat(self.top_k)
        kept = keep.nonzero()[:, 0]
        # Sort the kept assignments by expert (stable: queue order within an expert).
        order = kept[expert[kept].argsort(stable=True)]
        x_perm = permute(x, token[order])                                   # (M, d) expert-major
        # (E,) rows per expert; a scatter-add of ones into E zeros, where bincount reads max(expert) back
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, expert[order], torch.ones_like(order))
        self.last_counts.append(counts.detach())
        y_perm = self._experts(x_perm, counts)
        y_perm = y_perm * weight[order, None].to(y_perm.dtype)
        out = unpermute(y_perm, token[order], n_tokens)
        return out, aux, z, int(keep.numel() - kept.numel())

    def _experts(self, x_perm: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Run rows sorted by (global) expert through their experts, wherever those live."""
        if self.ep_size == 1:
            return self._local_experts(x_perm, counts)
        comm, group, n_local, p = self.comm, self.ep_group, self.local_experts, self.ep_size
        # 1. Counts first: received[s, j] = rows ep rank s sends to my local expert j.
        received = torch.empty_like(counts)
        comm.all_to_all(received, counts, group, tag="moe_counts")
        send_splits = counts.view(p, n_local).sum(dim=1).tolist()
        received = received.view(p, n_local)
        recv_splits = received.sum(dim=1).tolist()
        # 2. Dispatch: rows for experts on rank j go to rank j; they arrive ordered (source, local expert).
        x_recv = regions.all_to_all(x_perm, comm, group, recv_splits, send_splits, tag="moe_dispatch",
                                    in_flight=self.in_flight)
        # 3. Regroup by local expert (stable: source order within an expert), compute, restore the order.
        local_expert = torch.arange(n_local, device=x_perm.device).repeat(p).repeat_interleave(received.flatten())
        by_expert = local_expert.argsort(stable=True)
        y_sorted = self._local_experts(permute(x_recv, by_expert), received.sum(dim=0))
        y_recv = unpermute(y_sorted, by_expert, x_recv.shape[0])
        # 4. Combine: the inverse exchange, splits swapped.
        return regions.all_to_all(y_recv, comm, group, send_splits, recv_splits, tag="moe_combine",
                                  in_flight=self.in_flight)

    def _local_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: rows grouped by local expert, counts[j] (a tensor) rows for expert j -> each row through its
        expert, in two grouped products over all local experts (`minipar.moe.experts`)."""
        return expert_mlp(x, counts, self.w1, self.b1, self.w2, self.b2)


class SharedExperts(nn.Module):
    """S shared experts as one GELU MLP of hidden width S * d_hidden (the same function as S
    separate experts whose outputs are summed): x (..., d) -> (..., d)."""

    def __init__(self, d_model: int, d_hidden: int, gen: torch.Generator) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_hidden)
        self.proj = nn.Linear(d_hidden, d_model)
        with torch.no_grad():
            for lin in (self.fc, self.proj):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.02)
                lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(gelu(self.fc(x)))


def moe_layers(module: nn.Module) -> list[MoELayer]:
    return [m for m in module.modules() if isinstance(m, MoELayer)]
