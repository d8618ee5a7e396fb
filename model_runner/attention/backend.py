"""The attention backend interface: what every backend (torch_backend, cpu_backend,
triton_backend) provides, and the fused layer kernels one may bring along."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from model_runner.attention_metadata import AttentionMetadata

WriteKVCache = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
]


@dataclass(frozen=True)
class AttentionOptions:
    """What one layer's attention asks of a backend beyond plain causal softmax, fixed per
    layer and passed on every call. A family that needs more adds a field here, and every
    backend reads it.

    sliding_window: a query at position p sees only the keys at positions
    p - sliding_window + 1 .. p (Hugging Face's convention: the window counts the query's
    own key); None sees every earlier key. softcap: each scaled score s becomes
    softcap * tanh(s / softcap) before the softmax (Gemma 2); None leaves it. sinks: one
    learned logit per query head ([heads], this rank's under tensor parallelism; gpt-oss)
    that joins each of that head's softmax denominators and carries no value, so a row's
    weights sum to less than one; None: no sink.
    """

    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"softcap must be > 0, got {self.softcap}")
        if self.sinks is not None and self.sinks.dim() != 1:
            raise ValueError(f"sinks must be one logit per head, got {tuple(self.sinks.shape)}")

    @property
    def is_plain(self) -> bool:
        """Whether this is plain causal softmax (no window, cap or sink)."""
        return self.sliding_window is None and self.softcap is None and self.sinks is None


FULL_ATTENTION = AttentionOptions()


class PagedAttention(Protocol):
    """paged_attention(query [T, heads, D], k_cache, v_cache, meta, scale, options=...) ->
    [T, heads, D]: causal attention of every query row over its sequence's keys in the
    paged cache, as `options` restricts and caps it (see torch_backend.paged_attention).
    Callers pass `options` by keyword (a backend bound with extra arguments, as the
    Triton one with its tiles, may take more positional ones)."""

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        options: AttentionOptions = FULL_ATTENTION,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class LayerOps:
    """Fused kernels for the elementwise parts of a layer, which model_runner/models/layers.py runs
    instead of its torch code (the reference) for activations of one of `dtypes`.

    rms_norm(x [T, H], weight, eps) -> [T, H]; silu_and_mul([T, 2 I]) -> [T, I], and
    gelu_tanh_and_mul the same with gelu's tanh form (Gemma's; None where not given);
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
    gelu_tanh_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class AttentionBackend:
    """A matching pair of cache-write and attention functions, and the fused layer kernels
    of the same device, if any (`layer_ops`)."""

    name: str
    write_kv_cache: WriteKVCache
    paged_attention: PagedAttention
    layer_ops: LayerOps | None = None
