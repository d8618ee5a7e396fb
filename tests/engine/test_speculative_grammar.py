"""Speculative decoding under a grammar: drafts checked against it (cut at the first token
it rejects or one that ends it, the matcher left as it was), a mask per verified position
(the state after the drafts before it; late draft masks only stop the drafts), and through
the engine core on a tiny random model: greedy tokens as without speculation for a JSON
schema, a regex and a choice, with drafts accepted; aborts mid-verification leak nothing."""

from __future__ import annotations

import threading

import pytest

from engine.core import EngineCore
from engine.messages import AddRequests, FinishRequests, NewRequest
from kvcache.config import CacheConfig
from scheduler.config import SchedulerConfig, SpeculativeConfig
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from structured.compiler import GrammarCompiler, build_ll_tokenizer, fast_tokenizer_json
from structured.grammars import choice_grammar, json_schema_grammar, regex_grammar
from structured.matchers import MaskTask, StepMasks, StructuredOutputs
from tests.conftest import BYTE_EOS
from tests.support.model_helpers import TinyModel, make_repeating_model
from tests.support.structured_helpers import VOCAB_SIZE, allowed_tokens, make_structured

# ------------------------------------------------------------------ the matchers


def constrained(structured: StructuredOutputs, request_id: str, grammar: str) -> Request:
    structured.compiler.compile(grammar).result(timeout=10)
    request = Request(request_id, [1, 2, 3], SamplingParams(grammar=grammar),
                      eos_token_ids=frozenset({BYTE_EOS}))
    assert structured.add(request)
    return request


def verifying(request_id: str, drafts: bytes) -> ScheduledRequest:
    return ScheduledRequest(request_id, [3, *drafts], 3, [0], True, SamplingParams(), [], [],
                            num_draft_tokens=len(drafts))


def test_drafts_are_cut_at_the_first_rejected_token_and_before_the_grammars_end() -> None:
    structured = make_structured()
    constrained(structured, "r", regex_grammar("abcab"))
    assert structured.num_valid_drafts("r", list(b"abx")) == 2
    assert structured.num_valid_drafts("r", list(b"xab")) == 0
    # "abcab" ends the grammar: its last token would end it in a plain step too
    assert structured.num_valid_drafts("r", [*b"abcab", BYTE_EOS]) == 4
    assert structured.num_valid_drafts("unconstrained", list(b"ab")) == 0
    # the matcher is where it was: at the start
    (masks,) = [structured.bitmask(SchedulerOutput([verifying("r", b"")])).result(timeout=10)]
    assert allowed_tokens(masks.bitmask, 0) == [ord("a")]


def test_each_verified_position_gets_the_mask_after_the_drafts_before_it() -> None:
    structured = make_structured()
    request = constrained(structured, "r", regex_grammar("(ab|ac)d"))
    plan = SchedulerOutput([verifying("r", b"a"), verifying("free", b"zz")])
    masks = structured.bitmask(plan).result(timeout=10)
    assert masks.rows == {"r": 0} and masks.num_draft_rows == {"r": 1}
    assert allowed_tokens(masks.bitmask, 0) == [ord("a")]
    assert allowed_tokens(masks.bitmask, 1) == [ord("b"), ord("c")]
    # the accepted tokens reach the matcher once, through accept
    request.append_output_token(ord("a"))
    request.append_output_token(ord("c"))
    structured.accept(request)
    masks = structured.bitmask(SchedulerOutput([verifying("r", b"")])).result(timeout=10)
    assert allowed_tokens(masks.bitmask, 0) == [ord("d")]


class _GatedCopy:
    """A matcher whose copies wait for `gate` before their first token (a slow draft
    mask), once `reached` is set."""

    def __init__(self, matcher, reached: threading.Event, gate: threading.Event) -> None:
        self._matcher, self._reached, self._gate = matcher, reached, gate

    def deep_copy(self) -> _GatedCopy:
        return _GatedCopy(self._matcher.deep_copy(), self._reached, self._gate)

    def consume_token(self, token_id: int) -> bool:
        self._reached.set()
        self._gate.wait()
        return self._matcher.consume_token(token_id)

    def __getattr__(self, name: str):
        return getattr(self._matcher, name)


