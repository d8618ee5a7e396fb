"""One attack's run against the isolation bounds: the attacker's answer, and what the
victim's stream, /health and the server's processes showed meanwhile.

`Measure.violations` holds the bounds the isolation issue set: the victim's largest gap
within max(1 s, 8x its unattacked median), /health within 1 s, no process growing more
than 400 MB, the pool idle afterwards.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from tests.support.attacks import COMPLETIONS, KEYS, Answer, Attack, Context, RunConfig, auth
from tests.support.server_process import ServerProcess, cpu_seconds, read_rss_kib
from tests.support.waits import wait_idle

MAX_ITL_S, ITL_FACTOR, MAX_HEALTH_S, MAX_RSS_GROWTH_MB = 1.0, 8.0, 1.0, 400.0
VICTIM_BODY = {"prompt": "The history of the old harbour town begins", "max_tokens": 16,
               "ignore_eos": True, "temperature": 0, "stream": True}


@dataclass
class Measure:
    """One attack's run: the attacker's answer, whether it is a success, and what the
    victim, /health and the server's processes showed meanwhile."""

    name: str
    expected: str
    answer: Answer
    problem: str
    itl_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    health_s: list[float] = field(default_factory=list)
    rss_growth_mb: dict[str, float] = field(default_factory=dict)  # process -> peak growth
    max_rss_growth_mb: float = MAX_RSS_GROWTH_MB  # the bound on each process's growth
    api_cpu_s: float = 0.0
    duration_s: float = 0.0
    victim_error: str = ""
    idle_error: str = ""

    def summary(self) -> dict[str, Any]:
        itl = self.itl_s
        return {
            "attack": self.name, "expected": self.expected, "problem": self.problem,
            "answer": asdict(self.answer),
            "itl_ms": {"p50": _ms(statistics.median(itl) if itl else None),
                       "p99": _ms(_p99(itl)), "max": _ms(max(itl, default=None)),
                       "count": len(itl)},
            "ttft_ms": {"p50": _ms(statistics.median(self.ttft_s) if self.ttft_s else None),
                        "max": _ms(max(self.ttft_s, default=None))},
            "health_max_ms": _ms(max(self.health_s, default=None)),
            "rss_growth_mb": self.rss_growth_mb, "api_cpu_s": round(self.api_cpu_s, 2),
            "duration_s": round(self.duration_s, 2), "victim_error": self.victim_error,
            "idle_error": self.idle_error,
        }

    def violations(self, unattacked_itl_median_s: float) -> list[str]:
        """The isolation bounds this run broke (the victim's largest gap against the
        unattacked median, /health, RSS growth, the pool idle afterwards)."""
        found = []
        itl_bound = max(MAX_ITL_S, ITL_FACTOR * unattacked_itl_median_s)
        if self.victim_error:
            found.append(f"victim: {self.victim_error}")
        if not self.itl_s:
            found.append("the victim got no token during the attack")
        elif max(self.itl_s) > itl_bound:
            found.append(f"victim gap {max(self.itl_s):.2f} s > {itl_bound:.2f} s")
        if max(self.health_s, default=0.0) > MAX_HEALTH_S:
            found.append(f"/health took {max(self.health_s):.2f} s")
        for process, growth in self.rss_growth_mb.items():
            if growth > self.max_rss_growth_mb:
                found.append(f"{process} grew {growth:.0f} MB > {self.max_rss_growth_mb:.0f} MB")
        if self.idle_error:
            found.append(f"not idle afterwards: {self.idle_error[:200]}")
        return found


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def _p99(values: Sequence[float]) -> float | None:
    if len(values) < 2:
        return max(values, default=None)
    return statistics.quantiles(values, n=100, method="inclusive")[98]


