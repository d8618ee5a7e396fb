"""GPU check part 3a: greedy tokens of the runner against Hugging Face `generate`."""

from __future__ import annotations

from pathlib import Path

from bench.gpu_check.common import (
    PartResult,
    agreement,
    device_for,
    free_device_memory,
    hf_greedy,
    import_runner,
    make_runner,
    random_model_folder,
    scheduler_loop,
    small_llama_config,
)


def check_greedy_parity_hf(dry_run: bool) -> PartResult:
    """Greedy tokens of the runner == HF `generate` on the same random small Llama: exact
    in fp32, agreement % in bf16. Requests are batched, chunked, prefix-cached, and in a
    second run preempted (a small KV pool), through the real Scheduler; decodes go
    through the decode graph runner (CUDA graphs on a GPU)."""
    import_runner()
    import copy
    import random
    import tempfile

    import torch

    from model_runner.config import ModelConfig
    from scheduler.sampling_params import SamplingParams

    device = device_for(dry_run)
    hf_config = small_llama_config(dry_run)
    vocab = hf_config.vocab_size
    num_prompts, max_len, max_tokens = (6, 20, 4) if dry_run else (12, 150, 24)
    block_size, prefix_len = (4, 8) if dry_run else (16, 48)
    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    prompts = []
    for i in range(num_prompts):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randint(3, max_len - prefix_len))]
        prompts.append(prefix + tail if i % 3 == 0 else tail)  # every third shares a prefix
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * len(
        prompts)
    longest = max(len(p) for p in prompts) + max_tokens
    tight_pool = -(-longest // block_size) + 2  # one long request and a little more

    rows, failures = [], []
    with tempfile.TemporaryDirectory(prefix="gpu_check_llama_") as tmp:
        hf32 = random_model_folder(hf_config, Path(tmp), torch.float32, device)
        for dtype in (torch.float32, torch.bfloat16):
            dtype_name = str(dtype).removeprefix("torch.")
            hf = hf32 if dtype == torch.float32 else copy.deepcopy(hf32).to(dtype)
            expected = hf_greedy(hf, prompts, max_tokens, device)
            if dtype == torch.float32:
                expected_fp32 = expected
            # bf16 noise alone: how far HF's own bf16 tokens stray from its fp32 ones
            hf_vs_fp32 = agreement(expected, expected_fp32)[1]
            config = ModelConfig(
                model=tmp, device=device.type, dtype=dtype_name, block_size=block_size,
                num_kv_blocks=4 * num_prompts * -(-longest // block_size),
                max_num_seqs=8, max_num_batched_tokens=16 if dry_run else 64,
                attention_backend="torch" if dry_run else "triton")
            # NOTE: the interpreter computes bf16 dot products wrongly: fp32 only there.
            runner = make_runner(config, dry_run, interpret_triton=dtype == torch.float32)
            for scenario, num_blocks in (("batched, chunked, prefix-cached", None),
                                         ("preempted (small KV pool)", tight_pool)):
                stats = scheduler_loop(runner, prompts, params, max_num_seqs=8,
                                        max_num_batched_tokens=config.max_num_batched_tokens,
                                        num_blocks=num_blocks)
                identical, pct, first = agreement(stats.outputs, expected)
                rows.append({"dtype": dtype_name, "scenario": scenario,
                             "backend": runner.attn.name,
                             "identical_seqs": f"{identical}/{len(prompts)}",
                             "token_agreement_pct": pct, "steps": stats.num_steps,
                             "decode_steps": stats.num_decode_steps,
                             "preemptions": stats.num_preemptions,
                             "vs_hf_fp32_pct": agreement(stats.outputs, expected_fp32)[1],
                             "hf_vs_hf_fp32_pct": hf_vs_fp32, "first_mismatch": first})
                if dtype == torch.float32 and identical != len(prompts):
                    failures.append(f"fp32 {scenario}: {first}")
            del runner, hf
            free_device_memory()
    detail = "; ".join(failures) or (
        "fp32 identical to HF generate; bf16 agreement in the table (token_agreement_pct: "
        "with HF generate in the same dtype; vs_hf_fp32_pct: with HF fp32; hf_vs_hf_fp32_pct: "
        "HF's own tokens in this dtype against its fp32 ones)")
    return PartResult("greedy_parity_hf", "fail" if failures else "pass", detail=detail,
                      rows=rows)


# --- 3b: throughput on a Qwen3-0.6B-shaped model -------------------------------------------


