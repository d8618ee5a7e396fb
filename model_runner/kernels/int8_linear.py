"""W8A8 projections on the CPU (`--weight-dtype int8`): int8 weight rows turned by a
Hadamard rotation, times int8 activations, on AMX's int8 tiles or fbgemm's GEMM, their small
batches on the kernel table's path."""

from __future__ import annotations

import warnings

import torch

from model_runner.kernels.cpu_kernel_table import (
    DEFAULT_TABLE,
    PATHS,
    KernelTable,
    int8_tiles_granted,
)
from model_runner.kernels.cpu_kernels import cpu_kernels_available
from model_runner.kernels.small_batch import DecodeForm, SmallBatchPath


class Int8Linear(SmallBatchPath):
    """W8A8: int8 weights and int8 activations, rotated and scaled per token.

    A few activation channels of these models run 100-1000x wider than the rest, and
    one 8-bit grid cannot hold both. So each input row is first turned by a block-diagonal
    Hadamard rotation H (orthogonal, blocks of up to 64 channels; QuaRot's idea), which
    spreads an outsize channel over its whole block, and the weight's columns are turned
    the same way once at load: x W^T = (x H)(W H)^T. Each rotated row is then scaled to a
    largest magnitude of 1, so fbgemm's one grid per call serves every token alike; the
    weight gets a grid per output row. Products sum exactly in int32.

    A weight with exact GGUF blocks (the default model's, block_quant.py) already is small
    integers with a scale per block of 32: in small batches it is read as such (its output
    rows in groups of eight: q4_1_int8_matvec, q8_0_int8_matvec), 5 or 8.5 bits a weight
    instead of 8, times each row quantized to int8 per block (llama.cpp's arithmetic: no
    rotation needed, an outsize channel widens one block's grid only;
    csrc/cpu_matvec_blocks_int8.cpp). Larger batches take the rotated int8 rows: on AMX's
    int8 tiles where the host grants them (cpu_kernel_table.int8_tiles_granted: each
    rotated row of x on its own 8-bit grid, csrc/cpu_int8_amx.cpp), else on fbgemm's GEMM
    as above.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, table: KernelTable = DEFAULT_TABLE
    ) -> None:
        weight = weight.detach().float()
        self.block = rotation_block(weight.shape[1])
        self.rotation = hadamard(self.block)
        self.fused = self.block >= 8 and cpu_kernels_available()  # the C++ rotation
        quantized = quantized_rows(rotate(weight, self.rotation))
        self.weight_scales = quantized.q_per_channel_scales().float()
        # larger batches: AMX's int8 tiles where the host grants them (their own layout of
        # the int8 values), else fbgemm's packed copy
        self.tiles = (Int8Tiles(quantized.int_repr(), self.weight_scales, self.block)
                      if takes_int8_tiles(*weight.shape) else None)
        self.packed = (torch.ops.quantized.linear_prepack(quantized, None)
                       if self.tiles is None else None)
        self.bias = None if bias is None else bias.detach()
        # small batches: the weight's exact GGUF blocks times int8 activations where it has
        # them (block_quant.py), else the int8 matvec's copy: fbgemm's int8 values and
        # float32 scales, row-major
        self._choose_path(weight, "int8", table)
        if self.path is not None and self.path.name == "int8_matvec":
            self.rows_weight = quantized.int_repr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        small = x.shape[0] <= self.max_rows
        if small and self.blocks is not None:
            return self.blocks(x, self.bias)
        if small and self.rows_weight is not None:
            x, row_amax = self.rotate_and_scale(x)
            return torch.ops.pagedserve.int8_matvec(
                x, row_amax, self.rows_weight, self.weight_scales, self.bias
            )
        return self.gemm(x)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] (any N) on the batches' GEMM: AMX's tiles (rotated and quantized per
        row in C++), or fbgemm's on the rotated rows scaled to 1."""
        if self.tiles is not None:
            return self.tiles(x, self.bias)
        x, row_amax = self.rotate_and_scale(x)
        # reduce_range: 7-bit activations, so AVX2's pairwise 16-bit sums cannot saturate
        y = torch.ops.quantized.linear_dynamic(x, self.packed, True)
        y.mul_(row_amax)
        return y if self.bias is None else y.add_(self.bias)

    def decode_form(self) -> DecodeForm | None:
        if self.path is None or (self.blocks is None and not self.fused):
            return None  # (the stack rotates in C++ only)
        batch = None if self.tiles is None else self.tiles.decode_form(self.bias)
        batch_from = self.path.max_rows + 1
        if self.blocks is not None:
            return DecodeForm(self.path, self.blocks.tensors, self.bias, 0, batch, batch_from)
        return DecodeForm(self.path, (self.rows_weight, self.weight_scales), self.bias,
                          self.block, batch, batch_from)

    def rotate_and_scale(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of x [N, in] rotated, then divided by their largest magnitude [N, 1]
        (returned too): one pass in C++ (cpu_layers.cpp) where the kernels are built."""
        if self.fused:
            return torch.ops.pagedserve.hadamard_rows(x, self.block)
        x = rotate(x, self.rotation)
        row_amax = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)
        return x.div_(row_amax), row_amax


class Int8Tiles:
    """A weight's rotated int8 rows [out, in] as AMX's int8 tiles read them (int8_amx_pack),
    with their float32 scales [out]: batches of x on the host's matrix unit (int8_amx_gemm:
    each row of x rotated with `block` and rounded to int8 on its own grid in C++;
    `takes_int8_tiles` says where)."""

    def __init__(self, rows: torch.Tensor, weight_scales: torch.Tensor, block: int) -> None:
        self.tiles = torch.ops.pagedserve.int8_amx_pack(rows)
        self.weight_scales = weight_scales
        self.block = block

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        return torch.ops.pagedserve.int8_amx_gemm(x, self.block, self.tiles,
                                                  self.weight_scales, bias)

    def decode_form(self, bias: torch.Tensor | None) -> DecodeForm:
        """The tiles as the C++ decode stack runs them (a batch form)."""
        return DecodeForm(PATHS["int8_amx_gemm"], (self.tiles, self.weight_scales), bias,
                          self.block)


def takes_int8_tiles(out_features: int, in_features: int) -> bool:
    """Whether the kernels, the host and the shape take an [out, in] weight's rotated int8
    rows on AMX's tiles (`int8_tiles`)."""
    return (rotation_block(in_features) >= 8 and cpu_kernels_available()
            and int8_tiles_granted(out_features, in_features))


