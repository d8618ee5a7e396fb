"""Paged attention and KV writes as Triton kernels: the CUDA fast path (the `triton`
backend). This module checks the arguments and launches the kernels of
triton_attention_kernels.py, which read and write the paged KV cache in place through the
block tables; no key or value is ever gathered into a dense copy.

The first meta.num_decode_seqs sequences (one query row each) go to the split-K decode
kernel, the rest to the prefill kernel. float32 inputs use IEEE dot products (no TF32) so
that they match the torch reference tightly on a GPU too.

CPU tests run these kernels under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton

from model_runner.attention.backend import FULL_ATTENTION, AttentionOptions
from model_runner.attention_metadata import AttentionMetadata
from model_runner.kernels import triton_attention_kernels as kernels

_LOG2E = 1.4426950408889634


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write a step's new keys and values into one layer's paged cache, in place.

    key, value: [num_tokens, num_kv_heads, head_dim] (the last dim contiguous; other
    strides are free, e.g. views into a fused qkv tensor). k_cache, v_cache:
    [num_blocks, block_size, num_kv_heads, head_dim]. slot_mapping: [num_tokens] int64,
    slot = block * block_size + offset; a negative slot (a padded row) is skipped.
    Values are cast to the cache dtype.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    kernels.write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=1 if num_kv_heads * head_dim <= 256 else 4,
    )


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of the attention kernels; tests override them to hit edge cases.

    num_splits: decode splits per sequence; None picks them from the batch and GPU size.
    """

    prefill_block_m: int = 64
    prefill_block_n: int = 64
    decode_block_n: int = 64
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("prefill_block_m", "prefill_block_n", "decode_block_n"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {size}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")


def default_tile_config(query: torch.Tensor) -> TileConfig:
    """Tiles for the device and dtype of `query`: big on a GPU, small in the interpreter
    (which runs each program in numpy, so small tiles keep CPU tests fast)."""
    if query.device.type != "cuda":
        return TileConfig(prefill_block_m=16, prefill_block_n=16, decode_block_n=16,
                          num_splits=1)
    if query.dtype == torch.float32:  # fp32 tiles take twice the shared memory
        return TileConfig(prefill_block_m=64, prefill_block_n=32, decode_block_n=32)
    return TileConfig()


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    options: AttentionOptions = FULL_ATTENTION,
) -> torch.Tensor:
    """Causal attention of a flat batch of query rows over the paged KV cache, as
    `options` restricts (a sliding window), caps (softcap) and sinks it.

    query: [num_tokens, num_heads, head_dim] (the last dim contiguous). k_cache, v_cache:
    [num_blocks, block_size, num_kv_heads, head_dim], already holding this step's keys
    and values (see `write_kv_cache`). The first meta.num_decode_seqs sequences (query
    length 1) go to the split-K decode kernel, the rest to the prefill kernel. Returns
    [num_tokens, num_heads, head_dim] in query's dtype; rows that belong to no sequence
    (padding past query_start_loc[-1]) are left unspecified.

    NOTE: no host sync. The decode split count depends on meta.max_context_len, a host
    int; under CUDA graph capture it is fixed at capture time, which stays correct for
    any context length (each split's range is computed on the device), only less tuned.
    """
    return paged_attention_with_config(query, k_cache, v_cache, meta, scale,
                                       default_tile_config(query), options)


def paged_attention_with_config(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    config: TileConfig,
    options: AttentionOptions = FULL_ATTENTION,
) -> torch.Tensor:
    """`paged_attention` with explicit tile sizes (tests, benchmarks)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    if query.dtype != k_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} differs from the cache's {k_cache.dtype}")
    query = _last_dim_contiguous(query)
    out = torch.empty_like(query)
    num_decode = meta.num_decode_seqs
    num_prefill = meta.num_seqs - num_decode
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    common = _CommonArgs(query, out, k_cache, v_cache, meta, scale * _LOG2E,
                         num_heads // num_kv_heads, options)
    if num_decode > 0:
        _launch_decode(common, num_decode, config)
    if num_prefill > 0:
        _launch_prefill(common, num_decode, num_prefill, config)
    return out


@dataclass
class _CommonArgs:
    query: torch.Tensor
    out: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    qk_scale: float
    group: int
    options: AttentionOptions

    def option_args(self) -> tuple[int, float]:
        """The kernels' window and softcap (in log2 units, as their scores) arguments."""
        return self.options.sliding_window or 0, (self.options.softcap or 0.0) * _LOG2E

    def option_flags(self) -> dict[str, bool]:
        return {"HAS_WINDOW": self.options.sliding_window is not None,
                "HAS_SOFTCAP": self.options.softcap is not None,
                "HAS_SINKS": self.options.sinks is not None}

    def sinks(self) -> torch.Tensor:
        """The kernels' sinks (float32), or any tensor for them not to read."""
        sinks = self.options.sinks
        return self.query if sinks is None else sinks.float()

    @property
    def dot_precision(self) -> str:
        # fp32: exact products (the default would be TF32 on a GPU). Ignored otherwise.
        return "ieee" if self.query.dtype == torch.float32 else "tf32"

    def cache_strides(self) -> tuple[int, ...]:
        k, v = self.k_cache, self.v_cache
        return (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))


