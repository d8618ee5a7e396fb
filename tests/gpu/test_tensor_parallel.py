"""Tensor parallelism's code path on the one GPU: a 1-rank NCCL group (gloo in the dry run),
the sharded model's all-reduces and logits gather, decode CUDA graphs captured with the
collectives in them; greedy tokens identical to the plain runner's in float32."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from tests.support.gpu_models import (
    agreement,
    attach_eager_decode_graphs,
    device_for,
    make_runner,
    random_model_folder,
    scheduler_loop,
    small_llama_config,
)

pytestmark = pytest.mark.gpu


def test_one_rank_tensor_parallel_runner_equals_the_plain_one(tmp_path, dry_run: bool) -> None:
    from model_runner.config import ModelConfig
    from model_runner.distributed.tp_workers import start_tensor_parallel
    from scheduler.sampling_params import SamplingParams

    device = device_for(dry_run)
    hf_config = small_llama_config(dry_run, vocab_size=255 if dry_run else 2047, tie=True)
    rng = random.Random(1)
    num_prompts, max_tokens = (4, 4) if dry_run else (16, 32)
    prompts = [[rng.randrange(3, hf_config.vocab_size) for _ in range(rng.randint(3, 60))]
               for _ in range(num_prompts)]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * len(
        prompts)
    random_model_folder(hf_config, tmp_path, torch.float32, device)
    config = ModelConfig(model=str(tmp_path), device=device.type, dtype="float32",
                         block_size=16, num_kv_blocks=256, max_num_seqs=16,
                         max_num_batched_tokens=256,
                         attention_backend="torch" if dry_run else "triton")
    plain = scheduler_loop(make_runner(config, dry_run), prompts, params, max_num_seqs=16,
                           max_num_batched_tokens=256)
    _, runner = start_tensor_parallel(replace(config, tensor_parallel_size=1))
    if dry_run:
        attach_eager_decode_graphs(runner, config.max_num_seqs)
    try:
        assert runner.model.tp is not None
        assert dry_run or len(runner.decode_graphs._graphs) > 0  # captured with collectives
        sharded = scheduler_loop(runner, prompts, params, max_num_seqs=16,
                                 max_num_batched_tokens=256)
    finally:
        runner.workers.close()
        runner.model.tp.close()
    identical, pct, first = agreement(sharded.outputs, plain.outputs)
    assert identical == len(prompts), f"{pct:.1f}% agree; {first}"
