"""Structured outputs' cost: W1 constrained by a JSON schema against W1 unconstrained, in
one run on the real model, and the per-step cost of the token masks at batch 16 and 64.

The engine core runs in-process (no HTTP), W1's requests are admitted 16 at a time; the
constrained pass gives every request a schema that cannot complete within W1's 128
output tokens, so both passes produce exactly the same number of tokens. Passes
alternate (plain, constrained, plain, constrained, ...) so that a drift in the machine's
speed hits both alike; besides wall-clock tokens/s (the best pass of each kind: the
least disturbed by other jobs on shared cores) each pass reports tokens per CPU second
of this process (all its threads), which other processes hardly move.
`python -m bench.structured_bench [--scale S] [--rounds R]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque
from typing import Any

import numpy as np

from engine.core import EngineCore
from engine.core_setup import build_core_parts
from engine.messages import AddRequests, NewRequest
from loadgen.workloads import w1
from model_runner.config import ModelConfig
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams
from structured.grammars import json_schema_grammar
from structured.matchers import StructuredOutputs

# A JSON object whose array must hold 100 integers: longer than 128 tokens, so the
# grammar never ends a request early.
SCHEMA = {
    "type": "object",
    "properties": {"values": {"type": "array", "minItems": 100,
                              "items": {"type": "integer", "minimum": 0, "maximum": 999}}},
    "required": ["values"],
    "additionalProperties": False,
}


def run_pass(core: EngineCore, scale: float, grammar: str | None) -> dict[str, float]:
    """W1 through `core`; output tokens, seconds, steps and the masks' share."""
    workload = w1(scale)
    pending = deque(workload.requests)
    structured = core.structured
    mask_s0 = structured.mask_seconds if structured else 0.0
    num_tokens = num_steps = in_flight = 0
    ids = iter(range(10**9))
    start, cpu_start = time.perf_counter(), time.process_time()
    while pending or core.has_work:
        batch = []
        while pending and in_flight < workload.concurrency:
            item = pending.popleft()
            params = SamplingParams(temperature=0.0, max_tokens=item.max_tokens,
                                    ignore_eos=True, grammar=grammar)
            batch.append(NewRequest(request_id=f"r{next(ids)}",
                                    prompt_token_ids=list(item.prompt), sampling_params=params))
            in_flight += 1
        if batch:
            core.apply(AddRequests(batch))
        for delta in core.step().deltas:
            num_tokens += len(delta.new_token_ids)
            if delta.finish_reason or delta.error:
                assert delta.error is None, delta.error
                in_flight -= 1
        num_steps += 1
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    mask_s = (structured.mask_seconds if structured else 0.0) - mask_s0
    return {"tokens": num_tokens, "seconds": seconds, "steps": num_steps,
            "tokens_per_s": num_tokens / seconds, "tokens_per_cpu_s": num_tokens / cpu_seconds,
            "mask_ms_per_step": 1e3 * mask_s / num_steps}


def mask_cost(structured: StructuredOutputs, tokenizer: Any, batch: int,
              repeats: int = 50) -> float:
    """Milliseconds to fill the masks of `batch` matchers, each in the middle of a JSON
    object of SCHEMA (different positions), as one step does."""
    from scheduler.output import ScheduledRequest, SchedulerOutput
    from scheduler.request import Request

    grammar = json_schema_grammar(SCHEMA)
    structured.compiler.compile(grammar).result()
    plan = SchedulerOutput()
    for i in range(batch):
        request = Request(f"mask-{i}", [1], SamplingParams(grammar=grammar, max_tokens=500))
        structured.add(request)
        prefix = '{"values":[' + ",".join(str(7 * j % 1000) for j in range(i % 20 + 1))
        for token in tokenizer.encode(prefix, add_special_tokens=False):
            request.append_output_token(token)
        structured.accept(request)
        plan.scheduled.append(ScheduledRequest(request.request_id, [1], 0, [0], True,
                                               request.sampling_params, [], []))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        future = structured.bitmask(plan)
        assert future is not None
        future.result()
        times.append(time.perf_counter() - start)
    for i in range(batch):
        structured.free(f"mask-{i}")
    return 1e3 * statistics.median(times)


def apply_cost(vocab: int, batch: int, repeats: int = 50) -> float:
    """Milliseconds to apply `batch` masks to a [batch, vocab] float32 logits tensor."""
    import torch

    from model_runner.sampler import apply_bitmask
    from scheduler.output import GrammarBitmask, ScheduledRequest

    logits = torch.randn(batch, vocab)
    requests = [ScheduledRequest(str(i), [1], 0, [0], True, SamplingParams(), [], [])
                for i in range(batch)]
    masks = GrammarBitmask({str(i): i for i in range(batch)},
                           np.full((batch, (vocab + 31) // 32), 0x5555, dtype=np.int32))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        apply_bitmask(logits, requests, masks)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="W1's size (1.0: 64 requests)")
    parser.add_argument("--rounds", type=int, default=2, help="plain/constrained pairs")
    args = parser.parse_args()
    model_config = ModelConfig(device="cpu", num_kv_blocks=512, max_num_seqs=64,
                               max_num_batched_tokens=512)
    scheduler_config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512)
    scheduler, runner, info, structured = build_core_parts(model_config, scheduler_config)
    assert structured is not None
    core = EngineCore(scheduler, runner, frozenset(info.eos_token_ids), structured=structured)
    grammar = json_schema_grammar(SCHEMA)
    run_pass(core, 0.0625, grammar)  # warm up: compile, kernels
    results: dict[str, list[dict[str, float]]] = {"plain": [], "json_schema": []}
    for _ in range(args.rounds):
        for name, pass_grammar in (("plain", None), ("json_schema", grammar)):
            results[name].append(run_pass(core, args.scale, pass_grammar))
            print(name, json.dumps(results[name][-1]), file=sys.stderr, flush=True)
    from model_runner.loader import load_model_spec

    tokenizer = load_model_spec(model_config).tokenizer
    summary: dict[str, Any] = {
        name: {"best_tokens_per_s": max(r["tokens_per_s"] for r in runs),
               "median_tokens_per_cpu_s": statistics.median(r["tokens_per_cpu_s"] for r in runs),
               "tokens": runs[0]["tokens"],
               "mask_ms_per_step": statistics.median(r["mask_ms_per_step"] for r in runs)}
        for name, runs in results.items()
    }
    plain, constrained = summary["plain"], summary["json_schema"]
    summary["ratio_best_wall"] = constrained["best_tokens_per_s"] / plain["best_tokens_per_s"]
    summary["ratio_cpu"] = (constrained["median_tokens_per_cpu_s"]
                            / plain["median_tokens_per_cpu_s"])
    summary["mask_fill_ms"] = {b: mask_cost(structured, tokenizer, b) for b in (16, 64)}
    summary["mask_apply_ms"] = {b: apply_cost(info.vocab_size, b) for b in (16, 64)}
    summary["runs"] = results
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
