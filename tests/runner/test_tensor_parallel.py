"""Tensor parallelism on the CPU: 2 ranks over gloo (this process is rank 0, one worker
process is rank 1, one torch thread each), float32, tiny random Llama, Qwen2, Qwen3 and
Gemma 2 (local layers of an 8-token window that the prompts cross, soft caps).

Greedy output is token for token that of one rank and of Hugging Face `generate`: batched,
chunked, and under the real scheduler with prefix caching, chunked prefill and preemption
(the workers' mirrored block tables). The models cover tied and untied embeddings, a
vocabulary of odd size (not divisible by 2), one KV head for two ranks (replicated),
o/down biases (a row-parallel bias is added once), and a mixture of experts (Qwen2-MoE).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

import msgspec
import pytest
import torch
from transformers import Gemma2Config, LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config

from kvcache.config import CacheConfig
from model_runner.config import ModelConfig
from model_runner.distributed.tensor_parallel import RanksOutOfStep
from model_runner.distributed.tp_plan import BlockTables, PlanWriter, StepPlan
from model_runner.distributed.tp_workers import start_tensor_parallel
from model_runner.loader import load_model
from model_runner.runner import ModelRunner
from scheduler.config import SchedulerConfig, SpeculativeConfig
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.placement import Placement
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from tests.support.model_helpers import TINY, VOCAB, RunnerLoop, Seq, make_model_folder

TP_CONFIGS = {
    # tied, odd vocabulary (one past the tokenizer's), 1 KV head for 2 ranks, o_proj and
    # down_proj biases
    "llama": lambda: LlamaConfig(**{**TINY, "vocab_size": VOCAB + 1, "num_key_value_heads": 1},
                                 tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),  # q/k/v biases
    # q/k norm; 3 KV heads, split 2 and 1 (as SmolLM2-135M's)
    "qwen3": lambda: Qwen3Config(**{**TINY, "num_attention_heads": 6, "num_key_value_heads": 3},
                                 head_dim=32, tie_word_embeddings=False),
    "gemma2": lambda: Gemma2Config(**TINY, head_dim=16, query_pre_attn_scalar=16,
                                   sliding_window=8, attn_logit_softcapping=20.0,
                                   final_logit_softcapping=30.0),
    # experts (each one's width split 12 and 12), a gated shared expert, a dense layer 1
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, mlp_only_layers=[1],
    ),
}
MAX_TOKEN_ID = 250  # prompts stay inside every vocabulary above


@dataclass
class Models:
    hf: torch.nn.Module
    single: ModelRunner  # one rank
    tp: ModelRunner  # rank 0 of two
    deaths: list[str]

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        out = self.hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=0)
        return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=list(TP_CONFIGS))
def models(request, tmp_path_factory) -> Iterator[Models]:
    folder = tmp_path_factory.mktemp(f"tp-{request.param}")
    hf = make_model_folder(folder, TP_CONFIGS[request.param]())
    config = ModelConfig(model=str(folder), block_size=4, num_kv_blocks=128)
    single = ModelRunner(load_model(config), config)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # shared by the two ranks: one thread each
    deaths: list[str] = []
    try:
        _, tp = start_tensor_parallel(replace(config, tensor_parallel_size=2), deaths.append)
        try:
            yield Models(hf, single, tp, deaths)
            tp.workers.close()  # EOF on its socket: the worker exits by itself
            assert [p.returncode for p in tp.workers.processes] == [0]
        finally:
            tp.model.tp.close()  # whatever happened, the next module can start its group
    finally:
        torch.set_num_threads(threads)
    assert not deaths


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, MAX_TOKEN_ID, (n,), generator=gen).tolist() for n in lengths]


def seqs(prompts: list[list[int]], max_tokens: int, tag: str) -> list[Seq]:
    """NOTE: ids unique per test: the engine loop never finishes a request, so the
    workers would still hold the block table of an id used before."""
    return [Seq(f"{tag}-{i}", p, max_tokens) for i, p in enumerate(prompts)]


def test_plan_carries_new_tokens_and_blocks_only():
    """What a step sends: the chunk's tokens and the blocks the workers lack; a freed
    (finished or preempted) table is dropped and sent whole when the request comes back."""
    writer, tables = PlanWriter(), BlockTables()

    def step(*requests: tuple[str, list[int], int, list[int]]) -> tuple[StepPlan, list]:
        scheduled = [ScheduledRequest(i, t, n, b, True, SamplingParams(), list(range(99)), [])
                     for i, t, n, b in requests]
        data = writer.plan(scheduled)
        plan = msgspec.msgpack.decode(data, type=StepPlan)
        return plan, [(r.request_id, r.token_ids, r.num_computed_tokens, list(r.block_table))
                      for r in tables.apply(data)[0]]

    plan, seen = step(("a", [5, 6, 7, 8, 9], 0, [3, 4]))
    assert [r.new_block_ids for r in plan.requests] == [[3, 4]]
    assert seen == [("a", [5, 6, 7, 8, 9], 0, [3, 4])]
    plan, seen = step(("a", [10], 5, [3, 4]), ("b", [1, 2], 0, [7]))
    assert [r.new_block_ids for r in plan.requests] == [[], [7]]
    plan, seen = step(("a", [11], 6, [3, 4, 9]))
    assert plan.requests[0].new_block_ids == [9] and seen[0][3] == [3, 4, 9]
    writer.forget(["a", "unknown"])
    plan, seen = step(("a", [5, 6, 7, 8, 9, 10, 11, 12], 4, [3, 8, 2]))  # resumed, cached head
    assert plan.forget_ids == ["a"] and plan.requests[0].new_block_ids == [3, 8, 2]
    assert seen == [("a", [5, 6, 7, 8, 9, 10, 11, 12], 4, [3, 8, 2])]
    assert len(tables) == 2


class RecordingWorkers:
    """Stands in for the worker processes: records what rank 0 sends them."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []
        self.steps: list[list[str]] = []

    def forget(self, request_ids) -> None:
        self.forgotten += request_ids

    def send_step(self, requests) -> None:
        self.steps.append([r.request_id for r in requests])

    def check_deaths(self, wait_s: float) -> None:
        pass  # every stand-in worker lives

    def close(self) -> None:
        pass


