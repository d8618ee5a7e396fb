"""The default model (SmolLM2-135M-Instruct) through the loader and the runner, greedy in
float32: token for token what Hugging Face `generate` gives on the same weights.

Hugging Face reads the same GGUF file (transformers' own dequantization); the loader reads
it as it is (gguf_file.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from model_runner.config import ModelConfig
from model_runner.kernels.block_quant import (
    Q41Blocks,
    Q41Int8Groups,
    Q41PlanesGroups,
    Q80FileBlocks,
)
from model_runner.kernels.cpu_kernel_table import GEMM_ONLY, MATVEC_MAX_ROWS
from model_runner.kernels.cpu_linear import Float16Linear, can_pack
from model_runner.kernels.int8_linear import Int8Linear
from model_runner.loader import LoadedModel, load_model
from model_runner.models.layers import Linear
from model_runner.runner import ModelRunner
from tests.support.gguf_parity import teacher_forced_agreement
from tests.support.model_helpers import RunnerLoop, Seq, load_hf_model
from tests.support.quality import (
    Quality,
    compare,
    reference_token_ids,
    teacher_forced_logits,
)

pytestmark = pytest.mark.e2e

NUM_NEW_TOKENS = 24
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime.",
]


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(ModelConfig(model=None, dtype="float32", device="cpu", num_kv_blocks=1))


@pytest.fixture(scope="module")
def prompts(loaded: LoadedModel) -> list[list[int]]:
    tokenizer = loaded.tokenizer
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def hf_model(loaded: LoadedModel) -> torch.nn.Module:
    """Hugging Face's reading of the same GGUF, once (each test changing it takes a copy)."""
    return load_hf_model(loaded.model_path)


