"""Every Triton kernel compiles for a Hopper GPU (sm_90) on a machine without one, and its machine code
keeps the promises of the design (issue 28's static checks).

The interpreter proves the kernels' arithmetic but neither type-checks nor lowers them, and says
nothing about speed. Triton compiles for a target named up front with the ptxas it ships, and the
wheel's nvdisasm and cuobjdump read the result, so CI can look at the SASS a GPU would run.

What is compiled is what the launchers really launch: each case calls a public function of
``minipar.kernels`` at the benchmark's width (D = 4096, V = 32768, bf16; fp32 too) inside
``dispatch.recording()``, which takes the Triton path for CPU tensors and records every launch (kernel,
grid, arguments, constexprs, warps) instead of running it. The signature is derived from those
arguments as Triton's launcher would type and specialise them (pointers 16-byte aligned, integers
divisible by 16 marked so), so a launcher that changes what it passes is checked as it now is. Rows
are fewer than the benchmark's 16384: the row count changes only the grid, never the code.

Checked for every kernel, from the SASS:
* it compiles, with no register spills (no local memory, no LDL/STL);
* a launch whose float scalars arrive typed fp64 (what Inductor did) compiles too, with no fp64
  arithmetic: the scalars are cast to fp32 at entry;
* tensors that are streamed (one element per token or per parameter: at least ``STREAMED`` elements)
  move in 16-byte vectors: the kernel has 128-bit global loads and stores, and no 8- or 16-bit ones
  except the scalar loads its table entry names;
* integer instructions are a minority (software rounding, the interpreter's workaround, showed up as
  a third of some kernels);
and from the launchers: none makes a host sync (`minipar.core.syncs`), none calls ``.item()``.
Per-kernel promises (a row loaded once when it fits, the loads a design needs) are in ``PROMISES``.
"""

from __future__ import annotations

import collections
import functools
import importlib
import os
import pathlib
import re
import subprocess
from dataclasses import dataclass

import pytest
import torch

from minipar import kernels
from minipar.kernels import dispatch
from minipar.core.syncs import count_host_syncs

from kernel_testing import INTERPRETING

pytestmark = pytest.mark.skipif(INTERPRETING, reason="the kernels were defined for the interpreter in this "
                                                     "process; the parent pytest compiles them")

ROWS, D, V, SHARD = 256, 4096, 32768, 1 << 20
H100_SMS = 132  # (the H200 has as many)
STREAMED = 65536  # elements: per-row statistics of ROWS rows are not streams, activations and shards are
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
         torch.int32: "i32", torch.bool: "i1", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv",
         torch.float8_e5m2: "fp8e5"}


# ----------------------------------------------------------------------------- the cases

