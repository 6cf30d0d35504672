"""minipar tensor parallelism against torch.distributed.tensor.parallel, step for step.

    torchrun --nproc_per_node=2 benchmarks/tp_vs_torch.py [--sequence-parallel --minipar-api sharded|parallelize
        --json out.json --check]  # --help: every flag
    torchrun --nproc_per_node=2 benchmarks/tp_vs_torch.py --async-tp  # collective matmul against synchronous

tp = world; the same GPT (untied head) and batches on both sides. minipar: ``ShardedModule(strategy=
"ddp", sequence_parallel=...)`` applying ``GPT.tp_plan`` (or ``parallelize`` alone); torch:
``parallelize_module`` with the tutorial's plan (`torch_tp_plan`), ``loss_parallel()``. Timed by
`harness.interleave` with forward + loss, backward and optimizer phases. Printed: the steps, medians,
ratio (goal <= 1.00, limit 1.25) and paired ratios; losses and parameters (the same function); minipar's
collectives in one more step by segment beside `theory`, and torch's. ``--check``: exit 1 above the
limit, on different functions, or on communication other than the theory.

``--async-tp``: instead, one sequence-parallel MLP (column fc D -> 4D, GELU, row proj 4D -> D; forward and
backward), synchronous against ``async_comm=True`` (collective matmul), beside the same local matmuls with
no communication at all; exposed communication = a variant's median minus the compute's (paired,
interleaved), and the planner's model (`minipar.plan.overlap`) fed the measured per-hop and per-chunk times.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, \
    RowwiseParallel, SequenceParallel, loss_parallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

import harness
import minipar
from minipar.core.comm import wire_bytes
from minipar.models import GPT
from minipar.core.placement import placement_of
from minipar.plan.overlap import exposed_comm_s
from minipar.tensor_parallel import ColumnParallelLinear, RowParallelLinear, parallelize, vocab_parallel_cross_entropy

RATIO_LIMIT, RATIO_GOAL = 1.25, 1.00
LOSS_TOL = 1e-4    # |loss_minipar - loss_torch| over the first steps (fp32, same weights, same data)
PARAM_TOL = 1e-4   # |param difference| after the whole run (rounding differences, grown by AdamW)
FIRST_STEPS = 3    # "the first steps" of the loss comparison
PHASES = ("forward+loss", "backward", "optimizer")
PHASES_COMM = ("forward", "backward", "optimizer")
SIDES = ("minipar", "torch")


def torch_tp_plan(n_layer: int, sequence_parallel: bool) -> dict:
    """torch's plan for the GPT (see the module docstring)."""
    act = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream between layers
    plan: dict = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
                  "lm_head": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False)}
    if sequence_parallel:
        plan["wpe"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        plan["ln_f"] = SequenceParallel()
    for i in range(n_layer):
        pre = f"layers.{i}."
        for name in ("attn", "mlp"):
            plan[pre + name] = PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),))
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc"):
            plan[pre + name] = ColwiseParallel()
        for name in ("attn.o_proj", "mlp.proj"):
            plan[pre + name] = RowwiseParallel(output_layouts=act)
        if sequence_parallel:
            plan[pre + "ln_1"] = plan[pre + "ln_2"] = SequenceParallel()
    return plan


def tick(clock: list) -> None:
    """Append the time to ``clock`` (after a GPU sync, so a phase's kernels count in it)."""
    harness.sync()
    clock.append(time.perf_counter())


class Side:
    context = contextlib.nullcontext  # torch's: loss_parallel(), around the loss and its backward

    def step(self, x, y, clock: list) -> float:
        """One training step, ``clock`` ticked after forward + loss and after backward; the loss."""
        with self.context():
            loss = self.forward_loss(x, y)
            tick(clock)
            loss.backward()
            tick(clock)
        self.opt.step()
        self.opt.zero_grad()
        return (loss.detach().to_local() if isinstance(loss, DTensor) else loss.detach()).item()


