"""A float32 weight's exact block-quantized form, when it has one: the matvec's copy.

A model converted from a GGUF holds, as float32, the values of the GGUF's quantized
blocks: the default model's projections are Q4_1 (each block of 32 weights of a row is
d * q + m, q in 0..15, d and m float16 values) and its embedding, the tied LM head, Q8_0
(d * q, q in -127..127). `find_blocks` recovers d, m and q from the float32 values and
keeps them only if they give back every weight to the bit; the small-batch float32
matvec then reads 4.5 or 8.5 bits a weight instead of 32 (csrc/cpu_matvec_blocks.cpp),
with the float32 matvec's result to the bit. Weights off such a grid (a model saved in
float32 or bfloat16) get None and keep the float32 matvec. `block_form` lays the same
blocks out for the path cpu_kernel_table.py gives a weight dtype: in groups of eight output
rows for `--weight-dtype int8` and (Q4_1) `float16` (csrc/cpu_matvec_blocks_int8.cpp).

A GGUF's weights of the other types the kernels read (Q4_0, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K) are never float32 first: the GGUF reader hands their blocks over as the file stores
them (`GGUFBlocks`, csrc/cpu_matvec_file_blocks.cpp), a fused projection's parts in runs
of one type (`block_runs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from model_runner.kernels.cpu_kernel_table import KernelPath

BLOCK = 32


class BlockForm:
    """A weight's blocks as one small-batch path reads them (cpu_kernel_table.PATHS): called
    with x [N, in] and a bias, its path's op on x and `tensors`, in the path's order."""

    path: ClassVar[str]
    tensors: tuple[torch.Tensor, ...]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return getattr(torch.ops.pagedserve, self.path)(x, *self.tensors, bias)


class Q41Blocks(BlockForm):
    """Q4_1 blocks: nibbles [out, in / 2] uint8, scales d and mins m [out, in / 32]; the
    float32 matvec's numbers (csrc/cpu_matvec_blocks.cpp)."""

    path = "q4_1_matvec"
    kind: ClassVar[str] = "q4_1"  # its key in cpu_kernel_table.SMALL_BATCH_PATHS

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        self.qs, self.d, self.m = qs, d, m
        self.tensors = (qs, d, m)


class Q80Blocks(BlockForm):
    """Q8_0 blocks: int8 values [out, in], scales d [out, in / 32]."""

    path = "q8_0_matvec"
    kind: ClassVar[str] = "q8_0"

    def __init__(self, qs: torch.Tensor, d: torch.Tensor) -> None:
        self.qs, self.d = qs, d
        self.tensors = (qs, d)


class GGUFBlocks(BlockForm):
    """A GGUF's blocks as the file stores them (Q4_0, Q5_0, Q5_1, Q8_0: blocks of 32
    weights; Q4_K, Q5_K, Q6_K: super-blocks of 256): [out, in / weights * bytes] uint8, read
    from the mapped file (csrc/cpu_matvec_file_blocks.cpp, csrc/block_formats.h). No
    float32 values exist to find them in: the GGUF reader hands them over (gguf_file.py)."""

    kind: ClassVar[str]  # its key in cpu_kernel_table.FILE_BLOCK_TYPES
    code: ClassVar[int]  # the kernels' number for the type (file_blocks_gemm and dequantize)
    weights_per_block: ClassVar[int]
    bytes_per_block: ClassVar[int]

    def __init__(self, blocks: torch.Tensor, in_features: int) -> None:
        self.blocks, self.in_features = blocks, in_features
        self.tensors = (blocks,)

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.in_features

    def gemm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [N, in] (any N) times the weight: its panels dequantized on the fly."""
        return torch.ops.pagedserve.file_blocks_gemm(x, self.blocks, self.code, bias)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 [out, in] weight (gguf-py's values to the bit), or only its `rows`
        (int64 indices: an embedding lookup's)."""
        blocks = self.blocks if rows is None else self.blocks.index_select(0, rows)
        out = torch.empty(blocks.shape[0], self.in_features)
        torch.ops.pagedserve.dequantize_file_blocks_(out, blocks, self.code)
        return out


