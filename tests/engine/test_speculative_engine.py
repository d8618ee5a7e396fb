"""Speculative decoding through the engine core on a tiny random model: greedy tokens (and
their logprobs) as without speculation, in plain and overlapped steps, under preemption,
with prefix hits, n > 1 and aborts; the pool whole afterwards."""

from __future__ import annotations

import pytest

from engine.core import EngineCore
from engine.messages import AddRequests, FinishRequests, NewRequest
from engine.metrics import ServerMetrics
from kvcache.config import CacheConfig
from scheduler.config import SchedulerConfig, SpeculativeConfig
from scheduler.placement import Placement
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.speculation import SpecDecodeStats
from tests.support.metrics import metric_in
from tests.support.model_helpers import TinyModel, make_repeating_model

LIVE_IDS = 64
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyModel:
    return make_repeating_model(tmp_path_factory.mktemp("llama"), LIVE_IDS)


def build(tiny: TinyModel, speculative: SpeculativeConfig | None, num_blocks: int,
          async_scheduling: bool = False) -> EngineCore:
    config = SchedulerConfig(policy="priority", max_num_seqs=8, max_num_batched_tokens=48,
                             max_model_len=256, async_scheduling=async_scheduling,
                             speculative=speculative)
    scheduler = Scheduler(config, CacheConfig(num_blocks=num_blocks, block_size=4))
    return EngineCore(scheduler, tiny.runner(block_size=4, num_kv_blocks=num_blocks),
                      frozenset({2}))


def requests() -> list[NewRequest]:
    """Greedy requests (one with logprobs), prompts sharing a prefix, a choice of n = 2,
    and a sampled one."""
    out = []
    for i in range(6):
        params = SamplingParams(temperature=0.0, max_tokens=30 + 4 * i, ignore_eos=True,
                                logprobs=2 if i == 1 else None)
        prompt = [3 + (5 * j) % 11 for j in range(12)] + [40 + i] * (2 + i)
        out.append(NewRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                              sampling_params=params, arrival_time=i,
                              placement=Placement(priority=i % 3)))
    out.append(NewRequest(request_id="r0-choice", prompt_token_ids=out[0].prompt_token_ids,
                          sampling_params=out[0].sampling_params, arrival_time=0,
                          prompt_leader_id="r0"))
    out.append(NewRequest(request_id="sampled", prompt_token_ids=[7, 8, 9] * 4, arrival_time=9,
                          sampling_params=SamplingParams(temperature=1.0, seed=3,
                                                         max_tokens=40, ignore_eos=True)))
    return out


def run(core: EngineCore, abort_after: dict[str, int]) -> tuple[dict, dict]:
    """Step until done: each request's tokens and logprobs."""
    core.apply(AddRequests(requests()))
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while core.has_work:
        for delta in core.step_fn().deltas:
            assert delta.error is None, delta.error
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            logprobs.setdefault(delta.request_id, []).extend(
                lp.logprob for lp in delta.logprobs or ())
        for request_id, n in abort_after.items():
            if len(tokens.get(request_id, ())) >= n:
                core.apply(FinishRequests([request_id], stopped=False))
    scheduler = core.scheduler
    scheduler.check_integrity()
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    return tokens, logprobs


ABORTS = {"r4": 6}


@pytest.fixture(scope="module")
def without_speculation(tiny) -> tuple[dict, dict]:
    return run(build(tiny, None, num_blocks=48), ABORTS)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "overlapped"])
def test_greedy_tokens_are_those_without_speculation(
    tiny, without_speculation, async_scheduling
) -> None:
    aborts = ABORTS
    want, want_logprobs = without_speculation
    core = build(tiny, SPEC, num_blocks=48, async_scheduling=async_scheduling)
    got, got_logprobs = run(core, aborts)
    stats = core.scheduler.stats
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_tokens > 0
    assert stats.spec_decode is not None and stats.spec_decode.num_accepted_tokens > 0
    for request_id, tokens in want.items():
        if request_id not in ("sampled", *aborts):
            assert got[request_id] == tokens, request_id
    assert got["r0-choice"] == got["r0"]
    assert len(got["sampled"]) == 40
    assert got_logprobs["r1"] == pytest.approx(want_logprobs["r1"], abs=1e-4)


def test_the_metrics_count_the_scheduler_counters_once() -> None:
    metrics = ServerMetrics("m")
    first = SpecDecodeStats(2, 7, 3, (2, 1, 0), {0: 4, -5: 3}, {0: 1, -5: 2})
    metrics.inc_spec_decode(first, SpecDecodeStats())
    metrics.inc_spec_decode(SpecDecodeStats(3, 10, 5, (3, 1, 1), {0: 4, -5: 6},
                                            {0: 1, -5: 4}), first)
    text = metrics.render().decode()
    assert metric_in(text, "pagedserve_spec_decode_num_drafts_total") == 3
    assert metric_in(text, "pagedserve_spec_decode_num_draft_tokens_total") == 10
    assert metric_in(text, "pagedserve_spec_decode_num_accepted_tokens_total") == 5
    assert metric_in(text, "pagedserve_spec_decode_num_accepted_tokens_per_pos_total",
                     position="2") == 1
    assert metric_in(text, "pagedserve_spec_decode_num_accepted_tokens_by_priority_total",
                     priority="-5") == 4
    assert metric_in(text, "pagedserve_spec_decode_num_draft_tokens_by_priority_total",
                     priority="0") == 4
