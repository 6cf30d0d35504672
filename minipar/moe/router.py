"""The MoE router: which experts each token goes to, with what weight, and which assignments fit.

One routing group of ``T`` tokens over ``E`` experts, ``logits = x W_g`` of shape (T, E)::

    scores   softmax: s = softmax(logits)            sigmoid: s = sigmoid(logits)
    choice   c = s + b  (b: the per-expert balance bias, `minipar.moe.balance`; zero under "aux")
    limit    route_limit = M over G expert groups (blocks of E / G consecutive experts): a group's
             score is its best c; each token keeps the experts of its top M groups, the rest -inf
    top-k    e_1..e_k = the k largest c (the bias picks experts; it never weights them)
    weights  softmax: w_i = s_{e_i}, renormalised to sum 1 when k > 1
             sigmoid: w_i = s_{e_i} / sum_j s_{e_j} (always renormalised)
             then times route_scale
    capacity C = ceil(cf * T * k / E) slots per expert, or every assignment kept (cf = None:
             dropless); slots go to first choices, then second choices, ..., tokens in order

With the defaults (softmax, "aux" balance, no limit, a capacity) this is the classic top-1/top-2
router bit for bit. The auxiliary losses are the Switch/GShard load-balancing loss
``E * sum_e f_e P_e`` (f_e: share of the T*k assignments, before drops, that chose e; P_e: mean
of the scores normalised over all experts, which is the softmax itself) and the ST-MoE z-loss.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

GATES = ("softmax", "sigmoid")
BALANCES = ("aux", "bias")


def check_moe_config(n_experts: int, k: int, capacity_factor: float | None, ep: int = 1, *,
                     gate: str = "softmax", balance: str = "aux", aux_loss_coef: float = 0.0,
                     route_scale: float = 1.0, bias_update_rate: float = 1e-3, expert_groups: int = 1,
                     route_limit: int | None = None, n_shared_experts: int = 0) -> None:
    """ValueError, with what to change, for a configuration the layer cannot run."""
    if not isinstance(n_experts, int) or n_experts < 1:
        raise ValueError(f"n_experts={n_experts!r} must be a positive integer")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"top_k={k!r} must be a positive integer (the experts each token goes to)")
    if k > n_experts:
        raise ValueError(f"top_k={k} is larger than the expert count {n_experts}: choose k <= n_experts")
    if capacity_factor is not None and (isinstance(capacity_factor, bool) or
                                        not isinstance(capacity_factor, (int, float)) or
                                        not 0 < capacity_factor < math.inf):
        raise ValueError(f"capacity_factor={capacity_factor!r} must be a finite number > 0 (1.0 gives each expert its even "
                         "share of the assignments; larger drops fewer tokens) or None (dropless: no token dropped)")
    if gate not in GATES:
        raise ValueError(f"gate={gate!r} is not a known gate: choose one of {GATES}")
    if balance not in BALANCES:
        raise ValueError(f"balance={balance!r} is not a known balancing: choose 'aux' (the load-balancing loss) "
                         "or 'bias' (a per-expert routing bias updated after each step)")
    if balance == "bias" and aux_loss_coef:
        raise ValueError(f"balance='bias' with aux_loss_coef={aux_loss_coef}: the bias replaces the auxiliary "
                         "loss; set aux_loss_coef=0 (or use balance='aux')")
    if balance == "bias" and not (isinstance(bias_update_rate, (int, float)) and 0 < bias_update_rate < math.inf):
        raise ValueError(f"bias_update_rate={bias_update_rate!r} must be a finite number > 0 (DeepSeek-V3: 1e-3)")
    if isinstance(route_scale, bool) or not isinstance(route_scale, (int, float)) or not 0 < route_scale < math.inf:
        raise ValueError(f"route_scale={route_scale!r} must be a finite number > 0 (1.0: weights summing to 1)")
    if isinstance(n_shared_experts, bool) or not isinstance(n_shared_experts, int) or n_shared_experts < 0:
        raise ValueError(f"n_shared_experts={n_shared_experts!r} must be an integer >= 0")
    if not isinstance(expert_groups, int) or expert_groups < 1 or n_experts % expert_groups:
        raise ValueError(f"expert_groups={expert_groups!r} must divide n_experts={n_experts}: the groups are "
                         "equal blocks of consecutive experts")
    if route_limit is not None:
        if not isinstance(route_limit, int) or not 1 <= route_limit <= expert_groups:
            raise ValueError(f"route_limit={route_limit!r} must be between 1 and expert_groups={expert_groups} "
                             "(the groups a token may use); set expert_groups to the number of ep blocks")
        if route_limit * (n_experts // expert_groups) < k:
            raise ValueError(f"route_limit={route_limit} groups of {n_experts // expert_groups} experts hold fewer "
                             f"than top_k={k} experts: raise route_limit or lower top_k")
    if n_experts % ep:
        raise ValueError(f"n_experts={n_experts} is not divisible by ep={ep}: every expert-parallel rank "
                         f"holds n_experts / ep experts; choose a multiple of {ep}")
    if route_limit is not None and ep > 1 and expert_groups % ep and ep % expert_groups:
        raise ValueError(f"expert_groups={expert_groups} does not line up with ep={ep}: a routing group must "
                         "be whole ep ranks' expert blocks or a part of one; choose expert_groups = ep, a "
                         "multiple of it or a divisor of it")


def capacity(tokens: int, n_experts: int, k: int, capacity_factor: float | None) -> int | None:
    """Slots per expert for one routing group: ceil(cf * tokens * k / experts); None when dropless."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * k / n_experts)


