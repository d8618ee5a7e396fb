"""GPU check part 3d: tensor parallelism's code path on the one GPU (a 1-rank NCCL group,
the sharded model's all-reduces and logits gather, decode CUDA graphs with the collectives
captured) against the plain runner."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from bench.gpu_check.common import (
    PartResult,
    agreement,
    device_for,
    free_device_memory,
    import_runner,
    make_runner,
    random_model_folder,
    scheduler_loop,
    small_llama_config,
)


def check_tp_one_rank_nccl(dry_run: bool) -> PartResult:
    """The TP runner (`start_tensor_parallel` with one rank: NCCL on CUDA, gloo in a dry
    run) against the plain one on the same random Llama, through the real Scheduler:
    identical greedy tokens in fp32, and the execute time per step of each."""
    import_runner()
    import random
    import tempfile

    import torch

    from model_runner.config import ModelConfig
    from model_runner.cuda_graphs import DecodeGraphRunner
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
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_tp_") as tmp:
        random_model_folder(hf_config, Path(tmp), torch.float32, device)
        config = ModelConfig(model=tmp, device=device.type, dtype="float32", block_size=16,
                             num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=256,
                             attention_backend="torch" if dry_run else "triton")
        for name in ("plain", "tp=1"):
            if name == "plain":
                runner = make_runner(config, dry_run)
            else:
                _, runner = start_tensor_parallel(
                    replace(config, tensor_parallel_size=1))
                if dry_run:
                    runner.decode_graphs = DecodeGraphRunner(
                        runner.model, runner.attn, max_num_seqs=config.max_num_seqs,
                        max_model_len=runner.max_model_len, block_size=runner.block_size,
                        use_cuda_graphs=False)
            try:
                stats = scheduler_loop(runner, prompts, params, max_num_seqs=16,
                                       max_num_batched_tokens=256)
            finally:
                if runner.workers is not None:
                    runner.workers.close()
                    runner.model.tp.close()
            graphs = runner.decode_graphs
            results[name] = stats.outputs
            rows.append({"runner": name, "backend": runner.attn.name,
                         "process_group": "none" if runner.model.tp is None else (
                             "nccl" if device.type == "cuda" else "gloo"),
                         "cuda_graphs": 0 if graphs is None else len(graphs._graphs),
                         "steps": stats.num_steps, "decode_steps": stats.num_decode_steps,
                         "execute_ms_per_step": 1000 * stats.phase_s["execute"]
                         / max(stats.num_steps, 1)})
            del runner
            free_device_memory()
    identical, pct, first = agreement(results["tp=1"], results["plain"])
    ok = identical == len(prompts)
    return PartResult("tp_one_rank_nccl", "pass" if ok else "fail", rows=rows,
                      detail="identical greedy tokens" if ok else f"{pct:.1f}% agree; {first}")
