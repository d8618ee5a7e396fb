"""Greedy tokens of the runner on CUDA (Triton backend, decode CUDA graphs) identical to
Hugging Face `generate` on the same random small Llama in float32, through the real
Scheduler: batched, chunked and prefix-cached, and preempted (a small KV pool)."""

from __future__ import annotations

import pytest
import torch

from tests.support.gpu_models import (
    agreement,
    device_for,
    hf_greedy,
    make_runner,
    parity_prompts,
    random_model_folder,
    scheduler_loop,
    small_llama_config,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preempted", [False, True], ids=["batched-chunked-cached", "preempted"])
def test_greedy_tokens_equal_hf_generate_in_float32(tmp_path, dry_run: bool,
                                                    preempted: bool) -> None:
    from model_runner.config import ModelConfig
    from scheduler.sampling_params import SamplingParams

    device = device_for(dry_run)
    hf_config = small_llama_config(dry_run)
    prompts, max_tokens, block_size = parity_prompts(hf_config.vocab_size, dry_run)
    hf = random_model_folder(hf_config, tmp_path, torch.float32, device)
    expected = hf_greedy(hf, prompts, max_tokens, device)
    longest = max(len(p) for p in prompts) + max_tokens
    config = ModelConfig(
        model=str(tmp_path), device=device.type, dtype="float32", block_size=block_size,
        num_kv_blocks=4 * len(prompts) * -(-longest // block_size), max_num_seqs=8,
        max_num_batched_tokens=16 if dry_run else 64,
        attention_backend="torch" if dry_run else "triton")
    runner = make_runner(config, dry_run, interpret_triton=True)
    tight_pool = -(-longest // block_size) + 2  # one long request and a little more
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * len(
        prompts)
    stats = scheduler_loop(runner, prompts, params, max_num_seqs=8,
                           max_num_batched_tokens=config.max_num_batched_tokens,
                           num_blocks=tight_pool if preempted else None)
    identical, _, first = agreement(stats.outputs, expected)
    assert identical == len(prompts), first
    assert stats.num_decode_steps > 0
    assert (stats.num_preemptions > 0) == preempted
