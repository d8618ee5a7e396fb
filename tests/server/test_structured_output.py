"""Structured outputs in the engine core: the grammar cache, the matchers' life cycle,
masked sampling, and the request fields' grammars (llguidance on a byte vocabulary)."""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from engine.core import EngineCore
from engine.messages import AddRequests, FinishRequests, NewRequest
from kvcache.config import CacheConfig
from model_runner.sampler import Sampler, apply_bitmask
from scheduler.config import SchedulerConfig
from scheduler.output import GrammarBitmask, ScheduledRequest
from scheduler.placement import Placement
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from server.limits import RequestLimits
from server.requests import CompletionRequest
from server.structured_output import GrammarError, request_grammar
from structured.compiler import GrammarCompiler
from structured.grammars import choice_grammar, json_schema_grammar, regex_grammar
from structured.matchers import GrammarState, StructuredOutputs
from tests.conftest import BYTE_EOS
from tests.support.structured_helpers import (
    MaskedRandomRunner,
    allowed_tokens,
    byte_ll_tokenizer,
    make_structured,
)

LIMITS = RequestLimits()

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


# ------------------------------------------------------------------ the cache


def test_compiler_caches_by_grammar_and_evicts_least_recent() -> None:
    compiler = GrammarCompiler(byte_ll_tokenizer(), cache_size=2)
    a, b, c = (regex_grammar(p) for p in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(a) is first
    assert compiler.num_compiles == 1
    first.result(timeout=10)
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recent
    compiler.compile(c)  # evicts b
    assert len(compiler) == 2 and compiler.num_compiles == 3
    compiler.compile(a)
    assert compiler.num_compiles == 3
    compiler.compile(b)
    assert compiler.num_compiles == 4


def test_compiler_failure_is_a_cached_value_error() -> None:
    compiler = GrammarCompiler(byte_ll_tokenizer())
    bad = regex_grammar("a(")
    with pytest.raises(ValueError, match="does not compile"):
        compiler.compile(bad).result(timeout=10)
    with pytest.raises(ValueError):
        compiler.compile(bad).result(timeout=10)
    assert compiler.num_compiles == 1


# ------------------------------------------------------------------ matchers


def _request(request_id: str, grammar: str, max_tokens: int = 64) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens, grammar=grammar),
                   eos_token_ids=frozenset({BYTE_EOS}))


def _wait_compiled(structured) -> tuple[list[Request], list]:
    deadline = time.monotonic() + 10
    ready, failed = [], []
    while structured.num_compiling and time.monotonic() < deadline:
        more, bad = structured.take_compiled()
        ready += more
        failed += bad
        time.sleep(0.001)
    return ready, failed


def test_requests_wait_for_their_grammar_in_arrival_order() -> None:
    structured = make_structured()
    gate = threading.Event()
    structured.compiler._pool.submit(gate.wait)  # the compile thread is busy
    grammar = regex_grammar("[0-9]{3}")
    first, second = _request("r0", grammar), _request("r1", grammar)
    assert not structured.add(first)
    assert not structured.add(second)
    assert structured.take_compiled() == ([], [])
    gate.set()
    ready, failed = _wait_compiled(structured)
    assert [r.request_id for r in ready] == ["r0", "r1"] and not failed
    assert structured.add(_request("r2", grammar))  # cached and nobody waiting: at once


def test_accept_ends_on_a_complete_grammar_and_flags_a_violation() -> None:
    structured = make_structured()
    grammar = json_schema_grammar(PERSON)
    structured.compiler.compile(grammar).result(timeout=10)
    done, bad = _request("done", grammar), _request("bad", grammar)
    assert structured.add(done) and structured.add(bad)
    text = '{"name":"ann","age":7,"tags":["a"]}'
    for token in text.encode()[:-1]:
        done.append_output_token(token)
    assert structured.accept(done) is GrammarState.OPEN
    done.append_output_token(ord("}"))
    assert structured.accept(done) is GrammarState.ENDED
    bad.append_output_token(ord("x"))
    assert structured.accept(bad) is GrammarState.VIOLATED
    structured.free("done")
    structured.free("bad")
    assert not structured.is_constrained("done") and not structured.is_constrained("bad")


