"""HTTP serving against the in-process engine loop, on the simulated runner, in one run.

    python -m bench.http_vs_engine --step-ms 10 --num-requests 256 --output-len 256 \\
        --stream-intervals 1,4 --baseline-tree /tmp/thread-baseline

Measures, on the same load (every request in flight at once, `ignore_eos`):
- the load generator's ceiling against bench/null_server.py (a server that does nothing);
- `pagedserve bench --engine-loop`: the step loop with no HTTP (this process);
- `pagedserve serve --simulate-step-ms` over HTTP, once per --stream-intervals value, and
  the server of --baseline-tree (another checkout, e.g. the thread design before the
  engine core had its own process, run with its own PYTHONPATH) when given;
and prints output tok/s and the CPU seconds per 1,000 output tokens of each server
process (the API process and, when there is one, the engine core) as a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from bench.client import BenchConfig, run_bench
from bench.engine_loop import run_engine_loop
from bench.server_process import REPO_ROOT, ServerProcess, cpu_seconds, free_port


def _server_flags(step_ms: float, num_requests: int) -> list[str]:
    return ["--simulate-step-ms", str(step_ms), "--num-kv-blocks", "32768",
            "--max-num-seqs", str(num_requests), "--max-num-batched-tokens", "8192",
            "--log-level", "warning"]


def measure_http(
    name: str, command: list[str], port: int, config: BenchConfig, env: dict[str, str],
    cwd: Path,
) -> dict[str, Any]:
    """One server: start it, run the load, read each process's CPU time over the load."""
    server = ServerProcess(command=command, port=port, env=env, cwd=cwd,
                           log_prefix="pagedserve-bench-")
    try:
        server.wait_healthy(120)
        pids = {"api": server.pid, **{"core" if i == 0 else f"core{i}": p for i, p in
                                      enumerate(server.child_pids())}}
        before = {k: cpu_seconds(p) for k, p in pids.items()}
        summary = asyncio.run(run_bench(BenchConfig(**{**config.__dict__,
                                                       "url": server.url})))
        after = {k: cpu_seconds(p) for k, p in pids.items()}
    finally:
        server.terminate()
        server.remove_log()
    tokens = max(summary["output_tokens"], 1)
    return {
        "name": name,
        "tok_s": summary["output_token_throughput"],
        "failed": summary["num_failed"],
        "itl_p50_ms": (summary["all"]["itl_s"]["p50"] or 0) * 1000,
        "cpu_per_1k": {k: 1000 * (after[k] - before[k]) / tokens for k in pids},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--stream-intervals", default="1",
                        help="comma-separated --stream-interval values for this tree's server")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="another checkout whose server is measured too")
    args = parser.parse_args()
    config = BenchConfig(url="", num_requests=args.num_requests,
                         concurrency=args.num_requests, input_len=(args.input_len,) * 2,
                         output_len=(args.output_len,) * 2, ignore_eos=True)
    rows = []

    port = free_port()
    null = [sys.executable, "-m", "bench.null_server", "--port", str(port)]
    null_server = ServerProcess(command=null, port=port)
    deadline = time.monotonic() + 30
    while True:
        try:
            ceiling = asyncio.run(run_bench(BenchConfig(**{**config.__dict__,
                                                           "url": null_server.url})))
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    null_server.terminate()
    null_server.remove_log()
    rows.append(f"| load generator vs a null server | {ceiling['output_token_throughput']:.0f} "
                "| - | - |")

    loop = run_engine_loop(config, args.step_ms)
    rows.append(f"| engine loop in-process (no HTTP) | {loop['output_token_throughput']:.0f} "
                f"| - | {loop['cpu_s_per_1k_tokens']:.3f} |")

    flags = _server_flags(args.step_ms, args.num_requests)
    servers: list[tuple[str, Path, list[str]]] = []
    if args.baseline_tree is not None:
        servers.append((f"HTTP, baseline {args.baseline_tree}", args.baseline_tree, flags))
    for interval in args.stream_intervals.split(","):
        extra = ["--stream-interval", interval] if interval != "1" else []
        servers.append((f"HTTP, this tree, --stream-interval {interval}", REPO_ROOT,
                        [*flags, *extra]))
    for name, tree, server_flags in servers:
        port = free_port()
        command = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1",
                   "--port", str(port), *server_flags]
        env = {"PYTHONPATH": str(tree)}
        result = measure_http(name, command, port, config, env, tree.resolve())
        cpu = ", ".join(f"{k} {v:.3f}" for k, v in result["cpu_per_1k"].items())
        rows.append(f"| {name} | {result['tok_s']:.0f} | {result['itl_p50_ms']:.1f} | {cpu} |"
                    + (f" ({result['failed']} failed)" if result["failed"] else ""))

    print(f"{args.num_requests} streams x {args.output_len} tokens ({args.input_len} in), "
          f"{args.step_ms:g} ms simulated steps, all in flight at once\n")
    print("| run | output tok/s | ITL p50 ms | CPU s per 1k tokens |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
