"""Tensor parallelism on the CPU: the decode step of -tp 2 against -tp 1, and the share of
the step that rank 0 spends in all-reduces.

`python -m bench.tp_bench [--model M] [--batch-sizes 1 64] [--context 128] [--steps 20]
[--threads N]`

For each tensor-parallel size the model is loaded as the server loads it (rank 0 in this
process, the workers started by model_runner/distributed/tp_workers.py, torch's threads shared
between the ranks), `B` requests are prefilled to `context` tokens, and `steps` decode
steps of all `B` are timed through `ModelRunner.execute` (after 3 untimed ones). With 2
ranks, rank 0 also times each all-reduce (the embedding's and two per layer); that time
includes waiting for the other rank to arrive, so it is an upper bound on the collective's
own cost. The collective alone is then timed apart: two fresh processes, nothing else to
do, all-reducing a [batch, hidden] float32 tensor back to back.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from model_runner.config import ModelConfig
from model_runner.distributed.tensor_parallel import (
    HOST,
    TIMEOUT,
    TensorParallel,
    init_tensor_parallel,
    open_store,
)
from model_runner.distributed.tp_workers import start_tensor_parallel
from model_runner.loader import load_model
from model_runner.runner import ModelRunner
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.sampling_params import SamplingParams

NUM_WARMUP_STEPS = 3
NUM_COLLECTIVES = 200
GREEDY = SamplingParams(temperature=0.0)


@dataclass
class AllReduceClock:
    """Rank 0's time inside TensorParallel.all_reduce (patched in for the bench)."""

    seconds: float = 0.0
    calls: int = 0

    def install(self) -> None:
        original = TensorParallel.all_reduce
        clock = self

        def timed(tp: TensorParallel, x: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            out = original(tp, x)
            clock.seconds += time.perf_counter() - start
            clock.calls += 1
            return out

        TensorParallel.all_reduce = timed  # type: ignore[method-assign]


def decode_steps(
    runner: ModelRunner, batch_size: int, context: int, steps: int, clock: AllReduceClock
) -> dict:
    """Prefill `batch_size` requests to `context` tokens, then time `steps` decode steps."""
    block_size = runner.block_size
    blocks_per_seq = -(-(context + NUM_WARMUP_STEPS + steps + 1) // block_size)
    gen = torch.Generator().manual_seed(batch_size)
    tokens = [torch.randint(1000, 20000, (context,), generator=gen).tolist()
              for _ in range(batch_size)]
    tag = f"b{batch_size}"
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
              for i in range(batch_size)]
    for i in range(batch_size):  # one prefill per step, as a token budget would split them
        out = runner.execute(SchedulerOutput([ScheduledRequest(
            f"{tag}-{i}", tokens[i], 0, tables[i], True, GREEDY, tokens[i], [])]))
        tokens[i].append(out.sampled_token_ids[f"{tag}-{i}"])
    times, reduce_s, reduce_calls = [], 0.0, 0
    for step in range(NUM_WARMUP_STEPS + steps):
        plan = SchedulerOutput([
            ScheduledRequest(f"{tag}-{i}", tokens[i][-1:], len(tokens[i]) - 1, tables[i], True,
                             GREEDY, tokens[i], [])
            for i in range(batch_size)])
        seconds, calls = clock.seconds, clock.calls
        start = time.perf_counter()
        out = runner.execute(plan)
        elapsed = time.perf_counter() - start
        for i in range(batch_size):
            tokens[i].append(out.sampled_token_ids[f"{tag}-{i}"])
        if step >= NUM_WARMUP_STEPS:
            times.append(elapsed)
            reduce_s += clock.seconds - seconds
            reduce_calls += clock.calls - calls
    runner.execute(SchedulerOutput(finished_ids=[f"{tag}-{i}" for i in range(batch_size)]))
    step_s = statistics.median(times)
    return {
        "step_ms": 1000 * step_s,
        "tokens_per_s": batch_size / step_s,
        "all_reduce_ms": 1000 * reduce_s / steps,
        "all_reduces_per_step": reduce_calls // steps,
        "all_reduce_share": reduce_s / sum(times),
    }


def all_reduce_ms(rank: int, port: int, world_size: int, shape: tuple[int, int]) -> float:
    """The median ms of one all-reduce of `shape` among `world_size` idle ranks (every
    rank calls it; rank 0 opened the store on `port`)."""
    store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=TIMEOUT)
    tp = init_tensor_parallel(rank, world_size, store, torch.device("cpu"))
    x, times = torch.ones(shape), []
    for _ in range(NUM_COLLECTIVES):
        start = time.perf_counter()
        tp.all_reduce(x)
        times.append(time.perf_counter() - start)
    tp.close()
    return 1000 * statistics.median(times)


def collective_alone(world_size: int, shape: tuple[int, int]) -> float:
    """`all_reduce_ms` with this process as rank 0 and fresh processes as the others."""
    store = open_store(world_size)
    others = [subprocess.Popen(
        [sys.executable, "-c", f"from bench.tp_bench import all_reduce_ms; "
         f"all_reduce_ms({rank}, {store.port}, {world_size}, {shape})"],
        cwd=Path(__file__).resolve().parents[1]) for rank in range(1, world_size)]
    try:
        return all_reduce_ms(0, store.port, world_size, shape)
    finally:
        for process in others:
            process.wait(60)


def run(config: ModelConfig, tp_size: int, batch_sizes: list[int], context: int,
        steps: int) -> list[dict]:
    clock = AllReduceClock()
    threads = torch.get_num_threads()
    if tp_size == 1:
        runner = ModelRunner(load_model(config), config)
    else:
        clock.install()
        _, runner = start_tensor_parallel(replace(config, tensor_parallel_size=tp_size))
    rows = []
    try:
        for batch_size in batch_sizes:
            row = decode_steps(runner, batch_size, context, steps, clock)
            rows.append({"tp": tp_size, "batch": batch_size,
                         "threads_per_rank": torch.get_num_threads(), **row})
    finally:
        if runner.workers is not None:
            runner.workers.close()
            runner.model.tp.close()
        torch.set_num_threads(threads)
    if tp_size > 1:
        for row in rows:
            shape = (row["batch"], runner.model.config.hidden_size)
            row["alone_ms"] = collective_alone(tp_size, shape)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=128, help="tokens before decoding")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps")
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads in all (shared by the ranks; default: torch's)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    blocks_per_seq = -(-(args.context + NUM_WARMUP_STEPS + args.steps + 1) // 16)
    config = ModelConfig(model=args.model, device="cpu", dtype="float32",
                         num_kv_blocks=max(args.batch_sizes) * blocks_per_seq,
                         max_num_seqs=max(args.batch_sizes))
    rows = []
    for tp_size in args.tp_sizes:
        rows += run(config, tp_size, args.batch_sizes, args.context, args.steps)
    print(f"CPU cores: {os.cpu_count()}, torch threads: {torch.get_num_threads()}, "
          f"context {args.context}, {args.steps} timed decode steps (median)")
    print("| -tp | batch | threads/rank | step ms | tokens/s | all-reduce ms/step "
          "| all-reduces/step | all-reduce share | one all-reduce alone, ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        alone = f"{r['alone_ms']:.3f}" if "alone_ms" in r else "-"
        print(f"| {r['tp']} | {r['batch']} | {r['threads_per_rank']} | {r['step_ms']:.1f} "
              f"| {r['tokens_per_s']:.0f} | {r['all_reduce_ms']:.2f} "
              f"| {r['all_reduces_per_step']} | {100 * r['all_reduce_share']:.0f}% | {alone} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
