"""Host cost of laying out a decode step against context length: `prepare_inputs`.

`python -m bench.prepare_inputs_bench [--batch 256] [--contexts 256,1024,4096]`: `batch`
decodes, each with a block table covering its context, laid out step after step as the
runner does, with the persistent block tables (each step copies only new blocks) and,
in the same run, with tables rebuilt every step (a fresh `BlockTables`, what the runner
did before). Reports the median milliseconds per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from model_runner.block_tables import BlockTables
from model_runner.runner import prepare_inputs
from scheduler.output import ScheduledRequest
from scheduler.sampling_params import SamplingParams

BLOCK_SIZE = 16


def bench(batch: int, context: int, steps: int, persistent: bool) -> float:
    num_blocks = -(-(context + steps) // BLOCK_SIZE)
    requests = [
        ScheduledRequest(f"r{i}", [1], context, list(range(i * num_blocks, (i + 1) * num_blocks)),
                         True, SamplingParams(), [], [])
        for i in range(batch)
    ]
    tables = BlockTables(BLOCK_SIZE, batch)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        prepare_inputs(requests, tables if persistent else BlockTables(BLOCK_SIZE, batch),
                       torch.device("cpu"))
        times.append(time.perf_counter() - start)
        for r in requests:
            r.num_computed_tokens += 1
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    print(f"batch {args.batch}, block size {BLOCK_SIZE}: ms per decode step (median)")
    for context in map(int, args.contexts.split(",")):
        rebuilt = bench(args.batch, context, args.steps, persistent=False)
        kept = bench(args.batch, context, args.steps, persistent=True)
        print(f"context {context:5d}: rebuilt every step {rebuilt:6.2f}   persistent {kept:6.2f}")


if __name__ == "__main__":
    main()