def test_rank_0_sends_the_step_in_its_order_and_fails_hard_mid_step(tmp_path, monkeypatch):
    """The workers get the requests in the runner's order (decodes first) and the freed
    ids; a failure after the send is RanksOutOfStep, which the engine core does not catch
    (the workers wait in a collective rank 0 never joins), a failure before it a
    ValueError as on one rank."""
    make_model_folder(tmp_path, LlamaConfig(**TINY))
    config = ModelConfig(model=str(tmp_path), block_size=4, num_kv_blocks=16)
    workers = RecordingWorkers()
    runner = ModelRunner(load_model(config), config, workers)
    prefill = ScheduledRequest("p", [5, 6, 7], 0, [0], True, SamplingParams(), [5, 6, 7], [])
    decode = ScheduledRequest("d", [8], 4, [1, 2], True, SamplingParams(), [5, 6, 7, 8], [])
    runner.execute(SchedulerOutput([prefill, decode], preempted_ids=["x"], finished_ids=["y"]))
    assert workers.steps == [["d", "p"]] and workers.forgotten == ["y", "x"]
    too_long = ScheduledRequest("t", [1] * 300, 0, list(range(16)), True, SamplingParams(), [], [])
    with pytest.raises(ValueError):
        runner.execute(SchedulerOutput([too_long]))
    assert len(workers.steps) == 1  # not sent
    monkeypatch.setattr(runner, "_forward", lambda requests: 1 / 0)
    with pytest.raises(RanksOutOfStep) as failure:
        runner.execute(SchedulerOutput([decode]))
    assert not isinstance(failure.value, Exception)


