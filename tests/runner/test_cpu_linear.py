"""CPU projections on packed weights (model_runner/kernels/cpu_linear.py) against nn.Linear.

oneDNN float32 must give nn.Linear's numbers at every padded row count; float16 weights
must give nn.Linear's numbers on the weights rounded to float16, so that a tiny model
served on them generates exactly what Hugging Face generates from the rounded weights.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from model_runner.config import WEIGHT_DTYPES, ModelConfig
from model_runner.kernels.cpu_kernel_table import (
    GEMMS,
    INT8_MATVEC_MAX_ROWS,
    MATVEC_MAX_ROWS,
    PATHS,
    SMALL_BATCH_PATHS,
    small_batch_path,
)
from model_runner.kernels.cpu_kernels import load_cpu_kernels
from model_runner.kernels.cpu_linear import can_pack, matvec_weight, pack_linear, padded_rows
from model_runner.kernels.int8_linear import Int8Linear, hadamard
from model_runner.loader import load_model
from model_runner.models.layers import Linear
from tests.support.model_helpers import (
    CONFIGS,
    RunnerLoop,
    TinyModel,
    greedy_seqs,
    make_model_folder,
    prompts,
)
from tests.support.quality import prefill

CPU = torch.device("cpu")
load_cpu_kernels()  # registers torch.ops.pagedserve.matvec
needs_onednn = pytest.mark.skipif(
    not can_pack(CPU, torch.float32, "auto"), reason="torch built without oneDNN"
)
needs_fbgemm = pytest.mark.skipif(
    not can_pack(CPU, torch.float32, "float16"), reason="torch built without fbgemm"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 5, 9, 63, 64, 65, 100, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_plain(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = Linear(48, 80, bias=bias)
    x = torch.randn(rows, 48)
    expected = F.linear(x, linear.weight, linear.bias)
    linear.pack("auto")
    with torch.inference_mode():
        got = linear(x)
    assert got.shape == (rows, 80)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert linear.weight.numel() == 0  # the parameter's storage is released once packed


def test_row_buckets_are_few_and_cover_every_count() -> None:
    buckets = {padded_rows(r) for r in range(1, 2049)}
    assert all(padded_rows(r) >= r for r in range(1, 2049))
    assert len(buckets) < 80
    assert [padded_rows(r) for r in (1, 2, 3, 8, 9, 65)] == [1, 2, 4, 8, 16, 96]


@needs_fbgemm
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_float16_weights_match_plain_on_rounded_weights(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = Linear(48, 80, bias=bias)
    x = torch.randn(rows, 48)
    expected = F.linear(x, linear.weight.half().float(), linear.bias)
    unrounded = F.linear(x, linear.weight, linear.bias)
    linear.pack("float16")
    with torch.inference_mode():
        got = linear(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 80)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # and the rounding is really there: the float32 weights give other numbers
    assert not torch.allclose(got, unrounded, rtol=0, atol=1e-7)


@needs_fbgemm
@torch.inference_mode()
def test_float16_weights_generate_what_hf_generates_from_rounded_weights(tmp_path) -> None:
    # untied embeddings: the embedding lookup stays float32 on both sides
    hf_model = make_model_folder(tmp_path, CONFIGS["llama3"]())
    loaded = load_model(ModelConfig(model=str(tmp_path), weight_dtype="float16"))
    for name, param in hf_model.named_parameters():
        if name.endswith("proj.weight") or name == "lm_head.weight":
            param.copy_(param.half().float())
    tiny = TinyModel(hf_model, loaded)
    seqs = greedy_seqs([5, 19, 33], max_tokens=12, seed=4)
    outputs = RunnerLoop(tiny.runner(block_size=4)).run(seqs)
    assert outputs == [tiny.generate(s.prompt, 12) for s in seqs]


needs_bf16 = pytest.mark.skipif(
    not can_pack(CPU, torch.float32, "bfloat16"), reason="oneDNN without bfloat16 on this CPU"
)


@needs_bf16
@pytest.mark.parametrize("rows", [9, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_weights_are_a_bfloat16_matmul_summed_in_float32(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = Linear(48, 80, bias=bias)
    x = torch.randn(rows, 48)
    # the inputs rounded to bfloat16, float32 sums, the output rounded to bfloat16
    product = F.linear(x.bfloat16().float(), linear.weight.bfloat16().float())
    expected = product.bfloat16().float() + (0 if linear.bias is None else linear.bias)
    unrounded = F.linear(x, linear.weight, linear.bias)
    linear.pack("bfloat16")
    with torch.inference_mode():
        got = linear(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 80)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-5)  # one bfloat16 step
    assert not torch.allclose(got, unrounded, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif("amx_bf16" not in open("/proc/cpuinfo").read(), reason="no AMX on this CPU")
@needs_bf16
def test_bfloat16_weights_run_on_amx_tiles_where_the_cpu_has_them() -> None:
    # oneDNN names the ISA of the kernel it ran; in a child process, so that the verbose
    # switch and its output are the child's alone
    code = ("import torch\n"
            "from model_runner.models.layers import Linear\n"
            "linear = Linear(64, 96, bias=False)\n"
            "linear.pack('bfloat16')\n"
            "with torch.inference_mode():\n"
            "    linear(torch.randn(32, 64))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "ONEDNN_VERBOSE": "1"}, timeout=120, check=True)
    matmuls = [line for line in run.stdout.splitlines() if ",exec," in line and "matmul" in line]
    assert matmuls and all("amx" in line for line in matmuls), run.stdout[-2000:]


def test_float16_weights_refused_where_unsupported(tmp_path) -> None:
    make_model_folder(tmp_path, CONFIGS["smollm2"]())
    with pytest.raises(ValueError, match="--weight-dtype float16 needs the CPU, --dtype float32"):
        load_model(ModelConfig(model=str(tmp_path), dtype="bfloat16", weight_dtype="float16"))
    with pytest.raises(ValueError, match="--weight-dtype int8 needs the CPU, --dtype float32"):
        load_model(ModelConfig(model=str(tmp_path), dtype="bfloat16", weight_dtype="int8"))
    with pytest.raises(ValueError, match="--weight-dtype bfloat16 needs the CPU, --dtype float32"):
        load_model(ModelConfig(model=str(tmp_path), dtype="bfloat16", weight_dtype="bfloat16"))
    with pytest.raises(ValueError, match="unknown weight dtype 'int4'"):
        ModelConfig(weight_dtype="int4")


def _outlier_inputs(rows: int, width: int, seed: int) -> torch.Tensor:
    """Inputs whose channels 3 and 17 run 100x wider than the rest, as LLM activations do."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen)
    x[:, [3, 17]] *= 100
    return x


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