def _fwd_bwd(fn, *inputs: torch.Tensor) -> None:
    leaves = [t.requires_grad_() if t.is_floating_point() else t for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward([o for o in outs if o.requires_grad], [torch.ones_like(o) for o in outs if o.requires_grad])


def _cases(dtype: torch.dtype) -> dict[str, callable]:
    """name -> a call of the public functions at the benchmark width (fresh tensors at each call)."""
    t = functools.partial(torch.randn, dtype=dtype)

    def xent():
        logits = t(ROWS, V)
        _fwd_bwd(lambda z: kernels.cross_entropy(z, torch.randint(0, V, (ROWS,))), logits)

    def adamw():
        p, m, v = (torch.randn(SHARD) for _ in range(3))
        kernels.adamw_step_(p, t(SHARD), m, v, step=3, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                            weight_decay=0.1, out=torch.empty(SHARD, dtype=dtype))

    cases = {
        "layer_norm": lambda: _fwd_bwd(kernels.layer_norm, t(ROWS, D), t(D), t(D)),
        "rms_norm": lambda: _fwd_bwd(kernels.rms_norm, t(ROWS, D), t(D)),
        "gelu": lambda: _fwd_bwd(kernels.gelu, t(ROWS, 4 * D)),
        "swiglu": lambda: _fwd_bwd(kernels.swiglu, t(ROWS, 4 * D), t(ROWS, 4 * D)),
        "cross_entropy": xent,
        "permute": lambda: _fwd_bwd(lambda x: kernels.permute(x, torch.randint(0, ROWS, (2 * ROWS,))), t(ROWS, D)),
        "unpermute": lambda: _fwd_bwd(lambda y: kernels.unpermute(y, torch.randint(0, ROWS, (2 * ROWS,)), ROWS),
                                      t(2 * ROWS, D)),
        "scale_cast": lambda: kernels.scale_cast_(torch.randn(SHARD), torch.empty(SHARD, dtype=dtype), 1 / 1024,
                                                  torch.zeros(1)),
        "adamw": adamw,
        # an FP8 operand's 1 x 128 tiles and whole rows (blockwise and rowwise recipes), e4m3
        "fp8_cast_tiles": lambda: kernels.fp8_cast(t(ROWS, D), torch.float8_e4m3fn, 128),
        "fp8_cast_rows": lambda: kernels.fp8_cast(t(ROWS, D), torch.float8_e4m3fn, D),
        # the MoE experts' grouped product: uneven groups, one empty (dropless routing)
        "grouped_mm": lambda: _fwd_bwd(lambda x, w: kernels.grouped_mm(x, w, torch.tensor([100, 0, 37, 120, 3, 60, 80, 112])),
                                       t(2 * ROWS, D // 4), t(8, D // 4, D)),
    }
    for name in ("add_layer_norm", "add_rms_norm"):  # the fused residual add + norm, where it exists
        fn = getattr(kernels, name, None)
        if fn is not None:
            params = (t(D), t(D)) if name == "add_layer_norm" else (t(D),)
            cases[name] = functools.partial(_fwd_bwd, fn, t(ROWS, D), t(ROWS, D), *params)
    if hasattr(kernels, "linear_cross_entropy"):
        cases["linear_cross_entropy"] = lambda: _fwd_bwd(
            lambda h, w: kernels.linear_cross_entropy(h, w, torch.randint(0, V, (ROWS,))), t(ROWS, D // 4), t(V, D // 4))
    return cases


@functools.lru_cache(maxsize=None)
def recorded() -> dict[str, list[dispatch.Launch]]:
    """kernel name -> its launches over every case, bf16 and fp32 (distinct signatures only)."""
    by_kernel: dict[str, dict[tuple, dispatch.Launch]] = collections.defaultdict(dict)
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for case in _cases(dtype).values():
            with dispatch.recording(sm_count=H100_SMS) as launches:  # grids sized as on the benchmark GPU
                case()
            for launch in launches:
                types, constexprs, _ = _signature(launch)
                by_kernel[launch.kernel.__name__][(tuple(types.items()), tuple(constexprs.items()))] = launch
    return {name: list(v.values()) for name, v in by_kernel.items()}


def _all_kernels() -> list[str]:
    folder = pathlib.Path(kernels.__file__).parent
    names = set()
    for path in folder.glob("*_triton.py"):
        module = importlib.import_module(f"minipar.kernels.{path.stem}")
        names |= {n for n, f in vars(module).items() if n.endswith("_kernel") and hasattr(f, "fn")}
    return sorted(names)


KERNELS = _all_kernels()


# ----------------------------------------------------------------------------- compiling a recorded launch

def _signature(launch: dispatch.Launch, fp64_scalars: bool = False):
    """(types, constexprs, divisible-by-16 argument names) as Triton's launcher would derive them."""
    params = launch.kernel.params
    values = dict(zip([p.name for p in params], launch.args))
    values.update({k: v for k, v in launch.kwargs.items() if k in values or any(p.name == k for p in params)})
    types, constexprs, div16 = {}, {}, []
    for p in params:
        value = values[p.name] if p.name in values else p.default
        if p.is_constexpr:
            constexprs[p.name] = value
            types[p.name] = "constexpr"
        elif torch.is_tensor(value):
            types[p.name] = "*" + TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                div16.append(p.name)
        elif isinstance(value, bool):
            types[p.name] = "i1"
        elif isinstance(value, int):
            types[p.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                div16.append(p.name)
        elif isinstance(value, float):
            types[p.name] = "fp64" if fp64_scalars else "fp32"
        else:
            raise TypeError(f"{launch.kernel.__name__}: argument {p.name}={value!r} of a type Triton does not take")
    return types, constexprs, div16


@dataclass
class Sass:
    kernel: str
    regs: int
    local: int
    ops: collections.Counter
    sass: str

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def count(self, *prefixes: str) -> int:
        return sum(c for op, c in self.ops.items() if op.startswith(prefixes))

    def accesses(self, kind: str) -> dict[str, int]:
        """``LDG`` or ``STG`` instructions by width suffix (``128``, ``64``, ``32``, ``U16``, ...)."""
        return {op: c for op, c in self.ops.items() if op.startswith(kind + ".")}

    def narrow(self, kind: str) -> int:
        return sum(c for op, c in self.accesses(kind).items() if re.search(r"\.(U8|S8|U16|S16)\b", op))

    @property
    def fp64_math(self) -> int:
        return sum(c for op, c in self.ops.items() if op.split(".")[0] in ("DADD", "DMUL", "DFMA", "DSETP", "DMNMX",
                                                                          "DSET", "MUFU.RCP64H", "MUFU.RSQ64H"))

    @property
    def int_share(self) -> float:
        ints = ("IADD3", "SHF", "LOP3", "IMAD", "ISETP", "SGXT", "PRMT", "LEA", "SEL", "VIADD", "IABS", "IMNMX",
                "VIMNMX", "IADD", "IMUL", "LOP")
        return sum(c for op, c in self.ops.items() if op.split(".")[0] in ints) / max(1, self.total)


_LINE = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")


def _tools() -> pathlib.Path:
    import triton
    return pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@functools.lru_cache(maxsize=None)
def _compiled(name: str, index: int, fp64_scalars: bool) -> Sass:
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launch = recorded()[name][index]
    types, constexprs, div16 = _signature(launch, fp64_scalars)
    names = [p.name for p in launch.kernel.params]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div16}
    options = {k: launch.kwargs[k] for k in ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg")
               if k in launch.kwargs}
    options.setdefault("enable_fp_fusion", True)  # triton 3.6's default, and what torch's nvcc builds do
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRITON_CACHE_DIR"] = tmp  # compile for real, never from a cache
        try:
            compiled = triton.compile(ASTSource(launch.kernel, types, constexprs, attrs),
                                      target=GPUTarget("cuda", 90, 32), options=options)
        finally:
            os.environ.pop("TRITON_CACHE_DIR", None)
        cubin = pathlib.Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([_tools() / "nvdisasm", "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([_tools() / "cuobjdump", "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
    regs, local = (int(x) for x in re.search(r"REG:(\d+).*?LOCAL:(\d+)", usage).groups())
    ops = collections.Counter(m.group(1) for line in sass.splitlines() if (m := _LINE.match(line))
                              and m.group(1) != "NOP")
    return Sass(name, regs, local, ops, sass)


def _variants(name: str) -> list[int]:
    launches = recorded().get(name)
    assert launches, f"no case launches {name}: add a call that launches it to _cases"
    return list(range(len(launches)))


def _streams(launch: dispatch.Launch) -> bool:
    """Whether the launch is given a streamed tensor (at least ``STREAMED`` elements). Which arguments a
    kernel reads and which it writes is not in its signature, so a kernel with one must have 128-bit loads
    and 128-bit stores, unless `PROMISES` says it writes only per-row scalars."""
    return any(torch.is_tensor(a) and a.numel() >= STREAMED for a in launch.args)


# ----------------------------------------------------------------------------- promises per kernel

@dataclass
class Promise:
    """What a kernel's SASS must show beyond the common checks."""
    narrow_loads: int = 0        # 8/16-bit global loads allowed (scalar loads of one element, e.g. a target logit)
    narrow_stores: int = 0
    stores_vectors: bool = True  # False: writes per-row scalars only
    max_vector_loads: int | None = None  # the row read once: at most this many 128-bit loads (bf16, D=4096)
    max_int_share: float = 0.40


PROMISES: dict[str, Promise] = collections.defaultdict(Promise, {
    # The row read once: x (and delta) and the parameters, 2 vectors each per thread at D = 4096 over 8 warps.
    "layer_norm_fwd_kernel": Promise(max_vector_loads=6),          # x, w, b
    "rms_norm_fwd_kernel": Promise(max_vector_loads=4),            # x, w
    "add_layer_norm_fwd_kernel": Promise(max_vector_loads=8),      # x, delta, w, b
    "add_rms_norm_fwd_kernel": Promise(max_vector_loads=6),        # x, delta, w
    # Writes the (D,) weight and bias gradients, 32 columns a program on a GPU: too short for vectors.
    "norm_grad_sum_kernel": Promise(stores_vectors=False, narrow_stores=2),
    "row_stats_kernel": Promise(stores_vectors=False, narrow_loads=1),  # per-row statistics; the target's logit
    "xent_loss_grad_kernel": Promise(narrow_loads=1),              # the target's logit: one element a row
    # A bf16 source widened to fp32 is integer work (an unpack per element) against one add per source.
    "segment_sum_rows_kernel": Promise(max_int_share=0.6),
    # One program counting the valid rows and summing their losses, ~120 instructions: counting is integer work.
    "xent_mean_kernel": Promise(max_int_share=0.7),
    # tile addressing around a few tensor-core instructions (HGMMA): measured 0.48-0.58
    "grouped_mm_kernel": Promise(max_int_share=0.6),
    "grouped_mm_weight_grad_kernel": Promise(max_int_share=0.6),
})


# ----------------------------------------------------------------------------- the tests

def test_every_kernel_is_launched_by_a_case():
    """Each ``*_kernel`` of each ``kernels/*_triton.py`` is launched by some case: a new kernel gets a case,
    or it is never checked (and a kernel no launcher uses is dead code)."""
    missing = sorted(set(KERNELS) - set(recorded()))
    assert not missing, f"no case launches {missing}"


@pytest.mark.parametrize("name", KERNELS)
def test_compiles_without_spills(name):
    for i in _variants(name):
        sass = _compiled(name, i, False)
        assert sass.local == 0 and sass.count("LDL", "STL") == 0, (name, i, sass.local, sass.count("LDL", "STL"))


@pytest.mark.parametrize("name", KERNELS)
def test_fp64_scalars_do_no_fp64_arithmetic(name):
    """The float scalars typed fp64, as Inductor passed them: the kernel casts them to fp32 at entry."""
    for i in _variants(name):
        sass = _compiled(name, i, True)
        assert sass.fp64_math == 0, (name, i, {op: c for op, c in sass.ops.items() if op.startswith("D")})
        assert sass.local == 0, (name, i, "spills with fp64 scalars")


@pytest.mark.parametrize("name", KERNELS)
def test_streams_move_in_16_byte_vectors(name):
    promise = PROMISES[name]
    for i in _variants(name):
        launch = recorded()[name][i]
        sass = _compiled(name, i, False)
        if _streams(launch):  # tl.dot's operands arrive by 16-byte async copies (cp.async) instead
            assert sass.count("LDG.E.128") + sass.count("LDGSTS.E.BYPASS.128") > 0, (name, i, sass.accesses("LDG"))
        if _streams(launch) and promise.stores_vectors:
            assert sass.count("STG.E.128") > 0, (name, i, sass.accesses("STG"))
        assert sass.narrow("LDG") <= promise.narrow_loads, (name, i, sass.accesses("LDG"))
        assert sass.narrow("STG") <= promise.narrow_stores, (name, i, sass.accesses("STG"))


@pytest.mark.parametrize("name", KERNELS)
def test_integer_instructions_are_a_minority(name):
    promise = PROMISES[name]
    for i in _variants(name):
        sass = _compiled(name, i, False)
        assert sass.int_share <= promise.max_int_share, (name, i, round(sass.int_share, 3), sass.total)


@pytest.mark.parametrize("name", sorted(n for n, p in PROMISES.items() if p.max_vector_loads is not None))
def test_the_row_is_read_once(name):
    for i in _variants(name):
        launch = recorded()[name][i]
        if not any(torch.is_tensor(a) and a.dtype == torch.bfloat16 for a in launch.args):
            continue
        sass = _compiled(name, i, False)
        assert sass.count("LDG.E.128") <= PROMISES[name].max_vector_loads, (name, i, sass.accesses("LDG"))


@pytest.mark.parametrize("case", sorted(_cases(torch.bfloat16)))
def test_launchers_make_no_host_sync(case):
    """Each public function, forward and backward, with the Triton path taken: no call that would make
    the host wait for a GPU (``minipar.core.syncs``; CPU tensors stand for device tensors here)."""
    fn = _cases(torch.bfloat16)[case]
    with dispatch.recording() as launches, count_host_syncs() as syncs:
        fn()
    assert launches, f"{case} launched nothing"
    assert not syncs.calls, syncs.report()


def figures() -> list[str]:
    """One line per compiled kernel variant: registers, instructions, integer share, loads and stores by
    width, barriers, shuffles, special-function calls (``python tests/test_kernels_compile.py``)."""
    lines = []
    for name in KERNELS:
        for i in _variants(name):
            s = _compiled(name, i, False)
            sig = _signature(recorded()[name][i])[0]
            data = ",".join(sorted({v[1:] for v in sig.values() if v in ("*bf16", "*fp32", "*fp16")}))
            lines.append(f"{name}[{data}]: regs {s.regs}, sass {s.total}, int {s.int_share:.0%}, "
                         f"LDG {s.accesses('LDG')}, STG {s.accesses('STG')}, BAR {s.count('BAR')}, "
                         f"SHFL {s.count('SHFL')}, MUFU {s.count('MUFU')}")
    return lines


if __name__ == "__main__":
    print("\n".join(figures()))
