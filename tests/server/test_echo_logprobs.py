"""`echo` with `logprobs` on /v1/completions (what lm-eval's `local-completions` sends): the
echoed prompt's logprobs and top-k are the model's, as a float32 log_softmax of Hugging
Face's logits has them, whatever the prompt's form, n, streaming or the prefix cache;
`max_tokens` 0 scores the prompt alone. A tiny random Llama served in process."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from fastapi.testclient import TestClient

from engine.client import EngineClient, EngineInfo
from kvcache.config import CacheConfig
from model_runner.config import ModelConfig
from model_runner.loader import load_model
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler
from server.app import build_app
from server.config import ServerConfig
from server.limits import RequestLimits
from tests.support.model_helpers import CONFIGS, TinyModel, make_model_folder
from tests.support.reliability_helpers import assert_openai_error
from tests.support.waits import assert_whole

TOLERANCE = 1e-5  # float32 on both sides, other kernels: 2.4e-6 apart at most here
PROMPT_IDS = [5, 17, 42, 9, 100, 33, 7, 250, 64, 12, 3, 88, 19]  # 13 tokens: 4 blocks of 4
PROMPT_TEXT = "t5 t17 t42 t9 t100 t33 t7"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyModel:
    """The tiny Llama with the default model's tokenizer, a byte-level BPE: a text is its
    tokens' texts end to end, so each offset is exact."""
    folder = tmp_path_factory.mktemp("echo-llama")
    hf_model = make_model_folder(folder, CONFIGS["smollm2"]())
    return TinyModel(hf_model, load_model(ModelConfig(model=str(folder), num_kv_blocks=1)))


@pytest.fixture(scope="module")
def client(tiny: TinyModel) -> Iterator[TestClient]:
    num_blocks = 64
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
        CacheConfig(num_blocks=num_blocks, block_size=4),
    )
    loaded = tiny.loaded
    info = EngineInfo(model_name="tiny", max_model_len=scheduler.max_request_len,
                      vocab_size=int(loaded.hf_config.vocab_size), policy="fcfs",
                      tokenizer=loaded.tokenizer, eos_token_ids=loaded.eos_token_ids)
    engine = EngineClient.in_process(scheduler, tiny.runner(block_size=4, num_kv_blocks=num_blocks),
                               info)
    limits = RequestLimits(max_prompt_logprobs_entries=200)
    with TestClient(build_app(engine, ServerConfig(limits=limits))) as test_client:
        yield test_client
        assert_whole(test_client.get("/scheduler/state?check=1").json())


