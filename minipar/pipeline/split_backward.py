"""The backward pass of a stage split in two: B (the input's gradient) now, W (the weights') later.

A stage computes ``y = f(x; W)``. Its backward has two products for each operation ``z = g(a; w)``
inside it, given the gradient ``dz`` arriving at that operation:

    B:  da = (dg/da)^T dz     the chain back to the input x: the previous stage waits for dx
    W:  dw = (dg/dw)^T dz     needed only by the optimizer step, at the end of the pipeline step

The zero-bubble schedules run B on the critical path and W whenever the rank would idle. Both are
computed on the autograd graph the forward built, without recomputing it:

* `backward_input` walks the graph from ``y`` and marks the nodes on a path to ``x`` (the *path*).
  A *boundary* node is a path node with an input edge leaving the path towards parameters: the
  operation ``g`` above, whose ``dz`` W needs. B hooks every boundary node to keep the ``dz`` it
  receives, then asks autograd for ``dx`` only (``retain_graph``: the graph stays for W). Autograd
  evaluates only what ``dx`` needs: a matmul's node computes ``da``, not ``dw``.
* `WeightGrad.run` (W) starts one backward at each boundary node, from its kept ``dz``, asking for
  the parameters beyond its off-path edges: autograd evaluates only ``dw`` (and what lies between,
  such as a cast of the weight). Each parameter's gradient is accumulated into ``p.grad`` by
  autograd itself, so the strategies' gradient hooks fire as in an ordinary backward.

Every path from ``y`` to a parameter leaves the path at exactly one node (its last path node), so
each contribution to ``dw`` is computed once. Two cases keep the whole backward in one piece:

* the input does not require a gradient (the first stage gets token ids): nothing waits for B, so
  B does nothing and W runs the whole backward;
* a parameter reachable from a boundary node both off and along the path (one weight used at two
  depths of the same stage): W at that node would recompute the path, so B runs the whole
  backward and W does nothing.

A node whose backward is a Python autograd function computes all of its outputs whatever is
asked (minipar's activation checkpointing recomputes a block there): with the split, such a
block's backward runs in B and again in W, each keeping only its own part. Correct, at one extra
block backward per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


@dataclass
class WeightGrad:
    """What W needs for one (micro-batch, chunk): each boundary node with the gradient it received
    in B and the parameters it reaches off the path; or the whole backward (``full``)."""

    boundaries: list[tuple[Node, list[torch.Tensor | None], list[torch.Tensor]]] = field(default_factory=list)
    full: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def run(self) -> None:
        """Accumulate the weights' gradients into ``p.grad``."""
        if self.full is not None:
            out, grad = self.full
            torch.autograd.backward(out, grad)
        for node, grads, params in self.boundaries:
            edges = [GradientEdge(node, i) for i, g in enumerate(grads) if g is not None]
            if edges:
                torch.autograd.backward(edges, [g for g in grads if g is not None], inputs=params,
                                        retain_graph=True)  # boundary nodes share weight-side nodes (casts)
        self.boundaries, self.full = [], None  # the graph is freed with the last reference to it


def _leaf(t: torch.Tensor) -> Node:
    """A leaf tensor's gradient accumulator node (created on first use of ``t`` in a graph)."""
    return t.view_as(t).grad_fn.next_functions[0][0]


def _graph(root: Node) -> list[Node]:
    """Every node reachable from ``root``, each after all of its inputs (children first)."""
    order, seen, stack = [], {root}, [(root, iter(root.next_functions))]
    while stack:  # iterative depth-first post-order: a deep stage must not hit Python's recursion limit
        node, children = stack[-1]
        for child, _ in children:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append((child, iter(child.next_functions)))
                break
        else:
            order.append(node)
            stack.pop()
    return order


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor | None) -> WeightGrad:
    """B: put d(out)/d(inp) applied to ``grad`` into ``inp.grad``; return what W needs.

    out: the stage's output (or its loss, ``grad`` None); inp: the stage's input leaf (None or
    not requiring a gradient on the first stage)."""
    if inp is None or not inp.requires_grad or out.grad_fn is None:
        return WeightGrad(full=(out, grad))
    target = _leaf(inp)
    order = _graph(out.grad_fn)
    on_path: dict[Node, bool] = {}
    params_below: dict[Node, set] = {}  # node -> ids of the parameters (leaf accumulators) it reaches
    for node in order:  # children first
        kids = [c for c, _ in node.next_functions if c is not None]
        on_path[node] = node is target or any(on_path[c] for c in kids)
        below = set()
        var = getattr(node, "variable", None)
        if var is not None and node is not target:
            below.add(id(node))
        for c in kids:
            below |= params_below[c]
        params_below[node] = below
    accumulators = {id(n): n for n in order if getattr(n, "variable", None) is not None}
    boundaries, hooks, whole = [], [], False
    for node in order:
        if not on_path[node] or node is target:
            continue
        kids = [c for c, _ in node.next_functions if c is not None]
        side = set().union(*(params_below[c] for c in kids if not on_path[c]))
        if not side:
            continue
        along = set().union(*(params_below[c] for c in kids if on_path[c]))
        if side & along:
            whole = True
            break
        kept: list = []
        boundaries.append((node, kept, [accumulators[i].variable for i in sorted(side)]))
        hooks.append(node.register_prehook(lambda grads, kept=kept: kept.extend(grads)))
    if whole or not on_path.get(out.grad_fn, False):
        for h in hooks:
            h.remove()
        torch.autograd.backward(out, grad)  # no split: the whole backward now
        return WeightGrad()
    try:
        (dx,) = torch.autograd.grad(out, inp, grad, retain_graph=True)
    finally:
        for h in hooks:
            h.remove()
    inp.grad = dx if inp.grad is None else inp.grad + dx
    return WeightGrad(boundaries=[(n, list(kept), params) for n, kept, params in boundaries])
