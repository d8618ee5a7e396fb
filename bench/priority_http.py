"""The HTTP targets of priority at scale, on the real model with `make serve`'s flags.

    python -m bench.priority_http [--baseline-tree PATH] [--rounds 1] [--scale 1.0]

Per system (this checkout, and with --baseline-tree another checkout as a same-run
baseline, the two alternating round by round):
- idle: the TTFT of a lone priority -10 request of 128 tokens (median of 8, 8 tokens out);
- WPS (loadgen.workloads.wps: 48 in flight, 128 in / 96 out, 15% at priority -10): the
  -10 TTFT p50, the loaded server's step (the median inter-token latency), and where the
  -10 TTFT p50 lies past idle, in loaded steps (the target: at most 2); the low TTFT p50
  and the output throughput;
- WPP (loadgen.workloads.wpp: WPS's low load, 48 in flight, with -10 probes on a clock of
  their own, so that they land anywhere in a step and not just after one starts): the
  -10 TTFT p50 and where it lies past idle, in loaded steps (the low ITL p50);
- WL (loadgen.workloads.wl: 16 low-priority streams and a 2,000-token -10 prompt): the
  low ITL p50 and p99 over the whole run (the target: p99 within 3x p50), timed per
  token (logprobs asked: see BenchConfig.logprobs).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.compare import run_client, server_in_tree, warm_up
from loadgen.workloads import BenchItem, wl, wpp, wps
from tests.support.server_process import free_port, pagedserve_command

SERVE_FLAGS = ["--scheduling-policy", "priority", "--log-level", "warning"]  # `make serve`
IDLE_REPEATS = 8


def measure(url: str, scale: float) -> dict[str, float]:
    """Idle TTFT, WPS and WL against the server at `url` (latencies in ms)."""
    warm_up(url)
    # NOTE: a prompt each, or the prefix cache would serve the later ones
    prompts = [item.prompt for item in wps(seed=1).requests[:IDLE_REPEATS]]
    idle = [
        run_client(url, [BenchItem(prompt, 8, priority=-10)], 1)["all"]["ttft_s"]["p50"]
        for prompt in prompts
    ]
    load = wps(scale)
    loaded = run_client(url, load.requests, load.concurrency)
    probes = wpp(scale)
    probed = run_client(url, probes.requests, probes.concurrency)
    long_prefill = wl(scale)
    stall = run_client(url, long_prefill.requests, long_prefill.concurrency, logprobs=0)
    high, low = loaded["by_priority"]["-10"], loaded["by_priority"]["10"]
    low_itl = stall["by_priority"]["10"]["itl_s"]
    return {
        "idle_ttft": statistics.median(idle) * 1e3,
        "wps_high_ttft_p50": high["ttft_s"]["p50"] * 1e3,
        "wps_step": loaded["all"]["itl_s"]["p50"] * 1e3,
        "wps_low_ttft_p50": low["ttft_s"]["p50"] * 1e3,
        "wps_tok_s": loaded["output_token_throughput"],
        "wpp_high_ttft_p50": probed["by_priority"]["-10"]["ttft_s"]["p50"] * 1e3,
        "wpp_step": probed["by_priority"]["10"]["itl_s"]["p50"] * 1e3,
        "wl_itl_p50": low_itl["p50"] * 1e3,
        "wl_itl_p99": low_itl["p99"] * 1e3,
        "failed": loaded["num_failed"] + probed["num_failed"] + stall["num_failed"],
    }


def report(name: str, r: dict[str, float]) -> str:
    steps = (r["wps_high_ttft_p50"] - r["idle_ttft"]) / r["wps_step"]
    probe_steps = (r["wpp_high_ttft_p50"] - r["idle_ttft"]) / r["wpp_step"]
    return (
        f"{name}: idle TTFT {r['idle_ttft']:.0f} ms | WPS -10 TTFT p50 "
        f"{r['wps_high_ttft_p50']:.0f} ms = idle + {steps:.2f} loaded steps of "
        f"{r['wps_step']:.0f} ms; 10 TTFT p50 {r['wps_low_ttft_p50']:.0f} ms; "
        f"{r['wps_tok_s']:.1f} tok/s | WPP -10 TTFT p50 {r['wpp_high_ttft_p50']:.0f} ms = "
        f"idle + {probe_steps:.2f} loaded steps of {r['wpp_step']:.0f} ms | "
        f"WL low ITL p50 {r['wl_itl_p50']:.0f} ms, p99 "
        f"{r['wl_itl_p99']:.0f} ms ({r['wl_itl_p99'] / r['wl_itl_p50']:.2f}x) | "
        f"failed {r['failed']:.0f}"
    )


def run_system(tree: Path | None, scale: float, extra_flags: list[str]) -> dict[str, float]:
    port = free_port()
    cmd = pagedserve_command(port, SERVE_FLAGS + extra_flags)
    log = Path(tempfile.gettempdir()) / f"priority_http-{'baseline' if tree else 'this'}.log"
    with server_in_tree(cmd, port, log, tree) as url:
        return measure(url, scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="another checkout, measured the same way in the same run")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--scale", type=float, default=1.0, help="scales WPS and WL")
    parser.add_argument("--serve-args", default="", help="extra `serve` flags for both")
    args = parser.parse_args()
    systems: list[tuple[str, Path | None]] = [("this tree", None)]
    if args.baseline_tree is not None:
        systems.insert(0, (f"baseline {args.baseline_tree}", args.baseline_tree.resolve()))
    for round_ in range(args.rounds):
        for name, tree in systems:
            result = run_system(tree, args.scale, args.serve_args.split())
            print(f"round {round_ + 1}, {report(name, result)}", flush=True)


if __name__ == "__main__":
    main()
