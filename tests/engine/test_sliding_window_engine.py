"""A model windowed in every layer, on the real runner under the real scheduler: each
request's blocks behind its window are freed while it runs and handed to other requests,
and greedy tokens still equal Hugging Face `generate`'s (float32), through chunked
prefill, a prefix-cache hit and preemptions, with plain and overlapped steps.

The model: a tiny random Gemma 2 whose every layer is local (window 8), with its soft caps;
the core built for it frees early, and not for one with a global layer.
"""

from __future__ import annotations

import pytest
from transformers import Gemma2Config

from engine.core import EngineCore
from engine.core_setup import build_core_parts
from engine.messages import AddRequests, NewRequest
from kvcache.config import CacheConfig
from model_runner.config import ModelConfig
from model_runner.loader import load_model
from model_runner.models.sliding_windows import model_window
from scheduler.config import SchedulerConfig
from scheduler.placement import Placement
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from tests.support.model_helpers import (
    TINY,
    TinyModel,
    clear_margin_generations,
    make_model_folder,
    prompts,
)

WINDOW = 8
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyModel:
    config = Gemma2Config(**dict(TINY, num_hidden_layers=3), head_dim=16,
                          query_pre_attn_scalar=24, sliding_window=WINDOW,
                          layer_types=["sliding_attention"] * 3,
                          attn_logit_softcapping=2.0, final_logit_softcapping=20.0)
    folder = tmp_path_factory.mktemp("gemma2-local")
    hf_model = make_model_folder(folder, config, norm_noise=0.3)
    return TinyModel(hf_model, load_model(ModelConfig(model=str(folder), num_kv_blocks=1)))


@pytest.fixture(scope="module")
def expected(tiny: TinyModel) -> dict[tuple[int, ...], list[int]]:
    found = clear_margin_generations(tiny.hf, prompts([30, 22, 27, 9, 35, 18, 25], seed=5),
                                     MAX_TOKENS, min_margin=2e-3)
    assert len(found) >= 4 and max(map(len, found)) > 3 * WINDOW
    return found


def build(tiny: TinyModel, async_scheduling: bool) -> EngineCore:
    num_blocks = 14  # 6 requests of up to 47 tokens: 72 blocks if held whole
    runner = tiny.runner(block_size=4, num_kv_blocks=num_blocks)
    window = model_window(tiny.loaded.hf_config)
    assert window == WINDOW
    cache = CacheConfig(num_blocks=num_blocks, block_size=4, sliding_window=window)
    config = SchedulerConfig(policy="priority", max_num_seqs=8, max_num_batched_tokens=12,
                             max_model_len=96, async_scheduling=async_scheduling)
    return EngineCore(Scheduler(config, cache), runner, frozenset())


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "overlapped"])
def test_greedy_tokens_equal_generate_while_blocks_are_freed(tiny, expected,
                                                             async_scheduling) -> None:
    core = build(tiny, async_scheduling)
    kv = core.scheduler.kv_cache
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ordered = list(expected)
    longest = max(ordered, key=len)
    requests = [
        NewRequest(request_id=f"r{i}", prompt_token_ids=list(p), sampling_params=params,
                   placement=Placement(priority=i % 3), arrival_time=i)
        for i, p in enumerate(ordered)
    ]
    longest_id = f"r{ordered.index(longest)}"
    core.apply(AddRequests(requests))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    released = False
    steps = 0
    while core.has_work:
        for delta in core.step_fn().deltas:
            assert delta.error is None, delta.error
            tokens[delta.request_id] += delta.new_token_ids
        released |= any(kv.num_held_blocks(r) < len(kv.get_block_ids(r)) for r in kv.holders())
        steps += 1
        if tokens[longest_id] and "again" not in tokens:
            # the longest prompt again, once computed: a prefix-cache hit past the window
            tokens["again"] = []
            core.apply(AddRequests([NewRequest(request_id="again",
                                               prompt_token_ids=list(longest),
                                               sampling_params=params, arrival_time=99)]))
        assert steps < 1000
    assert released
    assert core.scheduler.num_preemptions_total > 0
    assert kv.prefix_cache_hits_tokens > 0
    for request in requests:
        assert tokens[request.request_id] == expected[tuple(request.prompt_token_ids)]
    assert tokens["again"] == expected[longest]
    core.scheduler.check_integrity()
    assert kv.usage == 0


def test_the_core_frees_early_only_for_a_model_windowed_in_every_layer(tiny, tmp_path) -> None:
    scheduler, *_ = build_core_parts(
        ModelConfig(model=tiny.loaded.model_path, num_kv_blocks=16), SchedulerConfig()
    )
    assert scheduler.kv_cache.sliding_window == WINDOW
    mixed = Gemma2Config(**dict(TINY, num_hidden_layers=2), head_dim=16, sliding_window=WINDOW)
    assert mixed.layer_types == ["sliding_attention", "full_attention"]
    make_model_folder(tmp_path, mixed)
    scheduler, *_ = build_core_parts(
        ModelConfig(model=str(tmp_path), num_kv_blocks=16), SchedulerConfig()
    )
    assert scheduler.kv_cache.sliding_window is None