class MiniparSide(Side):
    def __init__(self, cfg, mesh, args, opt_kwargs: dict) -> None:
        self.comm, self.group = mesh.comm, mesh.group("tp")
        self.gpt = GPT(cfg)
        sp = args.sequence_parallel
        if args.minipar_api == "sharded":
            self.model = minipar.ShardedModule(self.gpt, mesh=mesh, strategy="ddp", sequence_parallel=sp)
            self.opt = self.model.build_optimizer(torch.optim.AdamW, **opt_kwargs)
        else:
            self.model = parallelize(self.gpt.to(mesh.device), mesh, self.gpt.tp_plan(mesh.tp, sequence_parallel=sp),
                                     sequence_parallel=sp)
            self.opt = torch.optim.AdamW(self.model.parameters(), **opt_kwargs)

    def forward_loss(self, x, y) -> torch.Tensor:
        return vocab_parallel_cross_entropy(self.model(x), y, self.comm, self.group)

    @torch.no_grad()
    def full_params(self) -> dict[str, torch.Tensor]:
        out = {}
        for n, p in self.gpt.named_parameters():
            t = p.detach()
            if placement_of(p).tensor_parallel:
                parts = [torch.empty_like(t) for _ in range(self.group.size)]
                dist.all_gather(parts, t.contiguous(), group=self.group.pg)  # not counted: not a training step
                t = torch.cat(parts, dim=placement_of(p).tp_dim)
            out[n] = t
        return out


class TorchSide(Side):
    context = staticmethod(loss_parallel)

    def __init__(self, cfg, device_mesh, args, opt_kwargs: dict, device) -> None:
        self.gpt = GPT(cfg).to(device)
        self.model = parallelize_module(self.gpt, device_mesh, torch_tp_plan(cfg.n_layer, args.sequence_parallel))
        for block in self.gpt.layers if args.sequence_parallel else ():
            # ln_2 also adds the residual, a keyword SequenceParallel leaves local, and returns (h, ln_2(h))
            block.ln_2.register_forward_pre_hook(lambda m, a, kw: (a, {**kw, "residual": DTensor.from_local(
                kw["residual"], device_mesh, [Shard(1)])}), with_kwargs=True)
            block.ln_2.register_forward_hook(lambda m, a, out: tuple(o.to_local() for o in out))
        # a foreach kernel refuses a list mixing DTensors and the plain tensors left replicated
        params = list(self.model.parameters())
        groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
        self.opt = torch.optim.AdamW([{"params": g} for g in groups if g], **opt_kwargs)

    def forward_loss(self, x, y) -> torch.Tensor:
        """Call inside ``loss_parallel()`` (and backward too)."""
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())  # logits: DTensor (b, t, V), Shard(-1)

    @torch.no_grad()
    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in self.gpt.named_parameters()}


def measure_minipar_comm(side: MiniparSide, x, y) -> dict[str, dict[str, list]]:
    """One training step under ``mesh.comm.counting()``, the records attributed to segments: "embedding",
    "layer i", "head", "loss/other" (the cross-entropy's) and "optimizer". Forward: module hooks mark where
    each module's records start and end; backward: a hook on each layer's output fires when its backward
    begins, one on layer 0's input when it ends (what follows is the embedding's)."""
    gpt = side.gpt
    marks: dict[str, list[tuple[int, str]]] = {"fwd": [], "bwd": []}   # (record index, segment starting there)
    stats: dict = {}
    handles = []

    def mark(phase, label):
        def hook(*_) -> None:  # returns None: a module hook's or tensor hook's result would replace its value
            marks[phase].append((len(stats[phase].records), label))
        return hook

    def mark_backward(tensor, label) -> None:
        tensor.register_hook(mark("bwd", label))

    for mod_name, label in [("wte", "embedding"), ("wpe", "embedding"), ("ln_f", "head"), ("lm_head", "head")] \
            + [(f"layers.{i}", f"layer {i}") for i in range(len(gpt.layers))]:
        m = gpt.get_submodule(mod_name)
        handles += [m.register_forward_pre_hook(mark("fwd", label)), m.register_forward_hook(mark("fwd", "loss/other"))]
    handles.append(gpt.layers[0].register_forward_pre_hook(lambda m, a: mark_backward(a[0], "embedding")))
    for i, layer in enumerate(gpt.layers):
        handles.append(layer.register_forward_hook(lambda m, a, out, i=i: mark_backward(out, f"layer {i}")))
    try:
        with side.comm.counting() as stats["fwd"]:
            loss = side.forward_loss(x, y)
        with side.comm.counting() as stats["bwd"]:
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    with side.comm.counting() as opt_stats:
        side.opt.step()
    side.opt.zero_grad()

    def attribute(records, boundary_marks, label):
        out: dict[str, list] = defaultdict(list)
        boundary_marks, k = sorted(boundary_marks, key=lambda m: m[0]), 0  # stable: order of marking kept
        for idx, rec in enumerate(records):
            while k < len(boundary_marks) and boundary_marks[k][0] <= idx:
                label, k = boundary_marks[k][1], k + 1
            out[label].append(rec)
        return out

    return {"forward": attribute(stats["fwd"].records, marks["fwd"], "other"),
            "backward": attribute(stats["bwd"].records, marks["bwd"], "head"),
            "optimizer": attribute(opt_stats.records, [], "optimizer")}