class Q4KBlocks(GGUFBlocks):
    path, kind, code, weights_per_block, bytes_per_block = "q4_k_matvec", "q4_k", 0, 256, 144


class Q5KBlocks(GGUFBlocks):
    path, kind, code, weights_per_block, bytes_per_block = "q5_k_matvec", "q5_k", 1, 256, 176


class Q6KBlocks(GGUFBlocks):
    path, kind, code, weights_per_block, bytes_per_block = "q6_k_matvec", "q6_k", 2, 256, 210


class Q40FileBlocks(GGUFBlocks):
    path, kind, code, weights_per_block, bytes_per_block = "q4_0_matvec", "q4_0", 3, 32, 18


class Q50FileBlocks(GGUFBlocks):
    path, kind, code, weights_per_block, bytes_per_block = "q5_0_matvec", "q5_0", 4, 32, 22


class Q51FileBlocks(GGUFBlocks):
    path, kind, code, weights_per_block, bytes_per_block = "q5_1_matvec", "q5_1", 5, 32, 24


class Q80FileBlocks(GGUFBlocks):
    path, kind, code, weights_per_block, bytes_per_block = (
        "q8_0_file_matvec", "q8_0_file", 6, 32, 34)


# a GGUF type's name (gguf-py's, lower case) -> the form its blocks are kept in
FILE_BLOCK_FORMS: dict[str, type[GGUFBlocks]] = {
    form.kind.removesuffix("_file"): form for form in (
        Q4KBlocks, Q5KBlocks, Q6KBlocks, Q40FileBlocks, Q50FileBlocks, Q51FileBlocks,
        Q80FileBlocks)}

Blocks = Q41Blocks | Q80Blocks | GGUFBlocks

GROUP = 8  # output rows whose blocks the grouped paths read side by side
# a Q4_1 group's eight integer sums end in this order of its rows; its d and m are so stored
Q41_GROUP_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class Q41Groups(BlockForm):
    """Q4_1 blocks in groups: nibbles [out / 8, in / 32, 8, 16] uint8 (eight output rows'
    blocks at one input position side by side), d and m [out / 8, in / 32, 8] float16 in
    Q41_GROUP_ORDER: a GGUF's 20 bytes a block (csrc/cpu_matvec_blocks_int8.cpp)."""

    def __init__(self, blocks: Q41Blocks) -> None:
        out, num_blocks = blocks.d.shape
        self.qs = _grouped(blocks.qs.view(out, num_blocks, 16))
        order = list(Q41_GROUP_ORDER)
        self.d = _grouped(blocks.d.half())[..., order].contiguous()
        self.m = _grouped(blocks.m.half())[..., order].contiguous()
        self.tensors = (self.qs, self.d, self.m)


class Q41Int8Groups(Q41Groups):
    """The groups times x's rows quantized to int8 per block of 32: `--weight-dtype
    int8`'s small batches."""

    path = "q4_1_int8_matvec"


class Q41PlanesGroups(Q41Groups):
    """The groups times float32 activations split per block into three int8 planes
    (x ~ d (q0 + q1 / 254 + q2 / 254^2), to 2^-24 of the block's largest |x|): float32's
    precision of the products at near int8's cost, where float32 multiply-adds on each
    weight made float are bound by their arithmetic: `--weight-dtype float16`'s small
    batches."""

    path = "q4_1_planes_matvec"


class Q80Int8Groups(BlockForm):
    """Q8_0 blocks in groups: int8 values [out / 8, in / 32, 8, 32], d [out / 8, in / 32, 8]
    float16 (a GGUF's 34 bytes a block), times x's rows quantized to int8 per block of 32:
    `--weight-dtype int8`'s small batches."""

    path = "q8_0_int8_matvec"

    def __init__(self, blocks: Q80Blocks) -> None:
        out, num_blocks = blocks.d.shape
        self.qs = _grouped(blocks.qs.view(out, num_blocks, BLOCK))
        self.d = _grouped(blocks.d.half())
        self.tensors = (self.qs, self.d)


