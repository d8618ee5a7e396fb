"""Gemma 2 and Gemma 3 (text) through the model runner against Hugging Face, in float32.

Tiny random checkpoints (from_config, norm weights moved off 0 so that (1 + w) shows,
saved as safetensors with the default model's tokenizer) with an 8-token sliding window that
every context here crosses, driven by the minimal engine loop of
tests/support/model_helpers.py. Gemma 2: local and
global layers alternate, attention and final logits soft-capped. Gemma 3: QK-norm, local
layers on their own RoPE base, a linearly scaled global RoPE. Mistral and Qwen2 with a
window use the same attention; gpt-oss (test_gpt_oss.py) adds sinks, YaRN and experts.
"""

from __future__ import annotations

import pytest
import torch

from model_runner.config import ModelConfig
from model_runner.loader import load_model
from model_runner.models.gemma import GemmaForCausalLM
from tests.support.model_helpers import (
    WINDOW,
    WINDOWED_CONFIGS,
    RunnerLoop,
    Seq,
    TinyModel,
    assert_chunked_logits_match_hf,
    clear_margin_generations,
    make_model_folder,
    prompts,
)

CONFIGS = WINDOWED_CONFIGS
# Candidate prompts; the tests use those whose greedy continuation has a clear margin.
LENGTHS = [3, 9, 17, 30, 12, 25, 6, 21]
MAX_TOKENS = 10
MIN_MARGIN = 2e-3  # top-1 minus top-2 logit at every step: 100x float32 noise


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory) -> TinyModel:
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = make_model_folder(folder, CONFIGS[request.param](), norm_noise=0.3)
    return TinyModel(hf_model, load_model(ModelConfig(model=str(folder), num_kv_blocks=1)))


@pytest.fixture(scope="module")
def expected(tiny: TinyModel) -> dict[tuple[int, ...], list[int]]:
    """HF's greedy tokens for the candidate prompts whose margins are clear."""
    found = clear_margin_generations(tiny.hf, prompts(LENGTHS, seed=3), MAX_TOKENS, MIN_MARGIN)
    assert len(found) >= 4, "too few prompts with a clear margin"
    assert max(len(p) for p in found) > 2 * WINDOW
    return found


def seqs_of(expected: dict[tuple[int, ...], list[int]]) -> list[Seq]:
    return [Seq(f"r{i}", list(p), MAX_TOKENS) for i, p in enumerate(expected)]


def test_registered_and_windowed(tiny: TinyModel) -> None:
    model = tiny.loaded.model
    windows = [layer.self_attn.options.sliding_window for layer in model.layers]
    assert WINDOW in windows
    if isinstance(model, GemmaForCausalLM):
        assert None in windows  # local and global layers
    assert tiny.loaded.max_model_len == 256  # no longer capped at the window


@torch.inference_mode()
def test_logits_match_hf_forward(tiny: TinyModel) -> None:
    """A whole prompt and a chunk after a cached prefix, both past the window."""
    assert_chunked_logits_match_hf(tiny, tiny.runner(block_size=4))


def test_one_at_a_time(tiny: TinyModel, expected) -> None:
    runner = tiny.runner(block_size=4)
    for seq in sorted(seqs_of(expected), key=lambda s: len(s.prompt))[-2:]:  # past the window
        assert RunnerLoop(runner).run([seq]) == [expected[tuple(seq.prompt)]]


@pytest.mark.parametrize(
    "backend,block_size,chunk_size", [("cpu", 4, None), ("torch", 4, 5), ("cpu", 16, 7)]
)
def test_batched_and_chunked(tiny: TinyModel, expected, backend, block_size, chunk_size) -> None:
    seqs = seqs_of(expected)
    runner = tiny.runner(block_size=block_size, attention_backend=backend)
    outputs = RunnerLoop(runner, chunk_size=chunk_size).run(seqs)
    assert outputs == [expected[tuple(s.prompt)] for s in seqs]


def test_prefix_blocks_reused(tiny: TinyModel, expected) -> None:
    """Later requests start from the first one's full blocks (a prefix-cache hit) longer
    than the window."""
    engine = RunnerLoop(tiny.runner(block_size=4))
    shared = max(expected, key=len)
    first = Seq("first", list(shared), MAX_TOKENS)
    engine.run([first])
    num_shared_blocks = (len(shared) - 1) // 4
    later = [Seq(f"later{i}", list(shared), MAX_TOKENS) for i in range(2)]
    for seq in later:
        seq.block_table = first.block_table[:num_shared_blocks]
        seq.num_computed = num_shared_blocks * 4
    engine.run(later)
    assert [s.output for s in [first, *later]] == [expected[shared]] * 3


def test_recompute_after_preemption(tiny: TinyModel, expected) -> None:
    engine = RunnerLoop(tiny.runner(block_size=4), chunk_size=6)
    victim, *others = seqs_of(expected)[:3]
    for _ in range(6):
        engine.step([victim, *others])
    generated = len(victim.output)
    assert 0 < generated < MAX_TOKENS
    original = victim.prompt
    # preempted: blocks gone, everything so far becomes the prompt and is computed again
    victim.prompt, victim.output = victim.tokens, []
    victim.max_tokens -= generated
    victim.block_table, victim.num_computed = [], 0
    engine.run([victim, *others])
    assert victim.prompt[len(original):] + victim.output == expected[tuple(original)]
    assert [s.output for s in others] == [expected[tuple(s.prompt)] for s in others]
