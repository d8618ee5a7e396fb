"""The "cpu" attention backend: the C++ kernels of csrc/cpu_attention.cpp, and the float32
layer kernels of csrc/cpu_layers.cpp as its LayerOps.

Decode rows read their keys and values straight from the paged cache (the torch
reference gathers them first); prompt chunks use the reference's prefill path, whose
time goes to matmul-shaped work that torch's fused CPU attention already does well.
`write_kv_cache` and `paged_attention` have the signatures of the torch reference's.
"""

from __future__ import annotations

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
    num_decodes = meta.num_decode_seqs
    decoded = torch.ops.pagedserve.decode_attention(
        query[:num_decodes], k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
        options.sliding_window or 0, options.softcap or 0.0, options.sinks,  # 0, None: none
    )
    if num_decodes == meta.num_seqs:
        return decoded
    out = torch.empty_like(query)
    out[:num_decodes] = decoded
    prefill_attention(query, k_cache, v_cache, meta, scale, out, options)
    return out


def rope_(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """As LayerOps.rope_, without the q/k norm (the model runs it in torch)."""
    if qk_norm is not None:
        raise ValueError("the C++ rope_ takes no q/k norm")
    torch.ops.pagedserve.rope_(qkv, cos, sin, num_heads + num_kv_heads, head_dim)


LAYER_OPS = LayerOps(
    name="cpu",
    dtypes=frozenset({torch.float32}),
    rms_norm=torch.ops.pagedserve.rms_norm,
    rope_=rope_,
    silu_and_mul=torch.ops.pagedserve.silu_and_mul,
    widths_multiple_of=16,  # csrc/cpu_layers.cpp: widths of 8, RoPE halves of 8
)

BACKEND = AttentionBackend("cpu", write_kv_cache, paged_attention, LAYER_OPS)
