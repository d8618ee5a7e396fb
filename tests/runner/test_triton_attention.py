"""The Triton paged-attention kernels against a dense torch reference.

Without CUDA the kernels run in Triton's interpreter, which executes every program in
numpy: shapes stay small (tests/support/triton_interpreter.py). On CUDA the same tests run
compiled kernels (`python -m bench.gpu_check` does that on the GPU machine).

Every cache starts filled with NaN and only the slots a sequence owns get real values,
so a kernel that reads a key outside its sequence, a padded block-table entry or a
position past the context turns its output into NaN and fails the comparison.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.support.triton_interpreter import DEVICE, ON_CUDA, import_triton, interpreted

import_triton()

from model_runner.attention.backend import AttentionOptions  # noqa: E402
from model_runner.kernels import triton_attention as ta  # noqa: E402
from model_runner.kernels import triton_attention_kernels  # noqa: E402
from tests.support import attention_helpers  # noqa: E402
from tests.support.attention_helpers import (  # noqa: E402
    SINKS,
    assert_close,
    dense_reference,
    poison_outside_windows,
)

# the launchers of `ta` read the kernels from their module at each call
interpreted(triton_attention_kernels, "prefill_kernel")

SMALL_TILES = ta.TileConfig(prefill_block_m=16, prefill_block_n=16, decode_block_n=16,
                            num_splits=1)
# NOTE: Triton 3.x's interpreter stores bfloat16 as uint16 and its tl.dot multiplies those
# bit patterns as integers, so bf16 attention can only be checked on a GPU. Loads, stores
# and casts of bf16 are fine (write_kv_cache is tested in bf16 everywhere).
BF16_DOT_REASON = "Triton's interpreter computes tl.dot on bfloat16 bit patterns; GPU only"


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


Batch = functools.partial(attention_helpers.Batch, device=DEVICE)


def skip_bf16_in_interpreter(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not ON_CUDA:
        pytest.skip(BF16_DOT_REASON)


# --------------------------------------------------------------------------------------
# write_kv_cache
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16])
def test_write_kv_cache(block_size: int, dtype: torch.dtype) -> None:
    num_blocks, num_kv_heads, head_dim = 6, 2, 40  # head_dim not a power of two
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, 7.0, dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, -7.0, dtype=dtype, device=DEVICE)
    slots = torch.tensor([3, -1, block_size * 5 + 1, 0, -1, block_size * 2 + block_size - 1],
                         device=DEVICE)
    # key/value are views into a fused [tokens, 3, kv_heads, dim] tensor: strided rows.
    fused = torch.randn(len(slots), 3, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    key, value = fused[:, 1], fused[:, 2]

    ta.write_kv_cache(key, value, k_cache, v_cache, slots)

    valid = slots >= 0
    expected_k = torch.full(shape, 7.0, dtype=dtype, device=DEVICE)
    expected_v = torch.full(shape, -7.0, dtype=dtype, device=DEVICE)
    expected_k.view(-1, num_kv_heads, head_dim)[slots[valid]] = key[valid]
    expected_v.view(-1, num_kv_heads, head_dim)[slots[valid]] = value[valid]
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_write_kv_cache_casts_to_cache_dtype() -> None:
    k_cache = torch.zeros(2, 8, 1, 16, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, 1, 16, device=DEVICE)
    ta.write_kv_cache(key, key * 2, k_cache, v_cache, torch.tensor([0, 9, 15], device=DEVICE))
    assert torch.equal(k_cache.view(-1, 1, 16)[[0, 9, 15]], key.half())
    assert torch.equal(v_cache.view(-1, 1, 16)[[0, 9, 15]], (key * 2).half())


# --------------------------------------------------------------------------------------
# Decode kernel (with and without the split-K reduction)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (2, 2)])
def test_decode(num_heads: int, num_kv_heads: int, block_size: int, num_splits: int) -> None:
    # Ragged contexts: one key, part of a block, exactly a block, several blocks. With 3
    # splits the shortest contexts leave some splits empty.
    context_lens = [1, 7, 16, 33, 50]
    batch = Batch([1] * len(context_lens), context_lens, block_size=block_size,
                  num_heads=num_heads, num_kv_heads=num_kv_heads,
                  num_decode_seqs=len(context_lens))
    batch.write_new_kv_with_torch()
    config = ta.TileConfig(16, 16, 16, num_splits=num_splits)

    out = ta.paged_attention_with_config(batch.query, batch.k_cache, batch.v_cache,
                                         batch.meta, batch.scale, config)

    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, ref, batch.num_rows)


def test_decode_many_splits_and_group_of_eight() -> None:
    # 8 query heads on 1 kv head; 5 splits (not a power of two) of a 100-key context.
    batch = Batch([1, 1], [100, 20], block_size=8, num_heads=8, num_kv_heads=1,
                  head_dim=32, num_decode_seqs=2, seed=3)
    batch.write_new_kv_with_torch()
    config = ta.TileConfig(16, 16, 16, num_splits=5)
    out = ta.paged_attention_with_config(batch.query, batch.k_cache, batch.v_cache,
                                         batch.meta, batch.scale, config)
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, ref, batch.num_rows)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_row_with_empty_context_is_zero(num_splits: int) -> None:
    # Padded decode entries (e.g. a CUDA graph's spare seats) may carry context_len 0:
    # their rows must come out finite, not NaN.
    batch = Batch([1, 1], [9, 1], block_size=8, num_decode_seqs=2, seed=4)
    batch.write_new_kv_with_torch()
    batch.meta.context_lens[1] = 0
    config = ta.TileConfig(16, 16, 16, num_splits=num_splits)
    out = ta.paged_attention_with_config(batch.query, batch.k_cache, batch.v_cache,
                                         batch.meta, batch.scale, config)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out[:1], ref[:1], 1)


# --------------------------------------------------------------------------------------
# Prefill kernel: whole prompts, chunks after a cached prefix, GQA layouts, head dims
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [
        pytest.param([5, 17, 33], [5, 17, 33], id="whole-prompts"),
        pytest.param([4, 20, 1], [13, 45, 30], id="chunks-after-cached-prefix"),
    ],
)
@pytest.mark.parametrize("block_size", [8, 16])
def test_prefill(query_lens: list[int], context_lens: list[int], block_size: int) -> None:
    batch = Batch(query_lens, context_lens, block_size=block_size)
    batch.write_new_kv_with_torch()
    out = ta.paged_attention_with_config(batch.query, batch.k_cache, batch.v_cache,
                                         batch.meta, batch.scale, SMALL_TILES)
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, ref, batch.num_rows)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [
        pytest.param(2, 2, 64, id="mha"),
        pytest.param(6, 2, 64, id="group-3"),  # rows of a tile: 5 tokens x 3 heads + 1 pad
        pytest.param(8, 1, 32, id="group-8"),
        pytest.param(4, 2, 40, id="head-dim-40"),
        pytest.param(2, 1, 128, id="head-dim-128"),
    ],
)
def test_prefill_head_layouts(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    batch = Batch([9, 3], [21, 3], block_size=8, num_heads=num_heads,
                  num_kv_heads=num_kv_heads, head_dim=head_dim, seed=1)
    batch.write_new_kv_with_torch()
    out = ta.paged_attention_with_config(batch.query, batch.k_cache, batch.v_cache,
                                         batch.meta, batch.scale, SMALL_TILES)
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, ref, batch.num_rows)


# --------------------------------------------------------------------------------------
# A whole step: write the new K/V with the kernel, then attend; decodes and chunks mixed
# --------------------------------------------------------------------------------------


def mixed_batch(dtype: torch.dtype = torch.float32, block_size: int = 16) -> Batch:
    # 3 decodes (contexts 1, 17, 40), a whole prompt, a chunk after a 24-token prefix, a
    # one-token chunk that is not a decode, then 3 padding rows (slot -1).
    return Batch([1, 1, 1, 19, 8, 1], [1, 17, 40, 19, 32, 6], block_size=block_size,
                 dtype=dtype, num_decode_seqs=3, num_padding_rows=3, seed=2)


@pytest.mark.parametrize("block_size", [8, 16])
def test_mixed_step_through_public_api(block_size: int) -> None:
    batch = mixed_batch(block_size=block_size)
    ta.write_kv_cache(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache,
                      batch.meta.slot_mapping)
    out = ta.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta,
                             batch.scale)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, ref, batch.num_rows)


def test_mixed_step_with_gpu_tile_sizes() -> None:
    # The tiles a GPU uses (64 x 64, split decode), here larger than most sequences.
    batch = mixed_batch()
    ta.write_kv_cache(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache,
                      batch.meta.slot_mapping)
    config = ta.TileConfig(64, 64, 64, num_splits=2)
    out = ta.paged_attention_with_config(batch.query, batch.k_cache, batch.v_cache,
                                         batch.meta, batch.scale, config)
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, ref, batch.num_rows)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_step_half_precision(dtype: torch.dtype) -> None:
    skip_bf16_in_interpreter(dtype)
    batch = mixed_batch(dtype=dtype)
    ta.write_kv_cache(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache,
                      batch.meta.slot_mapping)
    config = ta.TileConfig(16, 16, 16, num_splits=2)
    out = ta.paged_attention_with_config(batch.query, batch.k_cache, batch.v_cache,
                                         batch.meta, batch.scale, config)
    assert out.dtype == dtype
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, ref, batch.num_rows)


@pytest.mark.skipif(not ON_CUDA, reason="long contexts are too slow for the interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_long_context_default_config(dtype: torch.dtype) -> None:
    # Default tiles and the automatic split count, on contexts long enough to split.
    batch = Batch([1] * 4 + [300, 64], [3000, 1, 700, 2048, 300, 1500], num_heads=16,
                  num_kv_heads=8, head_dim=128, dtype=dtype, num_decode_seqs=4, seed=5)
    ta.write_kv_cache(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache,
                      batch.meta.slot_mapping)
    out = ta.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta,
                             batch.scale)
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, ref, batch.num_rows)


# --------------------------------------------------------------------------------------
# A layer's options: sliding window, soft-capped scores and sinks (split decodes: the
# sinks join in the reduce)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(AttentionOptions(sliding_window=6), id="window-6"),
        pytest.param(AttentionOptions(sliding_window=1), id="window-1"),
        pytest.param(AttentionOptions(softcap=0.5), id="softcap"),
        pytest.param(AttentionOptions(sliding_window=20, softcap=0.5), id="both"),
        pytest.param(AttentionOptions(sinks=SINKS), id="sinks"),
        pytest.param(AttentionOptions(sliding_window=6, sinks=SINKS), id="window-6-sinks"),
    ],
)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_mixed_step_with_options(options: AttentionOptions, num_splits: int) -> None:
    # Windows start inside blocks of 8 and cross block (and 16-key tile) boundaries; the
    # blocks wholly before every row's window hold NaN, so reading one fails.
    batch = mixed_batch(block_size=8)
    if options.sliding_window is not None and options.sliding_window < 19:
        assert poison_outside_windows(batch, options.sliding_window) > 0
    ta.write_kv_cache(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache,
                      batch.meta.slot_mapping)
    config = ta.TileConfig(16, 16, 16, num_splits=num_splits)
    out = ta.paged_attention_with_config(batch.query, batch.k_cache, batch.v_cache,
                                         batch.meta, batch.scale, config, options)
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                          options)
    assert_close(out, ref, batch.num_rows)


# --------------------------------------------------------------------------------------
# Against the project's torch backend (model_runner/attention/torch_backend.py)
# --------------------------------------------------------------------------------------


def test_matches_torch_backend() -> None:
    torch_backend = pytest.importorskip("model_runner.attention.torch_backend",
                                        reason="the torch backend is not there")
    batch = mixed_batch()
    # The torch backend multiplies whole gathered blocks by a mask, so NaN in a slot past
    # the context would leak into it: give the unused slots finite stale values, as a
    # real cache has.
    batch.k_cache.nan_to_num_(1e3)
    batch.v_cache.nan_to_num_(-1e3)
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    valid = batch.meta.slot_mapping >= 0  # the torch write takes valid slots only
    torch_backend.write_kv_cache(batch.new_k[valid], batch.new_v[valid], ref_k, ref_v,
                                 batch.meta.slot_mapping[valid])
    ta.write_kv_cache(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache,
                      batch.meta.slot_mapping)
    assert torch.equal(batch.k_cache, ref_k)
    assert torch.equal(batch.v_cache, ref_v)

    out = ta.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta,
                             batch.scale)
    ref = torch_backend.paged_attention(batch.query, ref_k, ref_v, batch.meta, batch.scale)
    assert_close(out, ref.double(), batch.num_rows)


# --------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="power of two"):
        ta.TileConfig(prefill_block_m=24)
    with pytest.raises(ValueError, match="num_splits"):
        ta.TileConfig(num_splits=0)
    batch = Batch([2], [2], num_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="multiple"):
        ta.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, 1.0)