def theory(args, n: int) -> dict[str, dict[str, list[tuple[str, str, int]]]]:
    """Expected (op, tag, payload bytes) per segment of one training step (fp32 activations)."""
    b, t, d, fp = args.batch, args.seq, args.n_embd, 4
    act = b * t * d * fp          # one activation: batch * seq * hidden elements
    tokens = b * t * fp           # one value per token
    fwd: dict[str, list] = {"loss/other": [("all_reduce", "tp_ce", tokens), ("all_reduce", "tp_ce", 3 * tokens)]}
    bwd: dict[str, list] = {}     # the loss: max; then (sum exp, sum z, z_t)
    if not args.sequence_parallel:
        fwd["embedding"] = [("all_reduce", "tp", act)]                        # vocab-parallel lookup summed
        for i in range(args.n_layer):
            fwd[f"layer {i}"] = [("all_reduce", "tp", act)] * 2               # o_proj, proj outputs
            bwd[f"layer {i}"] = [("all_reduce", "tp", act)] * 2               # attn input, fc input grads
        bwd["head"] = [("all_reduce", "tp", act)]                             # lm_head input grad
    else:
        ln = [("all_reduce", "sp_grad", d * fp)] * 2                          # weight, bias of a LayerNorm
        bias = [("all_reduce", "sp_grad", d * fp)]                            # a row-parallel bias
        fwd["embedding"] = [("reduce_scatter", "tp", act)]                    # wte; wpe: own chunk, no comm
        bwd["embedding"] = [("all_gather", "tp", act), ("all_gather", "tp", t * d * fp)]  # wte grad, wpe grad
        for i in range(args.n_layer):
            fwd[f"layer {i}"] = [("all_gather", "tp", act), ("reduce_scatter", "tp", act)] * 2
            bwd[f"layer {i}"] = ([("all_gather", "tp", act), ("reduce_scatter", "tp", act)] * 2
                                 + bias * 2 + ln * 2)                          # o_proj/proj bias, ln_1, ln_2
        fwd["head"] = [("all_gather", "tp", act)]                             # lm_head gathers the sequence
        bwd["head"] = [("reduce_scatter", "tp", act)] + ln                    # its adjoint; ln_f
    return {"forward": fwd, "backward": bwd, "optimizer": {}}  # the optimizer needs no communication


def comm_table(measured, expected, n: int) -> tuple[list[dict], bool]:
    """Rows (phase, segment, op, tag, calls/bytes/wire measured and expected, match: the same payloads and
    wire bytes, call for call); the all-match flag."""
    rows = []
    for phase in PHASES_COMM:
        order = ["embedding"] + [f"layer {i}" for i in range(len(expected[phase]))] + ["head", "loss/other"]
        segs = [s for s in order if s in expected[phase] or s in measured[phase]]
        for seg in segs + [s for s in measured[phase] if s not in segs]:
            m = [(r.op, r.tag, r.bytes, r.wire_bytes) for r in measured[phase].get(seg, [])]
            e = [(op, tag, b, wire_bytes(op, n, b)) for op, tag, b in expected[phase].get(seg, [])]
            for op, tag in sorted({c[:2] for c in m + e}):
                mine, want = (sorted(c[2:] for c in calls if c[:2] == (op, tag)) for calls in (m, e))
                rows.append({"phase": phase, "segment": seg, "op": op, "tag": tag, "calls": len(mine),
                             "bytes": sum(b for b, _ in mine), "wire_bytes": sum(w for _, w in mine),
                             "expected_calls": len(want), "expected_bytes": sum(b for b, _ in want),
                             "expected_wire_bytes": sum(w for _, w in want), "match": mine == want})
    return rows, all(r["match"] for r in rows)