@needs_fbgemm
@pytest.mark.parametrize("bias", [False, True])
def test_int8_weights_follow_float32_on_outlier_channels(bias: bool) -> None:
    # unrotated, the ordinary channels would sit within a grid step or two of zero on the
    # outliers' grid and drown (errors of tens of percent)
    torch.manual_seed(0)
    linear = Linear(64, 96, bias=bias)
    x = _outlier_inputs(40, 64, seed=1)
    expected = F.linear(x, linear.weight, linear.bias)
    linear.pack("int8")
    with torch.inference_mode():
        got = linear(x)
    assert got.dtype == torch.float32 and got.shape == (40, 96)
    assert _relative_error(got, expected) < 0.02
    assert linear.weight.numel() == 0  # the packed copy is the only one


@needs_fbgemm
def test_int8_activations_get_a_grid_per_token() -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 64) * 0.1
    x = torch.randn(8, 64)
    x[0] *= 1000  # one loud token in the batch
    packed = pack_linear(weight, None, "int8")
    with torch.inference_mode():
        got = packed(x)
    expected = F.linear(x, weight)
    # the quiet tokens keep their precision: on the loud token's grid, their whole
    # inputs would fall within one or two steps of it (errors near 100%)
    for row in range(8):
        assert _relative_error(got[row], expected[row]) < 0.03, row