def test_bitmask_has_rows_only_for_constrained_sampling_requests() -> None:
    structured = make_structured()
    grammar = choice_grammar(["yes", "no"])
    structured.compiler.compile(grammar).result(timeout=10)
    constrained = _request("c", grammar)
    assert structured.add(constrained)

    def scheduled(request_id: str, sample: bool) -> ScheduledRequest:
        return ScheduledRequest(request_id, [1], 0, [0], sample, SamplingParams(), [], [])

    from scheduler.output import SchedulerOutput

    plan = SchedulerOutput([scheduled("free", True), scheduled("c", True)])
    masks = structured.bitmask(plan).result(timeout=10)
    assert masks.rows == {"c": 0}
    assert allowed_tokens(masks.bitmask, 0) == sorted([ord("y"), ord("n")])
    assert structured.bitmask(SchedulerOutput([scheduled("c", False)])) is None


# ------------------------------------------------------------------ the sampler


def test_apply_bitmask_forbids_exactly_the_masked_tokens() -> None:
    logits = torch.zeros(2, 70)
    bitmask = np.zeros((1, 3), dtype=np.int32)
    bitmask[0, 1] = 1 << 3  # token 35 only
    reqs = [ScheduledRequest(i, [1], 0, [0], True, SamplingParams(), [], []) for i in "ab"]
    apply_bitmask(logits, reqs, GrammarBitmask({"b": 0}, bitmask))
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [35]


def test_sampler_applies_allowed_token_ids_and_logit_bias() -> None:
    sampler = Sampler(torch.device("cpu"), frozenset({0}))
    params = [SamplingParams(temperature=0.0, allowed_token_ids=(5, 9)),
              SamplingParams(temperature=0.0, logit_bias=((7, 100.0),))]
    reqs = [ScheduledRequest(str(i), [1], 0, [0], True, p, [], []) for i, p in enumerate(params)]
    logits = torch.arange(20, dtype=torch.float32).repeat(2, 1)
    out = sampler(logits, reqs, [None, None])
    assert out.token_ids == [9, 7]


# ------------------------------------------------------------------ the core


def _core(structured, num_blocks: int = 64, max_num_seqs: int = 16) -> EngineCore:
    scheduler = Scheduler(
        SchedulerConfig(policy="priority", max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=64, max_model_len=256),
        CacheConfig(num_blocks=num_blocks, block_size=4),
    )
    return EngineCore(scheduler, MaskedRandomRunner(), frozenset({BYTE_EOS}),
                      structured=structured)


def _run(core: EngineCore, max_steps: int = 5000) -> dict[str, tuple[list[int], str | None]]:
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}
    for _ in range(max_steps):
        if not core.has_work:
            break
        for delta in core.step().deltas:
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finish_reason or delta.error:
                finish[delta.request_id] = delta.finish_reason or f"error: {delta.error}"
    return {i: (outputs[i], finish.get(i)) for i in outputs}


def _text(token_ids: list[int]) -> str:
    return bytes(t for t in token_ids if t < 256).decode()


