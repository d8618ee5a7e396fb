"""The in-process engine step loop on the simulated runner, no HTTP.

Builds the engine core as `pagedserve serve --simulate-step-ms MS` does (the default
model's tokenizer, a SimulatedRunner) and steps it in this process (schedule, launch,
update, and the per-step message the core would send) with the same requests as the
HTTP load generator (`pagedserve bench`'s request flags), at most `--concurrency` in
flight, so that the HTTP figure of one run has the in-process ceiling beside it.

    python -m bench.engine_loop --simulate-step-ms 10 --num-requests 256 \\
        --concurrency 256 --input-len 128 --output-len 256 --ignore-eos [--async-scheduling]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from engine.core import EngineCore
from engine.core_setup import build_core_parts
from engine.messages import AddRequests, NewRequest
from loadgen.cli import add_load_arguments, load_fields
from loadgen.client import BenchConfig, make_items
from model_runner.config import ModelConfig
from model_runner.loader import load_model_spec
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams

# NOTE: the simulated pool holds no tensors, so it can be as large as the load needs.
_NUM_KV_BLOCKS = 32768
_MAX_NUM_BATCHED_TOKENS = 8192


def run_engine_loop(
    config: BenchConfig, step_ms: float, async_scheduling: bool = False
) -> dict[str, Any]:
    """Steps until every request of `config` finished (overlapped steps with
    `async_scheduling`); tokens, steps and wall time."""
    concurrency = config.concurrency or 8
    model_config = ModelConfig(
        num_kv_blocks=_NUM_KV_BLOCKS, max_num_seqs=concurrency,
        max_num_batched_tokens=_MAX_NUM_BATCHED_TOKENS, device="cpu", seed=config.seed,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=concurrency, max_num_batched_tokens=_MAX_NUM_BATCHED_TOKENS,
        async_scheduling=async_scheduling,
    )
    scheduler, runner, info, _ = build_core_parts(
        model_config, scheduler_config, simulate_step_ms=step_ms
    )
    core = EngineCore(scheduler, runner, frozenset(info.eos_token_ids))
    tokenizer = load_model_spec(model_config).tokenizer
    pending = deque(make_items(config))
    num_requests = len(pending)

    def admit() -> None:
        while pending and scheduler.num_running + scheduler.num_waiting < concurrency:
            item = pending.popleft()
            if not isinstance(item.prompt, list):
                item_ids = list(tokenizer.encode(item.prompt))
            else:
                item_ids = item.prompt
            params = SamplingParams(temperature=config.temperature, max_tokens=item.max_tokens,
                                    ignore_eos=config.ignore_eos)
            new = NewRequest(request_id=f"r{len(pending)}", prompt_token_ids=item_ids,
                             sampling_params=params)
            core.apply(AddRequests([new]))

    num_tokens = num_steps = 0
    start = time.perf_counter()
    cpu_start = time.process_time()
    admit()
    while core.has_work:
        num_tokens += sum(len(d.new_token_ids) for d in core.step_fn().deltas)
        num_steps += 1
        admit()
    duration = time.perf_counter() - start
    cpu_s = time.process_time() - cpu_start
    return {
        "mode": "engine-loop",
        "simulate_step_ms": step_ms,
        "num_requests": num_requests,
        "num_steps": num_steps,
        "duration_s": duration,
        "output_tokens": num_tokens,
        "output_token_throughput": num_tokens / duration,
        "steps_per_s": num_steps / duration,
        "cpu_s_per_1k_tokens": 1000 * cpu_s / max(num_tokens, 1),
    }


def format_engine_loop(summary: dict[str, Any]) -> str:
    return (
        f"engine loop ({summary['simulate_step_ms']:g} ms simulated steps): "
        f"{summary['output_tokens']} output tokens of {summary['num_requests']} requests in "
        f"{summary['duration_s']:.2f} s: {summary['output_token_throughput']:.1f} tok/s, "
        f"{summary['steps_per_s']:.1f} steps/s, "
        f"{summary['cpu_s_per_1k_tokens']:.3f} CPU s per 1k tokens"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_loop",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--simulate-step-ms", type=float, required=True, metavar="MS",
                        help="the simulated runner's step time")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="overlapped steps (as `pagedserve serve` takes it)")
    add_load_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the requests of the flags through the loop and print the summary; invalid
    flags end in `parser.error` (exit 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.simulate_step_ms < 0:
        parser.error("--simulate-step-ms must be >= 0")
    try:
        config = BenchConfig(url="", **load_fields(args))
    except ValueError as exc:
        parser.error(str(exc))
    summary = run_engine_loop(config, args.simulate_step_ms, args.async_scheduling)
    print(json.dumps(summary, indent=2) if config.json else format_engine_loop(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
