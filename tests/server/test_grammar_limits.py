"""Grammars that cannot stall a step nor crash the server: the size and nesting budgets
(each at its limit passes, one past is a 400 naming its flag), the compile and first mask
before admission (--grammar-timeout-s), and the per-step mask deadline: a late row or a
failed matcher fails its own request with an error while the step goes on for the
others (llguidance on a byte vocabulary)."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine.core import EngineCore
from engine.messages import AddRequests, NewRequest, StepOutputs
from kvcache.config import CacheConfig
from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from server.limits import RequestLimits
from server.requests import ChatCompletionRequest, CompletionRequest
from server.structured_output import GrammarError, json_depth, lark_depth, request_grammar
from structured.compiler import GrammarCompiler
from structured.grammars import choice_grammar, regex_grammar
from structured.matchers import StepMasks, StructuredOutputs
from tests.conftest import BYTE_EOS
from tests.support.structured_helpers import MaskedRandomRunner, make_structured


def _completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **fields})


def _nested_schema(depth: int) -> dict[str, Any]:
    """A JSON schema whose objects nest `depth` deep (json_depth)."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    assert json_depth(schema, depth) == depth
    return schema


def _refused(body: CompletionRequest, limits: RequestLimits) -> str:
    with pytest.raises(GrammarError) as info:
        request_grammar(body, limits)
    return str(info.value)


# ------------------------------------------------------------------ budgets


def _sized(kind: str, size: int) -> dict[str, Any]:
    """structured_outputs of `kind` whose text is exactly `size` bytes."""
    if kind == "regex":
        return {"regex": "a" * size}
    if kind == "choice":
        return {"choice": ["b" * (size - 3), "ccc"]}
    if kind == "grammar":
        head = 'start: ""'
        return {"grammar": head[:-1] + "d" * (size - len(head)) + '"'}
    if kind == "json":
        schema = json.dumps({"enum": ["e" * (size - 13)]}, separators=(",", ":"))
        assert len(schema) == size
        return {"json": schema}
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["regex", "choice", "grammar", "json"])
def test_grammar_bytes_at_the_limit_pass_and_one_past_is_refused(kind: str) -> None:
    limits = RequestLimits(max_grammar_bytes=200)
    assert request_grammar(_completion(structured_outputs=_sized(kind, 200)), limits)
    message = _refused(_completion(structured_outputs=_sized(kind, 201)), limits)
    assert "201 bytes" in message and "--max-grammar-bytes" in message


def test_a_parsed_schema_is_measured_compact() -> None:
    limits = RequestLimits(max_grammar_bytes=200)
    schema = json.loads(_sized("json", 200)["json"])
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    assert request_grammar(_completion(response_format=fmt), limits)
    schema["enum"][0] += "e"
    message = _refused(_completion(response_format=fmt), limits)
    assert message.startswith("response_format") and "--max-grammar-bytes" in message


@pytest.mark.parametrize("as_text", [False, True])
def test_schema_depth_at_the_limit_passes_and_one_past_is_refused(as_text: bool) -> None:
    limits = RequestLimits(max_grammar_depth=10)

    def body(depth: int) -> CompletionRequest:
        schema = _nested_schema(depth)
        return _completion(structured_outputs={"json": json.dumps(schema) if as_text
                                               else schema})

    assert request_grammar(body(10), limits)
    assert "--max-grammar-depth" in _refused(body(11), limits)


def test_lark_depth_at_the_limit_passes_and_one_past_is_refused() -> None:
    limits = RequestLimits(max_grammar_depth=5)

    def body(depth: int) -> CompletionRequest:
        # brackets in strings, regexes and comments do not count
        lark = 'start: ' + "(" * depth + '"((" /[(]+/' + ")" * depth + " // (((((((\n"
        return _completion(structured_outputs={"grammar": lark})

    assert lark_depth(body(5).structured_outputs.grammar) == 5  # type: ignore[union-attr]
    assert request_grammar(body(5), limits)
    message = _refused(body(6), limits)
    assert "6 levels" in message and "--max-grammar-depth" in message


