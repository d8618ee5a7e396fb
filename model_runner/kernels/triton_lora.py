"""The LoRA delta on Triton (CUDA): a grouped shrink and a grouped expand over a step's
rows, each row run with the adapter in its slot (punica's SGMV idea).

A projection's adapters sit in fixed slot buffers (model_runner/lora_stacks.py):
`shrink` [S, R, K] (the A matrices, zero past an adapter's rank) and `expand` [S, R, N]
(the B matrices transposed, scale folded in). `row_slots` [T] int32 names each row's slot
(-1: a base row). Then, for every row i of slot s,

    out[i] += (x[i] @ shrink[s].T) @ expand[s]

1. `_shrink_kernel`: per tile of BLOCK_M rows, block of rank columns and slot, the
   tile's rows of that slot times the slot's A matrices: t [T, R] (rounded to x's dtype,
   as torch's matmul is).
2. `_expand_kernel`: per tile of rows, block of output columns and slot, those rows of t
   times the slot's B matrices (R in blocks), rounded to the dtype and added into `out`
   in place.

A program whose tile holds no row of its slot returns at once; the runner orders a step's
rows by adapter, so most tiles hold one slot. The grid depends only on T, N and S, and the
slot of each row is read on the device: a step is launched without a host sync, the same
shapes and pointers at every replay (CUDA graphs). No atomics: each row belongs to one
slot, so each output element has one writer.

CPU tests run these kernels under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per tile (tl.dot's minimum)
MAX_BLOCK_R = 64  # rank columns per block: a fused projection's R reaches 3 x --max-lora-rank


@triton.jit
def _tile_rows(slots_ptr, num_rows, BLOCK_M: tl.constexpr):
    """This program's tile of rows [M] (program id 0), as int64, and each row's slot (-1
    past the last row)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_slots = tl.load(slots_ptr + rows, mask=rows < num_rows, other=-1)
    return rows.to(tl.int64), row_slots


@triton.jit
def _shrink_kernel(
    t_ptr,  # [T, R] out: x @ A.T on the rows of each slot
    x_ptr,  # [T, K]
    a_ptr,  # [S, R, K]
    slots_ptr,  # [T] int32 slot of each row, -1: none
    num_rows,
    stride_x,
    stride_as,
    stride_ar,
    stride_t,
    HIDDEN: tl.constexpr,  # K
    RANK: tl.constexpr,  # R
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    slot = tl.program_id(2)
    rows, row_slots = _tile_rows(slots_ptr, num_rows, BLOCK_M)
    mine = row_slots == slot  # [M]
    if tl.max(mine.to(tl.int32), axis=0) == 0:
        return
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rs < RANK
    a = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < HIDDEN
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                    mask=mine[:, None] & k_ok[None, :], other=0.0)  # [M, K]
        w = tl.load(a + rs[None, :] * stride_ar + ks[:, None],
                    mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # [K, R]
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    tl.store(t_ptr + rows[:, None] * stride_t + rs[None, :],
             acc.to(t_ptr.dtype.element_ty), mask=mine[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(
    out_ptr,  # [T, N] in and out: the base projection, plus the delta on slot rows
    t_ptr,  # [T, R]
    b_ptr,  # [S, R, N]
    slots_ptr,
    num_rows,
    stride_out,
    stride_t,
    stride_bs,
    stride_br,
    WIDTH: tl.constexpr,  # N
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    slot = tl.program_id(2)
    rows, row_slots = _tile_rows(slots_ptr, num_rows, BLOCK_M)
    mine = row_slots == slot
    if tl.max(mine.to(tl.int32), axis=0) == 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < WIDTH
    b = b_ptr + slot.to(tl.int64) * stride_bs
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, RANK, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs < RANK
        t = tl.load(t_ptr + rows[:, None] * stride_t + rs[None, :],
                    mask=mine[:, None] & r_ok[None, :], other=0.0)  # [M, R]
        w = tl.load(b + rs[:, None] * stride_br + cols[None, :],
                    mask=r_ok[:, None] & col_ok[None, :], other=0.0)  # [R, N]
        delta = tl.dot(t, w, delta, input_precision=DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    where = out_ptr + rows[:, None] * stride_out + cols[None, :]
    mask = mine[:, None] & col_ok[None, :]
    base = tl.load(where, mask=mask, other=0.0).to(tl.float32)
    # rounded where the reference rounds: the delta, then the sum
    tl.store(where, (base + delta.to(dtype).to(tl.float32)).to(dtype), mask=mask)


def add_lora(
    out: torch.Tensor,  # [T, N]
    x: torch.Tensor,  # [T, K]
    shrink: torch.Tensor,  # [S, R, K]
    expand: torch.Tensor,  # [S, R, N]
    row_slots: torch.Tensor,  # [T] int32, -1: no adapter
) -> torch.Tensor:
    """`out` plus, on each row i with row_slots[i] = s >= 0, (x[i] @ shrink[s].T) @
    expand[s], in place (rows of slot -1 untouched); `out`. Every tensor on one device,
    rows with contiguous last dims, x, out and the slot buffers in one dtype."""
    for t in (out, x, shrink, expand):
        if t.stride(-1) != 1:
            raise ValueError("add_lora: rows with contiguous last dims expected")
    num_rows, hidden = x.shape
    num_slots, rank, width = expand.shape
    if num_rows == 0:
        return out
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # ignored but for fp32
    block_r = min(MAX_BLOCK_R, max(16, triton.next_power_of_2(rank)))
    t = torch.empty((num_rows, rank), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(num_rows, BLOCK_M)
    block_k = min(64, max(16, triton.next_power_of_2(hidden)))
    _shrink_kernel[(tiles, triton.cdiv(rank, block_r), num_slots)](
        t, x, shrink, row_slots, num_rows,
        x.stride(0), shrink.stride(0), shrink.stride(1), t.stride(0),
        HIDDEN=hidden, RANK=rank, BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=block_k,
        DOT_PRECISION=precision, num_warps=4,
    )
    block_n = min(64, max(16, triton.next_power_of_2(width)))
    _expand_kernel[(tiles, triton.cdiv(width, block_n), num_slots)](
        out, t, expand, row_slots, num_rows,
        out.stride(0), t.stride(0), expand.stride(0), expand.stride(1),
        WIDTH=width, RANK=rank, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=block_r,
        DOT_PRECISION=precision, num_warps=4,
    )
    return out
