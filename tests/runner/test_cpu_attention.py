"""The C++ CPU kernels (the "cpu" attention backend) against a dense float64 reference,
the torch reference backend, and through a whole model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model_runner.attention import cpu_backend as cpu_attention
from model_runner.attention import torch_backend as attention
from model_runner.attention.selection import select_attention_backend
from tests.support.attention_helpers import Batch, assert_close, dense_reference

CPU = torch.device("cpu")


def step(batch: Batch) -> torch.Tensor:
    """Writes the step's new keys and values, then attends, through the cpu backend."""
    cpu_attention.write_kv_cache(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache,
                                 batch.meta.slot_mapping)
    return cpu_attention.paged_attention(batch.query, batch.k_cache, batch.v_cache,
                                         batch.meta, batch.scale)


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 1)])
def test_decode(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    # contexts shorter than, equal to and past a block, and one long one
    contexts = [1, 15, 16, 17, 40, 300]
    batch = Batch([1] * len(contexts), contexts, block_size=block_size, num_heads=num_heads,
                  num_kv_heads=num_kv_heads, num_decode_seqs=len(contexts), seed=block_size)
    out = step(batch)
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, ref, batch.num_rows)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (8, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("context", [255, 256, 1000])
def test_one_long_sequence_split_over_the_threads_by_kv_head(
    num_heads: int, num_kv_heads: int, context: int
) -> None:
    # fewer sequences than threads, 256 keys or more: its kv heads go to different threads,
    # with the numbers one thread gives
    batch = Batch([1], [context], num_heads=num_heads, num_kv_heads=num_kv_heads,
                  num_decode_seqs=1, seed=context)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        out = step(batch)
        torch.set_num_threads(1)
        one_thread = step(batch)
    finally:
        torch.set_num_threads(threads)
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, ref, batch.num_rows)
    assert torch.equal(out, one_thread)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_dtypes_and_head_dims(dtype: torch.dtype, head_dim: int) -> None:
    contexts = [3, 33, 130]
    batch = Batch([1] * 3, contexts, head_dim=head_dim, dtype=dtype, num_decode_seqs=3, seed=1)
    out = step(batch)
    assert out.dtype == dtype
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, ref, batch.num_rows)


def test_scores_far_apart_keep_their_softmax() -> None:
    # A key scoring far above the rest must take all the weight, whichever block it is
    # in: the running maximum and sum are rescaled when a later block raises the maximum.
    batch = Batch([1, 1], [40, 40], num_decode_seqs=2, seed=3)
    step(batch)
    block_size = batch.k_cache.shape[1]
    for seq, position in enumerate([2, 37]):  # an early block, then the last one
        block = int(batch.meta.block_tables[seq, position // block_size])
        batch.k_cache[block, position % block_size] = 20 * batch.query[seq].view(2, 2, 64)[:, 0]
    out = cpu_attention.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta,
                                        batch.scale)
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, ref, batch.num_rows)


def test_mixed_step_skips_padding_rows() -> None:
    # 3 decodes, a prompt, a chunk after a cached prefix, a one-token chunk, 3 padding rows
    batch = Batch([1, 1, 1, 19, 8, 1], [1, 17, 40, 19, 32, 6], num_decode_seqs=3,
                  num_padding_rows=3, seed=2)
    out = step(batch)
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, ref, batch.num_rows)


@pytest.mark.parametrize(("query_lens", "context_lens", "num_decodes", "num_padding_rows"), [
    # verifications (a token and its drafts after a cached prefix) alone, then beside a
    # decode, chunks at the decode kernel's limit and one past it, and padding rows
    ([5, 3], [50, 3], 0, 0),
    ([1, 5, 17, 18, 2], [9, 45, 60, 18, 20], 1, 2),
    ([1, 1, 9], [30, 12, 70], 2, 3),
    # rows x context at SHORT_CHUNK_KEYS (4 x 1,024) and past it (5 x 1,000)
    ([1, 4, 5], [30, 1024, 1000], 1, 0),
])
def test_short_chunks_attend_in_the_decode_kernel(
    query_lens: list[int], context_lens: list[int], num_decodes: int, num_padding_rows: int
) -> None:
    assert cpu_attention.SHORT_CHUNK_MAX == 17  # the cases straddle it
    assert cpu_attention.SHORT_CHUNK_KEYS == 4096
    batch = Batch(query_lens, context_lens, num_decode_seqs=num_decodes,
                  num_padding_rows=num_padding_rows, seed=6)
    long_chunks = [i for i, (q, c) in enumerate(zip(query_lens, context_lens, strict=True))
                   if q > 17 or q * c > 4096]
    assert cpu_attention._DecodeRows.of(batch.meta).long_chunks == long_chunks
    out = step(batch)
    assert out.shape == batch.query.shape
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, ref, batch.num_rows)


