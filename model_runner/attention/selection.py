"""Which attention backend a model runs: `select_attention_backend`.

A new backend is one module in this package that builds an `AttentionBackend`, and one
branch here.
"""

from __future__ import annotations

import logging

import torch

from model_runner.attention import torch_backend
from model_runner.attention.backend import AttentionBackend
from model_runner.config import ATTENTION_BACKENDS

logger = logging.getLogger(__name__)



def select_attention_backend(
    name: str, device: torch.device, head_dim: int
) -> AttentionBackend:
    """The backend for `name` ("auto", "torch", "cpu" or "triton") on `device`, for a model
    of `head_dim`.

    "auto" is Triton on CUDA when it imports, the C++ kernels ("cpu") on the CPU when they
    build and take the head_dim, else the torch reference. Asking for "triton" off CUDA or
    without Triton, or for "cpu" where "auto" would not pick it, is a ValueError.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}")
    if name == "torch":
        return torch_backend.BACKEND
    if device.type == "cpu" and name in ("auto", "cpu"):
        return _cpu_backend(head_dim, required=name == "cpu")
    if name == "cpu":
        raise ValueError(f"the cpu attention backend runs on the CPU, not {device.type}")
    if device.type != "cuda":
        raise ValueError(f"the triton attention backend needs a CUDA device, not {device.type}")
    try:
        # NOTE: imported here so that the CPU never needs triton installed.
        from model_runner.attention import triton_backend
    except ImportError as e:
        if name == "triton":
            raise ValueError(f"the triton attention backend is unavailable: {e}") from e
        logger.warning("triton attention unavailable (%s); using the torch reference", e)
        return torch_backend.BACKEND
    return triton_backend.BACKEND


def _cpu_backend(head_dim: int, required: bool) -> AttentionBackend:
    """The C++ CPU kernels, or (when they cannot serve and were not required) the torch
    reference."""
    from model_runner.kernels.cpu_kernels import cpu_kernels_error

    error = cpu_kernels_error(head_dim)
    if error is not None:
        if required:
            raise ValueError(error)
        logger.warning("%s; using the torch reference attention", error)
        return torch_backend.BACKEND
    from model_runner.attention import cpu_backend  # NOTE: importing it loads the kernels

    return cpu_backend.BACKEND
