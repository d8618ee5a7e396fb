"""Request validation and response shapes of the OpenAI protocol models."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from server.requests import ChatCompletionRequest, CompletionRequest
from server.responses import CompletionStreamChoice, DeltaMessage


def completion(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **kw})


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **kw}
    )


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_prompt_forms(prompt, prompts) -> None:
    assert completion(prompt=prompt).prompts == prompts


@pytest.mark.parametrize("prompt", [[], [1, "a"], [[]], [-1], [True], [1.5], {"a": 1}, None])
def test_invalid_prompts(prompt) -> None:
    with pytest.raises(ValidationError):
        completion(prompt=prompt)


def test_unknown_fields_are_ignored_and_defaults_apply() -> None:
    req = completion(frobnicate=3, logit_bias={"1": 2})
    params = req.to_sampling_params(16, None)
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.top_k == 0
    assert params.max_tokens == 16 and params.logprobs is None


def test_nulls_mean_defaults() -> None:
    params = completion(temperature=None, top_p=None, max_tokens=None).to_sampling_params(16, 2)
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.logprobs == 2


def test_sampling_fields_reach_sampling_params() -> None:
    req = completion(
        temperature=0, top_p=0.5, top_k=-1, min_p=0.1, seed=7, presence_penalty=1,
        frequency_penalty=-1, repetition_penalty=1.2, min_tokens=2, max_tokens=9,
        stop_token_ids=[5], ignore_eos=True,
    )
    p = req.to_sampling_params(9, None)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0, 0.5, 0, 0.1, 7)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1, -1, 1.2)
    assert (p.min_tokens, p.max_tokens, p.stop_token_ids, p.ignore_eos) == (2, 9, (5,), True)


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": -0.1},
        {"temperature": 2.5},
        {"top_p": 0},
        {"top_p": 1.1},
        {"top_k": -2},
        {"min_p": 1.5},
        {"n": 0},
        {"max_tokens": 0},
        {"logprobs": -1},
        {"presence_penalty": 3},
        {"frequency_penalty": -3},
        {"repetition_penalty": 0},
        {"min_tokens": -1},
        {"min_tokens": 5, "max_tokens": 4},
        {"stop": ""},
        {"stop_token_ids": [-1]},
        {"stream_options": {"include_usage": True}},
        {"priority": 2**40},
        {"seed": 2**70},
        {"echo": "maybe"},
        {"logit_bias": {"²": 1}},  # passes str.isdigit, fails int()
        {"logit_bias": {"١٢": 1}},
        {"logit_bias": {"1" * 19: 1}},
    ],
)
def test_out_of_bounds_fields_are_rejected(fields) -> None:
    with pytest.raises(ValidationError):
        completion(**fields)


def test_allowed_token_ids_are_deduplicated_in_order() -> None:
    assert completion(allowed_token_ids=[5, 3, 5, 3, 7]).allowed_token_ids == [5, 3, 7]
    params = completion(allowed_token_ids=[9, 9]).to_sampling_params(4, None)
    assert params.allowed_token_ids == (9,)


def test_stop_string_or_list() -> None:
    assert completion(stop="x").stop_strings == ["x"]
    assert completion(stop=["x", "y"]).stop_strings == ["x", "y"]
    assert completion().stop_strings == []


def test_stream_options_with_stream() -> None:
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage_in_stream
    assert not completion(stream=True).include_usage_in_stream


def test_chat_logprobs_and_max_tokens() -> None:
    assert chat().num_logprobs is None
    assert chat(logprobs=True).num_logprobs == 0
    assert chat(logprobs=True, top_logprobs=3).num_logprobs == 3
    assert chat(max_completion_tokens=7, max_tokens=9).requested_max_tokens == 7
    assert chat().requested_max_tokens is None
    with pytest.raises(ValidationError):
        chat(top_logprobs=3)
    with pytest.raises(ValidationError):
        chat(logprobs=True, top_logprobs=-1)


@pytest.mark.parametrize(
    "messages",
    [[], [{"role": "wizard", "content": "x"}], [{"content": "x"}],
     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]],
)
def test_invalid_chat_messages(messages) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": messages})


def test_chat_text_parts_are_joined_for_the_template() -> None:
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]})
    first, second = (m.to_template_dict() for m in req.messages)
    assert first == {"role": "user", "content": "a\nb"}
    assert second == {"role": "assistant", "content": "", "tool_calls": []}


def test_num_preemptions_only_in_the_finishing_chunk() -> None:
    middle = CompletionStreamChoice(index=0, text="a").model_dump()
    last = CompletionStreamChoice(index=0, text="", finish_reason="stop", num_preemptions=2)
    assert "num_preemptions" not in middle and middle["finish_reason"] is None
    assert last.model_dump()["num_preemptions"] == 2
    assert DeltaMessage(content="x").model_dump() == {"content": "x"}