def int8_tiles(weight: torch.Tensor) -> Int8Tiles:
    """A float32 [out, in] weight as rotated int8 rows on AMX's tiles (`takes_int8_tiles`
    says where)."""
    block = rotation_block(weight.shape[1])
    quantized = quantized_rows(rotate(weight.detach().float(), hadamard(block)))
    return Int8Tiles(quantized.int_repr(), quantized.q_per_channel_scales().float(), block)


def rotation_block(in_features: int) -> int:
    """The Hadamard block that turns rows of `in_features`: the largest power of two that
    divides it, up to MAX_ROTATION_BLOCK."""
    return min(in_features & -in_features, MAX_ROTATION_BLOCK)


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [N, in] times the block-diagonal `rotation` (its one block): a new [N, in] tensor."""
    rows, block = x.shape[0], rotation.shape[0]
    return torch.matmul(x.reshape(rows, -1, block), rotation).view(rows, -1)


def quantized_rows(rotated: torch.Tensor) -> torch.Tensor:
    """Rotated weight rows on an int8 grid each (a torch qint8 tensor, per channel)."""
    scales = (rotated.abs().amax(dim=1) / 127).clamp(min=1e-12).double()  # [out]
    zero_points = torch.zeros(rotated.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # NOTE: torch marks its quantized tensor types deprecated; fbgemm's packed int8
        # GEMM still takes its weights as one.
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_channel(rotated, scales, zero_points, 0, torch.qint8)


MAX_ROTATION_BLOCK = 64


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal n x n Hadamard matrix (Sylvester's construction; n a power of two)."""
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < n:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return matrix / n**0.5
