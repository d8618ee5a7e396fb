"""Every decoder family served over HTTP: `pagedserve serve --model DIR` on a tiny random
checkpoint of it (made here with transformers, float32, safetensors, the default model's
tokenizer) gives Hugging Face `generate`'s greedy tokens for text prompts and a chat, one
request at a time and batched, through chunked prefill (16 tokens a step), a prefix-cache
hit and a preemption (a pool of 20 blocks of 4). The server names its tokens by their texts
in logprobs; the prompts are picked so that each greedy token's text is its own.

To add a family: a config factory in `FAMILIES` or `EXPERT_FAMILIES`
(tests/support/model_helpers.py's FAMILY_CONFIGS, or one of its own). One server per
family, a few requests each; the mixtures of experts run in test_model_families_moe.py, on
these tests, so that `make test`'s two workers share the families. Gemma's and gpt-oss's
local layers have a window of 8 tokens that these contexts cross (their global layers keep
every block, so the pool still fills and preempts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from transformers import PretrainedConfig

from tests.e2e.conftest import ServerProcess
from tests.support.metrics import metric
from tests.support.model_helpers import (
    FAMILY_CONFIGS,
    MOE_CONFIGS,
    WINDOWED_CONFIGS,
    TextPrompt,
    make_model_folder,
    margin_texts,
    token_texts,
)

pytestmark = pytest.mark.e2e

# family -> its tiny config: the dense ones here, the mixtures of experts in
# test_model_families_moe.py
FAMILIES: dict[str, Callable[[], PretrainedConfig]] = {
    **FAMILY_CONFIGS,
    "gemma2": WINDOWED_CONFIGS["gemma2"],
    "gemma3": WINDOWED_CONFIGS["gemma3"],
}
EXPERT_FAMILIES: dict[str, Callable[[], PretrainedConfig]] = {
    **MOE_CONFIGS,
    "gpt_oss": WINDOWED_CONFIGS["gpt_oss"],  # sinks, YaRN, experts with biases
}
# Gemma inits its (1 + w) norms at w = 0: moved off it so that the 1 + shows
NORM_NOISE = {"gemma2": 0.3, "gemma3": 0.3}
FLAGS = ("--block-size", "4", "--num-kv-blocks", "20", "--max-num-batched-tokens", "16",
         "--long-prefill-token-threshold", "0", "--max-num-seqs", "4", "--device", "cpu")
MAX_TOKENS = 12


@dataclass
class Family:
    hf: torch.nn.Module
    server: ServerProcess

    def expected(self, prompt: TextPrompt) -> list[str]:
        """HF's greedy tokens after `prompt` (its margin measured on them), each named by
        its text."""
        return [token_texts()[i] for i in prompt.greedy]

    def complete(self, prompts: list[TextPrompt]) -> list[list[str]]:
        """One request for all `prompts` (batched in the engine): each one's tokens."""
        body = {"prompt": [p.text for p in prompts], "logprobs": 0}
        response = self.post("/v1/completions", body)
        assert response["usage"]["prompt_tokens"] == sum(len(p.ids) for p in prompts)
        choices = sorted(response["choices"], key=lambda c: c["index"])
        return [c["logprobs"]["tokens"] for c in choices]

    def chat(self, prompt: TextPrompt) -> list[str]:
        response = self.post("/v1/chat/completions",
                             {"messages": prompt.messages, "logprobs": True})
        return [t["token"] for t in response["choices"][0]["logprobs"]["content"]]

    def post(self, path: str, body: dict) -> dict:
        body = {**body, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        response = httpx.post(self.server.url + path, json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    def counter(self, name: str) -> float:
        return metric(self.server, name)


def serve_family(name: str, config: PretrainedConfig, tmp_path_factory) -> Iterator[Family]:
    """A tiny checkpoint of `config` served until the generator is closed."""
    folder: Path = tmp_path_factory.mktemp(name)
    hf = make_model_folder(folder, config, NORM_NOISE.get(name, 0.0))
    server = ServerProcess("--model", str(folder), *FLAGS)
    yield Family(hf, server)
    server.stop()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Iterator[Family]:
    yield from serve_family(request.param, FAMILIES[request.param](), tmp_path_factory)


def test_one_at_a_time_and_chunked(family: Family):
    for prompt in margin_texts(family.hf, [5, 37], MAX_TOKENS, seed=1):  # 37: 3 chunks
        assert family.complete([prompt]) == [family.expected(prompt)]


def test_batched_with_a_preemption(family: Family):
    """Three sequences of 20 + 12 tokens (8 blocks each) in a pool of 20 blocks: one is
    preempted once the decodes outgrow it, and recomputed."""
    preemptions = family.counter("pagedserve_num_preemptions_total")
    prompts = margin_texts(family.hf, [20, 20, 20], MAX_TOKENS, seed=2)
    assert family.complete(prompts) == [family.expected(p) for p in prompts]
    assert family.counter("pagedserve_num_preemptions_total") > preemptions


def test_prefix_cache_hit(family: Family):
    first, second = margin_texts(family.hf, [26, 26], MAX_TOKENS, seed=3, shared=16)
    assert family.complete([first]) == [family.expected(first)]
    hits = family.counter("pagedserve_prefix_cache_hits_total")
    assert family.complete([second]) == [family.expected(second)]
    assert family.counter("pagedserve_prefix_cache_hits_total") >= hits + 16


def test_chat(family: Family):
    """A user message through the checkpoint's chat template (the default model's): the
    server renders the ids HF is given (over 16 tokens: chunked) and answers its tokens."""
    (prompt,) = margin_texts(family.hf, [6], MAX_TOKENS, seed=4, chat=True)
    response = httpx.post(family.server.url + "/tokenize", json={"messages": prompt.messages})
    assert response.json()["tokens"] == prompt.ids
    assert family.chat(prompt) == family.expected(prompt)
