"""Context parallelism: the ranks of a cp group split every sequence and cooperate on attention.

Everything but attention works token by token, so a rank can run it on its own tokens alone; only
attention needs the other tokens' keys and values. `ShardedModule` (``mesh.cp > 1``) does four
things, here:

1. **Split.** The ranks of a cp group are given the same batch of full sequences; each keeps its
   tokens of the inputs and the targets. ``ring``: the sequence is cut into 2C chunks and rank r
   keeps chunks r and 2C-1-r (zig-zag), so every rank has the same causal work (a query in a late
   chunk sees many keys, one in an early chunk few). ``ulysses``: rank r keeps the r-th of C
   contiguous chunks (every rank attends over the whole sequence for its heads: balanced anyway).
2. **Positions.** The model computes positions 0..T/C-1 for its local tokens; a forward pre-hook
   on each module that takes positions (the learned table `GPT.wpe`, the rotary embedding
   `Rotary` of a ``pos="rope"`` model) maps them to the tokens' true positions.
3. **Attention.** Each attention module's ``context_attention`` becomes ring attention (K/V blocks
   passed around the cp ring, partial outputs merged by their log-sum-exp,
   `minipar.context_parallel.ring_attention.ring_attention`) or Ulysses (all-to-all to all tokens of H/C heads,
   local attention, all-to-all back, `minipar.context_parallel.ring_attention.ulysses_attention`).
4. **Loss.** A rank's loss is the mean over its own non-ignored targets (-100 ignored). Weighted
   by n_local * C / n_sequence (n counts non-ignored targets), the mean over the cp ranks is the
   mean over all tokens of their sequences; gradients are then averaged over dp x cp
   (``mesh.grad_axis``), and the loss `train_step` returns is the global batch's. A rank none of
   whose targets counts has weight 0, but its mean over no token is NaN, and 0 * NaN is NaN (in
   the loss and in every gradient): its loss function is given one counted target instead
   (`finite_if_empty`), a finite loss that the weight 0 removes.

Hugging Face models (`minipar.context_parallel.hf_attention`): their attention modules get the
same ``context_attention`` slot through an attention function registered with transformers, and
their rotary embedding's position ids are mapped to the true positions. Taken when their attention
is plain causal attention (Llama, Mistral without a sliding window, Qwen, ...; proven on the model
when it is wrapped), under pipeline parallelism too: a stage computes the rotary embedding through
the model's own module (`minipar.pipeline.spec`), whose hook maps every stage's position ids.

Parameters are replicated over cp like over dp: the data-parallel strategies treat dp x cp as
their data axis (ZeRO shards over it). Attention dropout is refused (the masks of a split
attention cannot match one process's).

What is checked when the model is wrapped, in one process, before any collective
(`ContextParallel.check_token_wise`): everything but the attention minipar wires must work token by
token. The model runs once on a short sequence, then once per cp rank on that rank's tokens with the
wired attention given the whole sequence's keys and values; a module that mixes tokens some other way
(an ``nn.MultiheadAttention``, a Hugging Face attention, a convolution over the sequence, positions
computed where no hook maps them) gives different logits, and the model is refused, naming the first
module whose output differs.

Outside `train_step` (``model(x)`` for evaluation, before or after training) every rank computes
the whole sequence it is given itself, as one process does: the split, the position mapping and the
ring or Ulysses exchange apply only to the forward of the inputs `split` produced (and to the
recomputation of its blocks in backward).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.mesh import Mesh
from .hf_attention import check_plain_causal, hf_attention_modules, rotary_modules, wire
from .ring_attention import contiguous_positions, ring_attention, ulysses_attention, zigzag_positions

FORMS = ("ring", "ulysses")
IGNORE_INDEX = -100  # targets the loss does not count (torch's cross-entropy default)


def check_form(form: Any) -> None:
    if form is not None and form not in FORMS:
        raise ValueError(f"context_parallel={form!r}; choose one of {', '.join(map(repr, FORMS))} (or None: "
                         "ring when the mesh has cp > 1)")


def attention_modules(module: nn.Module) -> list[nn.Module]:
    """The modules whose attention context parallelism replaces (minipar's GPT attention, with separate
    or fused q/k/v projections)."""
    return [m for m in module.modules() if hasattr(m, "context_attention") and
            (hasattr(m, "q_proj") or hasattr(m, "qkv_proj"))]


def _query_rows(attention: nn.Module) -> int:
    """The rows of the query projection: heads x head_dim (a third of a fused q/k/v projection)."""
    if hasattr(attention, "q_proj"):
        return attention.q_proj.weight.shape[0]
    return attention.qkv_proj.weight.shape[0] // 3


def counted(targets: torch.Tensor) -> torch.Tensor:
    """How many targets count (not `IGNORE_INDEX`), as a 0-d fp32 tensor (no host sync)."""
    return (targets != IGNORE_INDEX).sum().to(torch.float32)


def finite_if_empty(targets: Any, batch_counts: torch.Tensor) -> Any:
    """``targets``, unless none of them counts while ``batch_counts`` (a 0-d bool: the batch they are
    part of has counted targets): then the first becomes 0 (a class every loss over token ids has).

    Such a call's loss is weighted by its share of the counted targets, 0; but a mean over no token
    is NaN and 0 * NaN is NaN, in the loss and in every gradient, where one process computes a finite
    loss. Given one counted target the loss is finite and the weight 0 removes it, gradient and all.
    When the whole batch is ignored one process's loss is NaN too, and the targets are left alone.
    No host sync: a ``where`` on the device."""
    if not torch.is_tensor(targets) or targets.is_floating_point() or targets.numel() == 0:
        return targets
    empty = (targets == IGNORE_INDEX).all() & batch_counts
    first = torch.zeros(targets.numel(), dtype=torch.bool, device=targets.device)
    first[0] = True
    return torch.where(empty & first.view(targets.shape), torch.zeros((), dtype=targets.dtype,
                                                                      device=targets.device), targets)


class ContextParallel:
    """Context parallelism over ``mesh``'s cp group for ``module`` (see the module docstring)."""

    def __init__(self, module: nn.Module, mesh: Mesh, form: str | None) -> None:
        check_form(form)
        self.mesh, self.form = mesh, form or "ring"
        self.group, self.cp = mesh.group("cp"), mesh.cp
        self._hf = hf_attention_modules(module)
        unwire = wire(module, mesh.cp) if self._hf else (lambda: None)
        self._hooks: list = []
        try:
            self._wire(module, mesh)
        except ValueError:  # the model is left as it was
            unwire()
            for h in self._hooks:
                h.remove()
            raise

    def _wire(self, module: nn.Module, mesh: Mesh) -> None:
        """Check the attention modules, hook the position modules, check the model token by token,
        then give the attention modules ring or Ulysses attention (ValueError before any change of the
        attention: the hooks are the caller's to remove)."""
        attns = attention_modules(module)
        if not attns:
            raise ValueError(f"context parallelism (cp={mesh.cp}) found no attention to split in "
                             f"{type(module).__name__}: it needs modules with q_proj and a context_attention "
                             "slot (minipar.models.GPT's CausalSelfAttention) or a Hugging Face model's attention "
                             "(q_proj and a config); train this model with cp=1, or build its attention as such a "
                             "module")
        for a in attns:
            if getattr(a, "dropout", 0.0):
                raise ValueError(f"attention dropout ({a.dropout}) under context parallelism is not supported: "
                                 "the masks of a split attention cannot match one process's; build the model "
                                 "with dropout=0.0 or use cp=1")
            heads = _query_rows(a) // a.head_dim // mesh.tp  # a tp rank's heads (built before tp)
            if self.form == "ulysses" and heads % self.cp:
                raise ValueError(f"Ulysses context parallelism gives each cp rank heads / cp heads, but the "
                                 f"attention has {heads} heads per tp rank and cp={self.cp}; use a head count "
                                 f"(per tp rank) divisible by cp, or context_parallel='ring'")
        self.positions: torch.Tensor | None = None  # this rank's tokens' true positions, set by split
        self.seq_len = 0
        # Whether the forward running now is one of split's inputs (then the split, position mapping
        # and exchange apply) or a direct call (the whole sequence, computed here as one process
        # does). Set at the start of every forward of the model (`_arm`); a recomputed block in
        # backward runs under the state of its own forward. Under a pipeline the stages run only
        # micro-batches of split inputs, and a direct call runs one stage anyway: always armed.
        self._armed = mesh.pp > 1
        self._split_inputs: torch.Tensor | None = None
        self._hooks += [m.register_forward_pre_hook(self._true_positions) for m in position_modules(module)]
        self._hooks += [m.register_forward_pre_hook(self._true_position_ids, with_kwargs=True)
                        for m in rotary_modules(module)]
        self.check_token_wise(module, attns)  # ValueError here: no collective has run yet
        for a in attns:
            a.context_attention = self._attention
        if mesh.pp == 1:
            self._hooks.append(module.register_forward_pre_hook(self._arm))

    @property
    def seq_multiple(self) -> int:
        """What the sequence length must be a multiple of: 2C (ring's chunks) or C (Ulysses)."""
        return 2 * self.cp if self.form == "ring" else self.cp

    def local_positions(self, seq_len: int) -> torch.Tensor:
        split = zigzag_positions if self.form == "ring" else contiguous_positions
        return split(seq_len, self.cp, self.group.rank, device=self.mesh.device)

    def split(self, inputs: torch.Tensor, targets: Any, loss_fn: Callable) -> tuple[torch.Tensor, Any, Callable]:
        """This rank's tokens of ``inputs`` and ``targets`` (batch, seq, ...), and ``loss_fn``
        weighted so that the mean over the cp ranks is the mean over every token."""
        self.seq_len = inputs.shape[1]
        self.positions = self.local_positions(self.seq_len)
        local_inputs = inputs.index_select(1, self.positions.to(inputs.device))
        self._split_inputs = local_inputs  # the forward of exactly this tensor runs split (`_arm`)
        if not torch.is_tensor(targets):
            return local_inputs, targets, loss_fn
        local_targets = targets.index_select(1, self.positions.to(targets.device))
        total = counted(targets)
        weight = counted(local_targets) * self.cp / total.clamp(min=1.0)  # no host sync
        some = total > 0

        def weighted(output, y):
            return loss_fn(output, finite_if_empty(y, some.to(y.device))) * weight.to(output.device)
        return local_inputs, local_targets, weighted

    def _arm(self, module: nn.Module, args: tuple) -> None:
        """Forward pre-hook of the model: split applies to this forward only if its input is the one
        split produced; any other call computes the whole sequence it is given, as one process."""
        self._armed = bool(args) and args[0] is self._split_inputs and self._split_inputs is not None
        self._split_inputs = None

    def _true_positions(self, module: nn.Module, args: tuple) -> tuple | None:
        if not self._armed or self.positions is None or not args or not torch.is_tensor(args[0]):
            return None
        return (self.positions.to(args[0].device)[args[0]],) + tuple(args[1:])

    def _true_position_ids(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        """A Hugging Face rotary embedding's ``position_ids`` (its second argument) -> true positions."""
        if not self._armed or self.positions is None:
            return None
        if "position_ids" in kwargs:
            ids = kwargs["position_ids"]
            return args, {**kwargs, "position_ids": self.positions.to(ids.device)[ids]}
        ids = args[1]
        return (args[0], self.positions.to(ids.device)[ids]) + tuple(args[2:]), kwargs

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   original: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """(B, H, T_local, D) each -> (B, H, T_local, D). ``original``: what the model computes unwired
        (a Hugging Face attention, its mask and all), for a direct call."""
        if not self._armed:  # a direct call: this rank holds the whole sequence
            return original() if original is not None else F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.form == "ring":
            return ring_attention(q, k, v, self.mesh.comm, self.group, self.seq_len)
        return ulysses_attention(q, k, v, self.mesh.comm, self.group)

    # -- the wrap-time check ----------------------------------------------------------------------

    def check_token_wise(self, module: nn.Module, attns: list[nn.Module]) -> None:
        """ValueError unless ``module`` computes each token's logits from the other tokens only through
        the attention modules minipar wires (``attns``) and positions only through the modules it
        maps (`position_modules`). In one process, eval mode, on one short sequence (2C tokens, 4C
        when the model takes them: a few small forwards): the whole sequence once, recording every
        wired attention's keys and values; then for each cp rank its tokens alone, each wired
        attention attending from them to the recorded keys and values under the causal mask of the
        true positions. That is what the cp ranks compute together, so the logits must be the whole
        sequence's at those positions. MoE layers run without capacity drops here (their per-rank
        routing is intended). Nothing of the model changes."""
        with left_as_it_was(module):
            self._compare_token_wise(module, attns)

    def _compare_token_wise(self, module: nn.Module, attns: list[nn.Module]) -> None:
        config = getattr(module, "config", None)
        limit = next((getattr(config, k) for k in ("block_size", "max_position_embeddings", "n_positions")
                      if isinstance(getattr(config, k, None), int)), None)
        tokens = self.seq_multiple * 2 if limit is None or limit >= self.seq_multiple * 2 else self.seq_multiple
        if limit is not None and tokens > limit:
            return  # no sequence splits: the batch check refuses every batch with the length to use
        emb = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
        vocab = getattr(config, "vocab_size", None) or (emb.num_embeddings if emb is not None else 1)
        device = next(module.parameters()).device
        ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
        names = {m: n or type(module).__name__ for n, m in module.named_modules()}
        seen: list[tuple[str, Any]] = []  # (module name, first tensor of its output), in call order
        hooks = [m.register_forward_hook(lambda m, a, out: seen.append((names[m], _first_tensor(out))))
                 for m in names]
        moe = [(m, m.capacity_factor) for m in module.modules() if hasattr(m, "capacity_factor")
               and hasattr(m, "n_experts")]
        try:
            for m, _ in moe:  # T * k slots per expert: no token dropped, routing token by token
                m.capacity_factor = float(m.n_experts)
            keys: list[tuple[torch.Tensor, torch.Tensor]] = []

            if self._hf:  # the model's own attention must be what ring and Ulysses compute
                why = check_plain_causal(module, self._hf, ids, _close)
                if why:
                    raise ValueError(f"context parallelism (cp={self.cp}) runs causal attention over the split "
                                     f"sequence, but {type(module).__name__} {why}; train it with cp=1")

            def record(q, k, v, original=None):
                keys.append((k, v))
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            for a in attns:
                a.context_attention = record
            whole = _first_tensor(module(ids))
            whole_seen = dict(_numbered(seen))
            for rank in range(self.cp):
                positions = (zigzag_positions if self.form == "ring" else contiguous_positions)(
                    tokens, self.cp, rank, device=device)
                calls = iter(keys)

                def attend(q, k, v, original=None):  # this rank's queries over the whole sequence's keys, causally
                    full_k, full_v = next(calls)
                    mask = positions[:, None] >= torch.arange(tokens, device=q.device)[None, :]
                    return F.scaled_dot_product_attention(q, full_k, full_v, attn_mask=mask)
                for a in attns:
                    a.context_attention = attend
                self.positions, self._armed = positions, True
                seen.clear()
                local = _first_tensor(module(ids[:, positions]))
                if not _close(local, whole[:, positions]):
                    raise ValueError(self._mixing_message(module, attns, rank, local, whole[:, positions],
                                                          _first_difference(seen, whole_seen, positions, tokens)))
        finally:
            for h in hooks:
                h.remove()
            for a in attns:
                a.context_attention = None
            for m, cf in moe:
                m.capacity_factor = cf
            self.positions, self._armed = None, self.mesh.pp > 1

    def _mixing_message(self, module: nn.Module, attns: list[nn.Module], rank: int, local: torch.Tensor,
                        whole: torch.Tensor, culprit: str | None) -> str:
        wired = {id(m) for a in attns for m in a.modules()}
        unknown = [f"{n} ({type(m).__name__})" for n, m in module.named_modules() if id(m) not in wired
                   and (isinstance(m, nn.MultiheadAttention) or "attention" in type(m).__name__.lower())]
        diff = (local.float() - whole.float()).abs().max().item() if local.shape == whole.shape else float("nan")
        return (f"context parallelism (cp={self.cp}, {self.form!r}) splits every sequence over the cp ranks, but "
                f"{type(module).__name__} mixes tokens where minipar does not split them: run in one process, cp "
                f"rank {rank}'s tokens get other logits than the same tokens of the whole sequence (max difference "
                f"{diff:.3g}" + (f"; the first module whose output differs is {culprit}" if culprit else "") + "). "
                "minipar wires only its own attention (modules with q_proj or qkv_proj and a context_attention "
                "slot, as minipar.models.GPT's), a Hugging Face model's attention (q_proj and a config) and the "
                "position modules (wpe, takes_positions = True, a Hugging Face *RotaryEmbedding)"
                + (f"; not wired here: {', '.join(unknown)}" if unknown else "")
                + ". Train this model with cp=1, or build its attention as a module minipar wires")


@contextlib.contextmanager
def left_as_it_was(model: nn.Module) -> Iterator[None]:
    """Run ``model`` for a check: eval mode, no gradient; afterwards every module's training flag,
    the statistics modules keep of their last forward (``last_*``: an MoE layer's auxiliary loss,
    drops, counts) and the CPU random state are what they were."""
    modes = [(m, m.training) for m in model.modules()]
    kept = [(m, {k: v for k, v in vars(m).items() if k.startswith("last_")}) for m in model.modules()]
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.eval()
            yield
    finally:
        for m, mode in modes:
            m.training = mode
        for m, values in kept:
            vars(m).update(values)



def _first_tensor(out: Any) -> Any:
    """A module's output tensor: itself, a Hugging Face output's logits, or a tuple's first element."""
    if torch.is_tensor(out):
        return out
    if torch.is_tensor(getattr(out, "logits", None)):
        return out.logits
    if isinstance(out, (tuple, list)) and out:
        return _first_tensor(out[0])
    return None


def _close(local: Any, whole: Any) -> bool:
    """Equal up to the rounding of a masked attention against a causal one (relative to the scale)."""
    if not torch.is_tensor(local) or not torch.is_tensor(whole) or local.shape != whole.shape:
        return False
    scale = whole.float().abs().max().item() or 1.0
    tol = 1e-4 if whole.dtype == torch.float32 or whole.dtype == torch.float64 else 3e-2
    return bool(((local.float() - whole.float()).abs() <= tol * scale).all())


def _numbered(seen: list) -> list:
    """[((name, k), output)]: the k-th output of that module in the run (a module may run twice)."""
    calls: dict[str, int] = {}
    out = []
    for name, value in seen:
        calls[name] = calls.get(name, -1) + 1
        out.append(((name, calls[name]), value))
    return out


def _first_difference(local_seen: list, whole_seen: dict, positions: torch.Tensor, tokens: int) -> str | None:
    """The first module (in the order outputs were produced: innermost first) whose output over the
    sequence differs at this rank's positions from the whole sequence's."""
    for (name, call), out in _numbered(local_seen):
        ref = whole_seen.get((name, call))
        if not torch.is_tensor(out) or not torch.is_tensor(ref) or ref.dim() < 2 or ref.shape[1] != tokens \
                or out.shape[1] != positions.numel() or out.shape[2:] != ref.shape[2:] or out.shape[0] != ref.shape[0]:
            continue
        if not _close(out, ref[:, positions]):
            return f"{name!r}"
    return None


def position_modules(module: nn.Module) -> list[nn.Module]:
    """The modules whose input is the tokens' positions: learned position tables (minipar's GPT and
    its stages: ``wpe``) and any module that declares ``takes_positions`` (rotary embeddings)."""
    return [m for name, m in module.named_modules()
            if getattr(m, "takes_positions", False) or (name.split(".")[-1] == "wpe" and isinstance(m, nn.Embedding))]
