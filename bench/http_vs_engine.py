"""HTTP serving against the in-process engine loop, on the simulated runner, in one run.

    python -m bench.http_vs_engine --step-ms 10 --num-requests 256 --output-len 256 \\
        --stream-intervals 1,4 --baseline-tree /tmp/thread-baseline [--async-scheduling]

Measures, on the same load (every request in flight at once, `ignore_eos`; the load
generator's raw HTTP client, in this process):
- the load generator's ceiling against bench/null_server.py (a server that does nothing),
  streaming as fast as it can and paced like the engine (one chunk per stream per step);
- `python -m bench.engine_loop`: the step loop with no HTTP (this process);
- `pagedserve serve --simulate-step-ms` over HTTP, once per --stream-intervals value, and
  the server of --baseline-tree (another checkout, e.g. the thread design before the
  engine core had its own process, run with its own PYTHONPATH) when given;
and prints output tok/s, the inter-chunk p50 and the CPU seconds per 1,000 output tokens
of each process (the API process, the engine core when there is one, the client) as a
markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import uvloop

from bench.engine_loop import run_engine_loop
from loadgen.client import BenchConfig, run_bench
from tests.support.server_process import REPO_ROOT, ServerProcess, cpu_seconds, free_port


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
        client_cpu = time.process_time()
        summary = uvloop.run(run_bench(replace(config, url=server.url)))
        client_cpu = time.process_time() - client_cpu
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
        "cpu_per_1k": {**{k: 1000 * (after[k] - before[k]) / tokens for k in pids},
                       "client": 1000 * client_cpu / tokens},
    }


def measure_null_server(config: BenchConfig, step_ms: float | None) -> dict[str, Any]:
    """The load generator against bench/null_server.py: its own ceiling."""
    port = free_port()
    command = [sys.executable, "-m", "bench.null_server", "--port", str(port)]
    if step_ms is not None:
        command += ["--step-ms", str(step_ms)]
    server = ServerProcess(command=command, port=port, log_prefix="pagedserve-null-")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{server.url}/v1/models", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, server.log_tail()
                time.sleep(0.2)
        cpu = time.process_time()
        summary = uvloop.run(run_bench(replace(config, url=server.url)))
        cpu = time.process_time() - cpu
    finally:
        server.terminate()
        server.remove_log()
    tokens = max(summary["output_tokens"], 1)
    return {"tok_s": summary["output_token_throughput"],
            "itl_p50_ms": (summary["all"]["itl_s"]["p50"] or 0) * 1000,
            "client_cpu_per_1k": 1000 * cpu / tokens}


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
    parser.add_argument("--async-scheduling", action="store_true",
                        help="overlapped steps in this tree's engine loop and servers")
    args = parser.parse_args()
    config = BenchConfig(url="", num_requests=args.num_requests,
                         concurrency=args.num_requests, input_len=(args.input_len,) * 2,
                         output_len=(args.output_len,) * 2, ignore_eos=True,
                         http_client="raw")
    rows = []

    for pace in (None, args.step_ms):
        ceiling = measure_null_server(config, pace)
        what = "as fast as it can" if pace is None else f"one chunk per stream per {pace:g} ms"
        rows.append(f"| load generator vs a null server ({what}) | {ceiling['tok_s']:.0f} "
                    f"| {ceiling['itl_p50_ms']:.1f} | client {ceiling['client_cpu_per_1k']:.3f} |")

    loop = run_engine_loop(config, args.step_ms, args.async_scheduling)
    overlapped = ", overlapped steps" if args.async_scheduling else ""
    rows.append(f"| engine loop in-process (no HTTP{overlapped}) | "
                f"{loop['output_token_throughput']:.0f} "
                f"| - | {loop['cpu_s_per_1k_tokens']:.3f} |")

    flags = _server_flags(args.step_ms, args.num_requests)
    servers: list[tuple[str, Path, list[str]]] = []
    if args.baseline_tree is not None:
        servers.append((f"HTTP, baseline {args.baseline_tree}", args.baseline_tree, flags))
    for interval in args.stream_intervals.split(","):
        extra = ["--stream-interval", interval] if interval != "1" else []
        if args.async_scheduling:
            extra.append("--async-scheduling")
        servers.append((f"HTTP, this tree, --stream-interval {interval}{overlapped}",
                        REPO_ROOT, [*flags, *extra]))
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
