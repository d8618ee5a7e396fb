"""Triton kernels for paged attention: the CUDA fast path.

Three kernels read and write the paged KV cache in place, through the block tables; no
key or value is ever gathered into a dense copy:

- ``_write_kv_kernel``: scatter a step's new keys and values into the cache at
  ``slot_mapping`` (slot = block * block_size + offset; a negative slot is skipped).
- ``_decode_kernel`` (+ ``_decode_reduce_kernel``): one query row per sequence,
  flash-decoding style. The context of each sequence is cut into ``num_splits`` pieces
  that run in parallel; each writes a partial output and its log-sum-exp, and the
  reduce kernel merges them. With one split the decode kernel writes the output itself.
- ``_prefill_kernel``: flash-attention (online softmax) over the flat varlen batch with
  the causal offset; a program owns a tile of query rows of one sequence and walks that
  sequence's keys in tiles of BLOCK_N tokens, looking each token's page up in the block
  table.

GQA: a program works on one kv head and packs the ``group`` query heads that share it
into the rows of its tile, so each K/V tile is loaded once per kv head.

All math is fp32 (scores, softmax, accumulator) whatever the input dtype; the softmax is
in base 2 (the scale is pre-multiplied by log2(e)). head_dim is padded to a power of two
and masked, so any head_dim works. float32 inputs use IEEE dot products (no TF32) so that
they match the torch reference tightly on a GPU too.

CPU tests run these kernels under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from model_runner.attention_metadata import AttentionMetadata

_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------
# KV cache write
# --------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next_pow2(NUM_KV_HEADS)
    BLOCK_D: tl.constexpr,  # next_pow2(HEAD_DIM)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padded row: nothing to write
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    # k, v: [BLOCK_H, BLOCK_D]
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs
    tl.store(k_dst + offs_h[:, None] * stride_kch + offs_d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + offs_h[:, None] * stride_vch + offs_d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write a step's new keys and values into one layer's paged cache, in place.

    key, value: [num_tokens, num_kv_heads, head_dim] (the last dim contiguous; other
    strides are free, e.g. views into a fused qkv tensor). k_cache, v_cache:
    [num_blocks, block_size, num_kv_heads, head_dim]. slot_mapping: [num_tokens] int64,
    slot = block * block_size + offset; a negative slot (a padded row) is skipped.
    Values are cast to the cache dtype.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=1 if num_kv_heads * head_dim <= 256 else 4,
    )


# --------------------------------------------------------------------------------------
# Shared pieces of the attention kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,  # this sequence's row of block_tables
    offs_n,  # [BLOCK_N] token positions in the sequence
    kv_mask,  # [BLOCK_N] positions that exist
    kv_head,
    offs_d,  # [BLOCK_D]
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Load K^T [BLOCK_D, BLOCK_N] and V [BLOCK_N, BLOCK_D] of BLOCK_N tokens, each from
    the cache block its position maps to through the block table."""
    block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=kv_mask, other=0)
    # NOTE: int64, a big cache has more than 2**31 elements.
    block_ids = block_ids.to(tl.int64)
    in_block = offs_n % BLOCK_SIZE
    d_mask = offs_d < HEAD_DIM
    k_off = block_ids * stride_kcb + in_block * stride_kcs + kv_head * stride_kch
    v_off = block_ids * stride_vcb + in_block * stride_vcs + kv_head * stride_vch
    k_t = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None],
                  mask=kv_mask[None, :] & d_mask[:, None], other=0.0)
    v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :],
                mask=kv_mask[:, None] & d_mask[None, :], other=0.0)
    return k_t, v


@triton.jit
def _online_softmax_update(
    s,  # [M, BLOCK_N] fp32 scores in log2 units, -inf where masked
    v,  # [BLOCK_N, BLOCK_D]
    m_i,  # [M] running max
    l_i,  # [M] running sum of exp2
    acc,  # [M, BLOCK_D] fp32 running output (unnormalised)
    DOT_PRECISION: tl.constexpr,
):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row that has seen no key yet keeps m = -inf; subtract 0 instead so that
    # exp2(-inf - -inf) = nan never happens.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# --------------------------------------------------------------------------------------