# each path that reads blocks -> the form it reads them in
_FORMS: dict[str, type[BlockForm]] = {form.path: form for form in (
    Q41Blocks, Q80Blocks, Q41Int8Groups, Q80Int8Groups, Q41PlanesGroups,
    *FILE_BLOCK_FORMS.values())}


def block_form(blocks: Blocks, path: KernelPath) -> BlockForm | None:
    """`blocks` laid out for `path` (cpu_kernel_table.small_batch_path), or None for a path
    that reads no blocks (the float or int8 rows)."""
    form = _FORMS.get(path.name)
    if form is None or isinstance(blocks, form):
        return None if form is None else blocks
    return form(blocks)  # type: ignore[call-arg]  # a grouped form, from the blocks


def block_runs(
    parts: Sequence[tuple[int, GGUFBlocks]], shape: tuple[int, ...]
) -> list[GGUFBlocks] | None:
    """The GGUF blocks of an [out, in] weight given as parts (row offset, blocks; a fused
    projection's q, k and v), in runs of one type (adjacent parts of a type joined), or None
    unless they cover every row."""
    ordered = sorted(parts, key=lambda part: part[0])
    runs: list[list[GGUFBlocks]] = []
    row = 0
    for offset, blocks in ordered:
        if offset != row or blocks.in_features != shape[1]:
            return None
        row += blocks.shape[0]
        if runs and type(runs[-1][0]) is type(blocks):
            runs[-1].append(blocks)
        else:
            runs.append([blocks])
    if not runs or row != shape[0]:
        return None
    return [run[0] if len(run) == 1 else type(run[0])(
        torch.cat([blocks.blocks for blocks in run]), run[0].in_features) for run in runs]


def _grouped(per_row: torch.Tensor) -> torch.Tensor:
    """[out, blocks, ...] -> [out / 8, blocks, 8, ...], contiguous."""
    out, num_blocks = per_row.shape[:2]
    return (per_row.reshape(out // GROUP, GROUP, num_blocks, *per_row.shape[2:])
            .transpose(1, 2).contiguous())


@torch.no_grad()
def find_blocks(weight: torch.Tensor) -> Blocks | None:
    """The exact Q4_1 or Q8_0 form of a float32 [out, in] weight, or None."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    blocks = weight.detach().reshape(weight.shape[0], -1, BLOCK)
    return _q4_1(blocks) or _q8_0(blocks)


def _is_float16(values: torch.Tensor) -> bool:
    return bool(torch.isfinite(values).all()) and torch.equal(values.half().float(), values)


def _q4_1(blocks: torch.Tensor) -> Q41Blocks | None:
    m = blocks.amin(dim=-1)
    if not _is_float16(m):
        return None
    d = ((blocks.amax(dim=-1) - m) / 15).half().float()
    if not _is_float16(d):
        return None
    q = ((blocks - m[..., None]) / torch.where(d == 0, 1.0, d)[..., None]).round_().clamp_(0, 15)
    if not torch.equal(q * d[..., None] + m[..., None], blocks):
        return None
    q = q.to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    return Q41Blocks(nibbles.reshape(blocks.shape[0], -1).contiguous(), d.contiguous(),
                     m.contiguous())


def _q8_0(blocks: torch.Tensor) -> Q80Blocks | None:
    d = (blocks.abs().amax(dim=-1) / 127).half().float()
    if not _is_float16(d):
        return None
    q = (blocks / torch.where(d == 0, 1.0, d)[..., None]).round_().clamp_(-127, 127)
    if not torch.equal(q * d[..., None], blocks):
        return None
    return Q80Blocks(q.to(torch.int8).reshape(blocks.shape[0], -1).contiguous(), d.contiguous())
