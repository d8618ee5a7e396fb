"""The fused mixture-of-experts experts on Triton (CUDA): grouped GEMMs over the (token,
expert) pairs sorted by expert, the top-k weights applied in the epilogue.

`fused_experts` computes what model_runner/models/moe.py's `experts_torch` does (the
reference), without a host sync, so that a decode step stays capturable in a CUDA graph:

1. `align_by_expert` (torch ops on the device): the T * K pairs sorted by expert, each
   expert's run padded to a multiple of BLOCK_M so that a tile of BLOCK_M rows belongs to
   one expert, with a tile -> expert table. The buffers are sized for the worst case
   (every expert's run padded), so their sizes depend only on T, K and E; tiles past the
   used ones find no expert and return at once.
2. `_gate_up_kernel`: per tile and block of the intermediate width, the rows' tokens times
   the expert's gate and up weights (two accumulators), plus their biases if any,
   SiLU(gate) * up (or gpt-oss's clamped SwiGLU) stored per pair.
3. `_down_kernel`: per tile and block of the hidden width, those rows times the expert's
   down weight, plus its bias if any, scaled by each pair's routing weight, stored per
   pair; the K pairs of each token are then summed (no atomics: the order of the sum is
   fixed).

Shapes: T tokens, H hidden, E experts, K experts per token, I one expert's width.
CPU tests run these kernels under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # pairs per tile (tl.dot's minimum)


@triton.jit
def _gate_up_kernel(
    h_ptr,  # [T * K, I] out: the activation per pair
    x_ptr,  # [T, H]
    w13_ptr,  # [E, 2I, H]
    b13_ptr,  # [E, 2I] (read with HAS_BIAS)
    sorted_pairs_ptr,  # [padded] pair index per row, num_pairs for padding
    tile_experts_ptr,  # [tiles] expert of each tile, -1 past the used tiles
    num_pairs,
    limit,  # the clamp of gate (above) and up (both sides), with CLAMPED
    alpha,  # the sigmoid's gain, with CLAMPED
    stride_x,
    stride_we,
    stride_wn,
    stride_be,
    stride_h,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    WIDTH: tl.constexpr,  # I
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,  # gpt-oss's (up + 1) * gate * sigmoid(alpha * gate), else SwiGLU
):
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))  # [M]
    valid = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N] of I
    col_ok = cols < WIDTH
    w = w13_ptr + expert * stride_we
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < HIDDEN
        x = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)  # [M, K]
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w + (cols[None, :] + WIDTH) * stride_wn + ks[:, None], mask=w_mask,
                       other=0.0)  # [K, N]
        gate = tl.dot(x, w_gate, gate, input_precision=DOT_PRECISION)
        up = tl.dot(x, w_up, up, input_precision=DOT_PRECISION)
    if HAS_BIAS:  # the expert's bias of each gate and up column
        b = b13_ptr + expert * stride_be
        gate += tl.load(b + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b + cols + WIDTH, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dtype = h_ptr.dtype.element_ty
    # rounded where the reference rounds: the projections, the gate's activation, the product
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        glu = (gate * tl.sigmoid(gate * alpha)).to(dtype).to(tl.float32)
        h = ((up + 1.0) * glu).to(dtype)
    else:
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        h = (silu * up).to(dtype)
    tl.store(h_ptr + pairs.to(tl.int64)[:, None] * stride_h + cols[None, :], h,
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    out_ptr,  # [T * K, H] out: weight * expert(token) per pair
    h_ptr,  # [T * K, I]
    w2_ptr,  # [E, H, I]
    b2_ptr,  # [E, H] (read with HAS_BIAS)
    weights_ptr,  # [T * K] routing weight per pair
    sorted_pairs_ptr,
    tile_experts_ptr,
    num_pairs,
    stride_h,
    stride_we,
    stride_wn,
    stride_be,
    stride_out,
    HIDDEN: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N] of H
    col_ok = cols < HIDDEN
    w = w2_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, WIDTH, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < WIDTH
        h = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)  # [M, K]
        w_down = tl.load(w + cols[None, :] * stride_wn + ks[:, None],
                         mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [K, N]
        acc = tl.dot(h, w_down, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        b = b2_ptr + expert * stride_be
        acc += tl.load(b + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)  # [M]
    out = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)  # the epilogue
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out,
             mask=valid[:, None] & col_ok[None, :])


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of ids [T, K] sorted by expert, each expert's run padded to a multiple
    of block_m: (sorted_pairs [tiles * block_m] int32, pair index or T*K for padding;
    tile_experts [tiles] int32, -1 past the used tiles), tiles = ceil((T*K + E*(block_m-1))
    / block_m), the most any routing needs. On the device, no host sync."""
    flat = ids.flatten()
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # [E] end of each expert's run
    order = flat.argsort(stable=True)  # pair indices grouped by expert
    sorted_experts = flat[order]
    # position of each sorted pair: its expert's run start + its rank in the run
    rank = torch.arange(num_pairs, device=ids.device) - (counts.cumsum(0) - counts)[sorted_experts]
    dest = (ends - padded)[sorted_experts] + rank
    num_tiles = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    sorted_pairs = torch.full(
        (num_tiles * block_m,), num_pairs, dtype=torch.int32, device=ids.device
    )
    sorted_pairs[dest] = order.to(torch.int32)
    tile_starts = torch.arange(num_tiles, device=ids.device) * block_m
    tile_experts = torch.searchsorted(ends, tile_starts, right=True)
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1).to(torch.int32)
    return sorted_pairs, tile_experts


