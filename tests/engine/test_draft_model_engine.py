"""Draft-model speculative decoding through the engine core on tiny random checkpoints of
one vocabulary: greedy tokens as without speculation, with a draft unlike the target and
with the target as its own draft (every draft accepted), batched under preemption, with
prefix hits, n = 2, overlapped steps and aborts mid-verification (the pool whole after);
the core's setup sizes both caches and refuses a draft model that cannot run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import LlamaConfig

from engine.client import EngineClient, EngineInfo
from engine.core import EngineCore
from engine.core_setup import build_core_parts
from engine.messages import AddRequests, FinishRequests, NewRequest
from kvcache.config import CacheConfig
from model_runner.config import ModelConfig
from model_runner.loader import LoadedModel, load_model
from model_runner.runner import ModelRunner
from scheduler.config import SchedulerConfig, SpeculativeConfig
from scheduler.placement import Placement
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from server.app import build_app
from server.config import ServerConfig
from tests.support.metrics import metric_in
from tests.support.model_helpers import CONFIGS, TINY, make_model_folder
from tests.support.server_process import free_port
from tests.support.waits import assert_whole

LIVE_IDS = 64
DRAFT_CONFIG = dict(TINY, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1)
ABORTS = {"r2": 6}
SAMPLED_PRIORITY = 3


def save_live(folder, hf_config) -> str:
    """A tiny random model in `folder` whose output rows past LIVE_IDS are zero: its greedy
    text repeats ids of a small vocabulary, so that an unlike draft is right at times."""
    hf_model = make_model_folder(folder, hf_config)
    with torch.no_grad():
        hf_model.get_output_embeddings().weight[LIVE_IDS:] = 0
    hf_model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return {
        "target": save_live(tmp_path_factory.mktemp("target"), CONFIGS["smollm2"]()),
        "draft": save_live(tmp_path_factory.mktemp("draft"),
                           LlamaConfig(**DRAFT_CONFIG, tie_word_embeddings=True)),
    }


@pytest.fixture(scope="module")
def loaded(paths) -> dict[str, LoadedModel]:
    return {name: load_model(ModelConfig(model=path, num_kv_blocks=1))
            for name, path in paths.items()}


def build(loaded: dict[str, LoadedModel], draft: str | None, num_blocks: int,
          async_scheduling: bool = False) -> EngineCore:
    spec = None
    if draft is not None:
        spec = SpeculativeConfig(method="draft_model", model=loaded[draft].model_path,
                                 num_speculative_tokens=3)
    config = SchedulerConfig(policy="priority", max_num_seqs=8, max_num_batched_tokens=48,
                             max_model_len=256, async_scheduling=async_scheduling,
                             speculative=spec)
    scheduler = Scheduler(config, CacheConfig(num_blocks=num_blocks, block_size=4))
    target = loaded["target"]
    runner = ModelRunner(target, ModelConfig(model=target.model_path, block_size=4,
                                             num_kv_blocks=num_blocks),
                         draft=None if draft is None else loaded[draft])
    return EngineCore(scheduler, runner, frozenset({2}))


def requests(sampled: bool) -> list[NewRequest]:
    """Greedy requests of priorities 0..2 whose prompts share a prefix, a choice of n = 2,
    and (`sampled`) a sampled one of its own priority."""
    out = []
    for i in range(4):
        params = SamplingParams(temperature=0.0, max_tokens=12 + 3 * i, ignore_eos=True)
        prompt = [3 + (5 * j) % 11 for j in range(12)] + [40 + i] * (2 + i)
        out.append(NewRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                              sampling_params=params, arrival_time=i,
                              placement=Placement(priority=i % 3)))
    out.append(NewRequest(request_id="r0-choice", prompt_token_ids=out[0].prompt_token_ids,
                          sampling_params=out[0].sampling_params, arrival_time=0,
                          prompt_leader_id="r0"))
    if sampled:
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
        out.append(NewRequest(request_id="sampled", prompt_token_ids=[7, 8, 9] * 4,
                              sampling_params=params, arrival_time=9,
                              placement=Placement(priority=SAMPLED_PRIORITY)))
    return out


def run(core: EngineCore, sampled: bool, abort_after: dict[str, int]) -> dict[str, list[int]]:
    """Step until done: each request's tokens; the pool whole afterwards."""
    core.apply(AddRequests(requests(sampled)))
    tokens: dict[str, list[int]] = {}
    while core.has_work:
        for delta in core.step_fn().deltas:
            assert delta.error is None, delta.error
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        for request_id, n in abort_after.items():
            if len(tokens.get(request_id, ())) >= n:
                core.apply(FinishRequests([request_id], stopped=False))
    scheduler = core.scheduler
    scheduler.check_integrity()
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    return tokens


@pytest.fixture(scope="module")
def without_speculation(loaded) -> dict[str, list[int]]:
    return run(build(loaded, None, num_blocks=24), True, ABORTS)


