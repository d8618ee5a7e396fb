"""A float32 weight's exact block-quantized form, when it has one: the matvec's copy.

A model converted from a GGUF holds, as float32, the values of the GGUF's quantized
blocks: the default model's projections are Q4_1 (each block of 32 weights of a row is
d * q + m, q in 0..15, d and m float16 values) and its embedding, the tied LM head, Q8_0
(d * q, q in -127..127). `find_blocks` recovers d, m and q from the float32 values and
keeps them only if they give back every weight to the bit; the small-batch float32
matvec then reads 4.5 or 8.5 bits a weight instead of 32 (csrc/cpu_matvec_blocks.cpp),
with the float32 matvec's result to the bit. Weights off such a grid (a model saved in
float32 or bfloat16) get None and keep the float32 matvec. `int8_groups` lays the same
blocks out for `--weight-dtype int8`, `split_groups` for `--weight-dtype float16`
(csrc/cpu_matvec_blocks_int8.cpp).
"""

from __future__ import annotations

import torch

BLOCK = 32


class Q41Weight:
    """Q4_1 blocks: nibbles [out, in / 2] uint8, scales d and mins m [out, in / 32]."""

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        self.qs, self.d, self.m = qs, d, m

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.pagedserve.q4_1_matvec(x, self.qs, self.d, self.m, bias)


class Q80Weight:
    """Q8_0 blocks: int8 values [out, in], scales d [out, in / 32]."""

    def __init__(self, qs: torch.Tensor, d: torch.Tensor) -> None:
        self.qs, self.d = qs, d

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.pagedserve.q8_0_matvec(x, self.qs, self.d, bias)


BlockWeight = Q41Weight | Q80Weight

GROUP = 8  # output rows whose blocks `--weight-dtype int8` reads side by side
# a Q4_1 group's eight integer sums end in this order of its rows; its d and m are so stored
Q41_GROUP_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class Q41Groups:
    """Q4_1 blocks as `--weight-dtype int8` reads them: nibbles [out / 8, in / 32, 8, 16]
    uint8 (eight output rows' blocks at one input position side by side), d and m
    [out / 8, in / 32, 8] float16 in Q41_GROUP_ORDER: a GGUF's 20 bytes a block."""

    def __init__(self, blocks: Q41Weight) -> None:
        out, num_blocks = blocks.d.shape
        self.qs = _grouped(blocks.qs.view(out, num_blocks, 16))
        order = list(Q41_GROUP_ORDER)
        self.d = _grouped(blocks.d.half())[..., order].contiguous()
        self.m = _grouped(blocks.m.half())[..., order].contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x's rows quantized to int8 per block of 32, times the blocks' integers
        (csrc/cpu_matvec_blocks_int8.cpp): `--weight-dtype int8`'s small batches."""
        return torch.ops.pagedserve.q4_1_int8_matvec(x, self.qs, self.d, self.m, bias)


class Q41SplitGroups(Q41Groups):
    """The same groups times float32 activations split per block into three int8 planes
    (x ~ d (q0 + q1 / 254 + q2 / 254^2), to 2^-24 of the block's largest |x|;
    csrc/cpu_matvec_blocks_int8.cpp): float32's precision of the products at near int8's
    cost, where float32 multiply-adds on each weight made float are bound by their
    arithmetic: `--weight-dtype float16`'s small batches."""

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.pagedserve.q4_1_planes_matvec(x, self.qs, self.d, self.m, bias)


class Q80Groups:
    """Q8_0 blocks as `--weight-dtype int8` reads them: int8 values [out / 8, in / 32, 8,
    32], d [out / 8, in / 32, 8] float16: a GGUF's 34 bytes a block."""

    def __init__(self, blocks: Q80Weight) -> None:
        out, num_blocks = blocks.d.shape
        self.qs = _grouped(blocks.qs.view(out, num_blocks, BLOCK))
        self.d = _grouped(blocks.d.half())

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """As Q41Groups'."""
        return torch.ops.pagedserve.q8_0_int8_matvec(x, self.qs, self.d, bias)


BlockGroups = Q41Groups | Q80Groups


def int8_groups(blocks: BlockWeight | None) -> BlockGroups | None:
    """`blocks` laid out for `--weight-dtype int8`'s small batches, or None when there are
    none or their output rows do not come in eights."""
    if blocks is None or blocks.d.shape[0] % GROUP:
        return None
    return Q41Groups(blocks) if isinstance(blocks, Q41Weight) else Q80Groups(blocks)


def split_groups(blocks: BlockWeight | None) -> BlockWeight | Q41SplitGroups | None:
    """Q4_1 `blocks` whose output rows come in eights as Q41SplitGroups, other blocks as
    they are (the float matvec reads them)."""
    if isinstance(blocks, Q41Weight) and blocks.d.shape[0] % GROUP == 0:
        return Q41SplitGroups(blocks)
    return blocks


def _grouped(per_row: torch.Tensor) -> torch.Tensor:
    """[out, blocks, ...] -> [out / 8, blocks, 8, ...], contiguous."""
    out, num_blocks = per_row.shape[:2]
    return (per_row.reshape(out // GROUP, GROUP, num_blocks, *per_row.shape[2:])
            .transpose(1, 2).contiguous())


@torch.no_grad()
def find_blocks(weight: torch.Tensor) -> BlockWeight | None:
    """The exact Q4_1 or Q8_0 form of a float32 [out, in] weight, or None."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    blocks = weight.detach().reshape(weight.shape[0], -1, BLOCK)
    return _q4_1(blocks) or _q8_0(blocks)


def _is_float16(values: torch.Tensor) -> bool:
    return bool(torch.isfinite(values).all()) and torch.equal(values.half().float(), values)


def _q4_1(blocks: torch.Tensor) -> Q41Weight | None:
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
    return Q41Weight(nibbles.reshape(blocks.shape[0], -1).contiguous(), d.contiguous(),
                     m.contiguous())


def _q8_0(blocks: torch.Tensor) -> Q80Weight | None:
    d = (blocks.abs().amax(dim=-1) / 127).half().float()
    if not _is_float16(d):
        return None
    q = (blocks / torch.where(d == 0, 1.0, d)[..., None]).round_().clamp_(-127, 127)
    if not torch.equal(q * d[..., None], blocks):
        return None
    return Q80Weight(q.to(torch.int8).reshape(blocks.shape[0], -1).contiguous(), d.contiguous())
