"""What every packed CPU projection holds for its small batches (cpu_linear.py, int8_linear.py):
the path the kernel table gives it (cpu_kernel_table.small_batch_path), its copy in that
path's form, and that copy as the C++ decode stack takes it (`DecodeForm`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_runner.kernels.block_quant import BlockForm, block_form, find_blocks
from model_runner.kernels.cpu_kernel_table import KernelPath, KernelTable, small_batch_path
from model_runner.kernels.cpu_kernels import cpu_kernels_available


@dataclass(frozen=True)
class DecodeForm:
    """A projection's small-batch copy as the C++ decode stack holds it
    (csrc/cpu_decode_stack.cpp): its path (cpu_kernel_table.PATHS: the stack's kind), its
    tensors in that path's order, its bias, its op's integer after the tensors (`argument`:
    int8 rows' rotation block, a GGUF's blocks' type code), and the same weight's form for
    batches of `batch_from` rows or more (`batch`; None: the stack runs no more rows than
    the path's)."""

    path: KernelPath
    tensors: tuple[torch.Tensor, ...]
    bias: torch.Tensor | None
    argument: int = 0
    batch: DecodeForm | None = None
    batch_from: int = 0

    @property
    def parts(self) -> tuple[DecodeForm, ...]:
        """The forms the stack runs for it, outputs side by side: itself."""
        return (self,)


@dataclass(frozen=True)
class SplitDecodeForm:
    """A projection the stack runs as its parts (SplitLinear's), one kernel call each, their
    outputs side by side."""

    parts: tuple[DecodeForm, ...]


ProjectionForm = DecodeForm | SplitDecodeForm


class SmallBatchPath:
    """What every packed projection holds for its small batches: its path
    (cpu_kernel_table.small_batch_path, None where the kernels are not built or none fits)
    and the most rows it runs there under the model's table (`use_table`), the weight's
    exact GGUF blocks in the path's form (`blocks`) or its row-major copy (`rows_weight`)."""

    path: KernelPath | None
    max_rows: int
    blocks: BlockForm | None
    rows_weight: torch.Tensor | None

    def _choose_path(self, weight: torch.Tensor, weight_dtype: str, table: KernelTable) -> None:
        kernels = cpu_kernels_available()
        found = find_blocks(weight) if kernels else None
        kind = None if found is None else found.kind
        self.path = small_batch_path(weight_dtype, kind, *weight.shape) if kernels else None
        self.blocks = None if found is None or self.path is None else block_form(found, self.path)
        self.rows_weight = None
        self.use_table(table)

    def use_table(self, table: KernelTable) -> None:
        """Run small batches up to the rows `table` gives this projection's path."""
        self.max_rows = table.rows(self.path)
