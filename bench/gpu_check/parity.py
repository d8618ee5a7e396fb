"""GPU check part: how far the runner's greedy tokens in bfloat16 stay with Hugging Face
`generate` on a random small Llama (float32 identity is tests/gpu/test_parity_hf.py's)."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

from bench.gpu_check.common import PartResult
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


def measure_bf16_agreement(dry_run: bool) -> PartResult:
    """Token agreement % of the runner in bfloat16 with HF generate in bfloat16 and in
    float32, beside HF's own bfloat16 tokens against its float32 ones (bfloat16 noise
    alone); batched, chunked, prefix-cached requests through the real Scheduler. In a dry
    run float32 (the interpreter computes bfloat16 dot products wrongly)."""
    import torch

    from model_runner.config import ModelConfig
    from scheduler.sampling_params import SamplingParams

    device = device_for(dry_run)
    hf_config = small_llama_config(dry_run)
    prompts, max_tokens, block_size = parity_prompts(hf_config.vocab_size, dry_run)
    longest = max(len(p) for p in prompts) + max_tokens
    dtype = torch.float32 if dry_run else torch.bfloat16
    dtype_name = str(dtype).removeprefix("torch.")
    with tempfile.TemporaryDirectory(prefix="gpu_check_llama_") as tmp:
        hf32 = random_model_folder(hf_config, Path(tmp), torch.float32, device)
        expected_fp32 = hf_greedy(hf32, prompts, max_tokens, device)
        expected = hf_greedy(copy.deepcopy(hf32).to(dtype), prompts, max_tokens, device)
        config = ModelConfig(
            model=tmp, device=device.type, dtype=dtype_name, block_size=block_size,
            num_kv_blocks=4 * len(prompts) * -(-longest // block_size), max_num_seqs=8,
            max_num_batched_tokens=16 if dry_run else 64,
            attention_backend="torch" if dry_run else "triton")
        runner = make_runner(config, dry_run)
        params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * len(
            prompts)
        stats = scheduler_loop(runner, prompts, params, max_num_seqs=8,
                               max_num_batched_tokens=config.max_num_batched_tokens)
    identical, pct, first = agreement(stats.outputs, expected)
    row = {"dtype": dtype_name, "backend": runner.attn.name,
           "identical_seqs": f"{identical}/{len(prompts)}", "token_agreement_pct": pct,
           "vs_hf_fp32_pct": agreement(stats.outputs, expected_fp32)[1],
           "hf_vs_hf_fp32_pct": agreement(expected, expected_fp32)[1], "first_mismatch": first}
    return PartResult("bf16_agreement_hf", "pass", rows=[row],
                      detail="token_agreement_pct: with HF generate in the same dtype; "
                      "vs_hf_fp32_pct: with HF fp32; hf_vs_hf_fp32_pct: HF's own tokens in "
                      "this dtype against its fp32 ones")
