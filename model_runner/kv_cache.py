"""The physical paged KV cache: per layer, a key and a value tensor of
(num_blocks, block_size, num_kv_heads, head_dim) on the model's device, in the model's
dtype or (CPU, float32 model) a 2-byte one."""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache)


@dataclass
class KVCache:
    """Per-layer (k_cache, v_cache) pairs, all of one shape."""

    layers: KVCaches
    num_blocks: int
    block_size: int


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes over all layers, keys and values."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVCache:
    """Allocate a zeroed cache.

    NOTE: zeroed, not empty: attention reads whole blocks and masks the unused tail, and a
    NaN left in fresh memory would survive the mask (0 * NaN) into the output.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    layers = [(zeroed(shape, dtype, device), zeroed(shape, dtype, device))
              for _ in range(num_layers)]
    return KVCache(layers, num_blocks, block_size)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on the CPU on an anonymous mapping, whose pages the OS zeroes when
    first touched: the cache takes memory as its blocks are first written, not all of
    --kv-cache-memory at start (torch.zeros writes every page)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)
    return torch.frombuffer(pages, dtype=dtype).view(shape)  # the tensor holds the mapping


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The cache's dtype for ModelConfig.kv_cache_dtype `name`: "auto" is the model's; a
    2-byte cache under a float32 model is for the CPU (its attention widens on load)."""
    if name == "auto":
        return model_dtype
    dtype = getattr(torch, name)
    if dtype != model_dtype and (device.type != "cpu" or model_dtype != torch.float32):
        raise ValueError(
            f"--kv-cache-dtype {name} is for a float32 model on the CPU; this model runs in "
            f"{str(model_dtype).removeprefix('torch.')} on {device.type} (use auto)"
        )
    return dtype


def num_blocks_for_memory(budget_bytes: int, block_bytes: int) -> int:
    """How many blocks fit in `budget_bytes`; a ValueError when not even one does."""
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({budget_bytes} bytes) holds no block of {block_bytes} bytes; "
            "raise --kv-cache-memory / --gpu-memory-utilization or set --num-kv-blocks"
        )
    return num_blocks


# NOTE: the CPU cache's pages are taken only as its blocks are first written (zeroed), so a
# large budget costs nothing until it is used; half of what is free leaves the rest of the
# host (other processes, the page cache of a mapped GGUF) its room when the cache fills.
AUTO_KV_FRACTION = 0.5


def cpu_kv_budget(config_bytes: int | None, memory_share: float, ranks: int) -> int:
    """The CPU KV cache's bytes for one rank: `config_bytes` (--kv-cache-memory) when set,
    else AUTO_KV_FRACTION of the memory available now (after the weights are loaded),
    shared among the engine cores (`memory_share`) and the tensor-parallel `ranks`."""
    if config_bytes is not None:
        return config_bytes
    return int(available_memory() * AUTO_KV_FRACTION * memory_share / ranks)


def available_memory() -> int:
    """The host's available memory in bytes (Linux's MemAvailable: free plus what the kernel
    can reclaim), or half the physical memory where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def profile_cuda_num_blocks(
    profile_forward: Callable[[], None],
    block_bytes: int,
    gpu_memory_utilization: float,
    device: torch.device,
) -> int:
    """Blocks that fit in gpu_memory_utilization of the GPU after a profiling forward.

    `profile_forward` runs the largest step the runner will see; its activation peak is
    kept free, as is everything already in use on the device (weights, CUDA context,
    other processes).
    """
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_forward()
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * gpu_memory_utilization) - (total - free) - activation_peak
    return num_blocks_for_memory(budget, block_bytes)
