"""Cutting a model into pipeline stages: embedding + first blocks, ..., last blocks + head.

Any block-sequential model can be cut (`minipar.pipeline.spec`: minipar's GPT, Hugging Face
GPT-2 and Llama-family models are recognised; others give a `StageSpec`). Below, "the GPT"
stands for any of them: wte/wpe are its embedding modules, ln_f/lm_head its head's.

Every rank builds the whole single-process model from the same seed and keeps
its stage's pieces, so stage s holds exactly the weights the reference holds
for those layers. A tied embedding / LM head lives on the first stage (as the
embedding) and on the last (as the head): two copies, kept identical by
summing their gradients between those two stages before every step
(`sync_tied_grads`).

Where the cuts go. Stage s runs blocks [b_s, b_{s+1}) with 0 = b_0 < b_1 <
... < b_p = n_layer (every stage at least one block). Its cost is the number
of parameters it holds,

    c_s = E [s = 0] + H [s = p - 1] + sum over its blocks l of P_l

with P_l block l's parameters, E = wte + wpe (the embedding, on the first
stage) and H = ln_f + lm_head (on the last; a tied lm_head weight is counted
once, as the embedding's, so H = ln_f then). The default cut minimises the
largest c_s (a pipeline step runs at the pace of its fullest stage), and
among those cuts the most even one (smallest sum of c_s^2), then the one that
gives earlier stages more blocks. With equal blocks and E = H = 0 this is the
even split by layer count: n_layer = 5 over 4 stages gives 2, 1, 1, 1.

Parameters stand for both memory (weights, gradients, optimizer state scale
with them) and compute (a matmul costs 6 FLOPs per parameter per token, forward
and backward). They overstate the first stage's compute: an embedding lookup
costs no matmul; and a tied head's matmul runs on the last stage, whose cost
does not count it.

Explicit boundaries (``GPTStage(..., boundaries=)``, `resolve_boundaries`) are
either ``p`` block counts, e.g. ``[1, 3]``, or the ``p + 1`` cut points
b_0..b_p, e.g. ``[0, 1, 4]`` (both: 1 block on stage 0, 3 on stage 1).
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.nn as nn

from ..core.mesh import Mesh
from .schedule import holder, virtual_stage
from .spec import StageSpec, find, gpt_spec, hidden_of, spec_for


def balanced_boundaries(n_layer: int, stages: int, block_params: Sequence[int] | None = None,
                        first_params: int = 0, last_params: int = 0) -> list[int]:
    """The cut points b_0..b_p (stage s runs blocks [b_s, b_{s+1})) that balance the stages' parameters.

    block_params: each block's parameter count (default: 1 each, i.e. balance by layer count);
    first_params / last_params: what the first / last stage holds besides blocks (E and H above).
    Raises ValueError when there are more stages than blocks.
    """
    if stages < 1:
        raise ValueError(f"stages={stages} must be at least 1")
    if stages > n_layer:
        raise ValueError(f"{stages} pipeline stages but only {n_layer} layers: use at most {n_layer} stages "
                         "(every stage needs at least one layer)")
    sizes = [1] * n_layer if block_params is None else [int(n) for n in block_params]
    if len(sizes) != n_layer:
        raise ValueError(f"block_params has {len(sizes)} entries for n_layer={n_layer}")
    prefix = [0]
    for n in sizes:
        prefix.append(prefix[-1] + n)

    def cost(s: int, i: int, j: int) -> int:  # stage s running blocks [i, j)
        return prefix[j] - prefix[i] + (first_params if s == 0 else 0) + (last_params if s == stages - 1 else 0)

    # Pass 1: the smallest achievable largest stage. worst[s][j]: the best largest cost when stages
    # 0..s-1 run blocks [0, j). Each stage takes at least one block, so stage s ends in [s+1, n - rest].
    inf = float("inf")
    worst = [[inf] * (n_layer + 1) for _ in range(stages + 1)]
    worst[0][0] = 0
    for s in range(stages):
        for j in range(s + 1, n_layer - (stages - 1 - s) + 1):
            worst[s + 1][j] = min(max(worst[s][i], cost(s, i, j)) for i in range(s, j))
    limit = worst[stages][n_layer]
    # Pass 2: under that limit, the smallest sum of squares (additive, so a plain DP is exact); ties
    # go to the cut whose block counts are lexicographically largest (earlier stages take more).
    best: list[dict[int, tuple]] = [{0: (0, ())}] + [{} for _ in range(stages)]
    for s in range(stages):
        for i, (sq, counts) in best[s].items():
            for j in range(i + 1, n_layer - (stages - 1 - s) + 1):
                c = cost(s, i, j)
                if c > limit:
                    continue
                cand = (sq + c * c, counts + (j - i,))
                old = best[s + 1].get(j)
                if old is None or (cand[0], tuple(-k for k in cand[1])) < (old[0], tuple(-k for k in old[1])):
                    best[s + 1][j] = cand
    counts = best[stages][n_layer][1]
    return [sum(counts[:s]) for s in range(stages + 1)]


def stage_params(model: nn.Module, spec: StageSpec | None = None) -> tuple[list[int], int, int]:
    """(each block's parameters, the embedding's E, the head's H) of a model, as `balanced_boundaries`
    takes them; a tied head's weight is counted once, in E."""
    spec = spec or spec_for(model)
    embedding = [p for path in spec.first for p in find(model, path).parameters()]
    seen = {id(p) for p in embedding}
    head = {id(p): p for path in spec.last for p in find(model, path).parameters() if id(p) not in seen}
    return ([sum(p.numel() for p in block.parameters()) for block in find(model, spec.blocks)],
            sum(p.numel() for p in {id(p): p for p in embedding}.values()), sum(p.numel() for p in head.values()))


def default_boundaries(model: nn.Module, stages: int, spec: StageSpec | None = None) -> list[int]:
    """The cut points that balance ``model``'s stages by parameter count (see the module docstring)."""
    blocks, first, last = stage_params(model, spec)
    return balanced_boundaries(len(blocks), stages, blocks, first, last)


def resolve_boundaries(spec: Sequence[int], n_layer: int, stages: int) -> list[int]:
    """Explicit boundaries as cut points: ``spec`` is either ``stages`` block counts (each >= 1, summing
    to n_layer) or ``stages + 1`` cut points rising strictly from 0 to n_layer. Raises ValueError otherwise."""
    spec = list(spec)
    example = f"e.g. {[1] * (stages - 1) + [n_layer - stages + 1]} (block counts) or " \
              f"{list(range(stages)) + [n_layer]} (cut points)" if stages <= n_layer else ""
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in spec):
        raise ValueError(f"pipeline_boundaries={spec} must be integers; {example}")
    if len(spec) == stages:
        if any(c < 1 for c in spec) or sum(spec) != n_layer:
            raise ValueError(f"pipeline_boundaries={spec} as block counts must be {stages} numbers, each at least 1, summing to "
                             f"n_layer={n_layer}; {example}")
        return [sum(spec[:s]) for s in range(stages + 1)]
    if len(spec) == stages + 1:
        if spec[0] != 0 or spec[-1] != n_layer or any(b >= c for b, c in zip(spec, spec[1:])):
            raise ValueError(f"pipeline_boundaries={spec} as cut points must rise strictly from 0 to n_layer={n_layer} "
                             f"(every stage at least one block); {example}")
        return spec
    raise ValueError(f"pipeline_boundaries={spec} for {stages} stages: give {stages} block counts or "
                     f"{stages + 1} cut points; {example}")


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with its own tables (children, parameters, buffers, hooks; their values
    shared), so that changing the copy's never changes the original's."""
    copy_ = copy.copy(module)
    for name, value in vars(module).items():
        if isinstance(value, (dict, set)):
            copy_.__dict__[name] = copy.copy(value)
    return copy_


def _pruned(model: nn.Module, changes: dict[str, nn.Module | None]) -> nn.Module:
    """A copy of ``model``'s module tree with the module at each path of ``changes`` replaced (None:
    dropped). Only the modules along those paths are copied; the rest (blocks, norms) are shared, and
    ``model`` itself is left as it was."""
    root = _shallow(model)
    fresh = {id(root)}
    for path, new in changes.items():
        *steps, leaf = path.split(".")
        parent = root
        for name in steps:
            child = parent._modules[name]
            if id(child) not in fresh:
                child = _shallow(child)
                fresh.add(id(child))
                parent._modules[name] = child
            parent = child
        parent._modules[leaf] = new
    return root


class Stage(nn.Module):
    """One pipeline stage of a block-sequential model (`StageSpec`). Input: token ids (first stage) or
    the previous stage's hidden states (batch, seq, hidden); output: hidden states, or logits on the
    last stage.

    The stage has the model's attribute tree and state-dict names (``transformer.h.k`` for a
    Hugging Face GPT-2), with the blocks it does not run left out of the block list (its
    ``blocks.k`` is the model's ``blocks.(layer_offset + k)``) and the embedding's and the head's
    modules only where they run. A tied embedding/head weight is two Parameters across stages: the
    first stage's embedding and the last stage's own copy for the head (`sync_tied_grads`).

    boundaries: None for the parameter-balanced default (`default_boundaries`), else block counts
    or cut points (`resolve_boundaries`). ``self.boundaries`` holds the cut points used.
    chunks, placement: with ``chunks`` > 1 the model is cut into stages * chunks pieces (virtual
    stages) and this rank holds ``chunks`` of them, where ``placement`` puts them
    (`minipar.pipeline.schedule.virtual_stage`: "interleaved" or "v"); its block list is its
    chunks' blocks in chunk order (``block_index[k]``: the model's index of block k), and
    ``forward(x, chunk=c)`` runs chunk c (the embedding first on piece 0, the head last on the
    last piece). ``first`` / ``last``: this rank holds the first / last piece.
    """

    def __init__(self, model: nn.Module, stage: int, stages: int, boundaries: Sequence[int] | None = None,
                 spec: StageSpec | None = None, chunks: int = 1, placement: str = "interleaved",
                 copy_tied: bool = True) -> None:
        super().__init__()
        spec = spec or spec_for(model)
        spec.check_paths(model)  # (the whole check, `cut_check.check_spec`, runs once when a model is wrapped)
        blocks = find(model, spec.blocks)
        pieces = stages * chunks  # the virtual stages: the model is cut into this many pieces
        bounds = default_boundaries(model, pieces, spec) if boundaries is None else \
            resolve_boundaries(boundaries, len(blocks), pieces)
        self.spec, self.boundaries = spec, bounds
        # chunk c of this rank runs virtual stage vstages[c]: its blocks [bounds[k], bounds[k + 1])
        self.vstages = [virtual_stage(stage, c, stages, placement) for c in range(chunks)]
        self.pieces = pieces
        self.block_index = [b for k in self.vstages for b in range(bounds[k], bounds[k + 1])]  # local -> model's
        starts = [0]
        for k in self.vstages:
            starts.append(starts[-1] + bounds[k + 1] - bounds[k])
        self.chunk_blocks = list(zip(starts, starts[1:]))  # chunk c runs its blocks [lo, hi)
        self.first, self.last = 0 in self.vstages, pieces - 1 in self.vstages
        self.layer_offset = bounds[self.vstages[0]]  # chunk 0's block k is the model's block (offset + k)
        # A tied embedding/head weight needs a copy (and a gradient sum) only where the first and the
        # last piece live on different ranks; a rank that holds both (ZB-V's first) shares it as the model does.
        self.tied = spec.tied_in(model) and holder(0, stages, placement)[0] != holder(pieces - 1, stages, placement)[0]
        # the whole tied weight's shape (every stage knows it: a middle stage adds zeros of it)
        self.tied_shape = tuple(find(model, spec.tied[0]).shape) if self.tied else None
        changes: dict[str, nn.Module | None] = {spec.blocks: nn.ModuleList(blocks[b] for b in self.block_index)}
        changes.update({path: None for path in (() if self.first else spec.first) + (() if self.last else spec.last)})
        copy_tied = copy_tied and self.tied and self.last  # (`check_cut` runs stages in one process: no copy)
        if copy_tied:  # the head module gets its own copy of the weight
            head_path, weight = spec.tied[1].rsplit(".", 1)
            changes[head_path] = _shallow(find(model, head_path))
        root = _pruned(model, changes)
        for name, child in root._modules.items():
            self.add_module(name, child)
        for name, p in root._parameters.items():
            self.register_parameter(name, p)
        if copy_tied:
            setattr(find(self, head_path), weight, nn.Parameter(find(model, spec.tied[1]).detach().clone()))

    def global_name(self, name: str) -> str:
        """The whole model's name for this stage's module, parameter or buffer ``name``."""
        blocks = self.spec.blocks + "."
        if not name.startswith(blocks):
            return name
        idx, _, rest = name[len(blocks):].partition(".")
        return f"{blocks}{self.block_index[int(idx)]}" + (f".{rest}" if rest else "")

    def stage_blocks(self) -> nn.ModuleList:
        """The blocks this stage runs, in order (chunk 0's, then chunk 1's, ...)."""
        return find(self, self.spec.blocks)

    def forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """Run chunk ``chunk``: the embedding first if it is the model's first piece, the head last if
        it is the last piece."""
        spec, k = self.spec, self.vstages[chunk]
        h = spec.embed(self, x) if k == 0 else x
        kwargs = spec.block_kwargs(self, h) if spec.block_kwargs is not None else {}
        lo, hi = self.chunk_blocks[chunk]
        for block in self.stage_blocks()[lo:hi]:
            h = hidden_of(block(h, **kwargs))
        return spec.head(self, h) if k == self.pieces - 1 else h

    def tied_weight(self) -> nn.Parameter | None:
        if not self.tied:
            return None
        return find(self, self.spec.tied[0]) if self.first else (find(self, self.spec.tied[1]) if self.last else None)


def GPTStage(gpt: nn.Module, stage: int, stages: int, boundaries: Sequence[int] | None = None) -> Stage:
    """A `Stage` of minipar's GPT (kept for the earlier name)."""
    return Stage(gpt, stage, stages, boundaries, spec=gpt_spec(gpt))


@torch.no_grad()
def sync_tied_grads(stage: Stage, mesh: Mesh, shape: torch.Size, already_summed: torch.Tensor | None = None) -> None:
    """Sum the tied weight's gradient over the first and last stage (middle stages add zeros).

    ``already_summed``: what ``w.grad`` held before this step (an earlier step's sum, identical on both
    stages, when zero_grad was not called in between): only the gradient added since is summed."""
    if not stage.tied:
        return
    w = stage.tied_weight()
    dtype = next(stage.parameters()).dtype  # the gradient's dtype (the compute dtype), equal on every stage
    buf = torch.zeros(shape, dtype=dtype, device=mesh.device) if w is None or w.grad is None else w.grad
    if already_summed is not None:
        buf.sub_(already_summed)
    mesh.comm.all_reduce(buf, mesh.group("pp"), tag="tied_grad")
    if already_summed is not None:
        buf.add_(already_summed)
    if w is not None and w.grad is None:
        w.grad = buf
