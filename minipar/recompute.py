"""Activation checkpointing: keep only a block's input in forward, recompute the rest in backward.

Without it, backward needs every intermediate a block produced (attention
scores, MLP pre-activations...), so activation memory grows with
layers x (all intermediates). With it, a chosen block saves only its input;
its backward first re-runs the block's forward, with gradients on, from that
input, then backpropagates through the fresh graph. Memory becomes
layers x (block inputs) + one block's intermediates, for one extra forward
per block.

`Recompute` is the autograd function that does this; the math, for a block
``y = f(x; W)`` (``W`` its parameters):

    forward(x, W):  y = f(x; W) under no_grad          saved: x and the RNG state before f
    backward(dy):   restore that RNG state; y' = f(x'; W') with x', W' fresh leaves aliasing x, W
                    (y' == y bit for bit: same inputs, same kernels, same dropout masks)
                    dx, dW = autograd.grad(y', (x', W'), dy)          returned as the gradients of x, W

The parameters are explicit inputs of the function, so their gradients leave
``backward`` as ordinary outputs and the *outer* backward accumulates them
into ``p.grad``. That matters for the strategies: DDP's and ZeRO's
post-accumulate-grad hooks, sequence parallelism's gradient hooks and ZeRO-3's
end-of-backward callback all fire exactly as without recomputation, once, in
the outer backward. (Accumulating inside the inner pass, as a reentrant
checkpoint does, would queue those callbacks on the inner pass and fire the
tensor hooks twice.) The recompute therefore runs on aliases ``W'`` of the
parameters, swapped into the modules for its duration: hooks registered on
the real parameters do not see the inner pass.

Randomness: the recompute must draw the same dropout masks. `RNGStreams`
snapshots every stream the block draws from -- the device's default
generator and, under tensor parallelism, the `TPRandom` streams -- before the
forward, replays them for the recompute, and puts the current states back
afterwards so the run's streams advance exactly once per forward.

Strategies: the block's own module hooks (ZeRO-3 unshard/reshard) run around
the checkpointed forward as usual, and ZeRO-3's pre-backward hook on the
block's output gathers the parameters again before `Recompute.backward`
runs; the recompute calls the block's original forward, not the module, so
no unit hook runs twice. A ZeRO-3 unit *inside* a checkpointed block would
need its hooks inside the recompute, which is refused (`check_units`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

__all__ = ["Recompute", "RNGStreams", "checkpoint_modules", "select_checkpointed", "ActivationMemory"]


class RNGStreams:
    """The random streams a block may draw from: the default generator of ``device`` and the
    streams of a `minipar.tensor_parallel.TPRandom` (``tp_random``), if any."""

    def __init__(self, device: torch.device, tp_random: Any = None) -> None:
        self.device, self.tp_random = torch.device(device), tp_random

    def snapshot(self) -> tuple:
        default = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()
        streams = dict(self.tp_random.states) if self.tp_random is not None else None
        return default, streams

    def _restore(self, snap: tuple) -> None:
        default, streams = snap
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(default, self.device)
        else:
            torch.set_rng_state(default)
        if streams is not None:
            self.tp_random.states = dict(streams)

    @contextlib.contextmanager
    def replay(self, snap: tuple) -> Iterator[None]:
        """Inside: the streams as they were at ``snap``. After: as they were before entering."""
        now = self.snapshot()
        self._restore(snap)
        try:
            yield
        finally:
            self._restore(now)


@contextlib.contextmanager
def _parameters_swapped(module: nn.Module, aliases: dict[int, torch.Tensor]) -> Iterator[None]:
    """Inside: every registration of a parameter p in ``module``'s tree reads ``aliases[id(p)]`` instead
    (tied parameters stay tied: one alias per parameter)."""
    swapped = []
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None and id(p) in aliases:
                swapped.append((m, name, p))
                m._parameters[name] = aliases[id(p)]
    try:
        yield
    finally:
        for m, name, p in swapped:
            m._parameters[name] = p


class Recompute(torch.autograd.Function):
    """y = block(*args), saving only the tensor args; backward recomputes (see the module docstring).

    apply(block, forward, rng, n_args, *args, *params): ``forward`` is the block's original forward,
    ``params`` its trainable parameters. Returns what ``forward`` returns (a tensor or a tuple of them).
    """

    @staticmethod
    def forward(ctx, block: nn.Module, fwd: Callable, rng: RNGStreams, n_args: int, *inputs: Any):
        args, params = inputs[:n_args], inputs[n_args:]
        ctx.block, ctx.fwd, ctx.rng, ctx.params = block, fwd, rng, params
        ctx.rng_state = rng.snapshot()
        ctx.tensor_at = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[args[i] for i in ctx.tensor_at])  # the block's inputs: all it keeps
        with torch.no_grad():
            return fwd(*args)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor):
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
            args[i] = t.detach().requires_grad_(t.requires_grad)
        aliases = {id(p): p.detach().requires_grad_() for p in ctx.params}
        with ctx.rng.replay(ctx.rng_state), _parameters_swapped(ctx.block, aliases), torch.enable_grad():
            outputs = ctx.fwd(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if torch.is_tensor(o) and o.requires_grad
                 and g is not None]
        wrt_args = [a for a in args if torch.is_tensor(a) and a.requires_grad]
        wrt = wrt_args + [aliases[id(p)] for p in ctx.params]
        grads = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True) \
            if pairs else [None] * len(wrt)
        arg_grads = iter(grads[:len(wrt_args)])
        input_grads = [next(arg_grads) if torch.is_tensor(a) and a.requires_grad else None for a in args]
        return (None, None, None, None, *input_grads, *grads[len(wrt_args):])


def _checkpointed_forward(block: nn.Module, fwd: Callable, rng: RNGStreams, *args: Any, **kwargs: Any):
    """What a checkpointed block's ``forward`` becomes."""
    if kwargs:
        fwd = functools.partial(fwd, **kwargs)  # keyword arguments pass through, but get no gradient
        if any(torch.is_tensor(v) and v.requires_grad for v in kwargs.values()):
            raise ValueError(f"a checkpointed {type(block).__name__} got a keyword tensor that requires grad; "
                             "pass it positionally so its gradient is computed")
    params = [p for p in block.parameters() if p.requires_grad]
    needs_grad = torch.is_grad_enabled() and (params or any(torch.is_tensor(a) and a.requires_grad for a in args))
    if not needs_grad:  # evaluation, or nothing to differentiate: an ordinary call
        return fwd(*args)
    return Recompute.apply(block, fwd, rng, len(args), *args, *params)


