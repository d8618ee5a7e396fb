"""Fair share among tenants over HTTP on the simulated runner, in one run.

    python -m bench.fair_share_bench [--seconds 60] [--step-ms 20]

1. Weights 2:1: tenants A (weight 2) and B (weight 1) each keep 32 requests of the same
   priority waiting on a saturated server (8 seats) for --seconds; the tokens each was
   served by then, and their ratio.
2. Weights 1:1, a burst: B sends one request every 100 ms; A sends 200 at once midway.
   B's queue time (p50, p90) during A's burst, with fair share (tenants) and without
   (the same load under one key: arrival order).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from tests.support.server_process import ServerProcess

KEYS = {"A": "bench-key-a", "B": "bench-key-b"}


def tenants_file(weight_a: float) -> str:
    lines = ["tenants:"]
    for name, key in KEYS.items():
        digest = hashlib.sha256(key.encode()).hexdigest()
        lines += [f"  - name: {name}", f"    api_key_sha256: {digest}",
                  f"    weight: {weight_a if name == 'A' else 1}"]
    path = Path(tempfile.mkdtemp()) / "tenants.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def server(step_ms: float, tenants: str | None) -> ServerProcess:
    flags = ["--simulate-step-ms", str(step_ms), "--scheduling-policy", "priority",
             "--max-num-seqs", "8", "--num-kv-blocks", "4096", "--log-level", "warning"]
    if tenants is not None:
        flags += ["--tenants", tenants]
    process = ServerProcess(flags, log_prefix="pagedserve-fair-")
    process.wait_healthy(300)
    return process


def tokens_by_tenant(url: str) -> dict[str, float]:
    served: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("pagedserve_tenant_generation_tokens_total{"):
            tenant = line.split('tenant="', 1)[1].split('"', 1)[0]
            served[tenant] = float(line.rsplit(" ", 1)[1])
    return served


async def two_to_one(url: str, seconds: float) -> dict[str, float]:
    stop = time.monotonic() + seconds

    async def tenant(key: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=600,
                                     headers={"Authorization": f"Bearer {key}"}) as client:
            async def loop() -> None:
                while time.monotonic() < stop:
                    await client.post("/v1/completions", json={
                        "prompt": "x", "max_tokens": 16, "ignore_eos": True})

            await asyncio.gather(*(loop() for _ in range(32)))

    async def read_at_stop() -> dict[str, float]:
        await asyncio.sleep(seconds)
        return tokens_by_tenant(url)

    *_, served = await asyncio.gather(tenant(KEYS["A"]), tenant(KEYS["B"]), read_at_stop())
    return served


async def burst(url: str, key_a: str, key_b: str) -> list[float]:
    """B's request latencies to first token while A's burst of 200 is queued."""
    unlimited = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=unlimited) as client:
        async def one(key: str) -> float:
            start = time.monotonic()
            async with client.stream("POST", "/v1/completions", headers={
                    "Authorization": f"Bearer {key}"}, json={
                    "prompt": "x", "max_tokens": 16, "ignore_eos": True,
                    "stream": True}) as response:
                first = None
                async for line in response.aiter_lines():  # to the end: it holds a seat
                    if first is None and line.startswith("data: {"):
                        first = time.monotonic() - start
            if first is None:
                raise RuntimeError("no token")
            return first

        b_tasks = []
        a_tasks = []
        for i in range(60):  # B: 6 s of one request per 100 ms; A's burst at 1 s
            if i == 10:
                a_tasks = [asyncio.create_task(one(key_a)) for _ in range(200)]
            b_tasks.append(asyncio.create_task(one(key_b)))
            await asyncio.sleep(0.1)
        waits = await asyncio.gather(*b_tasks[10:])
        await asyncio.gather(*a_tasks)
        return list(waits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--step-ms", type=float, default=20.0)
    args = parser.parse_args()

    process = server(args.step_ms, tenants_file(2.0))
    try:
        served = asyncio.run(two_to_one(process.url, args.seconds))
    finally:
        process.terminate()
        process.remove_log()
    print(f"2:1 over {args.seconds:g} s: A {served['A']:.0f} tokens, B {served['B']:.0f}, "
          f"ratio {served['A'] / served['B']:.3f}")

    rows = []
    for label, tenants, key_a in (("fair share (tenants, 1:1)", tenants_file(1.0), KEYS["A"]),
                                  ("arrival order (one key)", None, None)):
        process = server(args.step_ms, tenants)
        try:
            waits = asyncio.run(burst(process.url, key_a or "none",
                                      KEYS["B"] if tenants else "none"))
        finally:
            process.terminate()
            process.remove_log()
        waits.sort()
        rows.append((label, statistics.median(waits), waits[int(0.9 * len(waits))]))
    print("| B during A's burst of 200 | TTFT p50 ms | TTFT p90 ms |")
    print("|---|---|---|")
    for label, p50, p90 in rows:
        print(f"| {label} | {p50 * 1e3:.0f} | {p90 * 1e3:.0f} |")


if __name__ == "__main__":
    main()
