"""The int8-activation kernels on a GGUF's blocks (csrc/cpu_matvec_file_blocks_int8.cpp),
held against gguf-py's own dequantize on random blocks of each type.

Each row of x is quantized per 32 values in two int8 planes, x ~ d (254 q0 + q1) with
d = max|x| / 127 / 254 (q0 rounded to nearest even, q1 the residual rounded), which the
test repeats with numpy: the kernel's result is then x's rounded values @ dequantize(W).T
up to float32's sums, and its distance from x @ W.T is x's rounding, at most half of d a
value (1/254 of one int8 plane's), which the test also bounds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

from model_runner.kernels.cpu_kernel_table import MATVEC_MAX_ROWS, small_batch_path
from model_runner.kernels.cpu_kernels import load_cpu_kernels
from tests.runner.test_file_block_matvec import TYPES, WIDTHS, random_blocks

load_cpu_kernels()

ROOT = Path(__file__).resolve().parents[2]
INT8_OPS = {name.replace("_matvec", "_int8_matvec"): name for name in TYPES}


def quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the kernel rounds it (float64) and a bound on each value's rounding."""
    blocks = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    d = amax / np.float32(127)
    inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), np.float32(0))
    q0 = np.clip(np.rint(blocks * inverse.astype(np.float32)), -127, 127)
    residual = blocks.astype(np.float64) - d.astype(np.float64) * q0
    to_second = np.where(d > 0, 254.0 / np.where(d > 0, d, 1).astype(np.float64), 0.0)
    q1 = np.clip(np.rint(residual * to_second), -127, 127)
    unit = (d / np.float32(254)).astype(np.float32).astype(np.float64)
    rounded = (unit * (254 * q0 + q1)).reshape(x.shape)
    bound = (np.broadcast_to(unit / 2, blocks.shape).reshape(x.shape)
             + 2.0**-22 * np.abs(x.numpy().astype(np.float64)))
    return torch.from_numpy(rounded), torch.from_numpy(bound)


@pytest.mark.parametrize("op_name", sorted(INT8_OPS))
@pytest.mark.parametrize(("out_features", "shape"), [(1, 0), (37, 1), (130, 2)])
def test_int8_activations_on_gguf_pys_dequantized_weights(
    op_name: str, out_features: int, shape: int
) -> None:
    exact = INT8_OPS[op_name]
    in_features = WIDTHS[GGML_QUANT_SIZES[TYPES[exact][0]][0]][shape]
    raw = random_blocks(exact, out_features, in_features, seed=out_features + 1)
    weight = torch.from_numpy(dequantize(raw, TYPES[exact][0])).double()
    blocks = torch.from_numpy(raw)
    op = getattr(torch.ops.pagedserve, op_name)
    torch.manual_seed(out_features)
    bias = torch.randn(out_features)
    for rows in range(1, MATVEC_MAX_ROWS + 1):
        x = torch.randn(rows, 2 * in_features)[:, :in_features]  # strided rows
        x[0, :32] = 0  # a block of zeros: d_x = 0
        for b in (None, bias):
            assert_the_planes_arithmetic(op(x, blocks, b), x, weight, b)


def assert_the_planes_arithmetic(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                 bias: torch.Tensor | None) -> None:
    """y, a kernel's x @ W.T + bias on x in two int8 planes, is its own arithmetic: float32
    sums of the rounded x's products; and x's rounding is all that parts it from x @ W.T."""
    rounded, half_step = quantized_activations(x)
    y = y.double()
    offset = 0 if bias is None else bias.double()
    sums = 2e-6 * (rounded.abs() @ weight.abs().T).amax() + 1e-6
    assert (y - (rounded @ weight.T + offset)).abs().amax() <= sums
    bound = half_step @ weight.abs().T + sums
    assert ((y - (x.double() @ weight.T + offset)).abs() <= bound).all()


def test_bad_shapes_are_refused_by_name() -> None:
    blocks = torch.from_numpy(random_blocks("q4_k_matvec", 4, 512, seed=0))
    with pytest.raises(RuntimeError, match="q4_k_int8_matvec: blocks must be"):
        torch.ops.pagedserve.q4_k_int8_matvec(torch.randn(1, 256), blocks, None)
    with pytest.raises(RuntimeError, match="q4_k_int8_matvec: x must be"):
        torch.ops.pagedserve.q4_k_int8_matvec(torch.randn(9, 512), blocks, None)


def cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


@pytest.mark.skipif(not {"avx512_vnni", "avx512vl", "avx512bw"} <= cpu_flags(),
                    reason="the host has no AVX-512 VNNI")
def test_a_vnni_host_runs_the_vnni_kernels() -> None:
    assert torch.ops.pagedserve.file_blocks_int8_isa() == "avx512_vnni"


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="the kernels are not built for AVX2 here")
def test_a_files_blocks_take_int8_planes_by_default_but_q8_0_and_exact_sums_under_float16() -> None:
    assert small_batch_path("auto", "q5_0", 2048, 640).name == "q5_0_int8_matvec"
    assert small_batch_path("int8", "q4_k", 640, 1024).name == "q4_k_int8_matvec"
    assert small_batch_path("auto", "q8_0_file", 262144, 640).name == "q8_0_file_matvec"
    assert small_batch_path("int8", "q8_0_file", 262144, 640).name == "q8_0_file_int8_matvec"
    assert small_batch_path("float16", "q6_k", 640, 2048).name == "q6_k_matvec"
    assert torch.ops.pagedserve.file_blocks_int8_isa() in ("avx2", "avx512_vnni")


AVX2_RUN = """
import sys, torch
from model_runner.kernels.cpu_kernels import load_cpu_kernels
load_cpu_kernels()
from tests.runner.test_file_block_int8_matvec import inputs
print(torch.ops.pagedserve.file_blocks_int8_isa())
torch.save([getattr(torch.ops.pagedserve, op)(x, w, None) for op, x, w in inputs()], sys.argv[1])
"""


