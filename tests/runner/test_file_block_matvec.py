"""The kernels on a GGUF's blocks as the file stores them (csrc/cpu_matvec_file_blocks.cpp:
Q4_K, Q5_K, Q6_K, Q4_0, Q5_0, Q5_1, Q8_0): exact on the dequantized weights, i.e.
x @ dequantize(W).T up to the order of the float32 sums, with the weights dequantized by
gguf-py itself (gguf.quants.dequantize), not by the code under test.

The blocks are random bytes with finite float16 scales: every bit pattern of the other
bytes is a valid block (gguf-py quantizes no K-quant type)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from model_runner.kernels.block_quant import FILE_BLOCK_FORMS
from model_runner.kernels.cpu_kernel_table import MATVEC_MAX_ROWS
from model_runner.kernels.cpu_kernels import load_cpu_kernels
from model_runner.kernels.cpu_linear import BF16_GEMM_MIN_ROWS, FileBlocksLinear

load_cpu_kernels()

# each type's op, its kind for file_blocks_gemm and dequantize_file_blocks_, and where its
# float16 scales lie
Q = GGMLQuantizationType
TYPES = {
    "q4_k_matvec": (Q.Q4_K, 0, slice(0, 4)),  # d, dmin
    "q5_k_matvec": (Q.Q5_K, 1, slice(0, 4)),
    "q6_k_matvec": (Q.Q6_K, 2, slice(208, 210)),  # d
    "q4_0_matvec": (Q.Q4_0, 3, slice(0, 2)),  # d
    "q5_0_matvec": (Q.Q5_0, 4, slice(0, 2)),
    "q5_1_matvec": (Q.Q5_1, 5, slice(0, 4)),  # d, m
    "q8_0_file_matvec": (Q.Q8_0, 6, slice(0, 2)),
}
# widths: a multiple of each type's block (256 or 32), a Gemma 3 270M's 640 among them
WIDTHS = {256: (256, 768, 2048), 32: (32, 640, 2080)}


def random_blocks(kind: str, out_features: int, in_features: int, seed: int) -> np.ndarray:
    """[out, in / weights * bytes] uint8: random blocks of `kind` with finite scales."""
    qtype, _, scales = TYPES[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (out_features, in_features // block, size), dtype=np.uint8)
    count = (scales.stop - scales.start) // 2
    halves = (rng.standard_normal((out_features, in_features // block, count)) * 1e-3)
    blocks[..., scales] = halves.astype(np.float16).view(np.uint8)
    return blocks.reshape(out_features, -1)


@pytest.mark.parametrize("kind", sorted(TYPES))
@pytest.mark.parametrize(("out_features", "shape"), [(1, 0), (37, 1), (130, 2)])
def test_the_matvec_is_exact_on_gguf_pys_dequantized_weights(
    kind: str, out_features: int, shape: int
) -> None:
    in_features = WIDTHS[GGML_QUANT_SIZES[TYPES[kind][0]][0]][shape]
    raw = random_blocks(kind, out_features, in_features, seed=out_features)
    weight = torch.from_numpy(dequantize(raw, TYPES[kind][0])).double()
    blocks = torch.from_numpy(raw)
    op = getattr(torch.ops.pagedserve, kind)
    torch.manual_seed(out_features)
    bias = torch.randn(out_features)
    for rows in range(1, MATVEC_MAX_ROWS + 1):
        x = torch.randn(rows, 2 * in_features)[:, :in_features]  # strided rows
        for b in (None, bias):
            expected = x.double() @ weight.T + (0 if b is None else b.double())
            # float32 sums of in_features products, in another order than float64's
            tolerance = 1e-6 * (x.double().abs() @ weight.abs().T).amax() + 1e-6
            assert (op(x, blocks, b).double() - expected).abs().amax() <= tolerance


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_the_larger_batches_panels_are_exact_on_the_dequantized_weights(kind: str) -> None:
    """file_blocks_gemm: any rows, a panel's odd last rows and x's odd last tile."""
    in_features = 512 if GGML_QUANT_SIZES[TYPES[kind][0]][0] == 256 else 640
    raw = random_blocks(kind, 103, in_features, seed=5)
    weight = torch.from_numpy(dequantize(raw, TYPES[kind][0])).double()
    torch.manual_seed(5)
    bias = torch.randn(103)
    for rows in (1, 2, 3, 5, 9, 17, 40):
        x = torch.randn(rows, 2 * in_features)[:, :in_features]
        for b in (None, bias):
            y = torch.ops.pagedserve.file_blocks_gemm(x, torch.from_numpy(raw), TYPES[kind][1], b)
            expected = x.double() @ weight.T + (0 if b is None else b.double())
            tolerance = 1e-6 * (x.double().abs() @ weight.abs().T).amax() + 1e-6
            assert (y.double() - expected).abs().amax() <= tolerance, rows


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_dequantize_gives_gguf_pys_values_to_the_bit(kind: str) -> None:
    """Whole weights and gathered rows alike (an embedding lookup's)."""
    raw = random_blocks(kind, 19, 512, seed=3)
    expected = torch.from_numpy(dequantize(raw, TYPES[kind][0]))
    out = torch.empty(19, 512)
    torch.ops.pagedserve.dequantize_file_blocks_(out, torch.from_numpy(raw), TYPES[kind][1])
    assert torch.equal(out, expected)
    form = FILE_BLOCK_FORMS[TYPES[kind][0].name.lower()](torch.from_numpy(raw), 512)
    rows = torch.tensor([3, 0, 18, 3])
    assert torch.equal(form.dequantized(rows), expected[rows])


def test_bad_shapes_are_refused_by_name() -> None:
    blocks = torch.from_numpy(random_blocks("q4_k_matvec", 4, 512, seed=0))
    with pytest.raises(RuntimeError, match="q4_k_matvec: blocks must be"):
        torch.ops.pagedserve.q4_k_matvec(torch.randn(1, 256), blocks, None)
    with pytest.raises(RuntimeError, match="q4_k_matvec: x must be"):
        torch.ops.pagedserve.q4_k_matvec(torch.randn(9, 512), blocks, None)
    legacy = torch.from_numpy(random_blocks("q5_0_matvec", 4, 640, seed=0))
    with pytest.raises(RuntimeError, match=r"q5_0_matvec: blocks must be .* multiple of 32"):
        torch.ops.pagedserve.q5_0_matvec(torch.randn(1, 608), legacy, None)
    with pytest.raises(RuntimeError, match="file_blocks_gemm: kind 0..6"):
        torch.ops.pagedserve.file_blocks_gemm(torch.randn(1, 640), legacy, 7, None)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="oneDNN has no bfloat16 on this CPU")
