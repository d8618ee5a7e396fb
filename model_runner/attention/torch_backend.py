"""The "torch" attention backend: paged attention in plain torch, on any device, the
reference every other backend is tested against.

The cache layout is per layer (num_blocks, block_size, num_kv_heads, head_dim); token slot
s lives at block s // block_size, offset s % block_size. `write_kv_cache` and
`paged_attention` have the signatures of backend.WriteKVCache and backend.PagedAttention.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_runner.attention.backend import AttentionBackend
from model_runner.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the new keys and values of a step at their slots.

    key, value: [num_tokens, num_kv_heads, head_dim], cast to the caches' dtype; k_cache,
    v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; slot_mapping: [num_tokens]
    int64; a negative slot (a padding row of a CUDA-graph batch) is skipped, as in the
    Triton kernel.
    """
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    # flat caches: [num_blocks * block_size, num_kv_heads, head_dim] (views, no copy)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every query row over its sequence's keys in the paged cache.

    query: [num_tokens, num_heads, head_dim] laid out as `meta` describes (the first
    meta.num_decode_seqs sequences have one row each); num_heads is a multiple of the
    caches' num_kv_heads (GQA). Query row at position p of sequence i sees the keys at
    positions 0..p, read through meta.block_tables[i]. The caches may hold a narrower
    dtype than the query (a float16 cache under a float32 model); keys and values are
    widened to the query's. Returns [num_tokens, num_heads, head_dim].
    """
    out = torch.empty_like(query)
    num_decodes = meta.num_decode_seqs
    if num_decodes > 0:
        out[:num_decodes] = _decode_attention(query[:num_decodes], k_cache, v_cache, meta, scale)
    if num_decodes < meta.num_seqs:
        prefill_attention(query, k_cache, v_cache, meta, scale, out)
    return out


# A decode group is padded to its longest context. A new group starts where its padding
# would pass both a share of the group's real blocks and a number of blocks: a group costs
# a few calls per layer, worth it only when they save more than a little copying.
_DECODE_PADDING_SHARE = 0.25
_DECODE_PADDING_BLOCKS = 32


@dataclass
class _DecodeGroup:
    """Decode sequences of similar context length, attended to in one batched call."""

    rows: torch.Tensor  # [g] int64: the sequences' query rows
    blocks: torch.Tensor  # [g * num_blocks] int64: their block tables, padded and flattened
    num_blocks: int
    mask: torch.Tensor | None  # [g, 1, 1, num_blocks * block_size] bool; None: no padding


@dataclass
class _DecodePlan:
    """What every layer's decode attention of one step shares: the groups, and the buffers
    the keys and values are gathered into (allocated once a step, not once a layer)."""

    groups: list[_DecodeGroup]
    key_buffer: torch.Tensor  # [max over groups of g * num_blocks, *k_cache.shape[1:]]
    value_buffer: torch.Tensor


def _decode_plan(meta: AttentionMetadata, k_cache: torch.Tensor) -> _DecodePlan:
    """Sort the decode sequences by context length and cut them into groups whose padding
    stays small (see _DECODE_PADDING_SHARE and _decode_attention)."""
    block_size = k_cache.shape[1]
    num_decodes = meta.num_decode_seqs
    lens = meta.context_lens[:num_decodes].tolist()
    blocks_of = [-(-n // block_size) for n in lens]
    order = sorted(range(num_decodes), key=lens.__getitem__)
    spans: list[tuple[int, int]] = []  # [start, end) in `order`
    start, real = 0, 0
    for end, row in enumerate(order):
        num_blocks = blocks_of[row]
        padding = (end - start + 1) * num_blocks - (real + num_blocks)
        if padding > max(_DECODE_PADDING_SHARE * (real + num_blocks), _DECODE_PADDING_BLOCKS):
            spans.append((start, end))
            start, real = end, 0
        real += num_blocks
    spans.append((start, num_decodes))

    device = k_cache.device
    groups = []
    for start, end in spans:
        rows = order[start:end]
        num_blocks = blocks_of[rows[-1]]  # the longest of the group
        row_index = torch.tensor(rows, device=device)
        blocks = meta.block_tables[row_index, :num_blocks].flatten().to(torch.int64)
        group_lens = torch.tensor([lens[r] for r in rows], device=device)
        mask = None
        if lens[rows[0]] < num_blocks * block_size:
            positions = torch.arange(num_blocks * block_size, device=device)
            mask = (positions[None, :] < group_lens[:, None])[:, None, None, :]
        groups.append(_DecodeGroup(row_index, blocks, num_blocks, mask))
    capacity = max(g.blocks.numel() for g in groups)
    buffer_shape = (capacity, *k_cache.shape[1:])
    return _DecodePlan(
        groups,
        torch.empty(buffer_shape, dtype=k_cache.dtype, device=device),
        torch.empty(buffer_shape, dtype=k_cache.dtype, device=device),
    )


def _decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """One query row per sequence; one batched call per group of similar lengths.

    NOTE: attention here is bound by moving keys and values: each group's blocks are
    gathered (index_select copies whole blocks; advanced indexing goes element by element
    and is several times slower on the CPU) into buffers the step reuses in every layer,
    since fresh large buffers cost a page fault per 4 KiB. Grouping by length keeps the
    padding of a batch of mixed lengths from multiplying the bytes moved.
    """
    _, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    plan = meta.scratch.get("torch_decode")
    # NOTE: every layer of a model shares the plan; a caller that brings the same step's
    # metadata to a cache of another dtype or shape gets a new one.
    if plan is None or (plan.key_buffer.dtype, plan.key_buffer.shape[1:]) != (
        k_cache.dtype, k_cache.shape[1:]
    ):
        plan = meta.scratch["torch_decode"] = _decode_plan(meta, k_cache)
    out = torch.empty_like(query)
    for g in plan.groups:
        n = g.rows.numel()
        # gathered: [n, num_blocks * block_size, num_kv_heads, head_dim] -> heads first
        gathered = (n, g.num_blocks * block_size, num_kv_heads, head_dim)
        keys = plan.key_buffer[: g.blocks.numel()]
        values = plan.value_buffer[: g.blocks.numel()]
        torch.index_select(k_cache, 0, g.blocks, out=keys)
        torch.index_select(v_cache, 0, g.blocks, out=values)
        keys = keys.view(gathered).transpose(1, 2)
        values = values.view(gathered).transpose(1, 2)
        # NOTE: the `group_size` query heads that share a kv head ride in the query-length
        # axis, which is free here: a decode row sees all its keys, so they share one mask.
        q = query.index_select(0, g.rows).view(n, num_kv_heads, group_size, head_dim)
        o = F.scaled_dot_product_attention(
            q, keys.to(q.dtype), values.to(q.dtype), attn_mask=g.mask, scale=scale
        )
        out.index_copy_(0, g.rows, o.reshape(n, num_heads, head_dim))
    return out


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Prompt chunks, one sequence at a time; writes into `out`."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    starts = meta.query_start_loc.tolist()
    context_lens = meta.context_lens.tolist()
    for i in range(meta.num_decode_seqs, meta.num_seqs):
        start, end, context_len = starts[i], starts[i + 1], context_lens[i]
        query_len = end - start
        num_blocks = -(-context_len // block_size)
        blocks = meta.block_tables[i, :num_blocks]
        # NOTE: 4-d inputs (a batch of one): 3-d ones miss torch's fused CPU kernel.
        # keys, values: [1, num_kv_heads, context_len, head_dim]
        keys = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:context_len]
        keys = keys.transpose(0, 1)[None].to(query.dtype)
        values = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:context_len]
        values = values.transpose(0, 1)[None].to(query.dtype)
        q = query[start:end].transpose(0, 1)[None]  # [1, num_heads, query_len, head_dim]
        if query_len == context_len:
            o = F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            # causal with an offset: query row j sits at position context_len - query_len + j
            cached = context_len - query_len
            rows = torch.arange(query_len, device=query.device)[:, None] + cached
            mask = torch.arange(context_len, device=query.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[start:end] = o[0].transpose(0, 1)


BACKEND = AttentionBackend("torch", write_kv_cache, paged_attention)
