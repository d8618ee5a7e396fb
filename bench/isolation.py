"""The hostile-client suite: what each attack gets, and what another tenant sees meanwhile.

Three tenants share one server: `attacker` sends each hostile request of ATTACKS
(tests/support/attacks.py) while `victim` streams short completions back to back. Per
attack (tests/support/isolation.py): the attacker's answer against what is expected (a 4xx
naming the limit and its flag, or served within bounds), the victim's inter-token latency
(p50/p99/max) and TTFT against the unattacked run of the same server, /health latency, the
RSS growth of the server's processes (the API process and the engine core), the API
process's CPU seconds, and the pool idle afterwards (read by the `operator` tenant), held
to the isolation issue's bounds (`Measure.violations`).

`python -m bench.isolation` starts the default model with the tenants and the flags the
attacks need (SERVER_FLAGS), runs every attack, prints the table and can write JSON;
tests/e2e/test_isolation.py runs the same list against the same bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.support.attacks import (
    ATTACKS,
    SERVER_FLAGS,
    UNATTACKED,
    Attack,
    RunConfig,
    tenants_yaml,
)
from tests.support.isolation import Measure, run_attack, server_pids
from tests.support.server_process import ServerProcess


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per attack: outcome, the victim's ITL and TTFT (ms), /health max (ms), the
    largest RSS growth (MB), the API process's CPU seconds and the attack's duration."""
    head = (f"{'attack':30} {'outcome':44} {'ITL p50/p99/max':>17} {'TTFT p50/max':>13} "
            f"{'health':>7} {'RSS+MB':>7} {'APIcpu':>6} {'secs':>5}")
    lines = [head, "-" * len(head)]
    for row in rows:
        itl, ttft = row["itl_ms"], row["ttft_ms"]
        outcome = row["outcome"]
        lines.append(
            f"{row['attack']:30} {outcome[:44]:44} "
            f"{_fmt(itl['p50']) + '/' + _fmt(itl['p99']) + '/' + _fmt(itl['max']):>17} "
            f"{_fmt(ttft['p50']) + '/' + _fmt(ttft['max']):>13} {_fmt(row['health_max_ms']):>7} "
            f"{max(row['rss_growth_mb'].values(), default=0):>7.0f} {row['api_cpu_s']:>6.1f} "
            f"{row['duration_s']:>5.1f}")
    return "\n".join(lines)


def outcome(measure: Measure, unattacked_itl_median_s: float) -> str:
    """"ok: <statuses>", or what failed: the expectation first, then the bounds."""
    failures = [measure.problem] if measure.problem else []
    failures += measure.violations(unattacked_itl_median_s)
    statuses = "/".join(str(s) for s in measure.answer.statuses)
    return f"ok: {statuses}" if not failures else "FAIL: " + "; ".join(failures)


async def run_all(url: str, pids: dict[str, int], attacks: Sequence[Attack],
                  config: RunConfig, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The unattacked run, then each attack: their summaries with an outcome each."""
    baseline = await run_attack(url, pids, UNATTACKED, config)
    median = statistics.median(baseline.itl_s)
    rows = []
    for attack in (UNATTACKED, *attacks):
        measure = baseline if attack is UNATTACKED else await run_attack(url, pids, attack,
                                                                          config)
        row = {**measure.summary(), "outcome": outcome(measure, median)}
        log(f"{attack.name}: {row['outcome']} ({measure.duration_s:.1f} s)")
        rows.append(row)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.isolation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", help="comma-separated attack names (default: all)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="how long the attacker waits for an answer")
    parser.add_argument("--stream-s", type=float, default=10.0,
                        help="how long a streaming attack reads (the tool-call stream's "
                        "length)")
    parser.add_argument("--list", action="store_true", help="list the attacks and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        for attack in ATTACKS:
            print(f"{attack.name:32} {attack.expect.describe()}")
        return 0
    by_name = {a.name: a for a in ATTACKS}
    names = args.attacks.split(",") if args.attacks else list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        print(f"unknown attacks: {', '.join(unknown)} (see --list)", file=sys.stderr)
        return 2
    config = RunConfig(timeout_s=args.timeout_s, stream_s=args.stream_s)
    with tempfile.TemporaryDirectory() as folder:
        tenants = Path(folder) / "tenants.yaml"
        tenants.write_text(tenants_yaml())
        server = ServerProcess([*SERVER_FLAGS, "--tenants", str(tenants)],
                               log_prefix="pagedserve-isolation-")
        try:
            server.wait_healthy()
            rows = asyncio.run(run_all(server.url, server_pids(server),
                                       [by_name[n] for n in names], config,
                                       lambda line: print(line, file=sys.stderr)))
        finally:
            server.terminate()
            print(f"server log: {server.log.name}", file=sys.stderr)
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(row["outcome"].startswith("ok") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
