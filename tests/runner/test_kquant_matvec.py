"""The small-batch kernels on a GGUF's K-quant blocks as the file stores them
(csrc/cpu_matvec_kquants.cpp): exact on the dequantized weights, i.e. x @ dequantize(W).T
up to the order of the float32 sums, with the weights dequantized by gguf-py itself
(gguf.quants.dequantize), not by the code under test.

gguf-py quantizes no K-quant type, so the blocks are random bytes with finite float16
scales: every bit pattern of the other bytes is a valid block."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from model_runner.kernels.cpu_kernel_table import MATVEC_MAX_ROWS
from model_runner.kernels.cpu_kernels import load_cpu_kernels

load_cpu_kernels()

# the op of each type, its kind for dequantize_k_, and where its float16 scales lie
TYPES = {
    "q4_k": (GGMLQuantizationType.Q4_K, 0, slice(0, 4)),  # d, dmin
    "q5_k": (GGMLQuantizationType.Q5_K, 1, slice(0, 4)),
    "q6_k": (GGMLQuantizationType.Q6_K, 2, slice(208, 210)),  # d
}


def random_blocks(kind: str, out_features: int, in_features: int, seed: int) -> np.ndarray:
    """[out, in / 256 * bytes] uint8: random blocks of `kind` with finite scales."""
    qtype, _, scales = TYPES[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (out_features, in_features // block, size), dtype=np.uint8)
    count = (scales.stop - scales.start) // 2
    halves = (rng.standard_normal((out_features, in_features // block, count)) * 1e-3)
    blocks[..., scales] = halves.astype(np.float16).view(np.uint8)
    return blocks.reshape(out_features, -1)


@pytest.mark.parametrize("kind", sorted(TYPES))
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 256), (37, 768), (130, 2048)])
def test_the_matvec_is_exact_on_gguf_pys_dequantized_weights(
    kind: str, out_features: int, in_features: int
) -> None:
    raw = random_blocks(kind, out_features, in_features, seed=out_features)
    weight = torch.from_numpy(dequantize(raw, TYPES[kind][0])).double()
    blocks = torch.from_numpy(raw)
    op = getattr(torch.ops.pagedserve, f"{kind}_matvec")
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
    """k_quant_gemm: any rows, a panel's odd last rows and x's odd last tile."""
    raw = random_blocks(kind, 103, 512, seed=5)
    weight = torch.from_numpy(dequantize(raw, TYPES[kind][0])).double()
    torch.manual_seed(5)
    bias = torch.randn(103)
    for rows in (1, 2, 3, 5, 9, 17, 40):
        x = torch.randn(rows, 1024)[:, :512]
        for b in (None, bias):
            y = torch.ops.pagedserve.k_quant_gemm(x, torch.from_numpy(raw), TYPES[kind][1], b)
            expected = x.double() @ weight.T + (0 if b is None else b.double())
            tolerance = 1e-6 * (x.double().abs() @ weight.abs().T).amax() + 1e-6
            assert (y.double() - expected).abs().amax() <= tolerance, rows


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_dequantize_gives_gguf_pys_values_to_the_bit(kind: str) -> None:
    raw = random_blocks(kind, 19, 512, seed=3)
    out = torch.empty(19, 512)
    torch.ops.pagedserve.dequantize_k_(out, torch.from_numpy(raw), TYPES[kind][1])
    assert torch.equal(out, torch.from_numpy(dequantize(raw, TYPES[kind][0])))


def test_bad_shapes_are_refused_by_name() -> None:
    blocks = torch.from_numpy(random_blocks("q4_k", 4, 512, seed=0))
    with pytest.raises(RuntimeError, match="q4_k_matvec: blocks must be"):
        torch.ops.pagedserve.q4_k_matvec(torch.randn(1, 256), blocks, None)
    with pytest.raises(RuntimeError, match="q4_k_matvec: x must be"):
        torch.ops.pagedserve.q4_k_matvec(torch.randn(9, 512), blocks, None)
