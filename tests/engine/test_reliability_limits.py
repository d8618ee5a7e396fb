"""The limits that keep one request from taking the server down: each is refused with a
400 (413 for the body size) in OpenAI's shape whose message names the limit, and the
server serves the next request. And: whatever the protocol accepts, the real sampler
samples without raising (a raise would fail every request of the step) or NaN."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from model_runner.sampler import Sampler
from scheduler.output import ScheduledRequest
from server.app import build_app
from server.config import ServerConfig
from server.limits import RequestLimits
from server.requests import MAX_MESSAGES, MAX_STOP_TOKEN_IDS, CompletionRequest
from server.tenants import TenantRegistry
from tests.support.reliability_helpers import assert_openai_error

DEFAULTS = RequestLimits()
MAX_N, MAX_LOGPROBS = DEFAULTS.max_n, DEFAULTS.max_logprobs
MAX_CHOICES = DEFAULTS.max_choices
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS = DEFAULTS.max_stop_strings, DEFAULTS.max_stop_string_chars
CONTEXT = 128  # the fake engine's max_model_len
MAX_PROMPT_CHARS = CONTEXT * len("<eos>")  # the ByteTokenizer's longest vocabulary entry
USER = {"role": "user", "content": "hi"}


@pytest.fixture
def client(make_fake_engine) -> Iterator[TestClient]:
    engine = make_fake_engine(policy="priority", start=False)
    config = ServerConfig(limits=RequestLimits(max_body_bytes=64 * 1024))
    with TestClient(build_app(engine, config)) as test_client:
        yield test_client


def ok(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "Hel"


LIMITS = [
    # (route, body, needles): the needles name the limit
    ("completions", {"prompt": "hi", "n": MAX_N + 1}, ("n", f"{MAX_N}", "--max-n")),
    ("completions", {"prompt": ["a"] * 9, "n": MAX_N},
     ("9 prompts x n=16 is 144 choices", f"limit is {MAX_CHOICES}", "--max-choices")),
    ("completions", {"prompt": [[1]] * (MAX_CHOICES + 1)}, ("--max-choices",)),
    ("completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]},
     ("5 stop strings", f"the limit is {MAX_STOP_STRINGS}", "--max-stop-strings")),
    ("completions", {"prompt": "hi", "stop": "x" * (MAX_STOP_STRING_CHARS + 1)},
     ("stop string", f"the limit is {MAX_STOP_STRING_CHARS}")),
    ("completions", {"prompt": "hi", "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)},
     ("stop_token_ids", f"the limit is {MAX_STOP_TOKEN_IDS}", "--max-stop-token-ids")),
    ("completions", {"prompt": "hi", "stop_token_ids": [5, 300], "min_tokens": 2},
     ("stop_token_ids", "300", "257 tokens")),
    ("completions", {"prompt": "hi", "logprobs": MAX_LOGPROBS + 1},
     ("logprobs", f"{MAX_LOGPROBS}")),
    ("chat", {"messages": [USER], "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
     ("top_logprobs", f"{MAX_LOGPROBS}")),
    ("chat", {"messages": [USER] * (MAX_MESSAGES + 1)},
     ("messages", f"the limit is {MAX_MESSAGES}", "--max-messages")),
    ("completions", {"prompt": "x" * (MAX_PROMPT_CHARS + 1)},
     (f"at most {MAX_PROMPT_CHARS} characters", f"{MAX_PROMPT_CHARS + 1} characters long")),
    ("completions", {"prompt": ["hi", "y" * (MAX_PROMPT_CHARS + 1)]},
     (f"at most {MAX_PROMPT_CHARS} characters",)),
    ("chat", {"messages": [{"role": "user", "content": "x" * MAX_PROMPT_CHARS}]},
     (f"at most {MAX_PROMPT_CHARS} characters", "rendered chat")),
    ("completions", {"prompt": [1] * CONTEXT},
     (f"maximum context length is {CONTEXT}", f"{CONTEXT} input tokens")),
    ("completions", {"prompt": "x" * (CONTEXT + 2)},
     (f"maximum context length is {CONTEXT}", f"{CONTEXT + 2} input tokens")),
    ("completions", {"prompt": "hi", "max_tokens": CONTEXT - 1},
     (f"maximum context length is {CONTEXT}", "2 in the prompt", f"{CONTEXT - 1} in the")),
    ("completions", {"prompt": "hi", "max_tokens": 10**30}, ("max_tokens", f"{CONTEXT}")),
    ("chat", {"messages": [USER], "max_completion_tokens": CONTEXT},
     (f"maximum context length is {CONTEXT}",)),
    ("completions", {"prompt": "hi", "min_tokens": 17}, ("min_tokens", "max_tokens")),
    ("completions", {"prompt": "hi", "repetition_penalty": 0.001},
     ("repetition_penalty", "0.01")),
]


@pytest.mark.parametrize(("route", "body", "needles"), LIMITS,
                         ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(LIMITS)])
def test_each_limit_is_a_400_naming_it(client, route, body, needles) -> None:
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    assert_openai_error(client.post(path, json=body), 400, *needles)
    ok(client)


def test_the_limits_themselves_are_accepted(client) -> None:
    bodies = [
        {"prompt": [[104]] * (MAX_CHOICES // MAX_N), "n": MAX_N, "max_tokens": 1},
        {"prompt": "hi", "max_tokens": 2, "stop": ["z" * MAX_STOP_STRING_CHARS] * 4,
         "stop_token_ids": list(range(200, 200 + MAX_STOP_TOKEN_IDS // 8)) * 8,
         "logprobs": MAX_LOGPROBS, "repetition_penalty": 0.01},
        {"prompt": "x" * (CONTEXT - 2), "max_tokens": 2},
    ]
    for body in bodies:
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
    response = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": ""}] * 2 + [USER], "max_tokens": 2,
        "logprobs": True, "top_logprobs": MAX_LOGPROBS})
    assert response.status_code == 200, response.text


def test_a_huge_prompt_is_refused_without_tokenizing_it(make_fake_engine) -> None:
    engine = make_fake_engine(start=False)
    calls = []
    tokenizer = engine.info.tokenizer
    encode = tokenizer.encode
    tokenizer.encode = lambda text, **kw: (calls.append(len(text)), encode(text, **kw))[1]
    with TestClient(build_app(engine, ServerConfig())) as client:
        huge = "x" * 1_000_000
        assert_openai_error(client.post("/v1/completions", json={"prompt": huge}), 400,
                            "characters")
        body = {"messages": [{"role": "user", "content": huge}]}
        assert_openai_error(client.post("/v1/chat/completions", json=body), 400, "characters")
        assert calls == []
        ok(client)


def test_body_size_is_a_413_naming_the_limit(client) -> None:
    response = client.post("/v1/completions", json={"prompt": "x" * 70_000})
    error = assert_openai_error(response, 413, f"larger than {64 * 1024} bytes",
                                "--max-body-bytes")
    assert error["code"] == "request_too_large"
    ok(client)


def test_a_tiny_temperature_is_greedy() -> None:
    for temperature in (1e-300, 1e-9, 9e-6):
        request = CompletionRequest.model_validate({"prompt": "hi", "temperature": temperature})
        assert request.to_sampling_params(4, None).greedy
    request = CompletionRequest.model_validate({"prompt": "hi", "temperature": 1e-5})
    assert request.to_sampling_params(4, None).temperature == 1e-5


VOCAB = 300
_extremes = st.fixed_dictionaries({}, optional={
    "temperature": st.sampled_from([0.0, 1e-300, 1e-9, 1e-5, 2.0]) | st.floats(0, 2),
    "top_p": st.sampled_from([1e-300, 1e-9, 1.0]) | st.floats(0, 1, exclude_min=True),
    "top_k": st.sampled_from([-1, 0, 1, VOCAB - 1, VOCAB, VOCAB + 1, 2**31, 10**30]),
    "min_p": st.sampled_from([0.0, 1e-300, 1.0]) | st.floats(0, 1),
    "presence_penalty": st.sampled_from([-2.0, 2.0]) | st.floats(-2, 2),
    "frequency_penalty": st.sampled_from([-2.0, 2.0]) | st.floats(-2, 2),
    "repetition_penalty": st.sampled_from([0.01, 10.0]) | st.floats(0.01, 10),
    "seed": st.sampled_from([-(2**63), 2**63 - 1, 0]) | st.integers(-(2**63), 2**63 - 1),
    "min_tokens": st.integers(0, 8),
    "stop_token_ids": st.lists(st.sampled_from([0, 1, VOCAB - 1, VOCAB, 10**30]), max_size=4),
    "logprobs": st.sampled_from([0, 1, MAX_LOGPROBS]),
    "ignore_eos": st.booleans(),
    "n": st.integers(1, 3),
})


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.filter_too_much])
@given(fields=_extremes, num_outputs=st.integers(0, 12), seed=st.integers(0, 2**16))
def test_whatever_the_server_accepts_the_sampler_samples(fields, num_outputs, seed) -> None:
    try:
        request = CompletionRequest.model_validate({"prompt": [1, 2], "max_tokens": 16, **fields})
    except ValidationError:
        assume(False)
    assume(all(t < VOCAB for t in request.stop_token_ids or ()))  # the server's vocab check
    params = request.to_sampling_params(16, request.logprobs)
    torch.manual_seed(seed)
    rows, generators = [], []
    for i in range(request.n):
        outputs = torch.randint(0, VOCAB, (num_outputs,)).tolist()
        rows.append(ScheduledRequest(f"r{i}", [1], 2, [0], True, params, [1, 2], outputs))
        if params.seed is None:
            generators.append(None)
        else:  # what the runner does, with seed + i for the i-th of n samples
            generators.append(torch.Generator().manual_seed(params.seed + i))
    logits = torch.randn(request.n, VOCAB) * 30
    out = Sampler(torch.device("cpu"), frozenset({0}))(logits, rows, generators)
    assert all(0 <= t < VOCAB for t in out.token_ids)
    for sample in out.logprobs:
        assert (sample is None) == (params.logprobs is None)
        if sample is not None:
            assert math.isfinite(sample.logprob), (fields, sample)
            assert all(math.isfinite(lp) for _, lp in sample.top), (fields, sample)


def test_the_api_key_is_matched_by_its_hash_and_never_held(make_fake_engine) -> None:
    """A key is looked up by its sha256 (its timing tells nothing of the key) and the
    server keeps only the digest."""
    engine = make_fake_engine(start=False)
    tenants = TenantRegistry.single("s3cret")
    with TestClient(build_app(engine, ServerConfig(api_key="s3cret"), tenants)) as client:
        body = {"prompt": "hi", "max_tokens": 1}
        for auth, status in (("Basic s3cret", 401), ("Bearer s3creT", 401),
                             ("Bearer s3cret", 200), ("bearer  s3cret", 200)):
            response = client.post("/v1/completions", json=body, headers={"Authorization": auth})
            assert response.status_code == status, auth
    held = repr(vars(tenants)) + repr([vars(t) for t in tenants._by_name.values()])
    assert "s3cret" not in held and hashlib.sha256(b"s3cret").hexdigest() in held
