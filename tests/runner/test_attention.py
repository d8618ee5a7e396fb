"""The torch reference paged attention against dense causal attention."""

from __future__ import annotations

import pytest
import torch

from model_runner.attention.selection import select_attention_backend
from model_runner.attention.torch_backend import BACKEND as TORCH_BACKEND
from model_runner.attention.torch_backend import paged_attention, write_kv_cache
from model_runner.attention_metadata import AttentionMetadata
from tests.support.attention_helpers import Batch, assert_close, dense_reference


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """q: [query_len, heads, dim] at the last query_len positions of k, v [ctx, kv_heads,
    dim]; float64 softmax(q k^T) v with a causal offset mask."""
    query_len, num_heads, _ = q.shape
    context_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)  # [ctx, heads, dim]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    rows = torch.arange(query_len)[:, None] + context_len - query_len
    scores = scores.masked_fill(torch.arange(context_len)[None, :] > rows, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(
    seqs: list[tuple[int, int]],  # (context_len, query_len) per sequence, decodes first
    block_size: int,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    seed: int = 0,
) -> AttentionMetadata:
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-ctx // block_size) for ctx, _ in seqs)
    num_blocks = len(seqs) * max_blocks + 3
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    # blocks handed out in a scrambled order, so that sequences are not contiguous
    free = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    queries, expected, slots = [], [], []
    for i, (ctx, qlen) in enumerate(seqs):
        blocks = [free.pop() for _ in range(-(-ctx // block_size))]
        block_tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        keys = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        values = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        positions = torch.arange(ctx)
        seq_slots = (
            torch.tensor(blocks)[positions // block_size] * block_size + positions % block_size
        )
        # cached prefix and new tokens alike: attention reads them all from the cache
        write_kv_cache(keys, values, k_cache, v_cache, seq_slots)
        q = torch.randn(qlen, num_heads, head_dim, generator=gen)
        queries.append(q)
        expected.append(dense_attention(q, keys, values, head_dim**-0.5))
        slots.append(seq_slots[ctx - qlen :])
    query_lens = torch.tensor([qlen for _, qlen in seqs])
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.cat([torch.zeros(1), query_lens.cumsum(0)]).to(torch.int32),
        context_lens=torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=int(query_lens.max()),
        max_context_len=max(ctx for ctx, _ in seqs),
        num_decode_seqs=sum(1 for _, qlen in seqs if qlen == 1),
    )
    out = paged_attention(torch.cat(queries), k_cache, v_cache, meta, head_dim**-0.5)
    torch.testing.assert_close(out.double(), torch.cat(expected), atol=2e-5, rtol=1e-5)
    return meta


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_ragged_lengths(block_size):
    run_case([(1, 1), (5, 5), (17, 17), (33, 33)], block_size)


@pytest.mark.parametrize("block_size", [2, 16])
def test_chunks_with_cached_prefix(block_size):
    run_case([(40, 7), (16, 16), (33, 32), (20, 3)], block_size)


@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_decode_batch(block_size):
    run_case([(1, 1), (9, 1), (16, 1), (17, 1), (70, 1)], block_size)


@pytest.mark.parametrize("block_size", [1, 4])
def test_decode_batch_of_far_apart_lengths_in_groups(block_size):
    """Lengths in scrambled order, far enough apart that the batch is cut into several
    groups of similar length, each padded only to its own longest."""
    lengths = [300, 2, 150, 299, 40, 1, 151, 41, 260, 3]
    meta = run_case([(n, 1) for n in lengths], block_size, seed=block_size)
    groups = meta.scratch["torch_decode"].groups
    assert len(groups) > 1
    assert sorted(r for g in groups for r in g.rows.tolist()) == list(range(len(lengths)))


def test_decode_batch_of_equal_lengths_needs_no_mask():
    meta = run_case([(32, 1), (32, 1), (32, 1)], 16)
    (group,) = meta.scratch["torch_decode"].groups
    assert group.mask is None


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (9, 3), (8, 1)])
def test_gqa(num_heads, num_kv_heads):
    run_case([(12, 1), (30, 1), (25, 25), (40, 9)], 4, num_heads, num_kv_heads, head_dim=16)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_mixed_decode_and_prefill(seed):
    run_case([(3, 1), (64, 1), (50, 50), (31, 6), (7, 7)], 16, head_dim=64, seed=seed)


def test_write_kv_cache_places_tokens_at_slots():
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv_cache(key, value, k_cache, v_cache, torch.tensor([13, 2, 7]))
    for row, slot in enumerate([13, 2, 7]):
        assert torch.equal(k_cache[slot // 4, slot % 4], key[row])
        assert torch.equal(v_cache[slot // 4, slot % 4], value[row])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3


def test_backend_selection_on_cpu():
    cpu = torch.device("cpu")
    assert select_attention_backend("torch", cpu, 64) is TORCH_BACKEND
    # a head_dim the C++ kernels do not take: auto falls back, asking for them fails
    assert select_attention_backend("auto", cpu, 36) is TORCH_BACKEND
    with pytest.raises(ValueError, match="multiples of 8"):
        select_attention_backend("cpu", cpu, 36)
    with pytest.raises(ValueError, match="CUDA"):
        select_attention_backend("triton", cpu, 64)
    with pytest.raises(ValueError, match="unknown"):
        select_attention_backend("flash", cpu, 64)


def test_decode_metadata_brought_to_a_cache_of_another_dtype():
    """The decode plan is step scratch shared by every layer; the same metadata used on a
    bfloat16 cache and then on its float32 copy (as a reference check does) works on both."""
    batch = Batch([1, 1, 1], [40, 7, 23], num_decode_seqs=3, dtype=torch.bfloat16)
    batch.write_new_kv_with_torch()
    for cache in (batch.k_cache, batch.v_cache):
        cache.nan_to_num_(0.0)  # the model's cache starts zeroed, not NaN
    args = (batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    low = paged_attention(batch.query, *args)
    full = paged_attention(batch.query.float(), *(c.float() for c in args[:2]), *args[2:])
    ref = dense_reference(batch.query, *args)
    assert_close(low, ref, batch.num_rows)
    assert_close(full, ref, batch.num_rows)
