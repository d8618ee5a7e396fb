"""The "cpu" attention backend: the C++ kernels of csrc/cpu_attention.cpp, and the float32
layer kernels of csrc/cpu_layers.cpp as its LayerOps.

Decode rows, and every row of a short chunk (a speculative verification's last token
and drafts, a small prefill chunk: up to SHORT_CHUNK_MAX rows), read their keys and values
straight from the paged cache in the C++ decode kernel, once per sequence for all its rows,
each row with its own causal length (the torch reference gathers them first); longer
prompt chunks use the reference's
prefill path, whose time goes to matmul-shaped work that torch's fused CPU attention
already does well.
`write_kv_cache` and `paged_attention` have the signatures of the torch reference's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_runner.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionOptions,
    LayerOps,
)
from model_runner.attention.torch_backend import prefill_attention
from model_runner.attention_metadata import AttentionMetadata
from model_runner.kernels.cpu_kernels import load_cpu_kernels

load_cpu_kernels()  # registers torch.ops.pagedserve.*


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """As attention.write_kv_cache: negative slots are skipped, without a host sync."""
    torch.ops.pagedserve.write_kv_cache(
        key.to(k_cache.dtype), value.to(v_cache.dtype), k_cache, v_cache, slot_mapping
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    options: AttentionOptions = FULL_ATTENTION,
) -> torch.Tensor:
    """As attention.paged_attention."""
    rows = meta.scratch.get("cpu_rows")
    if rows is None:
        rows = meta.scratch["cpu_rows"] = _DecodeRows.of(meta)
    decoded = torch.ops.pagedserve.decode_attention(
        query[: rows.num_rows] if rows.index is None else query[rows.index], k_cache, v_cache,
        rows.block_tables, rows.context_lens, scale,
        options.sliding_window or 0, options.softcap or 0.0, options.sinks,  # 0, None: none
        rows.query_rows,
    )
    if not rows.long_chunks and rows.num_rows == query.shape[0]:
        return decoded
    out = torch.empty_like(query)
    if rows.index is None:
        out[: rows.num_rows] = decoded
    else:
        out[rows.index] = decoded
    if rows.long_chunks:
        prefill_attention(query, k_cache, v_cache, meta, scale, out, options, rows.long_chunks)
    return out


# NOTE: a chunk of up to this many rows (a verification: the last token and up to 16
# drafts; a small prefill chunk beside decodes) runs in the decode kernel, which reads its
# context once for all its rows: that costs less than gathering the context and the
# Python of the prefill path, at every layer, while its rows times its context stay
# within SHORT_CHUNK_KEYS; past that the prefill path's matmuls win (beside 16 decodes of
# the default model, 16 rows at context 1,600: 98 ms a step in the decode kernel, 72 on
# the prefill path; 4 rows at 800: 56 and 61)
SHORT_CHUNK_MAX = 17
SHORT_CHUNK_KEYS = 4096


@dataclass(frozen=True)
class _DecodeRows:
    """The rows of a step the decode kernel attends, those of decodes and short chunks:
    the first `num_rows` of the flat batch, or those at `index` when a long chunk comes
    between; each sequence's block table, context length and query rows (`query_rows`:
    None when each has one); the sequences left to the prefill path (`long_chunks`)."""

    num_rows: int
    index: torch.Tensor | None
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_rows: torch.Tensor | None
    long_chunks: list[int]

    @classmethod
    def of(cls, meta: AttentionMetadata) -> _DecodeRows:
        num_decodes, num_seqs = meta.num_decode_seqs, meta.num_seqs
        if num_decodes == num_seqs:
            return cls(num_decodes, None, meta.block_tables, meta.context_lens, None, [])
        starts, contexts = meta.query_start_loc.tolist(), meta.context_lens.tolist()
        query_lens = [starts[i + 1] - starts[i] for i in range(num_seqs)]
        chunks = range(num_decodes, num_seqs)
        short: list[int] = []
        long_chunks: list[int] = []
        for i in chunks:
            rows = query_lens[i]
            fits = rows <= SHORT_CHUNK_MAX and rows * contexts[i] <= SHORT_CHUNK_KEYS
            (short if fits else long_chunks).append(i)
        if not short:  # the decodes lead: their rows, tables and lengths as they are
            return cls(num_decodes, None, meta.block_tables, meta.context_lens, None,
                       long_chunks)
        seqs = torch.tensor([*range(num_decodes), *short])
        lens = torch.tensor(query_lens)[seqs]
        num_rows = int(lens.sum())
        index = None
        if long_chunks:  # the rows of the decodes and short chunks, in their order
            first_row = (torch.cumsum(lens, 0) - lens).repeat_interleave(lens)
            offset = torch.arange(num_rows) - first_row  # the row's place in its chunk
            index = meta.query_start_loc[seqs.repeat_interleave(lens)].long() + offset
        return cls(num_rows, index, meta.block_tables[seqs], meta.context_lens[seqs],
                   lens.to(torch.int32), long_chunks)


def rope_(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """As LayerOps.rope_: the C++ rope_, after the per-head q/k norm when given."""
    if qk_norm is None:
        torch.ops.pagedserve.rope_(qkv, cos, sin, num_heads + num_kv_heads, head_dim)
    else:
        q_weight, k_weight, eps = qk_norm
        torch.ops.pagedserve.qk_norm_rope_(
            qkv, cos, sin, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps
        )


LAYER_OPS = LayerOps(
    name="cpu",
    dtypes=frozenset({torch.float32}),
    rms_norm=torch.ops.pagedserve.rms_norm,
    rope_=rope_,
    silu_and_mul=torch.ops.pagedserve.silu_and_mul,
    takes_qk_norm=True,
    widths_multiple_of=16,  # csrc/cpu_layers.cpp: widths of 8, RoPE halves of 8
    gelu_tanh_and_mul=torch.ops.pagedserve.gelu_tanh_and_mul,
)

BACKEND = AttentionBackend("cpu", write_kv_cache, paged_attention, LAYER_OPS)
