"""Parameter server: some ranks own the parameters, the others compute gradients.

The world splits into ``servers`` server ranks (global ranks 0 .. S-1) and W = world - S
worker ranks. Each server owns a partition of the parameters -- whole tensors, balanced by
size -- and the optimizer state of that partition (the user's optimizer class over those
tensors only). One worker step:

    worker w                                  server s
    forward, backward on its local batch
    push  grads of partition s  ----------->  (sync)  wait for all W pushes, average, clip, step
                                              (async) apply w's push at once, scaled 1/W, step
    pull  params of partition s <-----------  reply with the partition's current values

Every message is a point-to-point send/recv through ``mesh.comm`` on the world group, so
``mesh.comm.counting()`` sees every byte; the servers' only collective is the all-reduce of
their partial squared gradient norms (sync clipping) on a group of their own.

Modes:

* ``"sync"``: the servers step once per round, on the mean of every worker's gradient: with
  equal per-worker batches this is the single-process run on the global batch, step for step.
  ``max_norm`` clips the *global* gradient: each server's partial sum of squares, summed over
  the servers, is the squared norm of the whole averaged gradient.
* ``"async"``: a server applies each push as it arrives (gradient / W, one optimizer step), so
  workers never wait for each other -- and compute on parameters that others have moved on
  since. ``staleness=k`` bounds that, the stale-synchronous-parallel way (Ho et al., 2013): a
  worker about to compute its step c waits until every unfinished worker has pushed at least
  c - k gradients, so the parameters it computes on hold every update of every step < c - k
  (their *version*, ``clock`` below, is at least c - k). ``staleness=0`` gives lock-step
  rounds (each push still its own step); None never waits. ``max_norm`` here clips each
  worker's own gradient before it is pushed (each push is its own step, so that is the
  gradient the step sees). A server takes pushes in arrival order with `Comm.recv_any`, an
  any-source receive that only gloo has: the async mode needs gloo.

Whole tensors keep each optimizer step identical to the single-process one for any optimizer
(also those that look at a tensor's shape or norm); the price is balance: a server holds at
least the largest tensor, so S is useful up to about (parameter bytes / largest tensor).

A push carries, beside each gradient, whether the worker computed one (one number per tensor). A
tensor no worker (sync) or the pushing worker (async) gave a gradient to -- a frozen parameter
(``requires_grad=False``), an expert no token reached -- keeps ``grad=None`` on its server, so the
optimizer skips it as it does in one process; a zero gradient would still move it (AdamW's decay,
its momentum). One some workers used gets the mean, the others contributing zero (as DDP).

Every rank builds the same model; the workers start from the servers' values (the first pull),
like DDP starts from rank 0's. Servers run ``serve()`` until every worker has called
``finish()``; a worker calls ``train_step`` once per step.

A worker whose step raises (a bad batch, a loss that fails) tells every server before it raises
(`_abort`); each server then answers every other worker's push with a refusal and raises too, so
every rank stops with an error instead of waiting for a gradient that never comes.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core.grad_norm import scale_by_norm_
from ..core.mesh import Mesh

MODES = ("sync", "async")
# The last element of a push: a gradient, "this worker has finished", or "this worker's step failed"
_PUSH, _DONE, _ABORT = 1.0, 0.0, 2.0
_OK, _FAILED = 1.0, 0.0  # the last element of a reply
_HEADER = 3  # reply: (sync: loss, version, grad norm | async: clock, updates, 0 | failed: the worker or -1), status


class ParameterServer:
    """Train ``model`` with parameter servers on the first ``servers`` ranks of ``mesh``.

    Args:
        model: the model, built identically on every rank; moved to ``mesh.device``.
        mesh: a purely data-parallel `Mesh` (tp = pp = cp = 1) over the whole world.
        optimizer: the optimizer class each server runs over its partition; ``**optimizer_kwargs``
            are its arguments (e.g. ``torch.optim.AdamW, lr=1e-3, weight_decay=0.1``).
        servers: how many server ranks, 1 <= servers < world size.
        mode: "sync" or "async".
        staleness: async only: a worker computes its step c on parameters that hold every worker's
            steps < c - staleness (it waits otherwise); None: no bound.
        max_norm: clip the gradient to this global 2-norm before each step (see the module doc).

    Raises ValueError, on every rank and before any communication, for a configuration that
    cannot run; then one small collective checks every rank passed the same one.
    """

    def __init__(self, model: nn.Module, mesh: Mesh, optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 *, servers: int = 1, mode: str = "sync", staleness: int | None = None,
                 max_norm: float | None = None, **optimizer_kwargs: Any) -> None:
        params = list(model.parameters())  # shared (tied) tensors once
        _check_config(mesh, params, servers, mode, staleness, max_norm)
        self.mesh, self.mode, self.staleness, self.max_norm = mesh, mode, staleness, max_norm
        self.model = model.to(mesh.device)
        self.params = list(self.model.parameters())
        self.n_servers, self.n_workers = servers, mesh.world_size - servers
        self.server_ranks = tuple(range(servers))
        self.worker_ranks = tuple(range(servers, mesh.world_size))
        self.is_server = mesh.rank < servers
        self.partitions = partition_by_size([p.numel() for p in self.params], servers)
        self.numels = [sum(self.params[i].numel() for i in part) for part in self.partitions]
        # a push: the partition's gradients, one "computed" flag per tensor, the loss, the push flag
        self.push_sizes = [n + len(part) + 2 for n, part in zip(self.numels, self.partitions)]
        self.dtype = self.params[0].dtype
        # Every rank builds the optimizer (a worker over all parameters, then drops it): arguments its class
        # refuses fail on every rank, before any message. On the servers alone, the workers would wait
        # for their first pull forever.
        owned = [self.params[i] for i in self.partitions[mesh.rank]] if self.is_server else self.params
        try:
            built = optimizer(owned, **optimizer_kwargs) if owned else None
        except Exception as e:  # noqa: BLE001 -- whatever the class raises, every rank raises it the same way
            raise ValueError(f"ParameterServer: {getattr(optimizer, '__name__', optimizer)}(params, "
                             f"**{optimizer_kwargs!r}) cannot be built ({type(e).__name__}: {e}); fix the "
                             "optimizer's arguments") from e

        self.world = mesh.world
        mesh.comm.check_same("ParameterServer(servers, mode, staleness, max_norm, parameter shapes)",
                             (servers, mode, staleness, max_norm, [tuple(p.shape) for p in self.params]),
                             self.world, where=mesh.where)
        # The servers' own group, for the norm all-reduce; every rank creates both groups, in order.
        self.group = mesh.new_group("ps_servers" if self.is_server else "ps_workers",
                                    [list(self.server_ranks), list(self.worker_ranks)])

        self.versions_used: list[tuple[int, int]] = []  # worker: (step, clock of the parameters it used)
        self.applied: list[tuple[int, int, int]] = []  # server: (worker, its step, updates before it)
        self.steps = 0
        self.last_grad_norm = 0.0
        if self.is_server:
            self.shard, self.optimizer = self.partitions[mesh.rank], built
            for w in self.worker_ranks:  # the first pull: every worker starts from the servers' values
                mesh.comm.send(self._reply(0.0, 0.0, 0.0), w, self.world, tag="ps_pull")
        else:
            self._pull([])

    # -- worker ----------------------------------------------------------------

    def train_step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """Worker: forward, loss, backward on this worker's batch, push the gradients, pull the new
        parameters. Returns the loss: sync, the mean over the workers (the global batch's loss);
        async, this worker's own."""
        if self.is_server:
            raise RuntimeError(f"rank {self.mesh.rank} is a parameter server: call serve(), not train_step")
        for p in self.params:
            p.grad = None
        try:
            loss = loss_fn(self.model(inputs), targets)
            loss.backward()
            if self.mode == "async" and self.max_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        except Exception:
            self._send_flag(self.server_ranks, _ABORT)  # the servers would wait for this push forever
            raise
        self.steps += 1  # the pulled parameters are for the next step
        header = self._exchange(loss.detach().reshape(1).to(self.dtype), _PUSH)
        if self.mode == "sync":
            self.last_grad_norm = header[2].item()  # of the global gradient, before clipping (0 without max_norm)
        return torch.as_tensor(header[0].item() if self.mode == "sync" else loss.item())

    def finish(self) -> None:
        """Worker: tell every server this worker is done (no reply); call it once, after the last step."""
        if self.is_server:
            raise RuntimeError(f"rank {self.mesh.rank} is a parameter server: serve() returns by itself")
        self._send_flag(self.server_ranks, _DONE)

    def _send_flag(self, servers, flag: float) -> None:
        """A push with no gradient and no reply to each of ``servers``: _DONE (this worker leaves) or
        _ABORT (its step failed: the server refuses every other worker's push and raises)."""
        for s in servers:
            msg = torch.zeros(self.push_sizes[s], dtype=self.dtype, device=self.mesh.device)
            msg[-1] = flag
            self.mesh.comm.send(msg, s, self.world, tag="ps_done")

    def _exchange(self, loss: torch.Tensor, flag: float) -> torch.Tensor:
        """Push every partition's gradient to its server, then pull every partition; returns the
        first server's reply header. Sends are posted before the receives: a server replies only
        after it has our push, so neither side waits on the other."""
        sends = []
        for s in self.server_ranks:
            part = [self.params[i] for i in self.partitions[s]]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in part]
            computed = loss.new_tensor([float(p.grad is not None) for p in part])
            msg = _flatten(grads + [computed, loss, loss.new_full((1,), flag)])
            sends.append(self.mesh.comm.send(msg, s, self.world, async_op=True, tag="ps_push"))
        headers = self._pull(sends)
        return headers[0]

    def _pull(self, sends: list) -> list[torch.Tensor]:
        replies = [self._reply_buffer(s) for s in self.server_ranks]
        works = [self.mesh.comm.recv(r, s, self.world, async_op=True, tag="ps_pull")
                 for s, r in zip(self.server_ranks, replies)]
        for w in sends + works:
            w.wait()
        refused = [int(r[-1 - _HEADER].item()) for r in replies if r[-1].item() != _OK]
        if refused:  # (async) a server that answered before it heard of the failure expects our next push
            self._send_flag([s for s, r in zip(self.server_ranks, replies) if r[-1].item() == _OK], _DONE)
            raise RuntimeError(_stopped(refused[0]))
        headers = []
        with torch.no_grad():
            for s, reply in zip(self.server_ranks, replies):
                owned = [self.params[i] for i in self.partitions[s]]
                values, rest = _unflatten(reply, owned)
                for p, v in zip(owned, values):
                    p.copy_(v)
                headers.append(rest[:_HEADER])
        if self.mode == "async":  # the parameters' clock: the oldest any server's partition holds
            self.versions_used.append((self.steps, min(int(h[0].item()) for h in headers)))
        return headers

    def _reply_buffer(self, server: int) -> torch.Tensor:
        return torch.empty(self.numels[server] + _HEADER + 1, dtype=self.dtype, device=self.mesh.device)

    # -- server ----------------------------------------------------------------

    def serve(self) -> None:
        """Server: answer the workers until every one has called ``finish()``."""
        if not self.is_server:
            raise RuntimeError(f"rank {self.mesh.rank} is a worker: call train_step and finish, not serve()")
        (self._serve_sync if self.mode == "sync" else self._serve_async)()

    def _serve_sync(self) -> None:
        n, k = self.numels[self.mesh.rank], len(self.shard)
        # One row per worker, reused every round: the mean below is a new tensor, so the rows are
        # free again once it is taken (the .grad views point into the mean, not into the inbox).
        inbox = torch.empty(self.n_workers, n + k + 2, dtype=self.dtype, device=self.mesh.device)
        while True:
            works = [self.mesh.comm.recv(inbox[j], w, self.world, async_op=True, tag="ps_push")
                     for j, w in enumerate(self.worker_ranks)]
            for work in works:
                work.wait()
            flags = inbox[:, -1].tolist()
            if all(f == _DONE for f in flags):
                return
            if any(f != _PUSH for f in flags):  # a step failed, or some finished while others pushed
                failed = next((w for w, f in zip(self.worker_ranks, flags) if f == _ABORT), -1)
                for w, f in zip(self.worker_ranks, flags):  # tell the pushers, then fail here too
                    if f == _PUSH:
                        self.mesh.comm.send(self._reply(failed, 0.0, 0.0, _FAILED), w, self.world, tag="ps_pull")
                raise RuntimeError(_stopped(failed))
            mean = inbox.mean(dim=0)
            norm = self._set_grads(mean[:n], (inbox[:, n:n + k] > 0).any(dim=0).tolist())
            self._step()
            reply = self._reply(mean[n + k].item(), float(self.steps), norm)
            sends = [self.mesh.comm.send(reply, w, self.world, async_op=True, tag="ps_pull")
                     for w in self.worker_ranks]
            for s in sends:
                s.wait()

    def _serve_async(self) -> None:
        n, k, W = self.numels[self.mesh.rank], len(self.shard), self.n_workers
        inbox = torch.empty(n + k + 2, dtype=self.dtype, device=self.mesh.device)
        pushes = [0] * W  # gradients applied from each worker: its step count
        finished = [False] * W
        waiting = [False] * W  # pushed, not yet answered
        sending: list = [None] * W
        failed = None  # a worker whose step failed: every other worker's push is refused from then on
        while not all(finished):
            # Whichever worker pushes first is served first. Blocking here cannot deadlock: the
            # gate below always releases the slowest unfinished worker, so someone is computing.
            i = self.mesh.comm.recv_any(inbox, self.world, tag="ps_push") - self.n_servers
            flag = inbox[-1].item()
            if flag == _DONE or flag == _ABORT:
                finished[i] = True
                failed = self.worker_ranks[i] if flag == _ABORT and failed is None else failed
            elif failed is not None:
                waiting[i] = True  # refused just below
            else:
                self.applied.append((i, pushes[i], self.steps))
                self._set_grads(inbox[:n] / W, (inbox[n:n + k] > 0).tolist())
                self._step()
                pushes[i] += 1
                waiting[i] = True
            if failed is not None:  # every waiting worker is refused (and leaves), none is served again
                for j in (j for j in range(W) if waiting[j]):
                    if sending[j] is not None:
                        sending[j].wait()
                    sending[j] = self.mesh.comm.send(self._reply(failed, 0.0, 0.0, _FAILED), self.worker_ranks[j],
                                                     self.world, async_op=True, tag="ps_pull")
                    waiting[j], finished[j] = False, True
                continue
            clock = min((pushes[j] for j in range(W) if not finished[j]), default=max(pushes))
            for j in range(W):
                # Stale-synchronous gate: step pushes[j] may start once every unfinished worker has
                # pushed at least pushes[j] - staleness gradients (clock >= pushes[j] - staleness).
                if waiting[j] and (self.staleness is None or pushes[j] - clock <= self.staleness):
                    if sending[j] is not None:
                        sending[j].wait()
                    sending[j] = self.mesh.comm.send(self._reply(float(clock), float(self.steps), 0.0),
                                                     self.worker_ranks[j], self.world, async_op=True, tag="ps_pull")
                    waiting[j] = False
        for s in sending:
            if s is not None:
                s.wait()
        if failed is not None:
            raise RuntimeError(_stopped(failed))

    def _set_grads(self, flat_grad: torch.Tensor, computed: list[bool]) -> float:
        """Point .grad at this server's slices of ``flat_grad`` (a fresh tensor the server owns: views,
        no copies), None where no worker ``computed`` one (the optimizer skips it, as in one process);
        clip (sync) to the global norm; return the norm."""
        owned = [self.params[i] for i in self.shard]
        grads, _ = _unflatten(flat_grad, owned)
        for p, g, c in zip(owned, grads, computed):
            p.grad = g if c else None
        if self.max_norm is None or self.mode == "async":
            return 0.0
        # |g|^2 = sum over servers of |g_s|^2: one all-reduce of a scalar among the servers.
        sq = flat_grad.double().pow(2).sum().reshape(1)
        self.mesh.comm.all_reduce(sq, self.group, tag="ps_grad_norm")
        norm = sq[0].sqrt()
        scale_by_norm_(grads, norm, self.max_norm)
        return norm.item()  # for the reply's header

    def _step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad()
        self.steps += 1

    def _reply(self, a: float, b: float, c: float, status: float = _OK) -> torch.Tensor:
        """This server's partition, flat, then the header (a, b, c) and the status."""
        with torch.no_grad():
            values = [self.params[i].detach() for i in self.partitions[self.mesh.rank]]
            header = torch.tensor([a, b, c, status], dtype=self.dtype, device=self.mesh.device)
            return _flatten(values + [header])