@pytest.fixture(scope="module")
def expected(hf_model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    hf = copy.deepcopy(hf_model)
    hf.generation_config.eos_token_id = None  # fixed lengths, as the engine loop below
    outputs = []
    for prompt in prompts:
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False, pad_token_id=0
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def run(loaded: LoadedModel, prompts: list[list[int]], chunk_size: int | None) -> list[list[int]]:
    config = ModelConfig(model=None, dtype="float32", device="cpu", num_kv_blocks=64)
    seqs = [Seq(f"r{i}", p, NUM_NEW_TOKENS) for i, p in enumerate(prompts)]
    return RunnerLoop(ModelRunner(loaded, config), chunk_size=chunk_size).run(seqs)


def test_default_model_loads(loaded: LoadedModel):
    assert loaded.hf_config.model_type == "llama"
    assert loaded.served_model_name == "SmolLM2-135M-Instruct"
    assert loaded.dtype == torch.float32
    assert loaded.tokenizer.chat_template
    assert loaded.tokenizer.eos_token_id in loaded.eos_token_ids


def test_batched_greedy_matches_generate(loaded, prompts, expected):
    assert run(loaded, prompts, chunk_size=None) == expected


def test_chunked_greedy_matches_generate(loaded, prompts, expected):
    assert run(loaded, prompts, chunk_size=13) == expected


def test_float16_weights_match_generate_on_rounded_weights(prompts, hf_model):
    """--weight-dtype float16 on the real model, in fbgemm's float16 GEMM (a batch above
    the small-batch paths' rows; forced here for three prompts): the same tokens as HF
    `generate` with the projection and LM-head weights rounded to float16 (the embedding
    lookup stays float32 on both sides, so the tied LM head is untied on the HF side)."""
    loaded = load_model(ModelConfig(model=None, weight_dtype="float16", num_kv_blocks=1))
    loaded.model.use_kernel_table(GEMM_ONLY)
    hf = copy.deepcopy(hf_model)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("proj.weight"):
                param.copy_(param.half().float())
        hf.lm_head.weight = torch.nn.Parameter(hf.lm_head.weight.detach().half().float())
    expected = [
        hf.generate(
            torch.tensor([p]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False, pad_token_id=0
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    assert run(loaded, prompts, chunk_size=None) == expected


def test_float16_small_batches_read_the_exact_blocks(prompts, expected):
    """--weight-dtype float16 on the real model at up to MATVEC_MAX_ROWS rows: its
    projections read the GGUF's exact blocks (block_quant.py), so HF float32's tokens."""
    loaded = load_model(ModelConfig(model=None, weight_dtype="float16", num_kv_blocks=1))
    assert_reads_its_blocks(loaded, Float16Linear)
    assert run(loaded, prompts, chunk_size=None) == expected


def assert_reads_its_blocks(loaded: LoadedModel, packed_type: type) -> None:
    """Every projection is `packed_type` on the GGUF's Q4_1 blocks with no row copy (int8
    and float16: in groups of eight rows), the tied LM head on the file's Q8_0 blocks of
    the embedding table whatever the dtype (one copy of the table)."""
    q41 = {Int8Linear: Q41Int8Groups, Float16Linear: Q41PlanesGroups}.get(packed_type,
                                                                           Q41Blocks)
    linears = [m.packed for m in loaded.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(p, packed_type) for p in linears)
    assert all(isinstance(p.blocks, q41) and p.rows_weight is None for p in linears)
    assert isinstance(loaded.model.packed_lm_head.blocks, Q80FileBlocks)


@pytest.fixture(scope="module")
def float32_text(loaded: LoadedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """tests.support.quality's text (token ids) and float32's teacher-forced logits on it."""
    token_ids = reference_token_ids(loaded)
    return token_ids, teacher_forced_logits(loaded, token_ids)


def weight_dtype_quality(weight_dtype: str, float32_text: tuple[torch.Tensor, torch.Tensor]
                         ) -> Quality:
    """The real model under `--weight-dtype weight_dtype`, teacher-forced on the text (one
    prefill: its GEMM), against float32."""
    model = load_model(ModelConfig(model=None, weight_dtype=weight_dtype, num_kv_blocks=1))
    token_ids, reference = float32_text
    return compare(teacher_forced_logits(model, token_ids), reference, token_ids)


def test_int8_weights_stay_close_on_english_text(float32_text):
    """--weight-dtype int8 on the real model, teacher-forced on tests.support.quality's text: the
    next-token choice agrees with float32 at >= 90% of positions (measured 94.7%) and the
    loss grows by <= 2% (measured +0.4%; without the rotation, 72.5% and +8.7%)."""
    quality = weight_dtype_quality("int8", float32_text)
    assert quality.top1_agreement >= 0.90, quality
    assert quality.nll <= 1.02 * quality.reference_nll, quality


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32, "bfloat16"),
                    reason="oneDNN without bfloat16 on this CPU")
def test_bfloat16_weights_stay_close_on_english_text(float32_text):
    """--weight-dtype bfloat16 on the real model, teacher-forced (one 1,024-token prefill: the
    bfloat16 GEMM, AMX where the CPU has it): top-1 agreement with float32 >= 95% (measured
    97.2%), the loss within 0.5% (measured +0.0%)."""
    quality = weight_dtype_quality("bfloat16", float32_text)
    assert quality.top1_agreement >= 0.95, quality
    assert quality.nll <= 1.005 * quality.reference_nll, quality


def test_int8_small_batches_on_the_blocks_stay_closer_still(loaded, monkeypatch):
    """--weight-dtype int8 at up to MATVEC_MAX_ROWS rows: the GGUF's exact blocks times
    activations quantized per block of 32 (csrc/cpu_matvec_blocks_int8.cpp). Teacher-forced
    on the text's first 512 tokens with every projection and the LM head called eight rows
    at a time: top-1 agreement with float32 >= 96% (measured 96.7%) and the loss within
    0.5% (measured +0.2%; over all 1,024 tokens 97.1% and +0.2%, the GEMM's 94.2%, +0.3%).
    A tiny change of the float sums (their order) moves these by about a point: it turns
    some activations' int8 rounding (docs/benchmarks-runner.md)."""
    int8 = load_model(ModelConfig(model=None, weight_dtype="int8", num_kv_blocks=1))
    assert_reads_its_blocks(int8, Int8Linear)
    rows = MATVEC_MAX_ROWS

    def in_small_calls(packed):
        return lambda x: torch.cat([packed(x[i : i + rows]) for i in range(0, x.shape[0], rows)])

    for module in int8.model.modules():
        if isinstance(module, Linear):
            monkeypatch.setattr(module, "packed", in_small_calls(module.packed))
    monkeypatch.setattr(int8.model, "packed_lm_head", in_small_calls(int8.model.packed_lm_head))
    token_ids = reference_token_ids(loaded)[:, :512]
    quality = compare(
        teacher_forced_logits(int8, token_ids), teacher_forced_logits(loaded, token_ids),
        token_ids,
    )
    assert quality.top1_agreement >= 0.96, quality
    assert quality.nll <= 1.005 * quality.reference_nll, quality


def test_teacher_forced_top1_agrees_with_hugging_face(loaded, hf_model):
    """The file's own blocks (Q4_1, the LM head Q8_0), float32: the next-token choice of
    every position of 512 tokens of English text is HF's at >= 99% of them
    (tests/e2e/test_gguf_parity.py holds the other files to the same)."""
    agreement, positions = teacher_forced_agreement(loaded, hf_model)
    assert positions == 512 and agreement >= 0.99, agreement
