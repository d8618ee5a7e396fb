"""GPU check part: the step rate of overlapped steps (`--async-scheduling`) against plain
ones on CUDA, the engine core over a batch of 64 on a random small Llama, in a roomy and a
tight KV pool (their tokens' identity is tests/gpu/test_overlap.py's)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.gpu_check.common import PartResult, free_device_memory
from tests.support.gpu_models import (
    device_for,
    make_runner,
    overlap_requests,
    random_model_folder,
    serve_core,
    small_llama_config,
)


def measure_async_scheduling(dry_run: bool) -> PartResult:
    """Steps, steps/s and preemptions of plain and overlapped steps."""
    import torch

    from model_runner.config import ModelConfig

    device = device_for(dry_run)
    hf_config = small_llama_config(dry_run)
    num, max_tokens, block_size = (8, 6, 4) if dry_run else (64, 48, 16)
    sizing = overlap_requests("sizing", num, hf_config.vocab_size, max_tokens)
    longest = max(len(r.prompt_token_ids) for r in sizing) + max_tokens
    roomy = num * -(-longest // block_size) + 8
    tight = max(roomy // 3, -(-longest // block_size) + 1)  # still fits the longest
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_overlap_") as tmp:
        random_model_folder(hf_config, Path(tmp), torch.float32, device)
        config = ModelConfig(model=tmp, device=device.type, dtype="float32",
                             block_size=block_size, num_kv_blocks=roomy, max_num_seqs=64,
                             max_num_batched_tokens=1024,
                             attention_backend="torch" if dry_run else "triton")
        runner = make_runner(config, dry_run)
        for scenario, num_blocks in (("roomy pool", roomy), ("tight pool", tight)):
            for overlapped in (False, True):
                tag = f"{scenario.split()[0]}-{overlapped}"
                requests = overlap_requests(tag, num, hf_config.vocab_size, max_tokens)
                _, steps, seconds, preemptions = serve_core(runner, requests, num_blocks,
                                                            overlapped, block_size)
                rows.append({"scenario": scenario, "async_scheduling": overlapped,
                             "steps": steps, "steps_per_s": round(steps / seconds, 1),
                             "preemptions": preemptions})
        del runner
        free_device_memory()
    return PartResult("async_scheduling_steps", "pass", rows=rows)