def test_rank_0_holds_its_share(models: Models):
    full, shard = models.single.model, models.tp.model
    num_kv_heads = full.num_kv_heads
    group = full.layers[0].self_attn.num_heads // num_kv_heads
    rank_kv_heads = 1 if num_kv_heads == 1 else -(-num_kv_heads // 2)
    rank_heads = group // 2 if num_kv_heads == 1 else rank_kv_heads * group
    assert shard.tp.world_size == 2
    assert shard.layers[0].self_attn.q_heads == (0, rank_heads)
    assert shard.layers[0].self_attn.kv_heads == (0, rank_kv_heads)
    assert models.tp.kv_cache.layers[0][0].shape[2] == rank_kv_heads
    assert shard.layers[0].mlp.intermediate_size == full.layers[0].mlp.intermediate_size // 2
    assert shard.embed_tokens.num_embeddings == -(-full.vocab_size // 2)
    assert models.tp.num_kv_blocks == models.single.num_kv_blocks


def test_batched_greedy_matches_one_rank_and_generate(models: Models):
    prompts = random_prompts([3, 17, 8, 30], seed=1)
    outputs = RunnerLoop(models.tp).run(seqs(prompts, 10, "batched"))
    assert outputs == RunnerLoop(models.single).run(seqs(prompts, 10, "batched"))
    assert outputs == [models.generate(p, 10) for p in prompts]


def test_chunked_greedy_matches_generate(models: Models):
    prompts = random_prompts([23, 9], seed=2)
    outputs = RunnerLoop(models.tp, chunk_size=5).run(seqs(prompts, 8, "chunked"))
    assert outputs == [models.generate(p, 8) for p in prompts]


def test_scheduler_with_prefix_caching_chunks_and_preemption(models: Models):
    """Priority scheduling over a pool too small for all: the workers mirror block tables
    that are shared from the prefix cache, grown chunk by chunk, freed on preemption and
    rebuilt on resume."""
    scheduler = Scheduler(
        SchedulerConfig(policy="priority", max_num_seqs=4, max_num_batched_tokens=16,
                        max_model_len=256),
        CacheConfig(num_blocks=14, block_size=4),
    )
    shared = random_prompts([12], seed=3)[0]
    prompts = [shared + tail for tail in random_prompts([5, 9, 3, 7], seed=4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(f"r{i}", prompt, params, placement=Placement(priority=-i)))
    outputs: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        for request in scheduler.update(plan, models.tp.execute(plan)):
            if request.is_finished:
                outputs[request.request_id] = list(request.output_token_ids)
    stats = scheduler.stats
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_tokens > 0, stats
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == [
        models.generate(p, params.max_tokens) for p in prompts
    ]
    models.tp.execute(scheduler.schedule())  # the last finished ids reach the workers
    assert not models.deaths


def test_prompt_logprobs_match_one_rank(models: Models):
    """Chunked, next to a plain request: the workers join rank 0's LM-head calls on the
    prompt rows (the plan names them), and the values are one rank's."""
    results = []
    for runner in (models.tp, models.single):
        scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=256),
            CacheConfig(num_blocks=32, block_size=4),
        )
        asked_ids, plain_ids = random_prompts([19, 6], seed=7)
        greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        asked = Request("plp-asked", asked_ids, replace(greedy, prompt_logprobs=2))
        scheduler.add_request(asked)
        scheduler.add_request(Request("plp-plain", plain_ids, greedy))
        while scheduler.has_unfinished_requests():
            plan = scheduler.schedule()
            scheduler.update(plan, runner.execute(plan))
        runner.execute(scheduler.schedule())  # the finished ids reach the workers
        results.append(asked.prompt_logprobs)
    tp, single = results
    assert tp is not None and single is not None and len(tp.logprobs) == 18
    assert all(abs(a - b) <= 1 for a, b in zip(tp.ranks, single.ranks, strict=True))  # ties
    assert [[t for t, _ in row] for row in tp.top] == [[t for t, _ in row] for row in single.top]
    torch.testing.assert_close(torch.tensor(tp.logprobs), torch.tensor(single.logprobs),
                               rtol=0, atol=1e-4)
    assert not models.deaths


def _drafts_proposed(tokens: list[int], num_generated: int = 12) -> bool:
    """Whether an n-gram proposer (n = 1) finds a match at some decode step of these
    prompt + generated tokens while the request still has room for a draft."""
    first = len(tokens) - num_generated
    return any(tokens[i] in tokens[:i] for i in range(first, len(tokens) - 2))


def test_speculative_decoding_matches_generate(models: Models):
    """Drafts verified across the ranks: the plan names them, the workers join the LM
    head on their rows, and greedy output is generate's."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
                        speculative=SpeculativeConfig(num_speculative_tokens=3,
                                                      prompt_lookup_min=1)),
        CacheConfig(num_blocks=32, block_size=4),
    )
    candidates = (chunk * 3 for seed in range(8, 48) for chunk in random_prompts([4, 5], seed))
    prompts = list(itertools.islice(
        (p for p in candidates if _drafts_proposed(p + models.generate(p, 12))), 2))
    assert prompts, "no prompt whose greedy tokens repeat an earlier one"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    requests = [Request(f"spec-{i}", p, params) for i, p in enumerate(prompts)]
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        scheduler.update(plan, models.tp.execute(plan))
    models.tp.execute(scheduler.schedule())  # the finished ids reach the workers
    spec = scheduler.stats.spec_decode
    assert spec is not None and spec.num_draft_tokens > 0
    assert [r.output_token_ids for r in requests] == [models.generate(p, 12) for p in prompts]
    assert not models.deaths