class Routed(NamedTuple):
    expert: torch.Tensor   # (T*k,) chosen expert of each assignment, choice-major: row c*T + t is token t's c-th
    weight: torch.Tensor   # (T*k,) its combine weight
    keep: torch.Tensor     # (T*k,) bool, False where the expert's capacity was exhausted
    aux: torch.Tensor      # load-balancing loss E * sum_e f_e P_e
    z: torch.Tensor        # router z-loss mean_t logsumexp(logits_t)^2
    load: torch.Tensor     # (E,) assignments that chose each expert, before drops


def route(logits: torch.Tensor, k: int, cap: int | None, *, gate: str = "softmax", bias: torch.Tensor | None = None,
          expert_groups: int = 1, route_limit: int | None = None, route_scale: float = 1.0) -> Routed:
    """Top-k routing of one group: logits (T, E) fp32 (see the module docstring)."""
    n_tokens, n_experts = logits.shape
    scores = logits.softmax(dim=-1) if gate == "softmax" else logits.sigmoid()
    if bias is None and route_limit is None:
        top_w, top_e = scores.topk(k, dim=-1)                # (T, k); today's router exactly
    else:
        choice = scores if bias is None else scores + bias   # the bias picks, it does not weight
        if route_limit is not None:
            choice = _limit_groups(choice, expert_groups, route_limit)
        top_e = choice.topk(k, dim=-1).indices
        top_w = scores.gather(1, top_e)
    if k > 1 or gate == "sigmoid":
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    if route_scale != 1.0:
        top_w = top_w * route_scale
    expert = top_e.t().reshape(-1)                           # choice-major priority
    weight = top_w.t().reshape(-1)
    one_hot = F.one_hot(expert, n_experts)                   # (T*k, E)
    load = one_hot.sum(dim=0)
    if cap is None:
        keep = torch.ones_like(expert, dtype=torch.bool)
    else:
        # Position of each assignment in its expert's queue: earlier assignments (first choices,
        # then lower token index) take the slots first.
        position = (one_hot.cumsum(dim=0) - 1).gather(1, expert[:, None])[:, 0]
        keep = position < cap
    share = one_hot.float().mean(dim=0)                      # f_e, before drops
    probs = scores if gate == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    aux = n_experts * (share * probs.mean(dim=0)).sum() if n_tokens else logits.sum()  # no tokens: 0, not nan
    z = logits.logsumexp(dim=-1).pow(2).mean() if n_tokens else logits.sum()
    return Routed(expert, weight, keep, aux, z, load)


def _limit_groups(choice: torch.Tensor, n_groups: int, limit: int) -> torch.Tensor:
    """choice (T, E) with every expert outside the token's ``limit`` best groups set to -inf; a
    group (E / n_groups consecutive experts: ep ranks' blocks) scores by its best expert."""
    n_tokens, n_experts = choice.shape
    best = choice.view(n_tokens, n_groups, n_experts // n_groups).amax(dim=-1)   # (T, G)
    chosen = best.topk(limit, dim=-1).indices
    allowed = torch.zeros_like(best, dtype=torch.bool).scatter_(1, chosen, True)
    allowed = allowed.repeat_interleave(n_experts // n_groups, dim=1)              # (T, E)
    return choice.masked_fill(~allowed, -math.inf)
