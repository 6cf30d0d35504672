"""Triton kernels for ``minipar.kernels.permute`` (imported at first use; see ``dispatch``)."""

import triton
import triton.language as tl

from .common_triton import round_to


def block_for(d: int) -> int:
    """Columns per program: the whole row up to 1024, so a short row is one program."""
    return min(1024, triton.next_power_of_2(d))


@triton.jit
def gather_rows_kernel(x_ptr, index_ptr, out_ptr, D, BLOCK_D: tl.constexpr):
    """Program (m, j): out[m, cols j] = x[index[m], cols j]."""
    row = tl.program_id(0).to(tl.int64)  # int64: row * D can pass 2**31 on large inputs
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    src = tl.load(index_ptr + row)
    vals = tl.load(x_ptr + src * D + cols, mask=mask)
    tl.store(out_ptr + row * D + cols, vals, mask=mask)


@triton.jit
def segment_sum_rows_kernel(y_ptr, order_ptr, start_ptr, count_ptr, out_ptr, D, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program (n, j): out[n, cols j] = sum over k < count[n] of y[order[start[n] + k], cols j], in fp32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    first = tl.load(start_ptr + row)
    n_src = tl.load(count_ptr + row)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in range(n_src):
        src = tl.load(order_ptr + first + k)
        # upcast on load: sums in fp32 (and bf16 arithmetic is wrong under the interpreter)
        acc += tl.load(y_ptr + src * D + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, round_to(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)