def _launch_decode(c: _CommonArgs, num_decode: int, config: TileConfig) -> None:
    num_heads, head_dim = c.query.shape[1], c.query.shape[2]
    num_kv_heads = c.k_cache.shape[2]
    block_d = _block_d(head_dim)
    num_splits = config.num_splits or _pick_num_splits(
        c.query.device, num_decode * num_kv_heads,
        min(c.meta.max_context_len, c.options.sliding_window or c.meta.max_context_len),
        config.decode_block_n)
    # Partial outputs (padded to block_d) and their log-sum-exps, one per split.
    part_shape = (num_decode, num_heads, num_splits) if num_splits > 1 else (1, 1, 1)
    part_out = torch.empty(*part_shape, block_d, dtype=torch.float32, device=c.query.device)
    part_lse = torch.empty(*part_shape, dtype=torch.float32, device=c.query.device)
    part_strides = (*part_out.stride()[:3], *part_lse.stride()[:2])
    kernels.decode_kernel[(num_decode, num_kv_heads, num_splits)](
        c.out, part_out, part_lse, c.query, c.k_cache, c.v_cache,
        c.meta.block_tables, c.meta.context_lens, c.meta.query_start_loc, c.sinks(),
        c.qk_scale, *c.option_args(),
        c.query.stride(0), c.query.stride(1), c.out.stride(0), c.out.stride(1),
        *c.cache_strides(),
        c.meta.block_tables.stride(0),
        *part_strides,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        GROUP=c.group,
        BLOCK_H=max(16, triton.next_power_of_2(c.group)),
        BLOCK_SIZE=c.k_cache.shape[1],
        BLOCK_N=config.decode_block_n,
        NUM_SPLITS=num_splits,
        DOT_PRECISION=c.dot_precision,
        **c.option_flags(),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if num_splits > 1:
        kernels.decode_reduce_kernel[(num_decode, num_heads)](
            c.out, part_out, part_lse, c.meta.query_start_loc, c.sinks(),
            c.out.stride(0), c.out.stride(1), *part_strides,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            BLOCK_SPLITS=triton.next_power_of_2(num_splits),
            HAS_SINKS=c.options.sinks is not None,
            num_warps=1 if block_d <= 64 else 2,
        )


def _launch_prefill(c: _CommonArgs, first_seq: int, num_prefill: int,
                    config: TileConfig) -> None:
    head_dim = c.query.shape[2]
    num_kv_heads = c.k_cache.shape[2]
    # A tile holds at least one query token with all heads of its group.
    block_m = max(config.prefill_block_m, triton.next_power_of_2(c.group))
    block_q = block_m // c.group
    grid = (num_prefill, triton.cdiv(c.meta.max_query_len, block_q), num_kv_heads)
    kernels.prefill_kernel[grid](
        c.out, c.query, c.k_cache, c.v_cache,
        c.meta.block_tables, c.meta.context_lens, c.meta.query_start_loc,
        first_seq, c.sinks(),
        c.qk_scale, *c.option_args(),
        c.query.stride(0), c.query.stride(1), c.out.stride(0), c.out.stride(1),
        *c.cache_strides(),
        c.meta.block_tables.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        GROUP=c.group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_SIZE=c.k_cache.shape[1],
        BLOCK_N=config.prefill_block_n,
        DOT_PRECISION=c.dot_precision,
        **c.option_flags(),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _pick_num_splits(device: torch.device, num_programs: int, max_context_len: int,
                     block_n: int) -> int:
    """Enough splits to give every SM about two programs, never splits shorter than
    256 keys (or one tile), at most 16; a power of two to bound recompilations."""
    if device.type != "cuda":
        return 1
    want = triton.cdiv(2 * _num_sms(device), max(num_programs, 1))
    useful = triton.cdiv(max_context_len, max(256, block_n))
    n = max(1, min(want, useful, 16))
    return 1 << int(math.log2(n))


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int,
                 head_dim: int) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} must both be "
                         "[num_blocks, block_size, num_kv_heads, head_dim]")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"cache heads/dim {tuple(k_cache.shape[2:])} do not match "
                         f"({num_kv_heads}, {head_dim})")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' last dimension must be contiguous")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
