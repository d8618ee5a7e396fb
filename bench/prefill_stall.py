"""The stall a long urgent prompt puts on running streams, in the engine alone.

    python -m bench.prefill_stall [--streams 16] [--prompt-len 2000] [--serve-args "..."]

One process, the real default model, the scheduler of `pagedserve serve --scheduling-policy
priority` (plus --serve-args) on the CPU, no HTTP: `--streams` low-priority requests
(priority 10, 128-token prompts) decode, then one priority -10 prompt of `--prompt-len`
tokens arrives. Prints the median decode step (the streams alone) and each step that
carries a chunk of the prompt as a ratio to it (median, p90, max): what every stream's
inter-token gap becomes while the prompt is computed, without the load generator and the
API process sharing the cores (WL of bench.priority_http measures it over HTTP).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine.core_setup import build_core_parts
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from server.cli import build_configs, build_parser

DECODE_STEPS = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--serve-args", default="", help="extra `serve` flags")
    args = parser.parse_args()
    serve = build_parser().parse_args(
        ["serve", "--scheduling-policy", "priority", "--device", "cpu",
         *args.serve_args.split()])
    configs = build_configs(serve, cuda=False)
    scheduler, runner, _, _ = build_core_parts(configs.model, configs.scheduler)
    rng = random.Random(0)

    def request(name: str, length: int, max_tokens: int, priority: int) -> Request:
        prompt = [rng.randrange(1000, 40000) for _ in range(length)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        return Request(name, prompt, params, priority=priority)

    def step() -> tuple[float, int]:
        """One step: its seconds and its prefill tokens."""
        plan = scheduler.schedule()
        start = time.perf_counter()
        result = runner.execute(plan)
        seconds = time.perf_counter() - start
        scheduler.update(plan, result)
        return seconds, sum(len(r.token_ids) for r in plan.scheduled if len(r.token_ids) > 1)

    for i in range(args.streams):
        scheduler.add_request(request(f"low-{i}", 128, 100_000, 10))
    while step()[1]:
        pass  # the streams' own prompts
    decode = statistics.median(step()[0] for _ in range(DECODE_STEPS))
    scheduler.add_request(request("urgent", args.prompt_len, 1, -10))
    chunks = []
    while (taken := step())[1]:
        chunks.append(taken)
    ratios = sorted(seconds / decode for seconds, _ in chunks)
    cap = configs.scheduler.long_prefill_token_threshold
    print(f"{args.streams} streams, a {args.prompt_len}-token urgent prompt, threshold {cap}: "
          f"decode step {decode * 1e3:.1f} ms; {len(chunks)} steps with a chunk "
          f"({statistics.mean(n for _, n in chunks):.0f} tokens on average) at "
          f"{statistics.median(ratios):.2f}x the decode step (p90 "
          f"{ratios[int(0.9 * (len(ratios) - 1))]:.2f}x, max {ratios[-1]:.2f}x)")


if __name__ == "__main__":
    main()
