"""The "torch" attention backend: paged attention in plain torch, on any device, the
reference every other backend is tested against.

The cache layout is per layer (num_blocks, block_size, num_kv_heads, head_dim); token slot
s lives at block s // block_size, offset s % block_size. `write_kv_cache` and
`paged_attention` have the signatures of backend.WriteKVCache and backend.PagedAttention.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_runner.attention.backend import FULL_ATTENTION, AttentionBackend, AttentionOptions
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
    options: AttentionOptions = FULL_ATTENTION,
) -> torch.Tensor:
    """Causal attention of every query row over its sequence's keys in the paged cache.

    query: [num_tokens, num_heads, head_dim] laid out as `meta` describes (the first
    meta.num_decode_seqs sequences have one row each); num_heads is a multiple of the
    caches' num_kv_heads (GQA). Query row at position p of sequence i sees the keys at
    positions 0..p (with options.sliding_window W, only p - W + 1..p), read through
    meta.block_tables[i]; blocks wholly before every row's window are never read. The
    caches may hold a narrower dtype than the query (a float16 cache under a float32
    model); keys and values are widened to the query's. Returns [num_tokens, num_heads,
    head_dim].
    """
    out = torch.empty_like(query)
    num_decodes = meta.num_decode_seqs
    if num_decodes > 0:
        out[:num_decodes] = _decode_attention(
            query[:num_decodes], k_cache, v_cache, meta, scale, options
        )
    if num_decodes < meta.num_seqs:
        prefill_attention(query, k_cache, v_cache, meta, scale, out, options)
    return out


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of q [b, heads, m, D] over keys, values [b, kv_heads, n, D]
    (each kv head serving a run of heads / kv_heads query heads) where the bool `mask`
    (broadcast to [b, heads, m, n]; None: everywhere) is True, the scores soft-capped;
    `sinks` (broadcast to [b, heads, m, 1]) join each row's softmax denominator."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != keys.shape[1]
        )
    # NOTE: torch's fused attention has no soft-capping or sinks: the scores are written out.
    group = q.shape[1] // keys.shape[1]
    if group > 1:
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [b, heads, m, n]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1, dtype=torch.float32)
    else:  # the sink's column joins the softmax, then is dropped: it has no value
        sink_column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink_column], -1).softmax(-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(q.dtype), values)


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


def _decode_plan(
    meta: AttentionMetadata, k_cache: torch.Tensor, window: int | None
) -> _DecodePlan:
    """Sort the decode sequences by how many blocks they read (with a `window`, only the
    blocks it reaches) and cut them into groups whose padding stays small (see
    _DECODE_PADDING_SHARE and _decode_attention)."""
    block_size = k_cache.shape[1]
    num_decodes = meta.num_decode_seqs
    lens = meta.context_lens[:num_decodes].tolist()
    # a row sees positions [starts[r], lens[r]); it reads blocks firsts[r] .. lasts[r]
    starts = [0 if window is None else max(0, n - window) for n in lens]
    firsts = [start // block_size for start in starts]
    lasts = [-(-n // block_size) - 1 for n in lens]
    blocks_of = [last + 1 - first for first, last in zip(firsts, lasts, strict=True)]
    order = sorted(range(num_decodes), key=blocks_of.__getitem__)
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
    groups = [
        _decode_group(meta, [order[i] for i in range(a, b)], lens, starts, firsts, lasts,
                      block_size, k_cache.device)
        for a, b in spans
    ]
    capacity = max(g.blocks.numel() for g in groups)
    buffer_shape = (capacity, *k_cache.shape[1:])
    return _DecodePlan(
        groups,
        torch.empty(buffer_shape, dtype=k_cache.dtype, device=k_cache.device),
        torch.empty(buffer_shape, dtype=k_cache.dtype, device=k_cache.device),
    )


def _decode_group(
    meta: AttentionMetadata,
    rows: list[int],
    lens: list[int],
    starts: list[int],
    firsts: list[int],
    lasts: list[int],
    block_size: int,
    device: torch.device,
) -> _DecodeGroup:
    """One group: each row's blocks from its first one on, padded to the group's longest
    by repeating its last block (masked out, as are the positions outside its window)."""
    num_blocks = max(lasts[r] + 1 - firsts[r] for r in rows)
    row_index = torch.tensor(rows, device=device)
    first = torch.tensor([firsts[r] for r in rows], device=device)
    last = torch.tensor([lasts[r] for r in rows], device=device)
    columns = torch.minimum(first[:, None] + torch.arange(num_blocks, device=device), last[:, None])
    blocks = meta.block_tables[row_index[:, None], columns].flatten().to(torch.int64)
    mask = None
    if any(starts[r] > firsts[r] * block_size or lens[r] < (firsts[r] + num_blocks) * block_size
           for r in rows):
        # positions: [g, num_blocks * block_size], of each gathered slot
        positions = first[:, None] * block_size + torch.arange(num_blocks * block_size,
                                                                device=device)
        seen_from = torch.tensor([starts[r] for r in rows], device=device)
        seen_to = torch.tensor([lens[r] for r in rows], device=device)
        mask = ((positions >= seen_from[:, None]) & (positions < seen_to[:, None]))[:, None, None]
    return _DecodeGroup(row_index, blocks, num_blocks, mask)


def _decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    options: AttentionOptions,
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
    window = options.sliding_window
    # each decode row's sinks in q's layout below: [1, kv_heads, group_size, 1]
    sinks = None if options.sinks is None else options.sinks.view(1, num_kv_heads, group_size, 1)
    key = "torch_decode" if window is None else f"torch_decode_{window}"
    plan = meta.scratch.get(key)
    # NOTE: every layer of a model with the same window shares the plan; a caller that
    # brings the same step's metadata to a cache of another dtype or shape gets a new one.
    if plan is None or (plan.key_buffer.dtype, plan.key_buffer.shape[1:]) != (
        k_cache.dtype, k_cache.shape[1:]
    ):
        plan = meta.scratch[key] = _decode_plan(meta, k_cache, window)
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
        o = _attend(q, keys.to(q.dtype), values.to(q.dtype), g.mask, scale, options.softcap,
                    sinks)
        out.index_copy_(0, g.rows, o.reshape(n, num_heads, head_dim))
    return out


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    options: AttentionOptions = FULL_ATTENTION,
    sequences: Sequence[int] | None = None,
) -> None:
    """Prompt chunks, one sequence at a time (`sequences`, by default all but the leading
    decodes); writes into `out`."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    window = options.sliding_window
    sinks = None if options.sinks is None else options.sinks.view(1, -1, 1, 1)
    starts = meta.query_start_loc.tolist()
    context_lens = meta.context_lens.tolist()
    if sequences is None:
        sequences = range(meta.num_decode_seqs, meta.num_seqs)
    for i in sequences:
        start, end, context_len = starts[i], starts[i + 1], context_lens[i]
        query_len = end - start
        cached = context_len - query_len  # the position of the chunk's first row
        # the first block any row's window reaches, and the position of its first slot
        first_block = 0 if window is None else max(0, cached - window + 1) // block_size
        base = first_block * block_size
        blocks = meta.block_tables[i, first_block : -(-context_len // block_size)]
        # NOTE: 4-d inputs (a batch of one): 3-d ones miss torch's fused CPU kernel.
        # keys, values: [1, num_kv_heads, context_len - base, head_dim]
        keys = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)
        keys = keys[: context_len - base].transpose(0, 1)[None].to(query.dtype)
        values = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)
        values = values[: context_len - base].transpose(0, 1)[None].to(query.dtype)
        q = query[start:end].transpose(0, 1)[None]  # [1, num_heads, query_len, head_dim]
        if query_len == context_len and options.is_plain:
            o = F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            # causal with an offset: query row j sits at position cached + j
            rows = torch.arange(query_len, device=query.device)[:, None] + cached
            positions = torch.arange(base, context_len, device=query.device)[None, :]
            mask = positions <= rows
            if window is not None:
                mask &= positions > rows - window
            o = _attend(q, keys, values, mask, scale, options.softcap, sinks)
        out[start:end] = o[0].transpose(0, 1)


BACKEND = AttentionBackend("torch", write_kv_cache, paged_attention)
