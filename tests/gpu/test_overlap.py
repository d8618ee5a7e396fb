"""Overlapped steps (`--async-scheduling`, engine/core.py) on CUDA: the engine core with and
without them on the same random small Llama (float32: greedy ties cannot differ by
rounding), greedy and seeded sampling, a roomy and a tight KV pool (preemption): the
tokens are identical."""

from __future__ import annotations

import pytest
import torch

from tests.support.gpu_models import (
    device_for,
    make_runner,
    overlap_requests,
    random_model_folder,
    serve_core,
    small_llama_config,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_overlapped_steps_give_the_tokens_of_plain_steps(tmp_path, dry_run: bool,
                                                         pool: str) -> None:
    from model_runner.config import ModelConfig

    device = device_for(dry_run)
    hf_config = small_llama_config(dry_run)
    num, max_tokens, block_size = (8, 6, 4) if dry_run else (64, 48, 16)
    random_model_folder(hf_config, tmp_path, torch.float32, device)
    sizing = overlap_requests("sizing", num, hf_config.vocab_size, max_tokens)
    longest = max(len(r.prompt_token_ids) for r in sizing) + max_tokens
    roomy = num * -(-longest // block_size) + 8
    config = ModelConfig(model=str(tmp_path), device=device.type, dtype="float32",
                         block_size=block_size, num_kv_blocks=roomy, max_num_seqs=64,
                         max_num_batched_tokens=1024,
                         attention_backend="torch" if dry_run else "triton")
    runner = make_runner(config, dry_run)
    num_blocks = roomy if pool == "roomy" else max(roomy // 3, -(-longest // block_size) + 1)
    results = {}
    for overlapped in (False, True):
        tag = f"{pool}-{overlapped}"
        requests = overlap_requests(tag, num, hf_config.vocab_size, max_tokens)
        tokens, *_ = serve_core(runner, requests, num_blocks, overlapped, block_size)
        results[overlapped] = [tokens[f"{tag}-r{i}"] for i in range(num)]
    assert results[True] == results[False]
