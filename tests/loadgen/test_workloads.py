"""The input-copying workloads (loadgen/edits.py, WE and WEP): deterministic prompts within
their token bounds."""

from __future__ import annotations

import difflib
import random

import pytest

from loadgen.edits import MAX_TOKENS, MIN_TOKENS, edit_prompts, load_blocks
from loadgen.workloads import in_vocabulary, w1, we, wep


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from model_runner.model_source import resolve_model_folder

    folder, _ = resolve_model_folder(None)
    return AutoTokenizer.from_pretrained(folder)


def _shown_block(prompt: str) -> str:
    """The block a prompt shows: between its first fence line and the closing fence."""
    return prompt.split("\n", 3)[3].split("\n```\n")[0]


def test_the_edit_workloads_are_the_same_for_a_seed_and_differ_across_seeds() -> None:
    assert we(seed=3) == we(seed=3) and wep(seed=3) == wep(seed=3)
    assert we(seed=3).requests != we(seed=4).requests


def test_every_block_is_256_to_512_tokens_of_code_or_prose(tokenizer) -> None:
    blocks = load_blocks()
    assert {b.kind for b in blocks} == {"code", "prose"}
    lengths = [len(tokenizer.encode(b.text, add_special_tokens=False)) for b in blocks]
    assert all(MIN_TOKENS <= n <= MAX_TOKENS for n in lengths), lengths


def test_an_edit_shows_its_block_nearly_unchanged_and_asks_for_no_more_than_it(tokenizer) -> None:
    """Each prompt shows one block with a small seeded edit; its answer (max_tokens) is
    256-512 tokens and fits in the block it copies, so the output is a copy, not free text."""
    texts = {b.text: b for b in load_blocks()}
    for edit in edit_prompts(3 * len(texts), random.Random(0)):
        shown = _shown_block(edit.prompt)
        block = max(texts, key=lambda t: difflib.SequenceMatcher(None, t, shown).ratio())
        changed = sum(a != b for a, b in zip(block, shown, strict=False))
        assert len(shown) == len(block) and changed <= 8
        block_tokens = len(tokenizer.encode(block, add_special_tokens=False))
        assert MIN_TOKENS <= edit.answer_tokens <= min(MAX_TOKENS, block_tokens + 8)
        assert len(tokenizer.encode(edit.prompt)) <= MAX_TOKENS + 64


def test_we_is_one_stream_and_wep_mixes_urgent_edits_into_a_saturating_low_load() -> None:
    single = we(scale=1.0)
    assert single.concurrency == 1 and {r.priority for r in single.requests} == {0}
    assert all(MIN_TOKENS <= r.max_tokens <= MAX_TOKENS for r in single.requests)
    mix = wep(scale=1.0)
    urgent = [r for r in mix.requests if r.priority == -10]
    low = [r for r in mix.requests if r.priority == 10]
    assert len(low) > mix.concurrency and all(r.send_at_s is None for r in low)
    times = [r.send_at_s for r in urgent]
    assert urgent and all(t is not None for t in times) and times == sorted(times)


def test_a_workload_in_another_vocabulary_keeps_its_shape_and_text_prompts() -> None:
    """bench.compare --model: every token-id prompt's ids come from the file's vocabulary,
    the same draw for every system; lengths, outputs and text prompts unchanged."""
    vocabulary = [7, 11, 13]
    for workload in (w1(scale=0.1), we(scale=0.1)):
        moved = in_vocabulary(workload, vocabulary)
        assert moved == in_vocabulary(workload, vocabulary)
        for old, new in zip(workload.requests, moved.requests, strict=True):
            assert new.max_tokens == old.max_tokens and len(new.prompt) == len(old.prompt)
            assert new.prompt == old.prompt if isinstance(old.prompt, str) \
                else set(new.prompt) <= set(vocabulary)
