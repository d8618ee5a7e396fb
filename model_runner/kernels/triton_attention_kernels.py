"""The Triton kernels of paged attention (their launchers and the API are in
triton_attention.py).

- ``write_kv_kernel``: scatter a step's new keys and values into the cache at
  ``slot_mapping`` (slot = block * block_size + offset; a negative slot is skipped).
- ``decode_kernel`` (+ ``decode_reduce_kernel``): one query row per sequence,
  flash-decoding style. The context of each sequence is cut into ``num_splits`` pieces
  that run in parallel; each writes a partial output and its log-sum-exp, and the
  reduce kernel merges them. With one split the decode kernel writes the output itself.
- ``prefill_kernel``: flash-attention (online softmax) over the flat varlen batch with
  the causal offset; a program owns a tile of query rows of one sequence and walks that
  sequence's keys in tiles of BLOCK_N tokens, looking each token's page up in the block
  table.

GQA: a program works on one kv head and packs the ``group`` query heads that share it
into the rows of its tile, so each K/V tile is loaded once per kv head.

All math is fp32 (scores, softmax, accumulator) whatever the input dtype; the softmax is
in base 2 (the scale is pre-multiplied by log2(e)). head_dim is padded to a power of two
and masked, so any head_dim works.

A layer's options (backend.AttentionOptions): with HAS_WINDOW a query at position p sees
only the keys p - window + 1 .. p, and no key before the earliest row's window is loaded;
with HAS_SOFTCAP each score s becomes softcap * tanh(s / softcap) (`softcap` in log2
units, like the scores); with HAS_SINKS each query head's sink logit (`sinks_ptr`, float32
in natural units) joins its softmax denominator once, when a row's output is normalised
(by the reduce kernel when a decode is split).
"""

from __future__ import annotations

import triton
import triton.language as tl

# --------------------------------------------------------------------------------------
# KV cache write
# --------------------------------------------------------------------------------------


@triton.jit
def write_kv_kernel(
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


@triton.jit
def _soft_cap(s, softcap):
    """softcap * tanh(s / softcap), with tanh(x) = 2 sigmoid(2 x) - 1."""
    return softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)


@triton.jit
def _normalise(acc, m_i, l_i, sinks_ptr, heads, h_mask, HAS_SINKS: tl.constexpr):
    """acc [M, BLOCK_D] over its running sum l_i [M] (max m_i, log2 units; a row that has
    seen no key gives zeros); with HAS_SINKS each row's head's sink joins the sum."""
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if HAS_SINKS:  # times the keys' share of the denominator, on the larger maximum
        sink = tl.load(sinks_ptr + heads, mask=h_mask, other=0.0) * 1.4426950408889634
        top = tl.maximum(m_i, sink)
        keys_sum = l_i * tl.exp2(m_i - top)  # 0 for a row that has seen no key
        out = out * (keys_sum / (keys_sum + tl.exp2(sink - top)))[:, None]
    return out


# --------------------------------------------------------------------------------------
# Decode: one query row per sequence, split over the context
# --------------------------------------------------------------------------------------


@triton.jit
def decode_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim], written when NUM_SPLITS == 1
    part_out_ptr,  # [num_decode_seqs, num_heads, NUM_SPLITS, head_dim] fp32
    part_lse_ptr,  # [num_decode_seqs, num_heads, NUM_SPLITS] fp32, log2 units
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    context_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    sinks_ptr,  # [num_heads] fp32 (read with HAS_SINKS and one split)
    qk_scale,  # softmax scale * log2(e)
    window,  # keys a query sees, its own included (read with HAS_WINDOW)
    softcap,  # the score cap * log2(e) (read with HAS_SOFTCAP)
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
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    q_row = tl.load(query_start_loc_ptr + seq)
    first_key = 0
    if HAS_WINDOW:
        first_key = tl.maximum(context_len - window, 0)
    # Every split of a sequence gets the same whole number of tiles; the last ones may
    # be short or empty.
    split_len = tl.cdiv(tl.cdiv(context_len - first_key, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_start = first_key + split * split_len
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
        if HAS_SOFTCAP:
            s = _soft_cap(s, softcap)
        s = tl.where(kv_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION)

    out_mask = h_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = _normalise(acc, m_i, l_i, sinks_ptr, heads, h_mask, HAS_SINKS)
        tl.store(out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # the sinks join in the reduce, once
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty split gives zeros
        out = acc / l_safe[:, None]
        part = part_out_ptr + seq * stride_ps + heads * stride_ph + split * stride_pp
        tl.store(part[:, None] + offs_d[None, :], out, mask=out_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def decode_reduce_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # [num_decode_seqs, num_heads, NUM_SPLITS, head_dim] fp32
    part_lse_ptr,  # [num_decode_seqs, num_heads, NUM_SPLITS] fp32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    sinks_ptr,  # [num_heads] fp32 (read with HAS_SINKS)
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
    HAS_SINKS: tl.constexpr,
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
    if HAS_SINKS:  # the head's sink joins the denominator: exp2(sink) beside the splits'
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # empty splits weigh 0
    total = tl.sum(w, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - m)
    total = tl.where(total == 0.0, 1.0, total)
    out = tl.sum(parts * w[:, None], axis=0) / total
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# --------------------------------------------------------------------------------------
# Prefill / chunked prefill: tiles of query rows against tiles of keys, causal with offset
# --------------------------------------------------------------------------------------


@triton.jit
def prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    context_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    first_seq,  # sequences before it are handled by the decode kernel
    sinks_ptr,  # [num_heads] fp32 (read with HAS_SINKS)
    qk_scale,  # softmax scale * log2(e)
    window,  # keys a query sees, its own included (read with HAS_WINDOW)
    softcap,  # the score cap * log2(e) (read with HAS_SOFTCAP)
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
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
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
    # The first row of the tile sees keys from kv_start on (0 without a window); no row
    # sees an earlier one, and none is loaded.
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(num_cached + tile_first_q - window + 1, 0)
    for tile_start in range(kv_start // BLOCK_N * BLOCK_N, kv_end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n >= kv_start) & (offs_n < kv_end)
        k_t, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_table_ptr, offs_n, kv_mask, kv_head, offs_d,
            stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
            HEAD_DIM, BLOCK_SIZE,
        )
        # s: [BLOCK_M, BLOCK_N]
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        if HAS_SOFTCAP:
            s = _soft_cap(s, softcap)
        visible = kv_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible &= offs_n[None, :] > q_pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION)

    out = _normalise(acc, m_i, l_i, sinks_ptr, heads, row_mask, HAS_SINKS)
    o_off = (q_start + q_idx) * stride_ot + heads * stride_oh
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])