def test_a_schema_nested_50k_deep_is_refused_not_a_recursion_error() -> None:
    text = '{"type":"array","items":' * 50_000 + "{}" + "}" * 50_000
    limits = RequestLimits(max_grammar_bytes=10**7)
    message = _refused(_completion(structured_outputs={"json": text}), limits)
    assert "--max-grammar-depth" in message
    assert "--max-grammar-bytes" in _refused(
        _completion(structured_outputs={"json": text}), RequestLimits())


def test_a_recursion_error_building_a_forced_tool_call_is_refused() -> None:
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})

    def build() -> str:
        raise RecursionError("maximum recursion depth exceeded")

    with pytest.raises(GrammarError) as info:
        request_grammar(body, RequestLimits(), build)
    assert info.value.param == "tool_choice" and "--max-grammar-depth" in str(info.value)


# ------------------------------------------------------------------ over HTTP


def _post(client: TestClient, **fields: Any) -> Any:
    return client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, **fields})


@pytest.mark.parametrize("structured, needle", [
    ({"grammar": "start: <[999999]>"}, "999999"),  # a token id past the vocabulary
    ({"grammar": "start: <|nope|>"}, "<|nope|>"),  # no such special token
    ({"json": '{"type":"array","items":' * 50_000 + "{}" + "}" * 50_000}, "--max-grammar"),
])
def test_what_only_the_tokenizer_aware_compile_rejects_is_a_400(
    structured_client, structured: dict[str, Any], needle: str
) -> None:
    response = _post(structured_client(), structured_outputs=structured)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "structured_outputs"
    assert needle in error["message"]


def test_a_grammar_not_compiled_in_time_is_a_400_naming_the_flag(
    structured_client, monkeypatch
) -> None:
    slow, gate = regex_grammar("[a-c]{3}"), threading.Event()
    compile_grammar = GrammarCompiler._compile

    def gated(self: GrammarCompiler, grammar: str) -> Any:
        if grammar == slow:  # compiles once the request has been answered
            gate.wait()
        return compile_grammar(self, grammar)

    monkeypatch.setattr(GrammarCompiler, "_compile", gated)
    client = structured_client(grammar_timeout_s=0.05)
    try:
        response = _post(client, structured_outputs={"regex": "[a-c]{3}"})
    finally:
        gate.set()
    error = response.json()["error"]
    assert response.status_code == 400 and "--grammar-timeout-s" in error["message"]
    assert error["param"] == "structured_outputs"
    response = _post(client, structured_outputs={"choice": ["yes", "no"]})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] in ("yes", "no")


def test_the_costly_regex_is_refused_or_fails_alone_with_an_error(structured_client) -> None:
    client = structured_client()
    response = _post(client, max_tokens=100, structured_outputs={"regex": "(a{1000}){1000}"})
    error = response.json()["error"]
    # a 400 before admission: it forces 97,908 bytes (37 MB of parser state), or its
    # compile outlived --grammar-timeout-s on a loaded machine
    assert response.status_code == 400 and error["type"] == "invalid_request_error"
    assert ("--grammar-timeout-s" in error["message"]
            or "forces 97908 bytes of output" in error["message"])
    response = _post(client, structured_outputs={"choice": ["yes", "no"]})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] in ("yes", "no")


# ------------------------------------------------------------------ the step's deadline


class _SlowMatcher:
    """A matcher whose masks wait for `gate` (a grammar slower than any deadline)."""

    def __init__(self, matcher: Any, gate: threading.Event) -> None:
        self._matcher = matcher
        self._gate = gate

    def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
        self._gate.wait()
        self._matcher.unsafe_compute_mask_ptr(pointer, size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._matcher, name)


class _FailingMatcher(_SlowMatcher):
    """A matcher whose lexer gives up at its next mask (llguidance's LexerTooComplex)."""

    def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
        self._matcher.unsafe_compute_mask_ptr(pointer, size)

    def is_error(self) -> bool:
        return True

    def get_error(self) -> str:
        return "lexer error: too many expressions constructed"


class _RaisingMatcher(_SlowMatcher):
    """A matcher whose mask raises (llguidance's API errors)."""

    def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
        raise RuntimeError("too many expressions")


def _core(structured: StructuredOutputs) -> EngineCore:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
        CacheConfig(num_blocks=64, block_size=4),
    )
    return EngineCore(scheduler, MaskedRandomRunner(), frozenset({BYTE_EOS}),
                      structured=structured)


