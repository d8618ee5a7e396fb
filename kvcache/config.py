"""KV cache (block accounting) configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    """num_blocks blocks of block_size tokens; prefix caching on by default."""

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