def test_matches_torch_backend_bit_for_bit_on_the_cache() -> None:
    batch = Batch([1, 1, 12], [9, 50, 12], num_decode_seqs=2, seed=4)
    batch.k_cache.nan_to_num_(1e3)  # the torch backend masks gathered blocks: keep it finite
    batch.v_cache.nan_to_num_(-1e3)
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    attention.write_kv_cache(batch.new_k, batch.new_v, ref_k, ref_v, batch.meta.slot_mapping)
    out = step(batch)
    assert torch.equal(batch.k_cache, ref_k) and torch.equal(batch.v_cache, ref_v)
    ref = attention.paged_attention(batch.query, ref_k, ref_v, batch.meta, batch.scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_write_kv_cache_rejects_a_slot_past_the_cache() -> None:
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    key = torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu_attention.write_kv_cache(key, key, k_cache, v_cache, torch.tensor([3, 8]))


@pytest.mark.parametrize("head_dim", [16, 40])
def test_decode_head_dims_taken_at_run_time(head_dim: int) -> None:
    # 64 and 128 are compiled as constants; other multiples of 8 take the run-time path
    batch = Batch([1] * 3, [4, 20, 70], head_dim=head_dim, num_decode_seqs=3, seed=6)
    out = step(batch)
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, ref, batch.num_rows)


def test_decode_rejects_a_table_that_leaves_the_cache() -> None:
    # a wrong block id or a context past its table would read outside the cache: an error,
    # not a crash of the server
    batch = Batch([1, 1], [5, 20], num_decode_seqs=2)
    tables = batch.meta.block_tables.clone()
    tables[1, 1] = batch.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="not in the cache"):
        ops_decode(batch, tables, batch.meta.context_lens)
    too_long = batch.meta.context_lens.clone()
    too_long[0] = tables.shape[1] * batch.k_cache.shape[1] + 1
    with pytest.raises(RuntimeError, match="does not fit"):
        ops_decode(batch, batch.meta.block_tables, too_long)


def test_decode_rejects_query_rows_that_do_not_fit() -> None:
    # a chunk's rows are the last of its context, and they must add up to the query's
    batch = Batch([1, 4], [9, 12], num_decode_seqs=1)
    tables, lens = batch.meta.block_tables, batch.meta.context_lens
    with pytest.raises(RuntimeError, match="count 4 rows, the query has 5"):
        ops_decode(batch, tables, lens, torch.tensor([1, 3], dtype=torch.int32))
    short = torch.tensor([9, 3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="of 3 keys cannot have 4 query rows"):
        ops_decode(batch, tables, short, torch.tensor([1, 4], dtype=torch.int32))


def ops_decode(batch: Batch, tables: torch.Tensor, lens: torch.Tensor,
               query_rows: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.pagedserve.decode_attention(batch.query, batch.k_cache, batch.v_cache,
                                                 tables, lens, batch.scale,
                                                 query_rows=query_rows)


def test_decode_rejects_a_head_dim_it_was_not_built_for() -> None:
    batch = Batch([1], [5], head_dim=36, num_decode_seqs=1)
    with pytest.raises(RuntimeError, match="head_dim 36"):
        step(batch)


def test_backend_selection() -> None:
    assert select_attention_backend("auto", CPU, 64).name == "cpu"
    assert select_attention_backend("cpu", CPU, 40).name == "cpu"
    with pytest.raises(ValueError, match="runs on the CPU"):
        select_attention_backend("cpu", torch.device("cuda"), 64)


@pytest.mark.parametrize("backend", [attention, cpu_attention], ids=["torch", "cpu"])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_narrow_cache_under_a_float32_query(backend, cache_dtype: torch.dtype) -> None:
    # --kv-cache-dtype: keys and values are rounded once on the way in, then attended to in
    # float32, so the result is the float32 one of the rounded cache
    batch = Batch([1, 1, 1, 19, 8], [1, 17, 40, 19, 32], num_decode_seqs=3, seed=7)
    batch.k_cache = batch.k_cache.nan_to_num(0.0).to(cache_dtype)
    batch.v_cache = batch.v_cache.nan_to_num(0.0).to(cache_dtype)
    backend.write_kv_cache(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache,
                           batch.meta.slot_mapping)
    out = backend.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta,
                                  batch.scale)
    assert out.dtype == torch.float32 and batch.k_cache.dtype == cache_dtype
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, ref, batch.num_rows)


def test_auto_falls_back_to_torch_where_the_kernels_cannot_be_built(tmp_path: Path) -> None:
    # a fresh process, a fresh extension cache and no compiler: "auto" warns and serves on
    # the torch reference, asking for "cpu" says why it cannot
    code = (
        "import torch\n"
        "from model_runner.attention.selection import select_attention_backend\n"
        "print(select_attention_backend('auto', torch.device('cpu'), 64).name)\n"
        "try:\n"
        "    select_attention_backend('cpu', torch.device('cpu'), 64)\n"
        "except ValueError as e:\n"
        "    print('refused:', str(e).splitlines()[0])\n"
    )
    env = {**os.environ, "CXX": str(tmp_path / "no-compiler"),
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "torch"
    assert lines[1].startswith("refused: the C++ CPU kernels could not be built")
    assert "using the torch reference attention" in done.stderr