# Decode: one query row per sequence, split over the context
# --------------------------------------------------------------------------------------


@triton.jit
def _decode_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim], written when NUM_SPLITS == 1
    part_out_ptr,  # [num_decode_seqs, num_heads, NUM_SPLITS, head_dim] fp32
    part_lse_ptr,  # [num_decode_seqs, num_heads, NUM_SPLITS] fp32, log2 units
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    context_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_bt,
    stride_ps,
    stride_ph,
    stride_pp,
    stride_ls,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next_pow2(HEAD_DIM), at least 16
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_H: tl.constexpr,  # >= GROUP, >= 16 (tl.dot minimum)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # keys per tile
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    q_row = tl.load(query_start_loc_ptr + seq)
    # Every split of a sequence gets the same whole number of tiles; the last ones may
    # be short or empty.
    split_len = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_start = split * split_len
    kv_end = tl.minimum(kv_start + split_len, context_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h  # [BLOCK_H] query heads of this kv head
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM

    # q: [BLOCK_H, BLOCK_D]
    q = tl.load(q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    block_table_ptr = block_tables_ptr + seq * stride_bt
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        kv_mask = offs_n < kv_end
        k_t, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_table_ptr, offs_n, kv_mask, kv_head, offs_d,
            stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
            HEAD_DIM, BLOCK_SIZE,
        )
        # s: [BLOCK_H, BLOCK_N]
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(kv_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty split (or context) gives zeros
    out = acc / l_safe[:, None]
    out_mask = h_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = part_out_ptr + seq * stride_ps + heads * stride_ph + split * stride_pp
        tl.store(part[:, None] + offs_d[None, :], out, mask=out_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # [num_decode_seqs, num_heads, NUM_SPLITS, head_dim] fp32
    part_lse_ptr,  # [num_decode_seqs, num_heads, NUM_SPLITS] fp32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    stride_ot,
    stride_oh,
    stride_ps,
    stride_ph,
    stride_pp,
    stride_ls,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,  # next_pow2(NUM_SPLITS)
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc_ptr + seq)

    offs_p = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    p_mask = offs_p < NUM_SPLITS
    part = part_out_ptr + seq * stride_ps + head * stride_ph
    # lse: [BLOCK_SPLITS]; parts: [BLOCK_SPLITS, BLOCK_D]
    lse = tl.load(part_lse_ptr + seq * stride_ls + head * stride_lh + offs_p,
                  mask=p_mask, other=float("-inf"))
    parts = tl.load(part + offs_p[:, None] * stride_pp + offs_d[None, :],
                    mask=p_mask[:, None], other=0.0)
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # empty splits weigh 0
    total = tl.sum(w, axis=0)
    total = tl.where(total == 0.0, 1.0, total)
    out = tl.sum(parts * w[:, None], axis=0) / total
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# --------------------------------------------------------------------------------------
# Prefill / chunked prefill: tiles of query rows against tiles of keys, causal with offset
# --------------------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    context_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    first_seq,  # sequences before it are handled by the decode kernel
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next_pow2(HEAD_DIM), at least 16
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_M: tl.constexpr,  # rows per tile: BLOCK_Q query tokens x GROUP heads (+ padding)
    BLOCK_Q: tl.constexpr,  # query tokens per tile, BLOCK_M // GROUP
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # keys per tile
    DOT_PRECISION: tl.constexpr,
):
    seq = first_seq + tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_first_q = q_tile * BLOCK_Q
    if tile_first_q >= query_len:  # the grid is sized for the longest query
        return
    context_len = tl.load(context_lens_ptr + seq)
    num_cached = context_len - query_len  # keys before this chunk's first token

    # Row r of the tile is query token tile_first_q + r // GROUP, head r % GROUP of
    # this kv head's group.
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = tile_first_q + offs_m // GROUP  # [BLOCK_M] index within the sequence's rows
    heads = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    row_mask = (offs_m < BLOCK_Q * GROUP) & (q_idx < query_len)
    q_pos = num_cached + q_idx  # [BLOCK_M] position of each row: sees keys 0..q_pos
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    # q: [BLOCK_M, BLOCK_D]
    q_off = (q_start + q_idx) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table_ptr = block_tables_ptr + seq * stride_bt
    # The last row of the tile sees keys up to its position; no row sees further.
    kv_end = tl.minimum(context_len, num_cached + tile_first_q + BLOCK_Q)
    for tile_start in range(0, kv_end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        kv_mask = offs_n < kv_end
        k_t, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_table_ptr, offs_n, kv_mask, kv_head, offs_d,
            stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
            HEAD_DIM, BLOCK_SIZE,
        )
        # s: [BLOCK_M, BLOCK_N]
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        visible = kv_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # only padding rows have seen no key
    out = acc / l_safe[:, None]
    o_off = (q_start + q_idx) * stride_ot + heads * stride_oh
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of the attention kernels; tests override them to hit edge cases.

    num_splits: decode splits per sequence; None picks them from the batch and GPU size.
    """

    prefill_block_m: int = 64
    prefill_block_n: int = 64
    decode_block_n: int = 64
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("prefill_block_m", "prefill_block_n", "decode_block_n"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {size}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")


def default_tile_config(query: torch.Tensor) -> TileConfig:
    """Tiles for the device and dtype of `query`: big on a GPU, small in the interpreter
    (which runs each program in numpy, so small tiles keep CPU tests fast)."""
    if query.device.type != "cuda":
        return TileConfig(prefill_block_m=16, prefill_block_n=16, decode_block_n=16,
                          num_splits=1)
    if query.dtype == torch.float32:  # fp32 tiles take twice the shared memory
        return TileConfig(prefill_block_m=64, prefill_block_n=32, decode_block_n=32)
    return TileConfig()


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a flat batch of query rows over the paged KV cache.

    query: [num_tokens, num_heads, head_dim] (the last dim contiguous). k_cache, v_cache:
    [num_blocks, block_size, num_kv_heads, head_dim], already holding this step's keys
    and values (see `write_kv_cache`). The first meta.num_decode_seqs sequences (query
    length 1) go to the split-K decode kernel, the rest to the prefill kernel. Returns
    [num_tokens, num_heads, head_dim] in query's dtype; rows that belong to no sequence
    (padding past query_start_loc[-1]) are left unspecified.

    NOTE: no host sync. The decode split count depends on meta.max_context_len, a host
    int; under CUDA graph capture it is fixed at capture time, which stays correct for
    any context length (each split's range is computed on the device), only less tuned.
    """
    return paged_attention_with_config(query, k_cache, v_cache, meta, scale,
                                       default_tile_config(query))


def paged_attention_with_config(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    config: TileConfig,
) -> torch.Tensor:
    """`paged_attention` with explicit tile sizes (tests, benchmarks)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    if query.dtype != k_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} differs from the cache's {k_cache.dtype}")
    query = _last_dim_contiguous(query)
    out = torch.empty_like(query)
    num_decode = meta.num_decode_seqs
    num_prefill = meta.num_seqs - num_decode
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    common = _CommonArgs(query, out, k_cache, v_cache, meta, scale * _LOG2E,
                         num_heads // num_kv_heads)
    if num_decode > 0:
        _launch_decode(common, num_decode, config)
    if num_prefill > 0:
        _launch_prefill(common, num_decode, num_prefill, config)
    return out


@dataclass
class _CommonArgs:
    query: torch.Tensor
    out: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    qk_scale: float
    group: int

    @property
    def dot_precision(self) -> str:
        # fp32: exact products (the default would be TF32 on a GPU). Ignored otherwise.
        return "ieee" if self.query.dtype == torch.float32 else "tf32"

    def cache_strides(self) -> tuple[int, ...]:
        k, v = self.k_cache, self.v_cache
        return (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))


def _launch_decode(c: _CommonArgs, num_decode: int, config: TileConfig) -> None:
    num_heads, head_dim = c.query.shape[1], c.query.shape[2]
    num_kv_heads = c.k_cache.shape[2]
    block_d = _block_d(head_dim)
    num_splits = config.num_splits or _pick_num_splits(
        c.query.device, num_decode * num_kv_heads, c.meta.max_context_len,
        config.decode_block_n)
    # Partial outputs (padded to block_d) and their log-sum-exps, one per split.
    part_shape = (num_decode, num_heads, num_splits) if num_splits > 1 else (1, 1, 1)
    part_out = torch.empty(*part_shape, block_d, dtype=torch.float32, device=c.query.device)
    part_lse = torch.empty(*part_shape, dtype=torch.float32, device=c.query.device)
    part_strides = (*part_out.stride()[:3], *part_lse.stride()[:2])
    _decode_kernel[(num_decode, num_kv_heads, num_splits)](
        c.out, part_out, part_lse, c.query, c.k_cache, c.v_cache,
        c.meta.block_tables, c.meta.context_lens, c.meta.query_start_loc,
        c.qk_scale,
        c.query.stride(0), c.query.stride(1), c.out.stride(0), c.out.stride(1),
        *c.cache_strides(),
        c.meta.block_tables.stride(0),
        *part_strides,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        GROUP=c.group,
        BLOCK_H=max(16, triton.next_power_of_2(c.group)),
        BLOCK_SIZE=c.k_cache.shape[1],
        BLOCK_N=config.decode_block_n,
        NUM_SPLITS=num_splits,
        DOT_PRECISION=c.dot_precision,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_decode, num_heads)](
            c.out, part_out, part_lse, c.meta.query_start_loc,
            c.out.stride(0), c.out.stride(1), *part_strides,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            BLOCK_SPLITS=triton.next_power_of_2(num_splits),
            num_warps=1 if block_d <= 64 else 2,
        )


def _launch_prefill(c: _CommonArgs, first_seq: int, num_prefill: int,
                    config: TileConfig) -> None:
    head_dim = c.query.shape[2]
    num_kv_heads = c.k_cache.shape[2]
    # A tile holds at least one query token with all heads of its group.
    block_m = max(config.prefill_block_m, triton.next_power_of_2(c.group))
    block_q = block_m // c.group
    grid = (num_prefill, triton.cdiv(c.meta.max_query_len, block_q), num_kv_heads)
    _prefill_kernel[grid](
        c.out, c.query, c.k_cache, c.v_cache,
        c.meta.block_tables, c.meta.context_lens, c.meta.query_start_loc,
        first_seq,
        c.qk_scale,
        c.query.stride(0), c.query.stride(1), c.out.stride(0), c.out.stride(1),
        *c.cache_strides(),
        c.meta.block_tables.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        GROUP=c.group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_SIZE=c.k_cache.shape[1],
        BLOCK_N=config.prefill_block_n,
        DOT_PRECISION=c.dot_precision,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _pick_num_splits(device: torch.device, num_programs: int, max_context_len: int,
                     block_n: int) -> int:
    """Enough splits to give every SM about two programs, never splits shorter than
    256 keys (or one tile), at most 16; a power of two to bound recompilations."""
    if device.type != "cuda":
        return 1
    want = triton.cdiv(2 * _num_sms(device), max(num_programs, 1))
    useful = triton.cdiv(max_context_len, max(256, block_n))
    n = max(1, min(want, useful, 16))
    return 1 << int(math.log2(n))


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int,
                 head_dim: int) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} must both be "
                         "[num_blocks, block_size, num_kv_heads, head_dim]")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"cache heads/dim {tuple(k_cache.shape[2:])} do not match "
                         f"({num_kv_heads}, {head_dim})")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' last dimension must be contiguous")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