def fused_experts(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, K]
    ids: torch.Tensor,  # [T, K]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    b13: torch.Tensor | None = None,  # [E, 2I]
    b2: torch.Tensor | None = None,  # [E, H]
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.0,
) -> torch.Tensor:
    """Sum over each token's k experts of weight * expert(token): [T, H], in x's dtype,
    as experts_torch: an expert is down(activation(gate, up)) with the biases `b13`
    (gate/up) and `b2` (down) if given; the activation is SiLU(gate) * up, or with
    `swiglu_limit` gpt-oss's (up + 1) * gate * sigmoid(swiglu_alpha * gate), gate clamped
    above at the limit and up on both sides."""
    rows = [t for t in (x, w13, w2, b13, b2) if t is not None]
    if x.dim() != 2 or any(t.stride(-1) != 1 for t in rows):
        raise ValueError("fused_experts: rows with contiguous last dims expected")
    num_tokens, top_k = ids.shape
    num_experts, width2, hidden = w13.shape
    width = width2 // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    sorted_pairs, tile_experts = align_by_expert(ids, num_experts)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # ignored but for fp32
    block_k, warps = 32, 4
    h = torch.empty((num_pairs, width), dtype=x.dtype, device=x.device)
    block_n = min(64, max(16, triton.next_power_of_2(width)))
    clamped = swiglu_limit is not None
    _gate_up_kernel[(len(tile_experts), triton.cdiv(width, block_n))](
        h, x, w13, w13 if b13 is None else b13, sorted_pairs, tile_experts, num_pairs,
        swiglu_limit if clamped else 0.0, swiglu_alpha,
        x.stride(0), w13.stride(0), w13.stride(1), 0 if b13 is None else b13.stride(0),
        h.stride(0),
        TOP_K=top_k, HIDDEN=hidden, WIDTH=width, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=block_k, DOT_PRECISION=precision, HAS_BIAS=b13 is not None,
        CLAMPED=clamped, num_warps=warps,
    )
    out = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    pair_weights = weights.flatten().to(x.dtype).contiguous()
    block_n = min(64, max(16, triton.next_power_of_2(hidden)))
    _down_kernel[(len(tile_experts), triton.cdiv(hidden, block_n))](
        out, h, w2, w2 if b2 is None else b2, pair_weights, sorted_pairs, tile_experts,
        num_pairs, h.stride(0), w2.stride(0), w2.stride(1), 0 if b2 is None else b2.stride(0),
        out.stride(0),
        HIDDEN=hidden, WIDTH=width, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=block_k, DOT_PRECISION=precision, HAS_BIAS=b2 is not None, num_warps=warps,
    )
    return out.view(num_tokens, top_k, hidden).sum(1)