def _start(core: EngineCore, grammars: dict[str, str | None]) -> None:
    """Add one request per grammar (None: unconstrained) and step until all run."""
    for grammar in {g for g in grammars.values() if g is not None}:
        core.structured.compiler.compile(grammar).result(timeout=10)  # type: ignore[union-attr]
    core.apply(AddRequests([
        NewRequest(request_id=request_id, prompt_token_ids=[1, 2, 3],
                   sampling_params=SamplingParams(max_tokens=50, grammar=grammar))
        for request_id, grammar in grammars.items()
    ]))


def _by_id(message: StepOutputs) -> dict[str, Any]:
    return {delta.request_id: delta for delta in message.deltas}


def _run_out(core: EngineCore) -> dict[str, str]:
    """Step to the end: each request's finish reason or error."""
    ends: dict[str, str] = {}
    for _ in range(500):
        if not core.has_work:
            break
        for delta in core.step().deltas:
            if delta.error or delta.finish_reason:
                ends[delta.request_id] = delta.error or delta.finish_reason  # type: ignore
    return ends


def test_a_late_mask_fails_only_its_request_and_the_step_goes_on(monkeypatch) -> None:
    structured = make_structured()
    structured.step_timeout_s = 0.5
    core = _core(structured)
    grammar = regex_grammar("[a-c]{20}")
    _start(core, {"slow": grammar, "fast": grammar, "free": None})
    gate = threading.Event()
    structured._matchers["slow"] = _SlowMatcher(structured._matchers["slow"], gate)
    deadlines = []

    def wait(masks: StepMasks, deadline: float | None) -> None:
        deadlines.append(deadline)  # it passes once every row but the slow one is done
        wait_all(masks, None, max_pending=1)

    wait_all = StepMasks.wait
    monkeypatch.setattr(StepMasks, "wait", wait)
    try:
        deltas = _by_id(core.step())
    finally:
        gate.set()
        monkeypatch.undo()
    assert len(deadlines) == 1 and deadlines[0] is not None
    assert deltas["slow"].error and "--grammar-step-timeout-s" in deltas["slow"].error
    assert deltas["slow"].error_status == 400  # its grammar's fault: a 400 to its client
    assert not deltas["slow"].new_token_ids and deltas["slow"].finish_reason is None
    assert len(deltas["fast"].new_token_ids) == 1 and not deltas["fast"].error
    assert chr(deltas["fast"].new_token_ids[0]) in "abc"  # under its mask
    assert len(deltas["free"].new_token_ids) == 1
    assert not structured.is_constrained("slow") and "slow" not in core.scheduler.requests
    ends = _run_out(core)
    assert ends == {"fast": "stop", "free": "length"}
    core.scheduler.check_integrity()
    assert core.scheduler.kv_cache.usage == 0 and not structured._matchers


@pytest.mark.parametrize("failing", [_FailingMatcher, _RaisingMatcher])
def test_a_matcher_error_mid_generation_ends_its_request_with_an_error(failing: type) -> None:
    structured = make_structured()
    core = _core(structured)
    grammar = choice_grammar(["yes", "no"])
    _start(core, {"bad": grammar, "good": grammar})
    structured._matchers["bad"] = failing(structured._matchers["bad"], threading.Event())
    deltas = _by_id(core.step())
    assert "too many expressions" in (deltas["bad"].error or "")
    assert deltas["bad"].error_status == 400
    assert deltas["bad"].finish_reason is None and deltas["good"].new_token_ids
    assert _run_out(core) == {"good": "stop"}
    core.scheduler.check_integrity()
    assert core.scheduler.kv_cache.usage == 0 and not structured._matchers


class _IgnoringRunner(MaskedRandomRunner):
    """A runner that samples 'z' for every row, whatever the masks allow."""

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        out = super().execute(plan)
        out.sampled_token_ids = {i: ord("z") for i in out.sampled_token_ids}
        return out


def test_a_token_outside_the_grammar_is_an_error_not_stop() -> None:
    structured = make_structured()
    core = _core(structured)
    core.runner = _IgnoringRunner()
    _start(core, {"r": regex_grammar("[a-c]+")})
    ends = _run_out(core)
    assert ends["r"].startswith("its grammar failed")
    assert core.scheduler.kv_cache.usage == 0 and not structured._matchers