def test_bfloat16_batches_run_on_the_weight_dequantized_for_the_call() -> None:
    """--weight-dtype bfloat16: from BF16_GEMM_MIN_ROWS rows, bfloat16's numbers (the
    weight and x rounded to bfloat16, float32 sums, the output rounded to bfloat16); fewer
    rows keep the exact paths; the blocks stay the one copy."""
    raw = random_blocks("q5_0_matvec", 96, 640, seed=7)
    weight = torch.from_numpy(dequantize(raw, Q.Q5_0))
    form = FILE_BLOCK_FORMS["q5_0"](torch.from_numpy(raw), 640)
    torch.manual_seed(7)
    bias = torch.randn(96)
    linear = FileBlocksLinear(form, bias, "bfloat16")
    for rows in (BF16_GEMM_MIN_ROWS - 1, BF16_GEMM_MIN_ROWS, 200):
        x = torch.randn(rows, 640)
        y = linear(x)
        if rows < BF16_GEMM_MIN_ROWS:
            assert torch.equal(y, form.gemm(x, bias))  # the exact float32 panels
            continue
        rounded = (x.to(torch.bfloat16).double() @ weight.to(torch.bfloat16).double().T)
        expected = rounded.to(torch.bfloat16).double() + bias.double()
        # the output's bfloat16 rounding (8 bits of mantissa) and float32 sums' order
        scale = (x.abs().double() @ weight.abs().double().T).amax()
        assert (y.double() - expected).abs().amax() <= 2**-7 * scale
        assert not torch.equal(y, form.gemm(x, bias))  # not the float32 panels
    assert linear.form.blocks.data_ptr() == form.blocks.data_ptr()
