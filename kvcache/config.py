"""KV cache (block accounting) configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    """num_blocks blocks of block_size tokens; prefix caching on by default.

    sliding_window: set when every layer of the model attends only to its last
    `sliding_window` keys (the query's own included); a request's blocks that fall wholly
    behind it are then freed while the request runs. None (a model with any full-attention
    layer): a request holds all its blocks to its end.
    """

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError("sliding_window must be >= 1")