def _stopped(failed_worker: float) -> str:
    """Why the servers stopped: a worker's failed step (its rank), or (-1) uneven step counts."""
    if failed_worker >= 0:
        return (f"the parameter servers stopped the run: worker rank {int(failed_worker)} failed in its step (its own "
                "error says why), so no rank waits for its gradient; fix that and start again from a checkpoint")
    return ("the parameter servers stopped the run: the workers did not take the same number of steps (sync mode "
            "needs every worker in every round; some finished while others pushed a gradient)")


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors laid end to end: one new 1-D tensor (a message)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``_flatten``'s inverse on a message: views of ``flat``'s start shaped as ``like``, and the rest."""
    sizes = [t.numel() for t in like]
    *pieces, rest = flat.split(sizes + [flat.numel() - sum(sizes)])
    return [v.view_as(t) for v, t in zip(pieces, like)], rest


def partition_by_size(numels: list[int], parts: int) -> list[list[int]]:
    """Indices of whole tensors per part, balanced by size: largest first onto the lightest part
    (LPT: the heaviest part is at most 4/3 of the optimum). Each part's indices in model order."""
    loads = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        k = min(range(parts), key=lambda k: (loads[k], k))
        out[k].append(i)
        loads[k] += numels[i]
    return [sorted(p) for p in out]


