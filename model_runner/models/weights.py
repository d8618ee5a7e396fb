"""Checkpoint weights as the models read them: whole, or only the slice one tensor-parallel
rank holds, from a tensor or a lazy safetensors slice (or rows of one, `RowRange`), or a
GGUF's blocks kept as the file has them (`FileBlocks`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from model_runner.kernels.block_quant import GGUFBlocks

# A checkpoint weight: a tensor, a safetensors slice (read only as far as indexed), a
# RowRange of either, or FileBlocks.
WeightSource = Any


def shape_of(source: WeightSource) -> tuple[int, ...]:
    return tuple(source.shape if isinstance(source, torch.Tensor) else source.get_shape())


def read(name: str, source: WeightSource, where: tuple[int, int, int, int] | None) -> torch.Tensor:
    """The whole of `source`, or its [start, stop) along dim (0 or 1) of `where` =
    (dim, start, stop, size), `size` being that dim's length in the checkpoint."""
    if where is None:
        return source[:]
    dim, start, stop, size = where
    shape = shape_of(source)
    if len(shape) <= dim or shape[dim] != size:
        raise ValueError(f"weight {name!r} has shape {shape}, expected {size} along dim {dim}")
    return source[start:stop] if dim == 0 else source[:, start:stop]


@dataclass(frozen=True)
class RowRange:
    """Rows [start, stop) of a checkpoint weight, indexed as the weight itself (one part of
    a weight the checkpoint fuses, such as Phi-3's qkv_proj); reads only what is indexed."""

    source: WeightSource
    start: int
    stop: int

    def get_shape(self) -> list[int]:
        return [self.stop - self.start, *shape_of(self.source)[1:]]

    def __getitem__(self, key: slice | tuple[slice, slice]) -> torch.Tensor:
        rows, cols = key if isinstance(key, tuple) else (key, None)
        picked = range(self.start, self.stop)[rows]
        if picked.step != 1:
            raise ValueError("a RowRange is read in contiguous rows")
        if cols is None:
            return self.source[picked.start : picked.stop]
        return self.source[picked.start : picked.stop, cols]


@dataclass(frozen=True)
class FileBlocks:
    """A weight in its GGUF file's blocks (gguf_file.py): a projection the model
    packs takes them as they are (cpu_linear.pack_linear's `parts`); any other reader
    indexes it as float32 values (gguf-py's, dequantized then)."""

    blocks: GGUFBlocks

    def get_shape(self) -> list[int]:
        return list(self.blocks.shape)

    def __getitem__(self, key: slice | tuple[slice, slice]) -> torch.Tensor:
        return self.blocks.dequantized()[key]