@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_hadamard_rotation_is_orthonormal(n: int) -> None:
    h = hadamard(n)
    torch.testing.assert_close(h @ h.T, torch.eye(n))
    assert (h.abs() == n**-0.5).all()


@needs_fbgemm
@pytest.mark.parametrize("in_features", [24, 40, 200])
def test_int8_rotation_blocks_fit_any_width(in_features: int) -> None:
    # 24 = 8 * 3, 40 = 8 * 5, 200 = 8 * 25: blocks of 8; a width of 64 * k takes 64
    torch.manual_seed(in_features)
    weight = torch.randn(32, in_features) * 0.1
    x = _outlier_inputs(5, in_features, seed=2)
    packed = pack_linear(weight, None, "int8")
    assert packed.block == 8
    with torch.inference_mode():
        assert _relative_error(packed(x), F.linear(x, weight)) < 0.05


@needs_fbgemm
@torch.inference_mode()
def test_int8_model_packs_every_projection_and_stays_close(tmp_path) -> None:
    make_model_folder(tmp_path, CONFIGS["llama3"]())
    exact = load_model(ModelConfig(model=str(tmp_path)))
    loaded = load_model(ModelConfig(model=str(tmp_path), weight_dtype="int8"))
    model = loaded.model
    projections = [m for m in model.modules() if isinstance(m, Linear)]
    assert projections and all(isinstance(m.packed, Int8Linear) for m in projections)
    assert isinstance(model.packed_lm_head, Int8Linear)

    tokens = torch.tensor([prompts([48], seed=3)[0]])
    reference = exact.model.compute_logits(prefill(exact.model, tokens))
    logits = model.compute_logits(prefill(model, tokens))
    # measured 8.7% and 41 of 48: a tiny random model's narrow rows quantize coarsely
    assert _relative_error(logits, reference) < 0.12
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.75


@needs_fbgemm
def test_int8_model_serves_whole_requests(tmp_path) -> None:
    hf_model = make_model_folder(tmp_path, CONFIGS["qwen2"]())  # with a qkv bias
    loaded = load_model(ModelConfig(model=str(tmp_path), weight_dtype="int8"))
    seqs = greedy_seqs([5, 19, 33], max_tokens=12, seed=4)
    outputs = RunnerLoop(TinyModel(hf_model, loaded).runner(block_size=4)).run(seqs)
    assert [len(out) for out in outputs] == [12, 12, 12]


@needs_fbgemm
@pytest.mark.parametrize(("in_features", "block"), [(64, 64), (576, 64), (1536, 64), (40, 8)])
def test_int8_rotation_in_cpp_matches_torch(in_features: int, block: int) -> None:
    packed = pack_linear(torch.randn(16, in_features), None, "int8")
    assert packed.block == block and packed.fused
    x = torch.randn(7, in_features + 8)[:, :in_features]  # rows with a stride
    x[3] = 0  # a zero row stays zero
    got, got_amax = packed.rotate_and_scale(x)
    packed.fused = False
    expected, expected_amax = packed.rotate_and_scale(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_amax, expected_amax, rtol=1e-5, atol=1e-12)
    assert got.abs().amax(dim=1)[[0, 1, 2, 4, 5, 6]].allclose(torch.ones(6))


