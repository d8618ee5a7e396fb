"""The batch feeder (server/batch/feeder.py) over a real store, with a line runner double
and a fake clock: how many lines it keeps in flight, fair share between tenants, a line
refused for room sent again, expiry aborting the lines in flight."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from server.batch.feeder import Feeder
from server.batch.line_runner import LineResult, Retry
from server.batch.metrics import BatchMetrics
from server.batch.store import BatchStore
from server.tenants import Tenant, TenantRegistry, TenantSpec

URL = "/v1/completions"
TICK_S = 0.3  # past the feeder's own tick


class HeldRunner:
    """Each line waits until the test releases it; records who ran what."""

    def __init__(self) -> None:
        self.started: list[tuple[str, str]] = []
        self.cancelled: list[str] = []
        self.release = asyncio.Event()
        self.refuse_first = 0

    async def run(self, endpoint: str, body_json: str, tenant: Tenant) -> LineResult:
        prompt = json.loads(body_json)["prompt"]
        if self.refuse_first:
            self.refuse_first -= 1
            raise Retry("no seat")
        self.started.append((tenant.name, prompt))
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(prompt)
            raise
        return LineResult(200, {"choices": [{"text": prompt}]})


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def setup(tmp_path: Path, max_in_flight: int, waiting: list[int]):
    store = BatchStore(tmp_path)
    specs = [TenantSpec.model_construct(name=n, api_key_sha256=[], max_in_flight=None)
             for n in ("alpha", "beta")]
    tenants = TenantRegistry(specs, keys_required=False)
    runner, clock = HeldRunner(), Clock()
    feeder = Feeder(store, runner, tenants, max_in_flight, lambda: waiting[0],  # type: ignore[arg-type]
                    BatchMetrics(CollectorRegistry(), "m"), clock)
    return store, runner, clock, feeder


def add_batch(store: BatchStore, feeder: Feeder, batch_id: str, tenant: str, num_lines: int,
              clock: Clock, window_s: float = 60.0) -> None:
    row = {"id": batch_id, "tenant": tenant, "endpoint": URL, "input_file_id": "file-1",
           "created_at": int(clock.now), "expires_at": clock.now + window_s, "metadata": None}
    store.create_batch(row, [(f"{batch_id}-{i}", json.dumps({"prompt": f"{batch_id}-{i}"}))
                             for i in range(num_lines)], None)
    feeder.add(store.get_batch(batch_id))


def run(test) -> None:
    async def main() -> None:
        await test()

    asyncio.run(main())


def test_fair_share_between_tenants_within_the_seats_and_the_queue(tmp_path: Path) -> None:
    async def test() -> None:
        waiting = [0]
        store, runner, clock, feeder = setup(tmp_path, 4, waiting)
        add_batch(store, feeder, "a1", "alpha", 10, clock)
        add_batch(store, feeder, "a2", "alpha", 10, clock)
        add_batch(store, feeder, "b1", "beta", 10, clock)
        task = asyncio.ensure_future(feeder.run())
        await asyncio.sleep(TICK_S)
        by_tenant = [name for name, _ in runner.started]
        assert sorted(by_tenant) == ["alpha", "alpha", "beta", "beta"]  # 4 seats, 2 each
        assert {p[:2] for _, p in runner.started if p.startswith("a")} == {"a1", "a2"}
        waiting[0] = 2  # the engine's queue holds half the seats: no more lines
        runner.release.set()
        await asyncio.sleep(TICK_S)
        assert feeder.num_in_flight == 0
        waiting[0] = 0
        await asyncio.sleep(TICK_S * 3)
        assert all(store.get_batch(b)["status"] == "completed" for b in ("a1", "a2", "b1"))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run(test)


def test_a_line_refused_for_room_runs_later(tmp_path: Path) -> None:
    async def test() -> None:
        store, runner, clock, feeder = setup(tmp_path, 2, [0])
        runner.refuse_first = 1
        runner.release.set()
        add_batch(store, feeder, "a1", "alpha", 3, clock)
        task = asyncio.ensure_future(feeder.run())
        await asyncio.sleep(TICK_S)
        clock.now += 2  # past the retry's wait
        await asyncio.sleep(TICK_S * 2)
        batch = store.get_batch("a1")
        assert batch["status"] == "completed" and store.counts("a1") == {"done": 3}
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run(test)


def test_expiry_aborts_the_lines_in_flight_and_lists_the_rest(tmp_path: Path) -> None:
    async def test() -> None:
        store, runner, clock, feeder = setup(tmp_path, 2, [0])
        add_batch(store, feeder, "a1", "alpha", 5, clock, window_s=10)
        task = asyncio.ensure_future(feeder.run())
        await asyncio.sleep(TICK_S)
        assert len(runner.started) == 2
        clock.now += 11
        await asyncio.sleep(TICK_S)
        batch = store.get_batch("a1")
        assert batch["status"] == "expired" and batch["output_file_id"] is None
        assert sorted(runner.cancelled) == ["a1-0", "a1-1"]
        errors = store.file_path(batch["error_file_id"]).read_text().splitlines()
        assert sorted((json.loads(e)["custom_id"], json.loads(e)["error"]["code"])
                      for e in errors) == [(f"a1-{i}", "batch_expired") for i in range(5)]
        assert feeder.num_in_flight == 0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run(test)


def test_a_restart_resumes_the_pending_lines_and_ends_a_finalizing_batch(tmp_path) -> None:
    async def test() -> None:
        store, runner, clock, feeder = setup(tmp_path, 2, [0])
        runner.release.set()
        add_batch(store, feeder, "a1", "alpha", 3, clock)
        add_batch(store, feeder, "a2", "alpha", 2, clock)
        for line in store.pending_lines("a1", -1, 10)[:2]:  # done before the "kill"
            store.finish_line(line, "done", "{}")
        store.set_status("a2", "finalizing")  # killed while writing its files
        store.finish_line(store.pending_lines("a2", -1, 10)[0], "done", "{}")
        store.finish_line(store.pending_lines("a2", -1, 10)[0], "done", "{}")
        restarted = Feeder(store, runner, feeder._tenants, 2, lambda: 0,  # type: ignore[arg-type]
                           BatchMetrics(CollectorRegistry(), "m"), clock)
        restarted.resume()
        task = asyncio.ensure_future(restarted.run())
        await asyncio.sleep(TICK_S * 2)
        assert runner.started == [("alpha", "a1-2")]  # only the line not done
        assert [store.get_batch(b)["status"] for b in ("a1", "a2")] == ["completed"] * 2
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run(test)
