"""What one request repeats for each of its choices, in one process (issue 28's review).

`python -m bench.shared_bench masks`: one request, n = 16, with 131,072 allowed ids (with
repeats) and 300 logit_bias entries: the core's side (decode the AddRequests message as
the core process does, make the requests, sample STEPS steps of the 16 rows). Prints the
message size, the RSS growth and the sampler's time per step.

`python -m bench.shared_bench prompt-logprobs [--stream]`: the review's body (2 prompts x
1,500 token ids, n = 16, prompt_logprobs 20, max_tokens 1) against the app on an
in-process engine (a fake runner, a byte tokenizer): the bytes the core sends, the
response's size and time, the event loop's longest stall (the client shares the loop, so
its reading of the response counts too), the RSS growth.

NOTE: it uses only interfaces an older tree has too, so the same file measures it for a
same-run baseline: `PYTHONPATH=/path/to/old/tree python bench/shared_bench.py masks`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
from dataclasses import replace
from typing import Any

import httpx
import torch

from engine.client import Engine, EngineInfo
from engine.messages import (
    AddRequests,
    NewRequest,
    command_decoder,
    command_encoder,
    output_encoder,
)
from kvcache.config import CacheConfig
from model_runner.sampler import Sampler
from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput, PromptLogprobs, ScheduledRequest, SchedulerOutput
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from server.app import build_app
from server.config import ServerConfig

VOCAB = 49152
N = 16
TOP = 20


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


# ------------------------------------------------------------------ masks


def mask_message() -> bytes:
    """The AddRequests of one request with n = 16, as this tree's API process sends it."""
    rng = random.Random(0)
    ids = [rng.randrange(VOCAB) for _ in range(131072)]
    bias = [(rng.randrange(VOCAB), 1.0) for _ in range(300)]
    shares = "shares_token_lists" in NewRequest.__struct_fields__
    if shares:
        from scheduler.sampling_params import unique_token_lists

        allowed, logit_bias = unique_token_lists(ids, bias)
    else:
        allowed, logit_bias = tuple(ids), tuple(bias)
    base = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True,
                          allowed_token_ids=allowed, logit_bias=logit_bias)
    new = []
    for i in range(N):
        params, extra = replace(base, seed=i), {}
        if shares and i > 0:
            params = replace(params, allowed_token_ids=None, logit_bias=())
            extra = {"shares_token_lists": True}
        new.append(NewRequest(request_id=f"r-{i}", prompt_token_ids=list(range(1, 33)),
                              sampling_params=params, **extra))
    return command_encoder.encode(AddRequests(new))


def bench_masks(steps: int) -> None:
    data = mask_message()
    gc.collect()
    sampler = Sampler(torch.device("cpu"), frozenset({0}))
    logits = torch.randn(N, VOCAB, generator=torch.Generator().manual_seed(0))
    rss0 = rss_mb()
    command = command_decoder.decode(data)
    params = (command.sampling_params() if hasattr(command, "sampling_params")
              else [new.sampling_params for new in command.requests])
    requests = [Request(new.request_id, new.prompt_token_ids, p)
                for new, p in zip(command.requests, params, strict=True)]
    del command, params
    rss1 = rss_mb()
    times = []
    for step in range(steps):
        rows = [ScheduledRequest(r.request_id, [1], 32 + step, [0], True, r.sampling_params,
                                 r.prompt_token_ids, r.output_token_ids) for r in requests]
        start = time.perf_counter()
        token_ids = sampler(logits.clone(), rows, [None] * N).token_ids
        times.append(time.perf_counter() - start)
        for request, token_id in zip(requests, token_ids, strict=True):
            request.append_output_token(token_id)
    print(f"message {len(data) / 2**20:.2f} MB; core RSS +{rss1 - rss0:.1f} MB for the requests, "
          f"+{rss_mb() - rss0:.1f} MB after {steps} steps; sampler step of the {N} rows: first "
          f"{times[0] * 1e3:.1f} ms, later (best) {min(times[1:]) * 1e3:.1f} ms")


# ------------------------------------------------------------------ prompt logprobs


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is EOS."""

    eos_token_id = 256

    def __len__(self) -> int:
        return 257

    def get_vocab(self) -> dict[str, int]:
        return {**{chr(i): i for i in range(256)}, "<eos>": 256}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(t for t in token_ids if t < 256).decode(errors="replace")


class PromptLogprobsRunner:
    """Prompt logprobs with TOP alternatives for every flagged row; samples byte "A"."""

    def launch(self, plan: SchedulerOutput) -> Any:
        out = ModelRunnerOutput()
        for s in plan.scheduled:
            lo, hi = s.prompt_logprob_rows
            if hi > lo:
                num = hi - lo
                top = [[(t, -0.1 * (t + 1)) for t in range(TOP)] for _ in range(num)]
                out.prompt_logprobs[s.request_id] = PromptLogprobs(
                    s.num_computed_tokens + lo + 1, [-1.2345678] * num, [3] * num, top)
            if s.sample:
                out.sampled_token_ids[s.request_id] = 65
        return _Done(out)


class _Done:
    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def result(self) -> ModelRunnerOutput:
        return self.output


async def _post_and_watch(app: Any, body: dict) -> tuple[httpx.Response, float, float]:
    """The response, its time and the event loop's longest stall meanwhile."""
    stalls: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            stalls.append(now - last)
            last = now

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=600) as client:
        await client.post("/v1/completions", json={**body, "prompt": [[1, 2]]})  # warm up
        tick = asyncio.ensure_future(ticker())
        start = time.perf_counter()
        response = await client.post("/v1/completions", json=body)
        elapsed = time.perf_counter() - start
        await asyncio.sleep(0.02)  # the ticker records the gap it was in
        tick.cancel()
    return response, elapsed, max(stalls)


def bench_prompt_logprobs(stream: bool) -> None:
    scheduler = Scheduler(
        SchedulerConfig(policy="fcfs", max_num_seqs=32, max_num_batched_tokens=4096,
                        max_model_len=2048),
        CacheConfig(num_blocks=1024, block_size=16),
    )
    info = EngineInfo(model_name="fake", max_model_len=scheduler.max_request_len,
                      vocab_size=257, policy="fcfs", tokenizer=ByteTokenizer(),
                      eos_token_ids=frozenset({256}))
    engine = Engine.in_process(scheduler, PromptLogprobsRunner(), info)  # type: ignore[arg-type]
    sent = [0]
    on_message = engine._on_message

    def counting(message: Any) -> None:
        sent[0] += len(output_encoder.encode(message))  # what the core process would send
        on_message(message)

    engine._on_message = counting  # type: ignore[method-assign]
    engine.start()
    body = {"prompt": [[(7 * i + p) % 250 + 1 for i in range(1500)] for p in range(2)],
            "n": N, "max_tokens": 1, "prompt_logprobs": TOP, "stream": stream}
    try:
        rss0 = rss_mb()
        response, elapsed, stall = asyncio.run(_post_and_watch(build_app(engine,
                                                                         ServerConfig()), body))
        assert response.status_code == 200, response.text[:300]
        print(f"{'streamed' if stream else 'whole'}: response {len(response.content) / 2**20:.1f}"
              f" MB in {elapsed:.2f} s; the core sent {sent[0] / 2**20:.2f} MB; longest "
              f"event-loop stall {stall * 1e3:.0f} ms; RSS +{rss_mb() - rss0:.0f} MB")
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=["masks", "prompt-logprobs"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.what == "masks":
        bench_masks(args.steps)
    else:
        bench_prompt_logprobs(args.stream)


if __name__ == "__main__":
    main()
