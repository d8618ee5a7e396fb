"""The Triton kernels compiled on CUDA at Qwen3-0.6B-like attention shapes (16 heads, 8 KV
heads, head_dim 128, bfloat16, block size 16), against the float64 reference: the KV write
stores every token where its slot says, paged attention agrees within bfloat16's tolerance
on decodes, prefills, chunks after a cached prefix and mixed steps."""

from __future__ import annotations

import pytest
import torch

from tests.support.attention_helpers import assert_close, dense_reference
from tests.support.gpu_models import DRY_RUN, attention_shapes, kv_write_sizes, model_batch

pytestmark = pytest.mark.gpu

@pytest.mark.parametrize("num_tokens", kv_write_sizes(DRY_RUN))
def test_write_kv_cache_stores_every_token_in_its_slot(num_tokens: int, dry_run: bool) -> None:
    from model_runner.kernels import triton_attention as ta

    batch = model_batch([num_tokens], [num_tokens], 0, dry_run)
    ta.write_kv_cache(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache,
                      batch.meta.slot_mapping)
    heads, dim = batch.k_cache.shape[2:]
    slots = batch.meta.slot_mapping
    assert torch.equal(batch.k_cache.view(-1, heads, dim)[slots], batch.new_k)
    assert torch.equal(batch.v_cache.view(-1, heads, dim)[slots], batch.new_v)


SHAPES = attention_shapes(DRY_RUN)


@pytest.mark.parametrize("name", list(SHAPES))
def test_paged_attention_matches_the_reference_at_model_shapes(name: str, dry_run: bool) -> None:
    from model_runner.kernels import triton_attention as ta

    batch = model_batch(*SHAPES[name], dry_run)
    batch.write_new_kv_with_torch()
    out = ta.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta,
                             batch.scale)
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, ref, batch.num_rows)