@pytest.mark.parametrize(("draft", "async_scheduling"), [("draft", False), ("target", True)],
                         ids=["unlike-draft", "target-as-draft-overlapped"])
def test_greedy_tokens_are_those_without_speculation(
    loaded, without_speculation, draft: str, async_scheduling: bool
) -> None:
    """A pool of 16 blocks that the batch overflows (preemptions), prefix hits, n = 2, an
    abort mid-verification; the target as its own draft has every greedy draft accepted
    (its greedy tokens are the target's; the sampled request accepts with p(draft))."""
    core = build(loaded, draft, num_blocks=16, async_scheduling=async_scheduling)
    got = run(core, True, ABORTS)
    stats = core.scheduler.stats
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_tokens > 0
    for request_id, tokens in without_speculation.items():
        if request_id not in ("sampled", *ABORTS):
            assert got[request_id] == tokens, request_id
    assert got["r0-choice"] == got["r0"]
    assert len(got["sampled"]) == 12
    spec = stats.spec_decode
    assert spec is not None and spec.num_draft_tokens > 0
    if draft == "target":
        greedy = [p for p in spec.draft_tokens_by_priority if p != SAMPLED_PRIORITY]
        assert sum(spec.accepted_tokens_by_priority[p] for p in greedy) > 0
        for p in greedy:
            assert spec.accepted_tokens_by_priority[p] == spec.draft_tokens_by_priority[p]


def test_over_http_the_text_is_the_one_without_speculation(loaded) -> None:
    """An in-process server, the target its own draft: a request's greedy text (and both
    choices of n = 2, streamed or not) is the one it gets with speculation off
    (`num_speculative_tokens` 0), and its drafts are accepted."""
    core = build(loaded, "target", num_blocks=64)
    target = loaded["target"]
    info = EngineInfo(model_name="tiny", max_model_len=core.scheduler.max_request_len,
                      vocab_size=int(target.hf_config.vocab_size), policy="priority",
                      tokenizer=target.tokenizer, eos_token_ids=target.eos_token_ids)
    engine = EngineClient.in_process(core.scheduler, core.runner, info)
    body = {"model": "tiny", "prompt": requests(False)[3].prompt_token_ids, "max_tokens": 24,
            "temperature": 0, "ignore_eos": True}
    with TestClient(build_app(engine, ServerConfig())) as client:
        def texts(**fields) -> list[str]:
            response = client.post("/v1/completions", json={**body, **fields})
            assert response.status_code == 200, response.text
            return [choice["text"] for choice in response.json()["choices"]]

        (want,) = texts(num_speculative_tokens=0)
        assert texts(n=2) == [want, want]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            chunks = [line for line in stream.iter_lines() if line.startswith("data: {")]
        assert "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks) == want
        metrics = client.get("/metrics").text
        assert metric_in(metrics, "pagedserve_spec_decode_num_accepted_tokens_total") > 0
        assert_whole(client.get("/scheduler/state?check=1").json())


def test_the_core_loads_the_draft_model_and_sizes_both_caches(paths) -> None:
    spec = SpeculativeConfig(method="draft_model", model=paths["draft"])
    model_config = ModelConfig(model=paths["target"], block_size=4, kv_cache_memory=2**20)
    scheduler, runner, *_ = build_core_parts(model_config, SchedulerConfig(speculative=spec))
    assert isinstance(runner, ModelRunner) and runner.draft is not None
    # float32 blocks of 4 tokens: 2048 bytes of the target's, 512 of the draft's
    assert scheduler.kv_cache.num_blocks == runner.num_kv_blocks == 2**20 // (2048 + 512)


@pytest.mark.parametrize(("draft", "tp", "error", "needle"), [
    ("missing", 1, FileNotFoundError, "not a local folder"),
    ("wide-vocab", 1, ValueError, "vocabulary of 49216 ids"),
    ("draft", 2, ValueError, "tensor-parallel-size"),
])
def test_a_draft_model_that_cannot_run_fails_the_start(
    paths, tmp_path, draft: str, tp: int, error: type, needle: str
) -> None:
    path = {"missing": str(tmp_path / "missing"), "draft": paths["draft"]}.get(draft)
    if draft == "wide-vocab":
        path = save_live(tmp_path, LlamaConfig(**dict(DRAFT_CONFIG, vocab_size=49216)))
    spec = SpeculativeConfig(method="draft_model", model=path)
    with pytest.raises(error, match=needle):
        build_core_parts(ModelConfig(model=paths["target"], num_kv_blocks=16,
                                     tensor_parallel_size=tp),
                         SchedulerConfig(speculative=spec))


def test_the_server_exits_non_zero_naming_a_bad_draft_model(paths, tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", paths["target"],
         "--num-kv-blocks", "16", "--port", str(free_port()),
         "--speculative-model", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0
    assert f"model {str(tmp_path / 'missing')!r} is not a local folder" in done.stderr
