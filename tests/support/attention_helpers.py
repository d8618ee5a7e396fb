"""Paged-attention test inputs and a dense float64 reference, shared by the tests of every
attention backend.

Every cache starts filled with NaN and only the slots a sequence owns get real values,
so a kernel that reads a key outside its sequence, a padded block-table entry or a
position past the context turns its output into NaN and fails the comparison.
"""

from __future__ import annotations

import torch

from model_runner.attention.backend import FULL_ATTENTION, AttentionOptions
from model_runner.attention_metadata import AttentionMetadata

CPU = torch.device("cpu")
# one sink logit per head of a 4-head batch: from a small share of the softmax to most of it
SINKS = torch.tensor([-2.0, 0.0, 1.5, 6.0])

TOLERANCE = {  # (atol, rtol) against a float64 reference of the same (rounded) inputs
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 1e-2),
    torch.bfloat16: (3e-2, 5e-2),
}


class Batch:
    """One step's inputs: queries, caches holding every key of every sequence, metadata."""

    def __init__(
        self,
        query_lens: list[int],
        context_lens: list[int],
        *,
        block_size: int = 16,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 64,
        dtype: torch.dtype = torch.float32,
        num_decode_seqs: int = 0,
        num_padding_rows: int = 0,
        seed: int = 0,
        device: torch.device = CPU,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        num_seqs = len(query_lens)
        blocks_per_seq = [-(-c // block_size) for c in context_lens]
        # Block 0 is never allocated: padded block-table entries point at NaN.
        num_blocks = 1 + sum(blocks_per_seq) + 2
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = torch.full(shape, float("nan"), dtype=dtype)
        v_cache = torch.full(shape, float("nan"), dtype=dtype)
        # Scattered, shuffled blocks, so that a wrong block-table lookup shows.
        free = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()
        block_tables = torch.zeros(num_seqs, max(max(blocks_per_seq), 1), dtype=torch.int32)
        slots = []  # per sequence: the slot of every position
        for i, n in enumerate(blocks_per_seq):
            blocks = [free.pop() for _ in range(n)]
            block_tables[i, :n] = torch.tensor(blocks, dtype=torch.int32)
            slots.append([blocks[p // block_size] * block_size + p % block_size
                          for p in range(context_lens[i])])
        num_tokens = sum(query_lens) + num_padding_rows
        slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64)
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        row = 0
        for i, (q_len, ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
            cached = slots[i][: ctx - q_len]
            flat_k[cached] = torch.randn(len(cached), num_kv_heads, head_dim,
                                         generator=gen).to(dtype)
            flat_v[cached] = torch.randn(len(cached), num_kv_heads, head_dim,
                                         generator=gen).to(dtype)
            slot_mapping[row: row + q_len] = torch.tensor(slots[i][ctx - q_len:])
            row += q_len
        # This step's new keys and values (padding rows carry junk and slot -1).
        self.new_k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
        self.new_v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
        self.query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
        query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
        self.meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            query_start_loc=query_start_loc.to(device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=block_tables.to(device),
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            num_decode_seqs=num_decode_seqs,
        )
        self.k_cache, self.v_cache = k_cache.to(device), v_cache.to(device)
        self.new_k, self.new_v = self.new_k.to(device), self.new_v.to(device)
        self.query = self.query.to(device)
        self.num_rows = sum(query_lens)
        self.scale = head_dim**-0.5

    def write_new_kv_with_torch(self) -> None:
        """Store the new keys/values with plain indexing (attention-only tests)."""
        valid = self.meta.slot_mapping >= 0
        slots = self.meta.slot_mapping[valid]
        heads, dim = self.k_cache.shape[2:]
        self.k_cache.view(-1, heads, dim)[slots] = self.new_k[valid]
        self.v_cache.view(-1, heads, dim)[slots] = self.new_v[valid]


def dense_reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    options: AttentionOptions = FULL_ATTENTION) -> torch.Tensor:
    """Gather each sequence's keys by its block table, then dense causal-with-offset
    softmax attention in float64, with the sliding window, soft cap and sinks of `options`
    (only the blocks the window reaches are gathered; a head's sink is one more logit in
    its softmax, with no value). Rows outside every sequence come back as 0."""
    window = options.sliding_window
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = query.shape[1] // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    starts = meta.query_start_loc.tolist()
    for i, ctx in enumerate(meta.context_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        first = 0 if window is None else max(0, ctx - (end - start) - window + 1) // block_size
        blocks = meta.block_tables[i, first : -(-ctx // block_size)].long()
        base = first * block_size
        # keys, values: [ctx - base, num_heads, head_dim]
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[: ctx - base]
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[: ctx - base]
        keys = keys.double().repeat_interleave(group, dim=1)
        values = values.double().repeat_interleave(group, dim=1)
        q = query[start:end].double()  # [q_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        if options.softcap is not None:
            scores = torch.tanh(scores / options.softcap) * options.softcap
        positions = ctx - (end - start) + torch.arange(end - start, device=query.device)
        key_positions = torch.arange(base, ctx, device=query.device)[None, :]
        visible = key_positions <= positions[:, None]
        if window is not None:
            visible &= key_positions > positions[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if options.sinks is None:
            probs = scores.softmax(-1)
        else:
            sinks = options.sinks.double()[:, None, None].expand(-1, end - start, 1)
            probs = torch.cat([scores, sinks], -1).softmax(-1)[..., :-1]
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


def assert_close(out: torch.Tensor, ref: torch.Tensor, num_rows: int) -> None:
    atol, rtol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out[:num_rows].double(), ref[:num_rows], atol=atol, rtol=rtol)


def poison_outside_windows(batch: Batch, window: int) -> int:
    """Fill with NaN every block that lies wholly before the window of its sequence's first
    query row (a block the KV manager may have freed and handed out again), so that a
    backend that reads one fails; returns how many blocks were poisoned."""
    meta, block_size = batch.meta, batch.k_cache.shape[1]
    starts, lens = meta.query_start_loc.tolist(), meta.context_lens.tolist()
    poisoned = 0
    for i, ctx in enumerate(lens):
        num_out = max(0, ctx - (starts[i + 1] - starts[i]) - window + 1) // block_size
        for block in meta.block_tables[i, :num_out].tolist():
            batch.k_cache[block] = float("nan")
            batch.v_cache[block] = float("nan")
        poisoned += num_out
    return poisoned
