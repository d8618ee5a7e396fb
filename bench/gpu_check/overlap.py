"""GPU check part 3e: overlapped steps (`--async-scheduling`) on CUDA.

The engine core with and without overlapped steps on the same random small Llama (fp32:
greedy ties cannot differ by rounding), under a tight KV pool (preemption), greedy and
seeded sampling: the tokens must be identical; and the decode step rate of both on a
batch of 64, with the gain that overlapping the host work buys.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.gpu_check.common import (
    PartResult,
    device_for,
    free_device_memory,
    import_runner,
    make_runner,
    random_model_folder,
    small_llama_config,
)


def _serve(runner, requests, num_blocks: int, async_scheduling: bool, block_size: int):
    """Step an EngineCore over `requests` to the end: tokens by id, steps, seconds."""
    from engine.core import EngineCore
    from engine.messages import AddRequests
    from kvcache.config import CacheConfig
    from scheduler.config import SchedulerConfig
    from scheduler.scheduler import Scheduler

    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024,
                             max_model_len=runner.max_model_len,
                             async_scheduling=async_scheduling)
    core = EngineCore(Scheduler(config, CacheConfig(num_blocks=num_blocks,
                                                    block_size=block_size)),
                      runner, frozenset({2}))
    core.apply(AddRequests(requests))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    steps, start = 0, time.perf_counter()
    while core.has_work:
        for delta in core.step_fn().deltas:
            if delta.error:
                raise RuntimeError(delta.error)
            tokens[delta.request_id] += delta.new_token_ids
        steps += 1
    return tokens, steps, time.perf_counter() - start, core.scheduler.num_preemptions_total


def check_async_scheduling(dry_run: bool) -> PartResult:
    import_runner()
    import random

    import torch

    from engine.messages import NewRequest
    from model_runner.config import ModelConfig
    from scheduler.sampling_params import SamplingParams

    device = device_for(dry_run)
    hf_config = small_llama_config(dry_run)
    num, max_tokens, block_size = (8, 6, 4) if dry_run else (64, 48, 16)

    def requests(tag: str):
        """The same requests under fresh ids (the runner keeps a finished request's seeded
        generator until a later step names it finished)."""
        rng = random.Random(0)
        out = []
        for i in range(num):
            params = SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i,
                                    max_tokens=max_tokens - i % 5, ignore_eos=True)
            prompt = [rng.randrange(3, hf_config.vocab_size) for _ in range(5 + (i * 7) % 40)]
            out.append(NewRequest(request_id=f"{tag}-r{i}", prompt_token_ids=prompt,
                                  sampling_params=params))
        return out

    batch = requests("sizing")
    rows, failures = [], []
    with tempfile.TemporaryDirectory(prefix="gpu_check_overlap_") as tmp:
        random_model_folder(hf_config, Path(tmp), torch.float32, device)
        longest = max(len(r.prompt_token_ids) for r in batch) + max_tokens
        roomy = num * -(-longest // block_size) + 8
        config = ModelConfig(model=tmp, device=device.type, dtype="float32",
                             block_size=block_size, num_kv_blocks=roomy, max_num_seqs=64,
                             max_num_batched_tokens=1024,
                             attention_backend="torch" if dry_run else "triton")
        runner = make_runner(config, dry_run)
        tight = max(roomy // 3, -(-longest // block_size) + 1)  # still fits the longest
        for scenario, num_blocks in (("roomy pool", roomy), ("tight pool", tight)):
            results = {}
            for overlapped in (False, True):
                tag = f"{scenario.split()[0]}-{overlapped}"
                tokens, steps, seconds, preemptions = _serve(runner, requests(tag), num_blocks,
                                                             overlapped, block_size)
                results[overlapped] = [tokens[f"{tag}-r{i}"] for i in range(num)]
                rows.append({"scenario": scenario, "async_scheduling": overlapped,
                             "steps": steps, "steps_per_s": round(steps / seconds, 1),
                             "preemptions": preemptions})
            if results[True] != results[False]:
                bad = [i for i, (a, b) in enumerate(zip(*results.values(), strict=True)) if a != b]
                failures.append(f"{scenario}: tokens differ for requests {bad[:5]}")
        del runner
        free_device_memory()
    detail = "; ".join(failures) or "overlapped tokens identical to plain steps"
    return PartResult("async_scheduling", "fail" if failures else "pass", detail=detail,
                      rows=rows)
