"""`-dp 2` against `-dp 1` on the default model, in one run: W1 over HTTP.

    python -m bench.data_parallel_bench [--scale 0.5] [--repeats 2]

Both servers use every CPU thread there is: `-dp 1` one core with all of them, `-dp 2`
two cores with half each. Prints output tok/s, TTFT p50 and ITL p50 per configuration
(medians over --repeats, the two alternating) as a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

import uvloop

from loadgen.client import BenchConfig, run_bench
from tests.support.server_process import ServerProcess

CONFIGS = {"-dp 1": [], "-dp 2": ["-dp", "2"]}
FLAGS = ["--num-kv-blocks", "512", "--max-num-seqs", "32", "--log-level", "warning"]


def measure(flags: list[str], config: BenchConfig) -> dict[str, float]:
    server = ServerProcess([*FLAGS, *flags], log_prefix="pagedserve-dp-bench-")
    try:
        server.wait_healthy(300)
        uvloop.run(run_bench(replace(config, url=server.url, scale=0.125)))  # warm-up
        summary = uvloop.run(run_bench(replace(config, url=server.url)))
    finally:
        server.terminate()
        server.remove_log()
    assert summary["num_failed"] == 0, summary["errors"]
    return {"tok_s": summary["output_token_throughput"],
            "ttft_p50_ms": summary["all"]["ttft_s"]["p50"] * 1e3,
            "itl_p50_ms": summary["all"]["itl_s"]["p50"] * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    config = BenchConfig(url="", workload="W1", scale=args.scale, http_client="raw")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    for _ in range(args.repeats):
        for name, flags in CONFIGS.items():
            runs[name].append(measure(flags, config))
            print(name, runs[name][-1], flush=True)
    base = statistics.median(r["tok_s"] for r in runs["-dp 1"])
    print("| config | output tok/s | vs -dp 1 | TTFT p50 ms | ITL p50 ms |")
    print("|---|---|---|---|---|")
    for name, results in runs.items():
        tok_s = statistics.median(r["tok_s"] for r in results)
        ttft = statistics.median(r["ttft_p50_ms"] for r in results)
        itl = statistics.median(r["itl_p50_ms"] for r in results)
        print(f"| {name} | {tok_s:.0f} | {tok_s / base:.2f}x | {ttft:.0f} | {itl:.1f} |")


if __name__ == "__main__":
    main()