@pytest.mark.parametrize("num_blocks", [64, 24])  # 24: a preemption storm
def test_core_outputs_follow_their_grammars(num_blocks: int) -> None:
    structured = make_structured()
    core = _core(structured, num_blocks=num_blocks)
    grammars = {"json": json_schema_grammar(PERSON), "re": regex_grammar("[a-c]{2,4}-[0-9]"),
                "choice": choice_grammar(["red", "green", "blue"])}
    new = []
    for i in range(12):
        kind = list(grammars)[i % 3]
        params = SamplingParams(max_tokens=120, grammar=grammars[kind])
        new.append(NewRequest(request_id=f"{kind}-{i}", prompt_token_ids=list(range(1, 9)),
                              sampling_params=params, placement=Placement(priority=i % 2)))
    new.append(NewRequest(request_id="free", prompt_token_ids=[1, 2],
                          sampling_params=SamplingParams(max_tokens=8)))
    core.apply(AddRequests(new))
    results = _run(core)
    assert set(results) == {r.request_id for r in new}
    for request_id, (token_ids, finish) in results.items():
        text = _text(token_ids)
        if request_id.startswith("json"):
            assert finish == "stop", (request_id, text)
            jsonschema.validate(json.loads(text), PERSON)
        elif request_id.startswith("re"):
            assert finish == "stop" and __import__("re").fullmatch("[a-c]{2,4}-[0-9]", text)
        elif request_id.startswith("choice"):
            assert finish == "stop" and text in ("red", "green", "blue")
    if num_blocks == 24:
        assert core.scheduler.num_preemptions_total > 0
    assert not structured._matchers and not structured.num_compiling
    core.scheduler.check_integrity()
    assert core.scheduler.kv_cache.usage == 0


def test_core_n_choices_share_one_compile_and_each_validates() -> None:
    structured = make_structured()
    core = _core(structured)
    grammar = json_schema_grammar(PERSON)
    params = SamplingParams(max_tokens=120, grammar=grammar)
    new = [NewRequest(request_id="r-0", prompt_token_ids=[1, 2, 3, 4, 5], sampling_params=params)]
    new += [NewRequest(request_id=f"r-{i}", prompt_token_ids=[1, 2, 3, 4, 5],
                       sampling_params=params, prompt_leader_id="r-0")
            for i in range(1, 4)]
    core.apply(AddRequests(new))
    results = _run(core)
    assert structured.compiler.num_compiles == 1
    for token_ids, finish in results.values():
        assert finish == "stop"
        jsonschema.validate(json.loads(_text(token_ids)), PERSON)


def test_core_abort_while_compiling_and_while_running_frees_everything() -> None:
    structured = make_structured()
    core = _core(structured)
    grammar = regex_grammar("[a-z]{300}")  # longer than max_tokens: runs until aborted
    params = SamplingParams(max_tokens=200, grammar=grammar)
    core.apply(AddRequests([NewRequest(request_id="early", prompt_token_ids=[1, 2],
                                       sampling_params=params)]))
    core.apply(FinishRequests(["early"]))  # still compiling
    core.apply(AddRequests([NewRequest(request_id="late", prompt_token_ids=[1, 2],
                                       sampling_params=params)]))
    deadline = time.monotonic() + 10
    while not core.scheduler.requests.get("late") and time.monotonic() < deadline:
        core.step()  # the compile runs on its own thread
    for _ in range(20):
        core.step()
    assert structured.is_constrained("late") and core.scheduler.requests["late"].output_token_ids
    core.apply(FinishRequests(["late"]))
    assert not structured._matchers and not structured.num_compiling
    assert not core.has_work
    core.scheduler.check_integrity()


def test_core_reports_a_grammar_that_fails_to_compile() -> None:
    core = _core(make_structured())
    params = SamplingParams(max_tokens=10, grammar=regex_grammar("a("))
    core.apply(AddRequests([NewRequest(request_id="bad", prompt_token_ids=[1, 2],
                                       sampling_params=params)]))
    results = _run(core)
    assert not results or results["bad"][1].startswith("error")
    assert not core.has_work