def select_checkpointed(module: nn.Module, policy: Any, require: bool = True) -> list[tuple[str, nn.Module]]:
    """The (name, submodule) pairs to recompute, outermost only.

    policy: True -> every entry of every nn.ModuleList (the transformer blocks); a tuple of module
    classes -> the outermost modules of those classes; a callable(module) -> bool -> the outermost
    modules it accepts. (The same choices as ZeRO-3's wrap policies, minus parameter counts.)
    ``require``: raise ValueError when nothing matches (False for a pipeline stage, which may hold
    none of the chosen modules; the whole model was checked first).
    """
    from .core.units import select_units

    if policy is not True and (policy is None or isinstance(policy, (bool, int, float, str))):
        raise ValueError(f"activation_checkpointing={policy!r} is not understood; pass True (each nn.ModuleList "
                         "entry), a tuple of module classes, or a callable(module) -> bool")
    try:
        chosen = select_units(module, None if policy is True else policy, option="activation_checkpointing")
    except ValueError:
        if require:
            raise
        chosen = []
    if not chosen and require:
        raise ValueError(f"activation_checkpointing=True recomputes each nn.ModuleList entry, but "
                         f"{type(module).__name__} has none; pass module classes or a callable")
    return [(n, m) for n, m in chosen if not any(n.startswith(o + ".") for o, _ in chosen)]


def check_units(checkpointed: list[tuple[str, nn.Module]], unit_names: list[str]) -> None:
    """Refuse a ZeRO-3 unit strictly inside a checkpointed module: its unshard/reshard hooks would
    have to run inside the recompute, which calls the block's forward without them."""
    for name, _ in checkpointed:
        inner = [u for u in unit_names if u.startswith(name + ".")]
        if inner:
            raise ValueError(f"zero3 units {inner} lie inside the checkpointed module {name!r}; checkpoint at "
                             "or inside the unit level (e.g. the default: units and checkpoints both the "
                             "transformer blocks), or choose a wrap_policy with coarser units")


def checkpoint_modules(module: nn.Module, policy: Any, device: torch.device) -> list[str]:
    """Make the modules ``policy`` selects recompute their forward in backward (in place).

    The RNG streams replayed are ``device``'s default generator and ``module.tp_random`` if the
    model is tensor-parallel. Returns the names of the checkpointed modules.
    """
    rng = RNGStreams(device, getattr(module, "tp_random", None))
    chosen = select_checkpointed(module, policy, require=False)
    for _, block in chosen:
        # An instance attribute shadows the class's forward; nn.Module.__call__ still runs the block's
        # hooks around it (ZeRO-3's unshard/reshard), and `del block.forward` undoes it.
        block.forward = functools.partial(_checkpointed_forward, block, block.forward, rng)
    return [n for n, _ in chosen]


class ActivationMemory:
    """Counts the bytes of activations autograd keeps for backward, and their peak.

        with ActivationMemory(model.parameters()) as mem:
            loss = model(x).sum(); loss.backward()
        mem.peak_bytes, mem.after_forward_bytes (call mem.mark_forward_done() between the two)

    Every tensor autograd saves passes through a saved-tensors pack hook; a
    storage is counted once while any saved reference to it is alive (it is
    uncounted when the graph node holding the last reference is freed, which
    backward does node by node). Parameters (and views of them) are not
    activations and are not counted. Recomputation saves inside backward while
    the block is re-run; those count too, so ``peak_bytes`` is the true peak
    of memory held for backward.
    """

    def __init__(self, params) -> None:
        self._param_storages = {p.untyped_storage().data_ptr() for p in params}
        self._live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.bytes = 0
        self.peak_bytes = 0
        self.after_forward_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._param_storages or storage.nbytes() == 0:
            return t
        return _Held(self, t, key, storage.nbytes())

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    def _add(self, key: int, nbytes: int) -> None:
        entry = self._live.setdefault(key, [0, nbytes])
        entry[0] += 1
        if entry[0] == 1:
            self.bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes)

    def _drop(self, key: int) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.bytes -= entry[1]
            del self._live[key]

    def mark_forward_done(self) -> None:
        self.after_forward_bytes = self.bytes

    def __enter__(self) -> "ActivationMemory":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class _Held:
    """A saved tensor as the graph keeps it: counted from packing until the graph lets go of it."""

    def __init__(self, meter: ActivationMemory, tensor: torch.Tensor, key: int, nbytes: int) -> None:
        self.meter, self.tensor, self.key = meter, tensor, key
        meter._add(key, nbytes)

    def __del__(self) -> None:
        self.meter._drop(self.key)
