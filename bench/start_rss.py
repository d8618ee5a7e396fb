"""A server's start and its memory: seconds to /health and the RSS of the API process and
of the engine core after one short completion, for a model, in one checkout or several.

    python -m bench.start_rss [--checkout DIR ...] [--rounds N] -- [serve flags]

Each checkout (default: this one) starts `pagedserve serve` with the flags, once with
$PAGEDSERVE_CACHE an empty folder (a first start), then `--rounds` times on what that left
(later starts: the checkouts alternated, their order turned each round; the median
printed last), each start stopped after its completion. Each checkout's C++ kernels are
built first, into its own .torch_ext (one build folder shared by two checkouts would
rebuild at every switch). The machine's other load moves the seconds, not the RSS.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.support.server_process import REPO_ROOT, ServerProcess, read_rss_kib


def measure(checkout: Path, flags: list[str], cache: Path) -> dict[str, float]:
    """One start of `checkout`'s server: seconds to /health, API and core RSS in MiB."""
    start = time.monotonic()
    server = ServerProcess(["--device", "cpu", *flags], cwd=checkout,
                           env={"PAGEDSERVE_CACHE": str(cache), **kernels_env(checkout)})
    try:
        server.wait_healthy(timeout_s=900)
        ready_s = time.monotonic() - start
        httpx.post(f"{server.url}/v1/completions", timeout=120,
                   json={"prompt": "Hello", "max_tokens": 8}).raise_for_status()
        core = max((read_rss_kib(pid) or 0 for pid in server.child_pids()), default=0)
        return {"health_s": ready_s, "api_mib": (read_rss_kib(server.pid) or 0) / 1024,
                "core_mib": core / 1024}
    finally:
        server.terminate()
        server.remove_log()


def kernels_env(checkout: Path) -> dict[str, str]:
    return {"TORCH_EXTENSIONS_DIR": str(checkout.resolve() / ".torch_ext")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", type=Path, action="append",
                        help="a checkout to start (repeat to compare; default: this one)")
    parser.add_argument("--rounds", type=int, default=1, help="later starts of each checkout")
    parser.add_argument("flags", nargs="*", help="pagedserve serve flags, after --")
    args = parser.parse_args()
    checkouts = args.checkout or [REPO_ROOT]
    for checkout in checkouts:
        subprocess.run([sys.executable, "-m", "model_runner.kernels.cpu_kernels"], cwd=checkout,
                       env={**os.environ, **kernels_env(checkout)}, check=True)
    print("| checkout | start | /health s | API RSS MiB | core RSS MiB |\n|---|---|---|---|---|")
    caches = {checkout: Path(tempfile.mkdtemp(prefix="pagedserve-cache-"))
              for checkout in checkouts}
    later: dict[Path, list[float]] = {checkout: [] for checkout in checkouts}
    try:
        for checkout in checkouts:
            report(checkout, "first", measure(checkout, args.flags, caches[checkout]))
        for round_ in range(args.rounds):
            for checkout in checkouts[::-1] if round_ % 2 else checkouts:
                got = measure(checkout, args.flags, caches[checkout])
                later[checkout].append(got["health_s"])
                report(checkout, "later", got)
    finally:
        for cache in caches.values():
            shutil.rmtree(cache, ignore_errors=True)
    for checkout, seconds in later.items():
        print(f"{checkout}: later starts' median {statistics.median(seconds):.1f} s")


def report(checkout: Path, start: str, got: dict[str, float]) -> None:
    print(f"| {checkout} | {start} | {got['health_s']:.1f} | {got['api_mib']:.0f} | "
          f"{got['core_mib']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
