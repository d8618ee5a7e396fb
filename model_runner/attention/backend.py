"""The attention backend interface: what every backend (torch_backend, cpu_backend,
triton_backend) provides, and the fused layer kernels one may bring along."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from model_runner.attention_metadata import AttentionMetadata

WriteKVCache = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
]
PagedAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor
]


@dataclass(frozen=True)
class LayerOps:
    """Fused kernels for the elementwise parts of a layer, which model_runner/models/layers.py runs
    instead of its torch code (the reference) for activations of one of `dtypes`.

    rms_norm(x [T, H], weight, eps) -> [T, H]; silu_and_mul([T, 2 I]) -> [T, I];
    rope_(qkv, cos, sin, num_heads, num_kv_heads, head_dim, qk_norm) rotates the query
    and key heads of the fused qkv rows in place, after the per-head norm `qk_norm` =
    (q weight, k weight, eps) when given, which only ops with `takes_qk_norm` accept.
    `widths_multiple_of`: the hidden, intermediate and head sizes must be multiples of it.
    """

    name: str
    dtypes: frozenset[torch.dtype]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    rope_: Callable[..., None]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    takes_qk_norm: bool = False
    widths_multiple_of: int = 1


@dataclass(frozen=True)
class AttentionBackend:
    """A matching pair of cache-write and attention functions, and the fused layer kernels
    of the same device, if any (`layer_ops`)."""

    name: str
    write_kv_cache: WriteKVCache
    paged_attention: PagedAttention
    layer_ops: LayerOps | None = None
