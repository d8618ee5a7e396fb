"""Sliding windows, soft-capped scores and attention sinks in the torch and cpu attention
backends, against
the dense float64 reference: prefill, chunked prefill and decode, windows that start
inside a block and cross block boundaries. The blocks wholly before a sequence's window
hold NaN (as if freed and handed out again), so a backend that reads one fails.
(The triton backend's own cases are in test_triton_attention.py.)"""

from __future__ import annotations

import pytest
import torch

from model_runner.attention import torch_backend
from model_runner.attention.backend import FULL_ATTENTION, AttentionBackend, AttentionOptions
from model_runner.kernels.cpu_kernels import cpu_kernels_available
from tests.support.attention_helpers import (
    SINKS,
    Batch,
    assert_close,
    dense_reference,
    poison_outside_windows,
)


def backends() -> list[AttentionBackend]:
    found = [torch_backend.BACKEND]
    if cpu_kernels_available():
        from model_runner.attention import cpu_backend

        found.append(cpu_backend.BACKEND)
    return found


BACKENDS = [pytest.param(b, id=b.name) for b in backends()]

# (query_lens, context_lens, num_decode_seqs): decodes first, then a whole prompt and
# chunks after a cached prefix, each context longer than the windows below.
MIXED = ([1, 1, 1, 30, 7, 1], [5, 23, 41, 30, 37, 19], 3)


def run(backend: AttentionBackend, options: AttentionOptions, block_size: int,
        case: tuple[list[int], list[int], int] = MIXED, seed: int = 0) -> int:
    """One step through `backend` against the reference; the blocks poisoned."""
    query_lens, context_lens, num_decodes = case
    batch = Batch(query_lens, context_lens, block_size=block_size, num_decode_seqs=num_decodes,
                  num_heads=4, num_kv_heads=2, head_dim=32, seed=seed)
    # NOTE: the torch backend gathers whole blocks and masks them: unused slots of a block
    # it reads must be finite, as in a real cache (see test_triton_attention.py).
    batch.k_cache.nan_to_num_(1e3)
    batch.v_cache.nan_to_num_(-1e3)
    poisoned = 0
    if options.sliding_window is not None:
        poisoned = poison_outside_windows(batch, options.sliding_window)
    backend.write_kv_cache(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache,
                           batch.meta.slot_mapping)
    out = backend.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta,
                                  batch.scale, options=options)
    ref = dense_reference(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                          options)
    assert_close(out, ref, batch.num_rows)
    return poisoned


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [1, 6, 16])
def test_sliding_window_mixed_step(backend: AttentionBackend, block_size: int,
                                   window: int) -> None:
    poisoned = run(backend, AttentionOptions(sliding_window=window), block_size)
    assert poisoned > 0  # some block lay wholly outside every window, and was not read


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_wider_than_every_context_is_full_attention(backend: AttentionBackend) -> None:
    batch_args = (backend, AttentionOptions(sliding_window=64), 4)
    assert run(*batch_args) == 0
    run(backend, FULL_ATTENTION, 4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 7])
def test_softcap(backend: AttentionBackend, window: int | None) -> None:
    # a small cap against large scores: capping changes the result a lot
    run(backend, AttentionOptions(sliding_window=window, softcap=0.5), 4, seed=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_changes_the_result(backend: AttentionBackend) -> None:
    batch = Batch([1, 9], [12, 9], block_size=4, num_decode_seqs=1, seed=3)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    backend.write_kv_cache(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache,
                           batch.meta.slot_mapping)
    capped = backend.paged_attention(*args, options=AttentionOptions(softcap=0.5))
    plain = backend.paged_attention(*args)
    assert not torch.allclose(capped[: batch.num_rows], plain[: batch.num_rows], atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 7])
def test_sinks(backend: AttentionBackend, window: int | None) -> None:
    run(backend, AttentionOptions(sliding_window=window, sinks=SINKS), 4, seed=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_take_a_share_of_each_row(backend: AttentionBackend) -> None:
    """A head's output shrinks by the share its sink takes of the softmax: the first
    head's (sink -2) hardly, the last one's (sink 6) by most."""
    batch = Batch([1, 9], [12, 9], block_size=4, num_decode_seqs=1, seed=3)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    backend.write_kv_cache(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache,
                           batch.meta.slot_mapping)
    sunk = backend.paged_attention(*args, options=AttentionOptions(sinks=SINKS))
    plain = backend.paged_attention(*args)
    ratio = sunk[: batch.num_rows].norm(dim=-1) / plain[: batch.num_rows].norm(dim=-1)
    assert bool((ratio[:, 0] > 0.7).all()) and bool((ratio[:, 3] < 0.3).all())
    assert bool((ratio <= 1.0 + 1e-6).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_groups_of_mixed_windows(backend: AttentionBackend) -> None:
    # many decodes of spread lengths: the torch backend cuts them into several groups
    lens = [3, 9, 17, 33, 64, 65, 130, 200, 257]
    run(backend, AttentionOptions(sliding_window=20), 4, ([1] * len(lens), lens, len(lens)))


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionOptions(sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        AttentionOptions(softcap=0.0)
    with pytest.raises(ValueError, match="sinks"):
        AttentionOptions(sinks=torch.zeros(2, 2))