def test_late_draft_masks_leave_the_first_mask_and_the_matcher_usable() -> None:
    structured = make_structured()
    constrained(structured, "r", regex_grammar("[a-c]+"))
    reached, gate = threading.Event(), threading.Event()
    matcher = _GatedCopy(structured._matchers["r"], reached, gate)
    masks = StepMasks([MaskTask("r", matcher, list(b"ab"))], (VOCAB_SIZE + 31) // 32)
    filler = threading.Thread(target=masks.fill)
    filler.start()
    try:
        assert reached.wait(10)  # the first mask is done, the drafts' are under way
        late = masks.result("late")
        assert late.rows == {"r": 0} and not late.failed and late.num_draft_rows == {}
        # the request's own matcher is free: the engine may feed it
        assert structured._matchers["r"].consume_token(ord("c"))
    finally:
        gate.set()
        filler.join()
    assert masks.result("late").num_draft_rows == {"r": 2}


# ------------------------------------------------------------------ the engine

LIVE_IDS = 512
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
PEOPLE = {"type": "array", "minItems": 6, "maxItems": 6,
          "items": {"type": "object", "properties": {"name": {"type": "string",
                                                                 "maxLength": 3}},
                    "required": ["name"], "additionalProperties": False}}
GRAMMARS = {
    "schema": json_schema_grammar(PEOPLE),
    "regex": regex_grammar("(ab|abc){4,12}!"),
    "choice": choice_grammar(["no way, not today", "yes yes yes yes yes yes yes"]),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyModel:
    return make_repeating_model(tmp_path_factory.mktemp("llama"), LIVE_IDS)


def build(tiny: TinyModel, speculative: SpeculativeConfig | None,
          async_scheduling: bool = False) -> EngineCore:
    loaded = tiny.loaded
    config = SchedulerConfig(policy="priority", max_num_seqs=8, max_num_batched_tokens=48,
                             max_model_len=256, async_scheduling=async_scheduling,
                             speculative=speculative)
    scheduler = Scheduler(config, CacheConfig(num_blocks=64, block_size=4))
    ll_tokenizer = build_ll_tokenizer(fast_tokenizer_json(loaded.tokenizer),
                                      int(loaded.hf_config.vocab_size),
                                      sorted(loaded.eos_token_ids))
    return EngineCore(scheduler, tiny.runner(block_size=4, num_kv_blocks=64),
                      loaded.eos_token_ids, structured=StructuredOutputs(
                          GrammarCompiler(ll_tokenizer)))


def run(core: EngineCore, aborts: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Each grammar's greedy tokens (prompts that repeat a word), step by step to the end;
    `aborts`: a request aborted once it has that many tokens."""
    core.apply(AddRequests([
        NewRequest(request_id=name, prompt_token_ids=[1, 2] + [100 + i] * 4 + [7, 8] * 6,
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=60,
                                                  grammar=grammar))
        for i, (name, grammar) in enumerate(GRAMMARS.items())
    ]))
    tokens: dict[str, list[int]] = {}
    while core.has_work:
        for delta in core.step_fn().deltas:
            assert delta.error is None, delta.error
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        for request_id, n in (aborts or {}).items():
            if len(tokens.get(request_id, ())) >= n:
                core.apply(FinishRequests([request_id], stopped=False))
    core.scheduler.check_integrity()
    assert core.scheduler.kv_cache.num_free_blocks == core.scheduler.kv_cache.num_blocks
    assert not core.structured._matchers  # type: ignore[union-attr]
    return tokens


@pytest.fixture(scope="module")
def without_speculation(tiny) -> dict[str, list[int]]:
    return run(build(tiny, None))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "overlapped"])
def test_greedy_tokens_under_a_grammar_are_those_without_speculation(
    tiny, without_speculation, async_scheduling
) -> None:
    core = build(tiny, SPEC, async_scheduling=async_scheduling)
    got = run(core)
    assert got == without_speculation
    stats = core.scheduler.stats.spec_decode
    assert stats is not None and stats.num_accepted_tokens > 0
    text = tiny.loaded.tokenizer.decode(got["choice"])
    assert text in ("no way, not today", "yes yes yes yes yes yes yes")


def test_aborts_mid_verification_leak_no_block(tiny, without_speculation) -> None:
    core = build(tiny, SPEC, async_scheduling=True)
    got = run(core, aborts={"schema": 5, "regex": 3})
    assert got["choice"] == without_speculation["choice"]
    assert 5 <= len(got["schema"]) < len(without_speculation["schema"])
