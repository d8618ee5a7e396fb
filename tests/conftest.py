"""Shared fixtures: a byte-level tokenizer and a scripted model runner, so that the server's
engine and HTTP app run on the real Scheduler without a model; the app over such an engine
in a TestClient or a live uvicorn server."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch
from fastapi.testclient import TestClient

from engine.client import EngineClient, EngineInfo
from kvcache.config import CacheConfig
from scheduler.config import SchedulerConfig
from scheduler.output import (
    PLACEHOLDER_TOKEN_ID,
    ModelRunnerOutput,
    PromptLogprobs,
    SampleLogprobs,
    SchedulerOutput,
)
from scheduler.scheduler import Scheduler
from server.app import build_app
from server.config import ServerConfig
from tests.support.crash_safe_loadscope import pytest_xdist_make_scheduler  # noqa: F401
from tests.support.live_server import LiveServer
from tests.support.triton_interpreter import use_interpreter

# NOTE: before any test module imports triton (peft does, at its import): without CUDA the
# Triton kernel tests run under its interpreter, which triton's first import decides.
use_interpreter()

# NOTE: `make test` runs two pytest workers (pytest-xdist) on this 2-core machine: each, and
# every server it starts, then takes one core's worth of torch threads rather than both.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The modules that take longest under `make test` (the first four measured at 3-5 minutes of
# a worker each, the rest at one to two), longest first. `make test` hands whole modules to
# its two workers in collection order (`--no-loadscope-reorder`; xdist's own order is most
# tests first, which left these for the end): they start first and the short ones fill the
# tail, where one long module started last would leave the other core idle while it runs.
# tests/test_house_rules.py checks that each exists.
LONGEST_MODULES = (
    "tests/e2e/test_model_families.py",
    "tests/e2e/test_model_families_moe.py",
    "tests/runner/test_tensor_parallel.py",
    "tests/runner/test_model_runner.py",
    "tests/runner/test_triton_attention.py",
    "tests/e2e/test_tensor_parallel_server.py",
    "tests/e2e/test_data_parallel_server.py",
    "tests/runner/test_gemma.py",
    "tests/engine/test_draft_model_engine.py",
    "tests/e2e/test_speculative_decoding.py",
    "tests/e2e/test_router_replicas.py",
    "tests/e2e/test_reliability_server.py",
    "tests/e2e/test_structured_outputs.py",
    "tests/e2e/test_server_openai.py",
    "tests/e2e/test_batch_api.py",
    "tests/server/test_request_budgets.py",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Moves the tests of LONGEST_MODULES first, in that order; the rest keep theirs."""
    rank = {path: i for i, path in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


BYTE_EOS = 256


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is the special EOS token "<eos>"."""

    eos_token_id = BYTE_EOS

    def __len__(self) -> int:
        return 257

    def get_vocab(self) -> dict[str, int]:
        return {**{chr(i): i for i in range(256)}, "<eos>": BYTE_EOS}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        data = bytes(t for t in token_ids if t < 256)
        text = data.decode(errors="replace")
        if not skip_special_tokens and BYTE_EOS in token_ids:
            text += "<eos>"
        return text

    def apply_chat_template(
        self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False,
        **template_kwargs: object,
    ) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting its work in `calls` ("encode", "decode", "template"),
    shared by its copies: what a test reads to prove a request cost no work."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def __deepcopy__(self, memo: dict) -> CountingTokenizer:
        return CountingTokenizer(self.calls)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append("encode")
        return super().encode(text, add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        self.calls.append("decode")
        return super().decode(token_ids, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = False,
                            **template_kwargs: object) -> str:
        self.calls.append("template")
        return super().apply_chat_template(messages, tokenize, add_generation_prompt,
                                           **template_kwargs)


class ComputedStep:
    """A step computed at launch: `result()` returns its output."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def result(self) -> ModelRunnerOutput:
        return self.output


class SyncRunner:
    """A test runner that computes each step in `launch` (what the engine core calls);
    subclasses write `execute(plan)`."""

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def launch(self, plan: SchedulerOutput) -> ComputedStep:
        return ComputedStep(self.execute(plan))


class ScriptedRunner(SyncRunner):
    """Samples the bytes of `script` in order (the k-th output token is script byte k),
    then EOS; with logprobs, every token has logprob -0.5 and is its own top-1; prompt
    token i's logprob is -i / 10 at rank 2, behind byte "~" (the top-1 of every position)."""

    def __init__(self, script: str = "Hello, wörld! Bye.") -> None:
        self.tokens = [*script.encode(), BYTE_EOS]
        self.num_steps = 0

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        out = ModelRunnerOutput()
        for scheduled in plan.scheduled:
            lo, hi = scheduled.prompt_logprob_rows
            if hi > lo:
                out.prompt_logprobs[scheduled.request_id] = scripted_prompt_logprobs(
                    scheduled.num_computed_tokens + lo + 1, hi - lo,
                    scheduled.sampling_params.prompt_logprobs or 0,
                )
            if not scheduled.sample:
                continue
            # NOTE: with overlapped steps the token before a placeholder is not on the host
            k = len(scheduled.output_token_ids) + (scheduled.token_ids[-1] == PLACEHOLDER_TOKEN_ID)
            token = self.tokens[min(k, len(self.tokens) - 1)]
            out.sampled_token_ids[scheduled.request_id] = token
            if scheduled.sampling_params.logprobs is not None:
                out.logprobs[scheduled.request_id] = SampleLogprobs(-0.5, [(token, -0.5)])
        return out


def scripted_prompt_logprobs(first: int, num: int, num_top: int) -> PromptLogprobs:
    """ScriptedRunner's prompt logprobs of prompt tokens first .. first + num - 1."""
    indices = range(first, first + num)
    top = [[(ord("~"), -0.01)][:num_top] for _ in indices]
    return PromptLogprobs(first, [-i / 10 for i in indices], [2] * num, top)


MakeEngine = Callable[..., EngineClient]


@pytest.fixture
def make_fake_engine() -> Iterator[MakeEngine]:
    """Factory of started engines over the real Scheduler, a ScriptedRunner and a
    ByteTokenizer; each is shut down after the test."""
    engines: list[EngineClient] = []

    def make(
        *,
        policy: str = "fcfs",
        script: str = "Hello, wörld! Bye.",
        num_blocks: int = 64,
        block_size: int = 4,
        max_model_len: int = 128,
        max_num_seqs: int = 16,
        start: bool = True,
        runner: object | None = None,
        stream_interval: int = 1,
        fair_share: bool = False,
        structured: object | None = None,
        async_scheduling: bool = False,
    ) -> EngineClient:
        scheduler = Scheduler(
            SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=64, max_model_len=max_model_len,
                            fair_share=fair_share, async_scheduling=async_scheduling),
            CacheConfig(num_blocks=num_blocks, block_size=block_size),
        )
        info = EngineInfo(
            model_name="fake-model",
            max_model_len=scheduler.max_request_len,
            vocab_size=257,
            policy=policy,
            tokenizer=ByteTokenizer(),
            eos_token_ids=frozenset({BYTE_EOS}),
            structured_outputs=structured is not None,
        )
        engine = EngineClient.in_process(scheduler, runner or ScriptedRunner(script), info,
                                         stream_interval=stream_interval,
                                         structured=structured)  # type: ignore[arg-type]
        if start:
            engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


@pytest.fixture
def open_client() -> Iterator[Callable[..., TestClient]]:
    """open_client(engine, config) -> a TestClient of `build_app(engine, config)` whose
    lifespan has run; closed after the test."""
    clients: list[TestClient] = []

    def open_(engine: EngineClient, config: ServerConfig) -> TestClient:
        client = TestClient(build_app(engine, config))
        client.__enter__()
        clients.append(client)
        return client

    yield open_
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def live_servers() -> Iterator[Callable[..., LiveServer]]:
    """live_servers(engine, tenants=None, **config) -> a started LiveServer; each one still
    running is stopped after the test."""
    servers: list[LiveServer] = []

    def start(engine: EngineClient, tenants: object = None, **config: object) -> LiveServer:
        server = LiveServer(engine, tenants, **config)
        servers.append(server)
        return server

    yield start
    for server in servers:
        if server.thread.is_alive():
            server.stop()
