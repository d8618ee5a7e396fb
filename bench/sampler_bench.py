"""Penalty cost per step against context length: the sampler's `_apply_penalties`.

`python -m bench.sampler_bench [--vocab 49152] [--batch 256] [--contexts 256,1024,4096]`:
`batch` rows with repetition and frequency penalties, each with a context of prompt and
output tokens, sample one token a step. The host time per step should not grow with the
context (the token counts live on the device and take only each step's new token).

NOTE: it only imports the sampler's public API, so the same file measures an older tree
for a same-run baseline: `PYTHONPATH=/path/to/old/tree python bench/sampler_bench.py`.
"""

from __future__ import annotations

import argparse
import time

import torch

from model_runner.sampler import Sampler
from scheduler.output import ScheduledRequest
from scheduler.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.1)


def bench(vocab: int, batch: int, context: int, steps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = [
        ScheduledRequest(
            f"r{i}", [0], context, [0], True, PARAMS,
            torch.randint(0, vocab, (context // 2,), generator=gen).tolist(),
            torch.randint(0, vocab, (context - context // 2,), generator=gen).tolist(),
        )
        for i in range(batch)
    ]
    sampler = Sampler(torch.device("cpu"), frozenset())
    times = []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=gen)
        start = time.perf_counter()
        token_ids = sampler(logits, rows, [None] * batch).token_ids
        times.append(time.perf_counter() - start)
        for row, token_id in zip(rows, token_ids, strict=True):
            row.output_token_ids.append(token_id)
    # NOTE: the best step after the first, so that other processes on the CPU do not skew it
    print(f"vocab {vocab} batch {batch} context {context:5d}: first step "
          f"{times[0] * 1e3:7.1f} ms, later steps (best) {min(times[1:]) * 1e3:7.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(2)
    for context in (int(c) for c in args.contexts.split(",")):
        bench(args.vocab, args.batch, context, args.steps)


if __name__ == "__main__":
    main()