def test_the_grammar_tokenizer_is_built_for_the_first_constrained_request() -> None:
    """The core's grammar tokenizer is built at the first constrained request, which waits
    for it (no KV block, no error) while others run, then is answered within its
    grammar; a server never asked for a grammar never builds it."""
    built, builds = threading.Event(), []

    def build() -> Any:
        builds.append(built.wait())
        return byte_ll_tokenizer()

    structured = StructuredOutputs(GrammarCompiler(build))
    core = _core(structured)
    core.apply(AddRequests([NewRequest(request_id="plain", prompt_token_ids=[1, 2],
                                       sampling_params=SamplingParams(max_tokens=4))]))
    assert _run(core)["plain"][1] == "length" and not builds
    params = SamplingParams(max_tokens=20, grammar=choice_grammar(["red", "green"]))
    core.apply(AddRequests([
        NewRequest(request_id="early", prompt_token_ids=[1, 2], sampling_params=params),
        NewRequest(request_id="free", prompt_token_ids=[1, 2],
                   sampling_params=SamplingParams(max_tokens=4))]))
    early = _run(core, max_steps=20)
    assert early["free"][1] == "length" and "early" not in early
    assert structured.num_compiling == 1 and core.scheduler.kv_cache.usage == 0
    built.set()
    token_ids, finish = _run(core)["early"]
    assert finish == "stop" and _text(token_ids) in ("red", "green") and builds == [True]


def test_a_grammar_tokenizer_that_fails_to_build_fails_constrained_requests_only() -> None:
    def build() -> Any:
        raise ValueError("structured outputs are not available: no fast tokenizer")

    core = _core(StructuredOutputs(GrammarCompiler(build)))
    params = SamplingParams(max_tokens=10, grammar=regex_grammar("a+"))
    core.apply(AddRequests([
        NewRequest(request_id="r", prompt_token_ids=[1, 2], sampling_params=params),
        NewRequest(request_id="free", prompt_token_ids=[1, 2],
                   sampling_params=SamplingParams(max_tokens=4))]))
    results = _run(core)
    assert "no fast tokenizer" in (results["r"][1] or "") and results["free"][1] == "length"
    core.scheduler.check_integrity()
    assert core.scheduler.kv_cache.usage == 0


def test_core_without_structured_outputs_fails_constrained_requests() -> None:
    core = _core(None)
    params = SamplingParams(max_tokens=10, grammar=regex_grammar("a+"))
    core.apply(AddRequests([NewRequest(request_id="r", prompt_token_ids=[1, 2],
                                       sampling_params=params)]))
    message = core.idle_message()
    assert message is not None and "not available" in (message.deltas[0].error or "")


# ------------------------------------------------------------------ request fields


def _completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **fields})


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
])
def test_uncompilable_constraints_name_the_field(fields, param) -> None:
    with pytest.raises(GrammarError) as info:
        request_grammar(_completion(**fields), LIMITS)
    assert info.value.param == param


def test_constraint_kinds_become_grammars() -> None:
    assert request_grammar(_completion(), LIMITS) is None
    assert request_grammar(_completion(response_format={"type": "text"}), LIMITS) is None
    for so in ({"json": {"type": "integer"}}, {"json": '{"type": "integer"}'},
               {"regex": "[a-z]+"}, {"choice": ["a", "b"]}, {"json_object": True},
               {"grammar": 'start: "x"'}):
        assert request_grammar(_completion(structured_outputs=so), LIMITS)
    assert request_grammar(_completion(response_format={"type": "json_object"}), LIMITS)


def test_structured_outputs_take_exactly_one_kind() -> None:
    import pydantic

    with pytest.raises(pydantic.ValidationError):
        _completion(structured_outputs={"regex": "a", "choice": ["a"]})
    with pytest.raises(pydantic.ValidationError):
        _completion(structured_outputs={})


def test_random_sampling_under_a_grammar_is_reproducible() -> None:
    random.seed(0)  # the runner's own rng is seeded; the core adds no randomness
    texts = []
    for _ in range(2):
        core = _core(make_structured())
        params = SamplingParams(max_tokens=120, grammar=json_schema_grammar(PERSON))
        core.apply(AddRequests([NewRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                           sampling_params=params)]))
        texts.append(_text(_run(core)["r"][0]))
    assert texts[0] == texts[1]