async def _victim(client: httpx.AsyncClient, running: asyncio.Event, attacked: asyncio.Event,
                  measure: Measure) -> None:
    """Streams VICTIM_BODY back to back until cancelled: the gaps and TTFTs seen after the
    attack began (a gap or a first token still awaited when cancelled counts too: a stalled
    stream shows)."""
    sent, last = time.perf_counter(), None

    def record(now: float) -> None:
        if attacked.is_set():
            (measure.ttft_s if last is None else measure.itl_s).append(
                now - (sent if last is None else last))

    try:
        while True:
            sent, last = time.perf_counter(), None
            async with client.stream("POST", COMPLETIONS, json=VICTIM_BODY) as response:
                if response.status_code != 200:
                    measure.victim_error = f"{response.status_code}: {await response.aread()!r}"
                    return
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        record(now := time.perf_counter())
                        last = now
                        running.set()
    except asyncio.CancelledError:
        record(time.perf_counter())
        raise
    except httpx.HTTPError as exc:
        measure.victim_error = repr(exc)


async def _probe_health(client: httpx.AsyncClient, measure: Measure) -> None:
    while True:
        sent = time.perf_counter()
        try:
            await client.get("/health")
        except asyncio.CancelledError:
            measure.health_s.append(time.perf_counter() - sent)
            raise
        measure.health_s.append(time.perf_counter() - sent)
        await asyncio.sleep(0.05)


async def _sample_rss(pids: dict[str, int], peaks: dict[str, int]) -> None:
    while True:
        for process, pid in pids.items():
            peaks[process] = max(peaks[process], read_rss_kib(pid) or 0)
        await asyncio.sleep(0.1)


def server_pids(server: ServerProcess) -> dict[str, int]:
    """The API process and its engine core(s), by name."""
    children = server.child_pids()
    cores = {"core" if len(children) == 1 else f"core{k}": pid for k, pid in enumerate(children)}
    return {"api": server.pid, **cores}


async def run_attack(url: str, pids: dict[str, int], attack: Attack,
                     config: RunConfig) -> Measure:
    """`attack` while the victim streams; the measure of its answer and of the bounds."""
    before = {process: read_rss_kib(pid) or 0 for process, pid in pids.items()}
    peaks = dict(before)
    cpu_before = cpu_seconds(pids["api"])
    running, attacked = asyncio.Event(), asyncio.Event()
    measure = Measure(attack.name, attack.expect.describe(), Answer(()), "")
    if attack.max_rss_growth_mb is not None:
        measure.max_rss_growth_mb = attack.max_rss_growth_mb
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    clients = {tenant: httpx.AsyncClient(base_url=url, headers=auth(tenant), limits=limits,
                                         timeout=config.timeout_s) for tenant in KEYS}
    health = httpx.AsyncClient(base_url=url, timeout=config.timeout_s)
    try:
        tasks = [asyncio.ensure_future(_victim(clients["victim"], running, attacked, measure)),
                 asyncio.ensure_future(_probe_health(health, measure)),
                 asyncio.ensure_future(_sample_rss(pids, peaks))]
        await asyncio.wait_for(running.wait(), 60)
        attacked.set()
        started = time.perf_counter()
        try:
            answer = await asyncio.wait_for(attack.run(Context(url, clients, config)),
                                            config.timeout_s + 5)
        except TimeoutError:
            answer = Answer((0,), f"no answer within {config.timeout_s + 5:g} s")
        except httpx.HTTPError as exc:  # the connection broke, or a probe's status
            answer = Answer((0,), f"{type(exc).__name__}: {exc}")
        measure.duration_s = time.perf_counter() - started
        await asyncio.sleep(max(0.0, config.min_window_s - measure.duration_s))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for client in (*clients.values(), health):
            await client.aclose()
    measure.answer, measure.problem = answer, attack.expect.problem(answer)
    measure.api_cpu_s = cpu_seconds(pids["api"]) - cpu_before
    measure.rss_growth_mb = {p: round((peaks[p] - before[p]) / 1024, 1) for p in pids}
    try:
        await asyncio.to_thread(wait_idle, url, auth("operator"), 30.0)
    except (AssertionError, httpx.HTTPError) as exc:  # still busy, or no answer at all
        measure.idle_error = f"{type(exc).__name__}: {exc}"
    return measure