def inputs() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Each op with three rows of x and 37 output rows of random blocks."""
    cases = []
    for i, op_name in enumerate(sorted(INT8_OPS)):
        exact = INT8_OPS[op_name]
        in_features = WIDTHS[GGML_QUANT_SIZES[TYPES[exact][0]][0]][1]
        blocks = torch.from_numpy(random_blocks(exact, 37, in_features, seed=i))
        cases.append((op_name, torch.randn(3, in_features, generator=torch.Generator()
                                           .manual_seed(i)), blocks))
    return cases


@pytest.mark.skipif(torch.ops.pagedserve.file_blocks_int8_isa() != "avx512_vnni",
                    reason="the AVX2 kernels are the only ones here")
def test_the_avx2_kernels_give_the_vnni_kernels_numbers(tmp_path: Path) -> None:
    """The same int32 byte-product sums by maddubs and madd (PAGEDSERVE_NO_VNNI, in a
    process of its own) as by vpdpbusd, then the same float32 steps: equal to the bit."""
    out = tmp_path / "avx2.pt"
    env = {**os.environ, "PAGEDSERVE_NO_VNNI": "1"}
    run = subprocess.run([sys.executable, "-c", AVX2_RUN, str(out)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True)
    assert run.stdout.split()[-1] == "avx2"
    for (op_name, x, blocks), theirs in zip(inputs(), torch.load(out), strict=True):
        assert torch.equal(getattr(torch.ops.pagedserve, op_name)(x, blocks, None), theirs)


AMX_HOST = {"amx_tile", "amx_int8"} <= cpu_flags()


@pytest.mark.skipif(not AMX_HOST, reason="the host has no AMX int8 tiles")
@pytest.mark.parametrize("op_name", sorted(INT8_OPS))
def test_batches_on_amx_tiles_are_the_int8_planes_arithmetic(op_name: str) -> None:
    # 48 output rows: three groups of 16; 37 rows of x: two full tiles and a part
    assert torch.ops.pagedserve.amx_int8_granted()
    exact = INT8_OPS[op_name]
    kind, code, _ = TYPES[exact]  # code: the kernels' number of the type
    in_features = WIDTHS[GGML_QUANT_SIZES[kind][0]][1]
    raw = random_blocks(exact, 48, in_features, seed=len(op_name))
    weight = torch.from_numpy(dequantize(raw, kind)).double()
    blocks = torch.from_numpy(raw)
    torch.manual_seed(3)
    bias = torch.randn(48)
    for rows in (1, 4, 16, 37):
        x = torch.randn(rows, 2 * in_features)[:, :in_features]  # strided rows
        x[0, :32] = 0
        for b in (None, bias):
            assert_the_planes_arithmetic(
                torch.ops.pagedserve.file_blocks_amx_gemm(x, blocks, code, b), x, weight, b)
        if rows <= MATVEC_MAX_ROWS:  # the matvec's numbers but for the order of the sums
            assert torch.allclose(torch.ops.pagedserve.file_blocks_amx_gemm(x, blocks, code, bias),
                                  getattr(torch.ops.pagedserve, op_name)(x, blocks, bias),
                                  rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not AMX_HOST, reason="the host has no AMX int8 tiles")
def test_a_q8_0_weight_takes_amx_tiles_from_four_rows_and_refuses_bad_shapes() -> None:
    from model_runner.kernels.block_quant import Q80FileBlocks
    from model_runner.kernels.cpu_linear import FileBlocksLinear

    raw = torch.from_numpy(random_blocks("q8_0_file_matvec", 32, 64, seed=3))
    linear = FileBlocksLinear(Q80FileBlocks(raw, 64), None, "auto")
    assert linear.max_rows == 3 and linear.matrix_unit is not None
    x = torch.randn(6, 64)
    assert torch.equal(linear(x), torch.ops.pagedserve.file_blocks_amx_gemm(x, raw, 6, None))
    # the exact path below
    assert torch.equal(linear(x[:3]), torch.ops.pagedserve.q8_0_file_matvec(x[:3], raw, None))
    with pytest.raises(RuntimeError, match="file_blocks_amx_gemm: blocks must be"):
        torch.ops.pagedserve.file_blocks_amx_gemm(
            x, torch.from_numpy(random_blocks("q8_0_file_matvec", 8, 64, seed=4)), 6, None)
    with pytest.raises(RuntimeError, match="file_blocks_amx_gemm: kind 0..6"):
        torch.ops.pagedserve.file_blocks_amx_gemm(x, raw, 7, None)


@pytest.mark.skipif(not AMX_HOST, reason="the host has no AMX int8 tiles")
def test_a_q6_k_weight_takes_amx_tiles_past_the_matvecs_rows() -> None:
    # Q6_K's scale per 16 halves each tile product, yet the tiles beat its float panels
    from model_runner.kernels.block_quant import Q6KBlocks
    from model_runner.kernels.cpu_linear import FileBlocksLinear

    raw = torch.from_numpy(random_blocks("q6_k_matvec", 32, 256, seed=6))
    linear = FileBlocksLinear(Q6KBlocks(raw, 256), None, "auto")
    assert linear.max_rows == MATVEC_MAX_ROWS and linear.matrix_unit is not None
    x = torch.randn(MATVEC_MAX_ROWS + 1, 256)
    assert torch.equal(linear(x), torch.ops.pagedserve.file_blocks_amx_gemm(x, raw, 2, None))


NO_AMX_RUN = """
import torch
from model_runner.kernels.cpu_kernels import load_cpu_kernels
load_cpu_kernels()
from model_runner.kernels.block_quant import Q80FileBlocks
from model_runner.kernels.cpu_linear import FileBlocksLinear
from tests.runner.test_file_block_matvec import random_blocks
raw = torch.from_numpy(random_blocks("q8_0_file_matvec", 32, 64, seed=3))
linear = FileBlocksLinear(Q80FileBlocks(raw, 64), None, "auto")
x = torch.randn(16, 64)
assert not torch.ops.pagedserve.amx_int8_granted() and linear.matrix_unit is None
assert linear.max_rows == 8
assert torch.equal(linear(x), torch.ops.pagedserve.file_blocks_gemm(x, raw, 6, None))
try:
    torch.ops.pagedserve.file_blocks_amx_gemm(x, raw, 6, None)
except RuntimeError as e:
    print("refused:", "no AMX int8 tiles granted" in str(e))
"""


def test_without_amx_q8_0_keeps_the_exact_matvec_and_the_panels() -> None:
    # PAGEDSERVE_NO_AMX stands for a host (or a kernel) that does not grant the tiles
    env = {**os.environ, "PAGEDSERVE_NO_AMX": "1"}
    run = subprocess.run([sys.executable, "-c", NO_AMX_RUN], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True)
    assert run.stdout.split()[-1] == "True", run.stdout + run.stderr[-2000:]
