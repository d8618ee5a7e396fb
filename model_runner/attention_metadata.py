"""The flat batch layout every attention backend reads.

A step's tokens are laid out flat: sequence i owns query rows
query_start_loc[i] .. query_start_loc[i+1]-1, whose positions are
context_lens[i] - query_len_i .. context_lens[i] - 1. Before attention, the new keys and
values are written into the paged cache at slot_mapping (slot = block * block_size +
offset); attention then reads every key and value of sequence i (context_lens[i] of them)
from the cache through block_tables[i], with the causal offset: query row at position p
sees keys at positions 0..p.

A backend may keep what it derives from the metadata once per step (and reuses in every
layer) in `scratch`; a new step brings a new AttentionMetadata, or empties the scratch of
a reused one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    context_lens: torch.Tensor  # [num_seqs] int32, cached + new tokens per sequence
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    max_query_len: int
    max_context_len: int
    num_decode_seqs: int = 0  # the first num_decode_seqs sequences have query_len == 1
    scratch: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])