@torch.inference_mode()
def hf_logprobs(tiny: TinyModel, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's float32 logits: row i scores the token after position i."""
    return torch.log_softmax(tiny.hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def complete(client: TestClient, **body) -> dict:
    response = client.post("/v1/completions", json={"temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def streamed_choices(client: TestClient, **body) -> dict[int, list[dict]]:
    """Each choice's chunks, in order."""
    chunks: dict[int, list[dict]] = {}
    with client.stream("POST", "/v1/completions",
                       json={"temperature": 0, **body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    chunks.setdefault(choice["index"], []).append(choice)
    return chunks


def joined(chunks: list[dict]) -> dict:
    """A choice's chunks as the non-streamed choice has it (text, logprobs, finish)."""
    logprobs: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
    for chunk in chunks:
        for key, values in (chunk["logprobs"] or {}).items():
            logprobs[key] += values
    return {"index": chunks[0]["index"], "text": "".join(c["text"] for c in chunks),
            "logprobs": logprobs, "finish_reason": chunks[-1]["finish_reason"],
            "num_preemptions": chunks[-1]["num_preemptions"]}


def assert_prompt_scored(tiny: TinyModel, ids: list[int], logprobs: dict, k: int) -> None:
    """The first len(ids) entries of `logprobs` are the prompt's, as the model has them."""
    tokenizer = tiny.loaded.tokenizer
    expected = hf_logprobs(tiny, ids)
    texts = [tokenizer.decode([i]) for i in ids]
    assert logprobs["tokens"][: len(ids)] == texts
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    got = torch.tensor(logprobs["token_logprobs"][1 : len(ids)])
    chosen = expected[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(got, chosen, rtol=0, atol=TOLERANCE)
    best = expected[:-1].topk(k, dim=-1)
    for i, top in enumerate(logprobs["top_logprobs"][1 : len(ids)]):
        want = {tokenizer.decode([t]): v for t, v in
                zip(best.indices[i].tolist(), best.values[i].tolist(), strict=True)}
        want.setdefault(texts[i + 1], chosen[i].item())
        assert top.keys() == want.keys(), (i, top, want)
        torch.testing.assert_close(torch.tensor(list(top.values())),
                                   torch.tensor([want[t] for t in top]), rtol=0, atol=TOLERANCE)
    # each token's offset is where its text starts in the echoed prompt's tokens
    offsets = [sum(map(len, texts[:i])) for i in range(len(ids))]
    assert logprobs["text_offset"][: len(ids)] == offsets


def test_echo_scores_token_id_prompts_then_the_generated_tokens(client, tiny) -> None:
    body = complete(client, prompt=PROMPT_IDS, max_tokens=3, logprobs=2, echo=True,
                    ignore_eos=True)
    [choice] = body["choices"]
    echo_text = tiny.loaded.tokenizer.decode(PROMPT_IDS)
    assert choice["text"].startswith(echo_text) and "prompt_logprobs" not in choice
    logprobs = choice["logprobs"]
    assert_prompt_scored(tiny, PROMPT_IDS, logprobs, 2)
    generated = tiny.generate(PROMPT_IDS, 3)
    tail = {key: values[len(PROMPT_IDS):] for key, values in logprobs.items()}
    assert tail["tokens"] == [tiny.loaded.tokenizer.decode([t]) for t in generated]
    assert all(lp is not None and lp <= 0 for lp in tail["token_logprobs"])
    assert all(len(top) in (2, 3) for top in tail["top_logprobs"])
    # the generated tokens' offsets follow the echoed text
    assert tail["text_offset"][0] == len(echo_text)
    assert body["usage"]["completion_tokens"] == 3


def test_string_prompts_times_n_each_scored_and_streamed_alike(client, tiny) -> None:
    """Two string prompts x n=2: every choice scores its own prompt; the stream carries
    each choice's echo and prompt logprobs in its first chunk and joins to the response."""
    tokenizer = tiny.loaded.tokenizer
    prompts = [PROMPT_TEXT, "t200 t201 t9 t9 t9"]
    request = dict(prompt=prompts, n=2, max_tokens=4, logprobs=1, echo=True, ignore_eos=True)
    choices = complete(client, **request)["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for choice in choices:
        ids = tokenizer.encode(prompts[choice["index"] // 2])
        assert choice["text"].startswith(prompts[choice["index"] // 2])
        assert_prompt_scored(tiny, ids, choice["logprobs"], 1)
        assert len(choice["logprobs"]["tokens"]) == len(ids) + 4
    streamed = streamed_choices(client, **request)
    for index, chunks in streamed.items():
        prompt = prompts[index // 2]
        assert chunks[0]["text"].startswith(prompt)
        assert len(chunks[0]["logprobs"]["tokens"]) > len(tokenizer.encode(prompt))
        assert all(not c["text"].startswith(prompt) for c in chunks[1:])
    assert [joined(streamed[i]) for i in range(4)] == choices


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(client, tiny) -> None:
    request = dict(prompt=PROMPT_TEXT, max_tokens=0, logprobs=3, echo=True)
    body = complete(client, **request)
    [choice] = body["choices"]
    ids = tiny.loaded.tokenizer.encode(PROMPT_TEXT)
    assert choice["text"] == PROMPT_TEXT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert_prompt_scored(tiny, ids, choice["logprobs"], 3)
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] == len(ids)
    [chunks] = streamed_choices(client, **request).values()
    assert joined(chunks) == choice
    # without logprobs: the text alone
    plain = complete(client, prompt=PROMPT_TEXT, max_tokens=0, echo=True)["choices"][0]
    assert plain["text"] == PROMPT_TEXT and plain["logprobs"] is None
    response = client.post("/v1/completions", json={"prompt": PROMPT_TEXT, "max_tokens": 0})
    assert_openai_error(response, 400, "max_tokens 0 is only allowed with echo")


def test_a_prefix_cache_hit_changes_no_prompt_logprob(client) -> None:
    """Scored once, then the prompt served (its blocks cached), then scored again: the
    echo bypasses the cache (no cached tokens) and gives the very same values."""
    prompt = [*PROMPT_IDS, 44, 45, 46]
    request = dict(prompt=prompt, max_tokens=1, logprobs=2, echo=True)
    first = complete(client, **request)
    plain = complete(client, prompt=prompt, max_tokens=1)
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    again = complete(client, **request)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]


def test_echo_logprobs_ask_within_the_prompt_logprobs_budget(client) -> None:
    """13 tokens x (k + 1) x n against --max-prompt-logprobs-entries 200 (a 400 before any
    work), as prompt_logprobs does."""
    request = dict(prompt=PROMPT_IDS, max_tokens=1, echo=True, logprobs=3)
    complete(client, **request, n=3)  # 13 x 4 x 3 = 156
    response = client.post("/v1/completions", json={**request, "n": 4})  # 208
    assert_openai_error(response, 400, "echo with logprobs asks for 208",
                        "--max-prompt-logprobs-entries")
    assert response.json()["error"]["param"] == "logprobs"
    # echo without logprobs computes no prompt logprobs: no budget
    complete(client, prompt=PROMPT_IDS, max_tokens=1, echo=True, n=4)


def test_prompt_logprobs_beside_echo_keep_their_own_k(client) -> None:
    """prompt_logprobs 1 with echo's logprobs 3: the engine computes the top 3 once; each
    field shows its own k, the same values."""
    [choice] = complete(client, prompt=PROMPT_IDS, max_tokens=1, echo=True, logprobs=3,
                        prompt_logprobs=1)["choices"]
    entries, logprobs = choice["prompt_logprobs"], choice["logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPT_IDS)
    assert all(len(entry) in (1, 2) for entry in entries[1:])
    assert all(len(top) in (3, 4) for top in logprobs["top_logprobs"][1 : len(PROMPT_IDS)])
    for i, entry in enumerate(entries[1:], 1):
        assert entry[str(PROMPT_IDS[i])]["logprob"] == logprobs["token_logprobs"][i]
