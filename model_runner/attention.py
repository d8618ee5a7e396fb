"""Paged attention in plain torch: the reference every other backend is tested against.

The cache layout is per layer (num_blocks, block_size, num_kv_heads, head_dim); token slot
s lives at block s // block_size, offset s % block_size. `write_kv_cache` and
`paged_attention` have exactly the signatures of the Triton kernels in
model_runner/triton_attention.py, and `select_attention_backend` picks one pair of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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

    key, value: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks,
    block_size, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64; a negative slot
    (a padding row of a CUDA-graph batch) is skipped, as in the Triton kernel.
    """
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
    positions 0..p, read through meta.block_tables[i]. Returns [num_tokens, num_heads,
    head_dim].
    """
    out = torch.empty_like(query)
    num_decodes = meta.num_decode_seqs
    if num_decodes > 0:
        out[:num_decodes] = _decode_attention(query[:num_decodes], k_cache, v_cache, meta, scale)
    if num_decodes < meta.num_seqs:
        _prefill_attention(query, k_cache, v_cache, meta, scale, out)
    return out


def _decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """One query row per sequence, all sequences in one batched call."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    context_lens = meta.context_lens[:num_seqs].to(torch.int64)
    max_len = int(context_lens.max())
    num_blocks = -(-max_len // block_size)
    blocks = meta.block_tables[:num_seqs, :num_blocks].flatten()
    # NOTE: index_select copies whole blocks; advanced indexing goes element by element
    # and is several times slower on the CPU.
    # gathered: [num_seqs, num_blocks * block_size, num_kv_heads, head_dim] -> heads first
    gathered = (num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    keys = k_cache.index_select(0, blocks).view(gathered).transpose(1, 2)
    values = v_cache.index_select(0, blocks).view(gathered).transpose(1, 2)
    # mask: [num_seqs, 1, 1, padded_len], True where the key exists
    padded_len = num_blocks * block_size
    positions = torch.arange(padded_len, device=query.device)
    mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]
    # NOTE: the `group` query heads that share a kv head ride in the query-length axis,
    # which is free here: a decode row sees all its keys, so they all share one mask.
    q = query.view(num_seqs, num_kv_heads, group, head_dim)  # [seqs, kv_heads, group, dim]
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return o.reshape(num_seqs, num_heads, head_dim)


def _prefill_attention(
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
        keys = keys.transpose(0, 1)[None]
        values = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:context_len]
        values = values.transpose(0, 1)[None]
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


WriteKVCache = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
]
PagedAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor
]


@dataclass(frozen=True)
class AttentionBackend:
    """A matching pair of cache-write and attention functions."""

    name: str
    write_kv_cache: WriteKVCache
    paged_attention: PagedAttention


TORCH_BACKEND = AttentionBackend("torch", write_kv_cache, paged_attention)


def select_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend for `name` ("auto", "torch" or "triton") on `device`.

    "auto" is Triton on CUDA when it imports, else the torch reference. "triton" on a
    device other than CUDA, or without Triton installed, is a ValueError.
    """
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown attention backend {name!r}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TORCH_BACKEND
    if device.type != "cuda":
        raise ValueError(f"the triton attention backend needs a CUDA device, not {device.type}")
    try:
        # NOTE: imported here so that the CPU never needs triton installed.
        from model_runner import triton_attention
    except ImportError as e:
        if name == "triton":
            raise ValueError(f"the triton attention backend is unavailable: {e}") from e
        logger.warning("triton attention unavailable (%s); using the torch reference", e)
        return TORCH_BACKEND
    return AttentionBackend(
        "triton", triton_attention.write_kv_cache, triton_attention.paged_attention
    )