class _TorchCollectives(TorchDispatchMode):
    """Records torch's collectives (op, payload bytes as minipar counts them) as DTensor issues them: as
    ``CommDebugMode`` (which raised IndexError on this model, torch 2.13) it declines ops on DTensors, so
    DTensor desugars redistributions into functional collectives on plain tensors, seen here."""

    NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d")
    COLLECTIVES = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "all_to_all", "alltoall")

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if func.namespace in self.NAMESPACES and any(k in name for k in self.COLLECTIVES):
            t = out if "gather" in name else args[0]
            while isinstance(t, (list, tuple)):
                t = t[0]
            op = ("all_gather" if "gather" in name else "reduce_scatter" if "scatter" in name
                  else "all_to_all" if "to_all" in name else "all_reduce" if "reduce" in name else name)
            self.records.append((op, t.numel() * t.element_size()))
        return out


def torch_comm(side: TorchSide, x, y) -> dict:
    """torch's collectives for one training step: {phase: {op: {calls, bytes}}}."""
    modes = {phase: _TorchCollectives() for phase in PHASES_COMM}
    try:
        with loss_parallel():
            with modes["forward"]:
                loss = side.forward_loss(x, y)
            with modes["backward"]:
                loss.backward()
        with modes["optimizer"]:
            side.opt.step()
    except Exception as e:  # a reference figure: say so rather than fail the benchmark
        return {"note": f"counting torch's collectives failed: {type(e).__name__}: {e}"}
    finally:
        side.opt.zero_grad()
    return {phase: {op: {"calls": sum(1 for o, _ in mode.records if o == op),
                         "bytes": sum(b for o, b in mode.records if o == op)} for op, _ in mode.records}
            for phase, mode in modes.items()}


