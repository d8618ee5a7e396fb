"""Int8Linear's larger batches on AMX's int8 tiles (csrc/cpu_int8_amx.cpp), where the host
has them: each row of x rotated (hadamard_rows), rounded to int8 on the grid 1 / 127 of its
largest magnitude, its byte products with the rotated int8 weight rows summed exactly, then
scaled by the row's and the weight row's scales. The test repeats that in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model_runner.kernels.cpu_kernels import load_cpu_kernels
from model_runner.kernels.cpu_linear import pack_linear
from model_runner.kernels.int8_linear import Int8Linear

load_cpu_kernels()

needs_amx = pytest.mark.skipif(not torch.ops.pagedserve.amx_int8_granted(),
                               reason="the host grants no AMX int8 tiles")
ops = torch.ops.pagedserve


def _int8_rows(out_features: int, in_features: int, seed: int
               ) -> tuple[Int8Linear, torch.Tensor]:
    """Int8Linear of a random weight with a bias, and the float32 weight."""
    torch.manual_seed(seed)
    weight = torch.randn(out_features, in_features) * 0.05
    packed = pack_linear(weight, torch.randn(out_features), "int8")
    assert isinstance(packed, Int8Linear)
    return packed, weight


def _per_row_reference(packed: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """What the tiles compute, in float64, from the same rotation and roundings."""
    turned, row_amax = ops.hadamard_rows(x, packed.block)
    qx = torch.round(turned * 127).double()  # nearest even, as the kernel's nearbyint
    weight = packed.rows_weight.double() * packed.weight_scales.double()[:, None]
    return qx @ weight.T * (row_amax.double() / 127) + packed.bias.double()


@needs_amx
@pytest.mark.parametrize(("out_features", "in_features"), [(48, 64), (960, 576), (32, 1536)])
@torch.inference_mode()
def test_int8_batches_on_amx_tiles_put_each_row_on_its_own_grid(out_features: int,
                                                                 in_features: int) -> None:
    # 48 output rows: a pair of groups of 16 and one alone; rows of x: a part of a tile,
    # one tile, two tiles and a part (pairs of tiles and one alone)
    packed, _ = _int8_rows(out_features, in_features, seed=in_features)
    assert packed.tiles is not None and packed.packed is None  # no fbgemm copy kept
    torch.manual_seed(1)
    for rows in (1, 5, 16, 37):
        x = torch.randn(rows, 2 * in_features)[:, :in_features]  # strided rows
        x[:, 3] *= 40  # an outsize channel, spread by the rotation
        x[0] = 0  # a zero row stays zero (then bias)
        got = packed.gemm(x)
        expected = _per_row_reference(packed, x)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[0], packed.bias)
        # one grid per row: a row's result does not depend on the rows beside it
        assert torch.equal(packed.gemm(x[rows - 1 :]), got[rows - 1 :])


@needs_amx
@torch.inference_mode()
def test_int8_rows_on_amx_tiles_follow_float32_on_every_row() -> None:
    packed, weight = _int8_rows(960, 576, seed=3)
    torch.manual_seed(4)
    x = torch.randn(40, 576)
    x[:, 7] *= 50
    x[5] *= 1000  # a loud token beside quiet ones
    exact = F.linear(x, weight, packed.bias)
    got = packed(x)
    assert torch.equal(got, packed.gemm(x))  # past the small-batch rows
    errors = (got - exact).norm(dim=1) / exact.norm(dim=1)
    # measured 0.7-1.2%: the weight's int8 grid, mostly
    assert errors.max() < 0.02, errors.max()


@needs_amx
def test_int8_amx_gemm_refuses_what_it_cannot_read() -> None:
    packed, _ = _int8_rows(32, 64, seed=5)
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="int8 tiles"):
        ops.int8_amx_gemm(x, 64, packed.rows_weight, packed.weight_scales, None)
    with pytest.raises(RuntimeError, match="int8 tiles"):
        ops.int8_amx_gemm(torch.randn(3, 128), 64, packed.tiles.tiles, packed.weight_scales,
                          None)
    with pytest.raises(RuntimeError, match="power of two"):
        ops.int8_amx_gemm(x, 48, packed.tiles.tiles, packed.weight_scales, None)
    with pytest.raises(RuntimeError, match="weight_scales"):
        ops.int8_amx_gemm(x, 64, packed.tiles.tiles, packed.weight_scales[:16], None)
    with pytest.raises(RuntimeError, match="out a multiple of 16"):
        ops.int8_amx_pack(torch.zeros(24, 64, dtype=torch.int8))


@torch.inference_mode()
def test_int8_rows_the_tiles_cannot_take_keep_fbgemm() -> None:
    # out 33 (not a multiple of 16), in 40 (not of 64): fbgemm on any host
    packed, weight = _int8_rows(33, 40, seed=6)
    assert packed.tiles is None and packed.packed is not None
    x = torch.randn(12, 40)
    exact = F.linear(x, weight, packed.bias)
    assert ((packed(x) - exact).norm() / exact.norm()) < 0.02


def _butterflies(x: torch.Tensor, block: int) -> tuple[np.ndarray, np.ndarray]:
    """hadamard_rows in float32, one butterfly round at a time in Sylvester's order."""
    v = x.numpy().astype(np.float32).reshape(x.shape[0], -1, block).copy()
    h = 1
    while h < block:
        pairs = v.reshape(*v.shape[:2], block // (2 * h), 2, h)
        a, b = pairs[..., 0, :].copy(), pairs[..., 1, :].copy()
        pairs[..., 0, :], pairs[..., 1, :] = a + b, a - b
        h *= 2
    v = v.reshape(x.shape[0], -1)
    norm = np.float32(1) / np.sqrt(np.float32(block))
    row_max = np.maximum(np.abs(v).max(axis=1) * norm, np.float32(1e-12))
    return v * (norm / row_max)[:, None], row_max


@pytest.mark.parametrize(("block", "width"), [(8, 40), (16, 48), (64, 576), (64, 1536)])
def test_the_rotation_in_cpp_is_the_butterflies_to_the_bit(block: int, width: int) -> None:
    # vectorized, the rounds within eight values are shuffles: a + b and a - b all the same
    torch.manual_seed(width)
    x = torch.randn(5, width) * 3
    got, row_max = ops.hadamard_rows(x, block)
    expected, expected_max = _butterflies(x, block)
    assert np.array_equal(got.numpy(), expected)
    assert np.array_equal(row_max.numpy()[:, 0], expected_max)
