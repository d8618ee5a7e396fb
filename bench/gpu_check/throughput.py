"""GPU check parts: throughput on nano-vllm's workload against HF static
batching, and the decode step against the device's copy bandwidth."""

from __future__ import annotations

import dataclasses
import time

from bench.gpu_check.common import (
    PartResult,
    free_device_memory,
    qwen3_model,
    sync,
    time_left,
)
from tests.support.gpu_models import (
    LoopStats,
    device_for,
    make_runner,
    scheduler_loop,
)


def nano_vllm_workload(dry_run: bool) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py: 256 sequences, prompts of 100..1024 random ids below 10000,
    100..1024 output tokens each (ignore_eos); 8 short ones in a dry run."""
    import random

    rng = random.Random(0)
    n, low, high, top = (8, 4, 24, 500) if dry_run else (256, 100, 1024, 10000)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(low, high))] for _ in range(n)]
    max_tokens = [rng.randint(low, high) for _ in range(n)]
    return prompts, max_tokens


def _hf_static_tps(hf, prompts: list[list[int]], max_tokens: list[int], num_steps: int,
                   temperature: float, device) -> dict:
    """HF generate with static batching: all requests in one left-padded batch, run
    until the longest is done. Only the prefill and `num_steps` decode steps run; the
    rest is extrapolated at the median step time (steps only get slower as the cache
    grows, so this flatters HF)."""
    import statistics

    import torch
    from transformers import LogitsProcessorList

    from bench.hf_baseline import StepTimes, left_pad

    ids, mask = left_pad(prompts)
    ids, mask = ids.to(device), mask.to(device)
    steps = min(num_steps, max(max_tokens))
    timer = StepTimes()
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                    temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=steps,
                    min_new_tokens=steps, pad_token_id=0,
                    logits_processor=LogitsProcessorList([timer]))
    sync(device)
    end = time.perf_counter()
    prefill_s = timer.times[0] - start
    step_s = statistics.median(b - a for a, b in zip(timer.times, timer.times[1:],
                                                     strict=False)) if steps > 1 else 0.0
    total_s = prefill_s + step_s * (max(max_tokens) - 1)
    return {"system": f"HF generate, static batch of {len(prompts)}",
            "output_tokens": sum(max_tokens), "seconds": total_s,
            "output_tok_per_s": sum(max_tokens) / total_s,
            "note": f"ran prefill + {steps} of {max(max_tokens)} steps "
                    f"({end - start:.1f}s), the rest extrapolated at the median step "
                    f"{step_s * 1e3:.1f} ms"}


def check_qwen3_shaped_throughput(dry_run: bool) -> PartResult:
    """Output tokens/s on nano-vllm's workload (256 sequences, 100..1024 tokens in and
    out, ignore_eos, temperature 0.6) of a Qwen3-0.6B-shaped model with random weights,
    through the real Scheduler + ModelRunner (CUDA graphs; eager too if time allows),
    against HF generate with static batching in the same run."""
    import torch

    from model_runner.config import ModelConfig
    from scheduler.sampling_params import SamplingParams

    device = device_for(dry_run)
    folder, hf = qwen3_model(dry_run)
    prompts, max_tokens = nano_vllm_workload(dry_run)
    temperature = 0.6
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True)
              for m in max_tokens]
    max_num_seqs, max_num_batched_tokens = (8, 64) if dry_run else (256, 16384)
    config = ModelConfig(
        model=str(folder), device=device.type, dtype="bfloat16", block_size=16,
        max_model_len=256 if dry_run else 4096, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, gpu_memory_utilization=0.9,
        kv_cache_memory=64 * 2**20,
        attention_backend="torch" if dry_run else "auto")
    rows = []

    def run(label: str, runner) -> LoopStats:
        # Warm-up, as nano-vllm does before timing: Triton compiles its kernel variants,
        # mixed steps included (a small token budget chunks the prompts).
        scheduler_loop(runner, prompts[:4], [SamplingParams(max_tokens=8, ignore_eos=True)] * 4,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=16 if dry_run else 256)
        sync(device)
        stats = scheduler_loop(runner, prompts, params, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens)
        rows.append({"system": label, "output_tokens": stats.num_output_tokens,
                     "seconds": stats.elapsed_s,
                     "output_tok_per_s": stats.num_output_tokens / stats.elapsed_s,
                     "note": f"{stats.num_steps} steps, {stats.num_decode_steps} decode-only, "
                             f"{stats.num_preemptions} preemptions, "
                             f"{runner.num_kv_blocks} KV blocks; ms per step: " + ", ".join(
                                 f"{k} {v / stats.num_steps * 1e3:.2f}"
                                 for k, v in stats.phase_s.items())})
        print(f"[gpu_check]   {label}: {rows[-1]['output_tok_per_s']:.0f} tok/s "
              f"({stats.elapsed_s:.1f}s)", flush=True)
        return stats

    runner = make_runner(config, dry_run)
    graphs = "CUDA graphs" if runner.decode_graphs and runner.decode_graphs.use_cuda_graphs \
        else "decode graph runner, eager"
    first = run(f"pagedserve ({runner.attn.name}, {graphs})", runner)
    if first.num_output_tokens != sum(max_tokens):
        raise RuntimeError(f"{first.num_output_tokens} tokens out, expected {sum(max_tokens)}")
    # The eager rerun only when the rest of the check keeps enough time after it.
    if time_left() > 2.5 * first.elapsed_s + 150:
        runner.decode_graphs = None
        run(f"pagedserve ({runner.attn.name}, eager)", runner)
    else:
        rows.append({"system": "pagedserve (eager)", "note": "skipped: budget"})
    del runner
    free_device_memory()
    rows.append(_hf_static_tps(hf, prompts, max_tokens, 4 if dry_run else 64, temperature,
                               device))
    print(f"[gpu_check]   HF static: {rows[-1]['output_tok_per_s']:.0f} tok/s (extrapolated)",
          flush=True)
    ours = rows[0]["output_tok_per_s"]
    detail = (f"{len(prompts)} requests, {sum(len(p) for p in prompts)} prompt tokens, "
              f"{sum(max_tokens)} output tokens; pagedserve {ours:.0f} tok/s = "
              f"{ours / rows[-1]['output_tok_per_s']:.2f}x HF static batching (HF time "
              f"extrapolated, see its note); random weights, {torch.bfloat16}")
    return PartResult("qwen3_shaped_throughput", "pass", detail=detail, rows=rows)


# --- decode step time against the memory-bandwidth floor


def _copy_bandwidth(device, dry_run: bool) -> float:
    """Bytes moved per second (read + written) by a large device-to-device tensor copy."""
    import torch

    num_bytes = (64 if dry_run else 4096) * 2**20
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    repeats = 3 if dry_run else 20
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    return 2 * num_bytes * repeats / (time.perf_counter() - start)


def check_decode_step_vs_bandwidth(dry_run: bool) -> PartResult:
    """Decode step time (ModelRunner.execute, greedy) of the Qwen3-0.6B-shaped model at
    batch 1, 64 and 256 with ~1k-token contexts, CUDA graphs and eager, against its floor:
    (weight bytes + KV bytes read) / the copy bandwidth measured here. Also the bare
    graph replay (the forward alone, no host work)."""
    import statistics

    import torch

    from model_runner.config import ModelConfig
    from scheduler.output import ScheduledRequest, SchedulerOutput
    from scheduler.sampling_params import SamplingParams

    device = device_for(dry_run)
    bandwidth = _copy_bandwidth(device, dry_run)
    folder, _ = qwen3_model(dry_run)
    batch_sizes, context, num_steps = ((1, 4, 8), 32, 3) if dry_run else ((1, 64, 256), 1024, 20)
    max_batch, block_size = max(batch_sizes), 16
    # Request 0 decodes in every timed step: up to 3 modes x (warm-up + num_steps) per
    # batch size.
    decode_tokens = len(batch_sizes) * 3 * (num_steps + 1)
    blocks_per_seq = -(-(context + decode_tokens + 8) // block_size)
    max_num_batched_tokens = 64 if dry_run else 16384
    config = ModelConfig(
        model=str(folder), device=device.type, dtype="bfloat16", block_size=block_size,
        max_model_len=256 if dry_run else 4096, max_num_seqs=max_batch,
        max_num_batched_tokens=max_num_batched_tokens,
        num_kv_blocks=max_batch * blocks_per_seq + 1,
        attention_backend="torch" if dry_run else "auto")
    runner = make_runner(config, dry_run)
    model, graphs = runner.model, runner.decode_graphs
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    k_cache = runner.kv_cache.layers[0][0]
    kv_bytes_per_token = (2 * len(runner.kv_cache.layers) * k_cache.shape[2] * k_cache.shape[3]
                          * k_cache.element_size())

    greedy = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    prompts = [torch.randint(3, vocab, (context,), generator=gen).tolist()
               for _ in range(max_batch)]
    outputs: list[list[int]] = [[] for _ in range(max_batch)]
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
              for i in range(max_batch)]

    def request(i: int, prefill: bool) -> ScheduledRequest:
        tokens = prompts[i] + outputs[i]
        new = prompts[i] if prefill else tokens[-1:]
        return ScheduledRequest(str(i), new, len(tokens) - len(new), tables[i], True, greedy,
                                prompts[i], outputs[i])

    def step(batch: list[ScheduledRequest]) -> None:
        out = runner.execute(SchedulerOutput(scheduled=batch))
        for r in batch:
            outputs[int(r.request_id)].append(out.sampled_token_ids[r.request_id])

    per_step = max(1, max_num_batched_tokens // context)
    for start in range(0, max_batch, per_step):
        step([request(i, prefill=True) for i in range(start, min(start + per_step, max_batch))])

    # (label, graph runner or None for eager): the runner's own graphs, and (on CUDA, for
    # the fused layer kernels' share) graphs of the same model with the torch layer code
    modes: list[tuple[str, object]] = [("eager", None)]
    if graphs is not None:
        modes.insert(0, ("CUDA graphs" if graphs.use_cuda_graphs else "graph runner, eager",
                         graphs))
        if graphs.use_cuda_graphs and runner.attn.layer_ops is not None:
            from model_runner.cuda_graphs import create_decode_graph_runner

            torch_layers = create_decode_graph_runner(
                model, dataclasses.replace(runner.attn, layer_ops=None), config,
                runner.max_model_len, device)
            torch_layers.capture(runner.kv_cache.layers)
            modes.insert(1, ("CUDA graphs, torch layer code", torch_layers))
    rows = []
    for batch_size in batch_sizes:
        for label, mode_graphs in modes:
            runner.decode_graphs = mode_graphs
            step([request(i, prefill=False) for i in range(batch_size)])  # warm-up
            times = []
            for _ in range(num_steps):
                batch = [request(i, prefill=False) for i in range(batch_size)]
                begin = time.perf_counter()
                step(batch)
                times.append(time.perf_counter() - begin)
            step_s = statistics.median(times)
            contexts = sum(len(prompts[i]) + len(outputs[i]) for i in range(batch_size))
            floor_s = (weight_bytes + contexts * kv_bytes_per_token) / bandwidth
            row = {"batch": batch_size, "mode": label,
                   "step_ms": step_s * 1e3, "floor_ms": floor_s * 1e3,
                   "floor_pct": 100 * floor_s / step_s, "tok_per_s": batch_size / step_s,
                   "mean_context": contexts / batch_size}
            if mode_graphs is not None:
                row["forward_only_ms"] = _time_graph_forward(mode_graphs, batch_size, runner,
                                                             num_steps) * 1e3
                row["forward_floor_pct"] = 100 * floor_s * 1e3 / row["forward_only_ms"]
            rows.append(row)
            print(f"[gpu_check]   batch {batch_size} {row['mode']}: {row['step_ms']:.2f} ms "
                  f"(floor {row['floor_ms']:.2f} ms)", flush=True)
    runner.decode_graphs = graphs
    detail = (f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write, device tensor copy); "
              f"weights {weight_bytes / 2**20:.0f} MiB; KV {kv_bytes_per_token} B/token; "
              f"step = ModelRunner.execute (inputs, forward, greedy sampling), median of "
              f"{num_steps}; forward_only = the graph replayed alone")
    return PartResult("decode_step_vs_bandwidth", "pass", detail=detail, rows=rows)


def _time_graph_forward(graphs, batch_size: int, runner, repeats: int) -> float:
    """Seconds per forward of the bucket's graph replayed back to back on the inputs
    staged last (same tokens at the same slots: the cache is rewritten unchanged)."""
    import torch

    bucket = graphs.bucket(batch_size)
    device = graphs.device

    def forward() -> None:
        if graphs.use_cuda_graphs:
            graphs._graphs[bucket].replay()
        else:
            with torch.inference_mode():
                graphs._run(bucket, runner.kv_cache.layers)

    forward()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        forward()
    sync(device)
    return (time.perf_counter() - start) / repeats