def _check_config(mesh: Mesh, params: list, servers: Any, mode: str, staleness: Any, max_norm: Any) -> None:
    if mesh.tp * mesh.pp * mesh.cp != 1:
        raise ValueError(f"ParameterServer needs a purely data-parallel mesh; got {mesh!r}: build Mesh() "
                         "(dp = world size)")
    if not params:
        raise ValueError("the model has no parameters: there is nothing to serve")
    if isinstance(servers, bool) or not isinstance(servers, int) or not 1 <= servers < mesh.world_size:
        raise ValueError(f"servers={servers!r} must be an integer with 1 <= servers < world size "
                         f"({mesh.world_size}), so at least one rank is left to be a worker")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: choose one of {MODES}")
    if mode == "async" and dist.get_backend() != "gloo":
        raise ValueError("the async mode's servers receive from whichever worker pushes first, which only gloo "
                         "supports; use mode='sync' or the gloo backend (MINIPAR_BACKEND=gloo)")
    if staleness is not None:
        if mode != "async":
            raise ValueError("staleness bounds the async mode; sync mode is never stale: drop staleness "
                             "or pass mode='async'")
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"staleness={staleness!r} must be an integer >= 0 (or None: unbounded)")
    if max_norm is not None and (isinstance(max_norm, bool) or not isinstance(max_norm, (int, float))
                                 or not max_norm > 0):
        raise ValueError(f"max_norm={max_norm!r} must be a number > 0 (or None: no clipping)")
    if mode == "async" and params and params[0].dtype not in (torch.float32, torch.float64):
        raise ValueError(f"the async mode sends step counts beside the parameters, in their dtype: {params[0].dtype} "
                         "cannot count exactly; keep float32 parameters (cast with MixedPrecision-style autocast)")
    if len({p.dtype for p in params}) != 1:
        raise ValueError("ParameterServer sends each partition as one flat tensor: every parameter must have "
                         f"the same dtype; got {sorted({str(p.dtype) for p in params})}")