def main() -> int:
    ap = harness.parser(__doc__, steps=30, warmup=3, n_layer=4, n_embd=256, n_head=8, vocab=2048, seq=128, batch=8,
                        lr=1e-3, seed=0, json=None, check=False,
                        help={"batch": "sequences per step (the same on every tp rank)"})
    ap.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism on both sides")
    ap.add_argument("--minipar-api", choices=("sharded", "parallelize"), default="sharded",
                    help="ShardedModule(strategy='ddp') applying GPT.tp_plan, or tensor_parallel.parallelize alone")
    ap.add_argument("--async-tp", action="store_true",
                    help="only the sequence-parallel MLP, synchronous vs async_comm=True vs its compute alone")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    mesh = harness.init(tp=world)
    if args.async_tp:
        return async_tp(args, mesh)
    device = mesh.device
    cfg = harness.gpt_config(args, tie_weights=False, seed=args.seed)
    # eps=1e-6, not 1e-8: AdamW's g / (sqrt(v) + eps) turns gradients that are pure rounding noise (the
    # k_proj bias's gradient is exactly zero in exact arithmetic: softmax ignores a per-query constant)
    # into full-size steps of random sign, which would make the parameter comparison meaningless.
    opt_kwargs = dict(lr=args.lr, eps=1e-6, **harness.ADAMW)
    mp = MiniparSide(cfg, mesh, args, opt_kwargs)
    pt = TorchSide(cfg, init_device_mesh(device.type, (world,)), args, opt_kwargs, device)
    n_params, local_params = sum(p.numel() for p in GPT(cfg).parameters()), sum(p.numel() for p in mp.gpt.parameters())
    batches = [harness.tokens(args.seed * 1_000_003 + s, args.batch, args, device)
               for s in range(args.warmup + args.steps + 1)]  # the last: one more step, its communication counted

    def step(side, i: int) -> tuple[float, list[float]]:
        clock: list[float] = []
        tick(clock)
        loss = side.step(*batches[i], clock)
        tick(clock)
        return loss, [b - a for a, b in zip(clock, clock[1:])]  # a rank's phase includes its waits in collectives

    t = harness.interleave({"minipar": lambda i: step(mp, i), "torch": lambda i: step(pt, i)}, args.steps, args.warmup)
    wall, times = t.wall_s, {s: t.timed(s) for s in SIDES}
    phases = harness.slowest_rank([p for s in SIDES for _, ph in t.results[s][args.warmup:] for p in ph])
    phases = torch.tensor(phases, dtype=torch.float64).view(2, args.steps, len(PHASES))
    phase_med = {s: {ph: statistics.median(phases[j, :, k].tolist()) for k, ph in enumerate(PHASES)}
                 for j, s in enumerate(SIDES)}
    rows, comm_ok = comm_table(measure_minipar_comm(mp, *batches[-1]), theory(args, world), world)
    torch_counts = torch_comm(pt, *batches[-1])
    full_a, full_b = mp.full_params(), pt.full_params()
    param_diffs = {k: (full_a[k] - full_b[k]).abs().max().item() for k in full_b}
    worst_param = max(param_diffs, key=param_diffs.get)
    param_diff, max_param = param_diffs[worst_param], max(v.abs().max().item() for v in full_b.values())
    losses = {s: [loss for loss, _ in t.results[s]] for s in SIDES}
    loss_diffs = [abs(a - b) for a, b in zip(losses["minipar"], losses["torch"])]
    first_diff, all_diff = max(loss_diffs[:FIRST_STEPS]), max(loss_diffs)
    same_function = sorted(full_a) == sorted(full_b) and first_diff <= LOSS_TOL and param_diff <= PARAM_TOL
    c = harness.compare(t, "minipar", "torch", RATIO_GOAL, RATIO_LIMIT)
    totals = {ph: {k: sum(r[k] for r in rows if r["phase"] == ph) for k in ("bytes", "wire_bytes", "calls")}
              for ph in PHASES_COMM}
    result = {
        **harness.run_info(args, mesh), "tp": world, "tie_weights": False, "n_params": n_params,
        "params_per_rank": local_params, "step_s": times, "minipar_over_torch": c,
        "median_phase_s_slowest_rank": phase_med, "losses": losses,
        "max_abs_loss_diff_first_steps": first_diff, "first_steps": min(FIRST_STEPS, len(loss_diffs)),
        "max_abs_loss_diff_all_steps": all_diff, "max_abs_param_diff": param_diff, "max_abs_param_diff_at": worst_param,
        "max_abs_param": max_param, "same_function": same_function, "minipar_comm": rows,
        "minipar_comm_totals": totals, "minipar_comm_matches_theory": comm_ok, "torch_comm_counts": torch_counts,
        "wall_s": wall}
    if dist.get_rank() == 0:
        api = ("ShardedModule(strategy='ddp') applying GPT.tp_plan" if args.minipar_api == "sharded"
               else "tensor_parallel.parallelize(GPT.tp_plan)")
        print(f"minipar TP vs torch TP (DTensor): tp={world}{' + sequence parallel' if args.sequence_parallel else ''}, "
              f"{harness.setting(mesh)}")
        print(f"minipar: {api}; torch: parallelize_module; the same AdamW on both")
        print(f"{harness.shape(args)} batch={args.batch} (untied head): {n_params:,} parameters, {local_params:,} per "
              f"rank; {args.warmup} warm-up + {args.steps} timed steps each\n")
        print(harness.step_table(t, "minipar", "torch", **{f"loss {s}": [f"{v:.6f}" for v in losses[s][args.warmup:]]
                                                          for s in SIDES}))
        harness.print_comparison(c)
        print("median per phase (slowest rank), ms: " + "; ".join(
            f"{ph} minipar {phase_med['minipar'][ph] * 1e3:.1f} / torch {phase_med['torch'][ph] * 1e3:.1f}"
            for ph in PHASES))
        print(f"\nequivalence: max |loss_minipar - loss_torch| over the first {result['first_steps']} steps "
              f"{first_diff:.3e}, over all {len(loss_diffs)} steps {all_diff:.3e}; max |param difference| after the "
              f"run {param_diff:.3e} (at {worst_param}; largest |param| {max_param:.3g}) -> "
              f"{'same function' if same_function else 'DIFFERENT'}")
        report_comm(args, world, rows, totals, comm_ok, torch_counts)
        print(f"\nwall time of the training loops: {wall:.1f} s")
        harness.write_json(args.json, result)
    return harness.finish(args.check and not (c["ok"] and same_function and comm_ok))

