"""The "triton" attention backend (CUDA): the Triton paged attention and KV-write kernels
of model_runner/kernels/triton_attention.py, and the Triton layer kernels of
model_runner/kernels/triton_layers.py as its LayerOps. Importing it needs triton."""

from __future__ import annotations

from model_runner.attention.backend import AttentionBackend
from model_runner.kernels import triton_attention, triton_layers

BACKEND = AttentionBackend(
    "triton",
    triton_attention.write_kv_cache,
    triton_attention.paged_attention,
    triton_layers.TRITON_LAYER_OPS,
)
