"""CPU projections on packed weights (model_runner/cpu_linear.py) against nn.Linear.

oneDNN float32 must give nn.Linear's numbers at every padded row count; float16 weights
must give nn.Linear's numbers on the weights rounded to float16, so that a tiny model
served on them generates exactly what Hugging Face generates from the rounded weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_runner.config import ModelConfig
from model_runner.cpu_linear import can_pack, padded_rows
from model_runner.llama import Linear
from model_runner.loader import load_model
from tests.model_helpers import CONFIGS, Engine, TinyModel, greedy_seqs, make_model_folder

CPU = torch.device("cpu")
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
    assert linear.weight.numel() == 0  # the packed copy is the only one


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
    outputs = Engine(tiny.runner(block_size=4)).run(seqs)
    assert outputs == [tiny.generate(s.prompt, 12) for s in seqs]


def test_float16_weights_refused_where_unsupported(tmp_path) -> None:
    make_model_folder(tmp_path, CONFIGS["smollm2"]())
    with pytest.raises(ValueError, match="--weight-dtype float16 needs the CPU, --dtype float32"):
        load_model(ModelConfig(model=str(tmp_path), dtype="bfloat16", weight_dtype="float16"))
    with pytest.raises(ValueError, match="unknown weight dtype 'int4'"):
        ModelConfig(weight_dtype="int4")
