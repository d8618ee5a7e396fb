"""The draft model in the runner, on two tiny random checkpoints of one vocabulary: its KV
follows the target's through a prefill, verified steps (a draft rejected) and its lookahead
decodes, so that its logits at the newest position are those of a plain forward over the
same tokens; its proposals are its greedy tokens; a draft that does not fit is refused."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig

from model_runner.config import ModelConfig
from model_runner.draft_model import check_draft_fits
from model_runner.loader import load_model
from model_runner.runner import ModelRunner, prepare_inputs
from scheduler.output import ScheduledRequest, SchedulerOutput
from tests.support.model_helpers import (
    CONFIGS,
    GREEDY,
    MIN_MARGIN,
    TINY,
    TinyModel,
    greedy_margin,
    make_model_folder,
    prompts,
)

# one layer, half the width, other heads: a draft unlike the target, of its vocabulary
DRAFT_CONFIG = dict(TINY, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1)
BLOCKS = list(range(16))  # the request's table: 64 slots of 4
NUM_GREEDY = 12


def tiny_model(folder, hf_config) -> TinyModel:
    hf_model = make_model_folder(folder, hf_config)
    return TinyModel(hf_model, load_model(ModelConfig(model=str(folder), num_kv_blocks=1)))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[TinyModel, TinyModel]:
    target = tiny_model(tmp_path_factory.mktemp("target"), CONFIGS["smollm2"]())
    draft = tiny_model(tmp_path_factory.mktemp("draft"),
                       LlamaConfig(**DRAFT_CONFIG, tie_word_embeddings=True))
    return target, draft


def clear_prompt(target: TinyModel) -> tuple[list[int], list[int]]:
    """A prompt whose target greedy tokens have a clear margin, and those tokens."""
    for seed in range(20):
        prompt = prompts([11], seed=seed)[0]
        tokens, margin = greedy_margin(target.hf, prompt, NUM_GREEDY)
        if margin > MIN_MARGIN:
            return prompt, tokens
    raise AssertionError("no prompt with a clear greedy margin")


def draft_greedy(draft: TinyModel, tokens: list[int], n: int) -> list[int]:
    got, margin = greedy_margin(draft.hf, tokens, n)
    assert margin > MIN_MARGIN  # NOTE: so that a near tie never decides the comparison
    return got


def test_the_draft_kv_follows_the_target_and_it_proposes_its_greedy_tokens(models) -> None:
    target, draft = models
    runner = ModelRunner(target.loaded, ModelConfig(model=target.loaded.model_path,
                                                    block_size=4, num_kv_blocks=64),
                         draft=draft.loaded)
    prompt, greedy = clear_prompt(target)
    output: list[int] = []

    def step(token_ids: list[int], drafts: list[int], lookahead: int):
        scheduled = ScheduledRequest("r", [*token_ids, *drafts], len(prompt) + len(output)
                                     - len(token_ids), BLOCKS, True, GREEDY, prompt, output,
                                     num_draft_tokens=len(drafts),
                                     num_lookahead_tokens=lookahead)
        return runner.execute(SchedulerOutput([scheduled]))

    out = step(prompt, [], 0)  # the prefill
    output.append(out.sampled_token_ids["r"])
    out = step(output[-1:], [], 3)  # a decode, then 3 proposals after its token
    output.append(out.sampled_token_ids["r"])
    assert out.draft_token_ids == {"r": draft_greedy(draft, prompt + output, 3)}
    wrong = (greedy[4] + 1) % 64
    out = step(output[-1:], [greedy[2], greedy[3], wrong], 2)  # 2 accepted, 1 rejected
    assert out.verified_token_ids["r"] == greedy[2:5]
    output += greedy[2:5]
    assert out.draft_token_ids == {"r": draft_greedy(draft, prompt + output, 2)}
    out = step(output[-1:], out.draft_token_ids["r"], 3)  # the draft's own proposals
    output += out.verified_token_ids["r"]
    assert output == greedy[:len(output)]

    # the draft's logits at the newest token, over its paged KV, against a plain forward
    tokens = prompt + output
    probe = ScheduledRequest("r", tokens[-1:], len(tokens) - 1, BLOCKS, True, GREEDY, prompt,
                             output)
    inputs = prepare_inputs([probe], runner.block_tables, runner.device)
    with torch.inference_mode():
        got = draft.loaded.model.compute_logits(runner.draft.forward(inputs))[0]
        want = draft.hf(torch.tensor([tokens])).logits[0, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_the_kv_budget_pays_for_both_caches(models) -> None:
    target, draft = models
    config = ModelConfig(model=target.loaded.model_path, block_size=4, kv_cache_memory=2**20)
    # a block in float32: 2 x 2 layers x 4 tokens x 2 heads x 16 dims x 4 bytes = 2048 for
    # the target; 2 x 1 x 4 x 1 x 16 x 4 = 512 for the draft
    assert ModelRunner(target.loaded, config).num_kv_blocks == 2**20 // 2048
    both = ModelRunner(target.loaded, config, draft=draft.loaded)
    assert both.num_kv_blocks == 2**20 // (2048 + 512)
    assert both.draft is not None and both.draft.kv_cache is not None
    assert both.draft.kv_cache.num_blocks == both.num_kv_blocks


@pytest.mark.parametrize(("change", "needle"), [
    ("vocab", "vocabulary of 49216 ids"),
    ("eos", "EOS ids"),
    ("context", "lower --max-model-len"),
])
def test_a_draft_that_does_not_fit_the_target_is_refused(models, change: str,
                                                         needle: str) -> None:
    target, draft = models
    loaded = draft.loaded
    if change == "vocab":
        hf_config = copy.deepcopy(loaded.hf_config)
        hf_config.vocab_size += 64
        loaded = replace(loaded, hf_config=hf_config)
    elif change == "eos":
        loaded = replace(loaded, eos_token_ids=frozenset({5}))
    else:
        loaded = replace(loaded, max_model_len=target.loaded.max_model_len - 1)
    with pytest.raises(ValueError, match=needle):
        check_draft_fits(target.loaded, loaded)