# --- the small-batch matvec (csrc/cpu_matvec.cpp) -----------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("in_features", [40, 64, 576])  # 40: a tail of eight after sixteens
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matvec_matches_float64_on_its_weights(rows: int, in_features: int,
                                               dtype: torch.dtype) -> None:
    torch.manual_seed(rows * in_features)
    weight = torch.randn(200, in_features).to(dtype)
    bias = torch.randn(200)
    x = torch.randn(rows, 2 * in_features)[:, in_features:]  # strided rows
    got = torch.ops.pagedserve.matvec(x, weight, bias)
    expected = (x.double() @ weight.double().T + bias.double()).float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    no_bias = torch.ops.pagedserve.matvec(x, weight, None)
    torch.testing.assert_close(no_bias, expected - bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_matvec_row_does_not_depend_on_the_rows_beside_it(dtype: torch.dtype) -> None:
    # a verification's rows (a token and its drafts) give each token the logits a plain
    # decode of it gives: bit for bit, whatever the number of rows beside it
    torch.manual_seed(1)
    weight, bias = torch.randn(300, 40).to(dtype), torch.randn(300)
    x = torch.randn(8, 40)
    together = torch.ops.pagedserve.matvec(x, weight, bias)
    for row in range(8):
        alone = torch.ops.pagedserve.matvec(x[row:row + 1], weight, bias)
        assert torch.equal(alone[0], together[row])


def test_matvec_refuses_what_it_cannot_read() -> None:
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.pagedserve.matvec(torch.randn(1, 12), torch.randn(4, 12), None)
    with pytest.raises(RuntimeError, match="n <= 8"):
        torch.ops.pagedserve.matvec(torch.randn(9, 16), torch.randn(4, 16), None)


@needs_onednn
@needs_fbgemm
@pytest.mark.parametrize("weight_dtype", ["auto", "float16"])
def test_small_batches_take_the_matvec_and_agree_with_the_gemm(weight_dtype: str) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    packed = pack_linear(weight, bias, weight_dtype)
    assert packed.rows_weight is not None
    x = torch.randn(MATVEC_MAX_ROWS + 1, 64)
    with torch.inference_mode():
        gemm = packed(x)  # one row more than the matvec takes
        for rows in range(1, MATVEC_MAX_ROWS + 1):
            torch.testing.assert_close(packed(x[:rows]), gemm[:rows], rtol=1e-5, atol=1e-5)


def test_widths_the_matvec_cannot_read_keep_the_gemm() -> None:
    assert matvec_weight(torch.randn(8, 12), torch.float32) is None
    assert matvec_weight(torch.randn(8, 16), torch.float16).dtype == torch.float16


def test_the_kernel_table_gives_every_weight_dtype_and_form_a_path() -> None:
    assert set(GEMMS) == set(WEIGHT_DTYPES)  # past the path's rows
    for weight_dtype in WEIGHT_DTYPES:
        for blocks in ("q4_1", "q8_0", None):
            names = SMALL_BATCH_PATHS[(weight_dtype, blocks)]
            assert names and all(name in PATHS for name in names)
    assert small_batch_path("int8", "q4_1", 64, 64).name == "q4_1_int8_matvec"
    assert small_batch_path("int8", "q4_1", 60, 64).name == "int8_matvec"  # rows not in eights
    assert small_batch_path("float16", "q4_1", 60, 64).name == "q4_1_matvec"
    assert small_batch_path("auto", None, 8, 12) is None  # a width the matvec cannot read


# --- the small-batch int8 matvec (csrc/cpu_matvec_int8.cpp) -------------------------------


def _fbgemm_weight(packed: Int8Linear) -> torch.ScriptObject:
    """fbgemm's packed copy of Int8Linear's int8 rows (built here: on an AMX host the
    batches take the tiles and no fbgemm copy is kept)."""
    out_features = packed.rows_weight.shape[0]
    quantized = torch._make_per_channel_quantized_tensor(
        packed.rows_weight, packed.weight_scales.double(),
        torch.zeros(out_features, dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(quantized, None)


def _fbgemm(packed: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """What Int8Linear computes on fbgemm's GEMM, at any row count."""
    scaled, row_amax = packed.rotate_and_scale(x)
    y = torch.ops.quantized.linear_dynamic(scaled, _fbgemm_weight(packed), True) * row_amax
    return y if packed.bias is None else y + packed.bias


@needs_fbgemm
@pytest.mark.parametrize(
    ("in_features", "out_features"),
    # blocks of 64 (the default model's widths), of 8 with a tail of eight after sixteens,
    # and an odd width: the torch rotation and a tail of five
    [(576, 960), (1536, 576), (40, 33), (37, 50)],
)
@pytest.mark.parametrize("bias", [False, True])
@torch.inference_mode()
def test_int8_matvec_gives_fbgemms_numbers(in_features: int, out_features: int,
                                           bias: bool) -> None:
    torch.manual_seed(in_features)
    weight = torch.randn(out_features, in_features) * 0.05
    packed = pack_linear(weight, torch.randn(out_features) if bias else None, "int8")
    assert packed.rows_weight is not None
    x = _outlier_inputs(INT8_MATVEC_MAX_ROWS, in_features, seed=out_features)
    for rows in range(1, INT8_MATVEC_MAX_ROWS + 1):
        # the same activation grid, roundings and sums: equal to the bit, not just close
        assert torch.equal(packed(x[:rows]), _fbgemm(packed, x[:rows])), rows


@needs_fbgemm
@pytest.mark.parametrize(
    "case", ["zeros", "tiny", "positive", "negative", "one row of zeros", "strided"]
)
def test_int8_matvec_grids_match_fbgemms_at_the_edges(case: str) -> None:
    # the op itself, on inputs whose grid takes torch's special cases: no range at all
    # (scale 0.1), a range below its smallest scale, a range on one side of zero
    torch.manual_seed(1)
    packed = pack_linear(torch.randn(48, 64) * 0.05, torch.randn(48), "int8")
    x = {
        "zeros": torch.zeros(2, 64),
        "tiny": torch.randn(3, 64) * 1e-6,
        "positive": torch.rand(4, 64) + 0.5,
        "negative": -torch.rand(1, 64),
        "one row of zeros": torch.cat([torch.zeros(1, 64), torch.randn(2, 64)]),
        "strided": torch.randn(3, 128)[:, 32:96],
    }[case]
    row_scales = torch.rand(x.shape[0], 1) + 0.5
    got = torch.ops.pagedserve.int8_matvec(
        x, row_scales, packed.rows_weight, packed.weight_scales, packed.bias
    )
    expected = torch.ops.quantized.linear_dynamic(x, _fbgemm_weight(packed), True) * row_scales
    assert torch.equal(got, expected + packed.bias)


@needs_fbgemm
@torch.inference_mode()
def test_int8_batches_above_the_matvecs_rows_take_the_gemm() -> None:
    torch.manual_seed(2)
    packed = pack_linear(torch.randn(96, 64) * 0.05, None, "int8")
    x = torch.randn(INT8_MATVEC_MAX_ROWS + 1, 64)
    expected = packed.gemm(x)
    packed.rows_weight = torch.zeros_like(packed.rows_weight)  # the matvec now gives zeros
    assert not packed(x[:INT8_MATVEC_MAX_ROWS]).any()
    assert torch.equal(packed(x), expected)


def test_int8_matvec_refuses_what_it_cannot_read() -> None:
    weight, scales = torch.zeros(4, 16, dtype=torch.int8), torch.ones(4)
    op = torch.ops.pagedserve.int8_matvec
    with pytest.raises(RuntimeError, match="n <= 4"):
        op(torch.randn(5, 16), torch.ones(5), weight, scales, None)
    with pytest.raises(RuntimeError, match="one value per row"):
        op(torch.randn(2, 16), torch.ones(3), weight, scales, None)
    with pytest.raises(RuntimeError, match="contiguous int8"):
        op(torch.randn(1, 16), torch.ones(1), weight.float(), scales, None)


@needs_fbgemm
def test_int8_matvec_is_exact_at_the_ends_of_both_grids() -> None:
    # weights of -128 and 127 against inputs at the top and the bottom of their grid: the
    # products and their pairwise sums reach the ends of int16, and must stay exact
    weight = torch.tensor([[-128] * 64, [127] * 64, [-128, 127] * 32], dtype=torch.int8)
    scales = torch.full((3,), 0.01)
    quantized = torch._make_per_channel_quantized_tensor(weight, scales.double(),
                                                         torch.zeros(3, dtype=torch.long), 0)
    packed = torch.ops.quantized.linear_prepack(quantized, None)
    for x in (torch.ones(1, 64), torch.cat([torch.ones(1, 32), -torch.ones(1, 32)], 1),
              torch.linspace(-0.3, 1, 64)[None]):
        got = torch.ops.pagedserve.int8_matvec(x, torch.ones(1), weight, scales, None)
        assert torch.equal(got, torch.ops.quantized.linear_dynamic(x, packed, True))