def async_tp(args, mesh) -> int:
    """Exposed communication of a sequence-parallel MLP, synchronous against collective matmul."""
    n, d, device = mesh.tp, args.n_embd, mesh.device
    gen = torch.Generator().manual_seed(args.seed)
    fc, proj = (torch.nn.Linear(a, b).to(device) for a, b in ((d, 4 * d), (4 * d, d)))
    x_full = torch.randn(args.batch, args.seq, d, generator=gen).to(device)
    x_shard = x_full.chunk(n, 1)[mesh.group("tp").rank].contiguous()
    mlps = {name: torch.nn.Sequential(ColumnParallelLinear(fc, mesh, sequence_parallel=True, async_comm=on),
                                      torch.nn.GELU(),
                                      RowParallelLinear(proj, mesh, sequence_parallel=True, async_comm=on))
            for name, on in (("sync", False), ("async", True))}
    # the same local matmuls, no communication: the gathered input in, the partial sum out
    local = torch.nn.Sequential(torch.nn.Linear(d, 4 * d // n), torch.nn.GELU(), torch.nn.Linear(4 * d // n, d))
    local = local.to(device)

    def run(model, x):
        def step(i: int) -> None:
            model(x.requires_grad_(True)).sum().backward()
            model.zero_grad(set_to_none=True)
            x.grad = None
        return step

    t = harness.interleave({"compute": run(local, x_full.clone()), "sync": run(mlps["sync"], x_shard.clone()),
                            "async": run(mlps["async"], x_shard.clone())}, args.steps, args.warmup)
    med = {k: t.median(k) for k in ("compute", "sync", "async")}
    exposed = {k: max(0.0, med[k] - med["compute"]) for k in ("sync", "async")}
    # the model, fed what was measured: 4 rings (fc and proj, forward and backward) of n-1 hops each;
    # 6 layer-sized matmuls (2 forward, 4 backward), n chunks each
    hops, chunks = 4 * (n - 1), 6 * n
    comm_hop, compute_chunk = exposed["sync"] / max(hops, 1), med["compute"] / chunks
    model = {k: 4 * exposed_comm_s(n, comm_hop, compute_chunk, overlap=k == "async") for k in ("sync", "async")}
    result = {**harness.run_info(args, mesh), "tp": n, "median_s": med, "exposed_comm_s": exposed,
              "model_exposed_comm_s": model, "async_over_sync": t.paired_median("async", "sync")}
    if dist.get_rank() == 0:
        print(f"sequence-parallel MLP (D={d} -> {4 * d} -> {d}, batch {args.batch} x seq {args.seq}), tp={n}, "
              f"{harness.setting(mesh)}; forward + backward, {args.warmup} warm-up + {args.steps} timed steps each\n")
        print(harness.table(["variant", "median ms", "exposed comm ms", "model exposed ms"],
                            [[k, f"{med[k] * 1e3:.2f}", "-" if k == "compute" else f"{exposed[k] * 1e3:.2f}",
                              "-" if k == "compute" else f"{model[k] * 1e3:.2f}"] for k in med]))
        print(f"\nasync / sync, paired median: {result['async_over_sync']:.3f}; model per hop: comm "
              f"{comm_hop * 1e3:.3f} ms, chunk matmul {compute_chunk * 1e3:.3f} ms")
        harness.write_json(args.json, result)
    return harness.finish(0)


def report_comm(args, world: int, rows: list[dict], totals: dict, comm_ok: bool, torch_counts: dict) -> None:
    act = args.batch * args.seq * args.n_embd * 4
    print(f"\nminipar communication in one more training step (forward + loss, backward, optimizer), tp={world} "
          f"(activation = batch*seq*hidden*4 B = {act:,} B):")
    print(harness.table(["phase", "segment", "op", "tag", "calls", "bytes", "wire", "theory calls", "theory bytes",
                         "theory wire", "match"],
                        [[r["phase"], r["segment"], r["op"], r["tag"], r["calls"], f"{r['bytes']:,}",
                          f"{r['wire_bytes']:,}", r["expected_calls"], f"{r['expected_bytes']:,}",
                          f"{r['expected_wire_bytes']:,}", "yes" if r["match"] else "NO"] for r in rows]))
    for ph, tt in totals.items():
        print(f"  {ph} total: {tt['calls']} calls, {tt['bytes']:,} B payload, {tt['wire_bytes']:,} B on the "
              f"wire ({tt['wire_bytes'] / act:.3f} activations)")
    print(f"  measured == theory, every segment, op, call and byte: {'yes, exactly' if comm_ok else 'NO'}")
    if "note" in torch_counts:
        print(f"torch collectives: {torch_counts['note']}")
        return
    print("torch's collectives in the same step (DTensor's redistributions), beside minipar's:")
    for ph in PHASES_COMM:
        ops = sorted(set(torch_counts[ph]) | {r["op"] for r in rows if r["phase"] == ph and r["calls"]})
        for op in ops:
            row = torch_counts[ph].get(op, {"calls": 0, "bytes": 0})
            mine = [r for r in rows if r["phase"] == ph and r["op"] == op]
            print(f"  {ph:<9} {op:<14} torch {row['calls']:>3} calls {row['bytes']:>11,} B   minipar "
                  f"{sum(r['calls'] for r in mine):>3} calls {sum(r['bytes'] for r in mine):>11,} B")
        if not ops:
            print(f"  {ph:<9} none on either side")


if __name__ == "__main__":
    harness.run(main)
