"""The feeder: one asyncio task on the API process's loop that sends the pending lines of
every active batch into the engine (server/batch/line_runner.py), commits each line's
result with its done mark, and ends batches (completed, expired, cancelled).

How many lines it keeps in the engine: at most `max_in_flight` (the engine's seats), and
none more while the engine's queue already holds half that many waiting requests (the
seats or the blocks are taken: by interactive requests, which then go first by priority,
or by lines), so a batch of 50,000 lines never fills the waiting queue. Of a tenant with
a seat limit, lines take at most half its seats, leaving the rest to its live requests.
Fair share: the next line comes from the tenant with the fewest lines in flight, then from
its batch with the fewest (the oldest first); the scheduler shares steps among tenants by
weight within the batch priority.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from server.batch.line_runner import LineResult, LineRunner, Retry
from server.batch.metrics import BatchMetrics
from server.batch.store import (
    CANCELLED,
    DONE,
    EXPIRED,
    FAILED,
    PENDING,
    BatchStore,
    PendingLine,
    StoreError,
    response_line,
)
from server.tenants import Tenant, TenantRegistry

logger = logging.getLogger(__name__)

_TICK_S = 0.2  # the longest the feeder sleeps without news (the engine's queue drains)
_RETRY_S = 1.0  # a line refused for room is sent again after this
_ERROR_PAUSE_S = 5.0
_READ_AHEAD = 64  # pending lines read from the store at once, per batch


@dataclass
class _Active:
    """A batch the feeder works on."""

    row: dict[str, Any]
    queued: deque[PendingLine] = field(default_factory=deque)
    cursor: int = -1  # the last line number read from the store
    exhausted: bool = False  # no pending line past the cursor
    tasks: dict[int, asyncio.Task[None]] = field(default_factory=dict)  # by line number
    retry_after: float = 0.0

    @property
    def id(self) -> str:
        return str(self.row["id"])

    @property
    def tenant(self) -> str:
        return str(self.row["tenant"])


class Feeder:
    """Feeds the active batches' lines to the engine (one per app, started by its
    lifespan); `add` and `cancel` are called by the batch routes."""

    def __init__(self, store: BatchStore, runner: LineRunner, tenants: TenantRegistry,
                 max_in_flight: int, num_waiting: Callable[[], int], metrics: BatchMetrics,
                 clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._runner = runner
        self._tenants = tenants
        self._max_in_flight = max_in_flight
        self._num_waiting = num_waiting
        self._metrics = metrics
        self._clock = clock
        self._batches: dict[str, _Active] = {}
        self._wake = asyncio.Event()
        self._turn = 0  # rotates the first tenant among equals

    def resume(self) -> None:
        """The batches a previous server left active: their pending lines run again."""
        for row in self._store.active_batches():
            self.add(row)

    def add(self, row: dict[str, Any]) -> None:
        self._batches[row["id"]] = _Active(row)
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """Stop feeding the batch; its lines in the engine are aborted, then it ends."""
        active = self._batches.get(batch_id)
        if active is not None:
            active.row["status"] = "cancelling"
        self._wake.set()

    def num_pending(self) -> float:
        """Lines of the active batches not yet ended (read by the metrics at a scrape; NaN
        when the store cannot say, rather than a failed scrape)."""
        try:
            return sum(self._store.counts(b).get(PENDING, 0) for b in self._batches)
        except StoreError:
            return math.nan

    @property
    def num_in_flight(self) -> int:
        return sum(len(b.tasks) for b in self._batches.values())

    async def run(self) -> None:
        """Until cancelled (the app's shutdown: the lines in flight are aborted and stay
        pending, to run again on the next start)."""
        try:
            while True:
                try:
                    await self._end_batches()
                    self._feed()
                except StoreError as exc:
                    logger.error("batches paused: %s", exc)
                    await asyncio.sleep(_ERROR_PAUSE_S)
                except Exception:  # a bug must not end every batch: logged, then again
                    logger.exception("the batch feeder failed; it goes on")
                    await asyncio.sleep(_ERROR_PAUSE_S)
                self._metrics.in_flight.set(self.num_in_flight)
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), _TICK_S)
                except TimeoutError:
                    pass
        finally:
            tasks = [t for b in self._batches.values() for t in b.tasks.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ ending batches

    async def _end_batches(self) -> None:
        now = self._clock()
        for active in list(self._batches.values()):
            if active.row["status"] == "cancelling":
                await self._end(active, CANCELLED, "batch_cancelled",
                                "The batch was cancelled before this line ran.", "cancelled")
            elif now >= active.row["expires_at"]:
                await self._end(active, EXPIRED, "batch_expired",
                                "This line was not run within the batch's completion "
                                "window.", "expired")
            elif active.row["status"] == "finalizing" or (
                    active.exhausted and not active.queued and not active.tasks):
                self._store.set_status(active.id, "finalizing")
                self._store.finalize(active.row, "completed")
                del self._batches[active.id]

    async def _end(self, active: _Active, line_status: str, code: str, message: str,
                   batch_status: str) -> None:
        """Abort the batch's lines in the engine (their tasks cancelled: each route aborts
        its request), end its pending lines as `line_status`, write its files."""
        tasks = list(active.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        num_ended = self._store.end_pending(active.id, line_status,
                                            {"code": code, "message": message})
        self._metrics.ended(line_status, num_ended)
        self._store.finalize(active.row, batch_status)
        del self._batches[active.id]

    # ------------------------------------------------------------ feeding

    def _feed(self) -> None:
        while (self.num_in_flight < self._max_in_flight
               and self._num_waiting() < max(1, self._max_in_flight // 2)):
            picked = self._next()
            if picked is None:
                return
            active, line = picked
            tenant = self._tenants.by_name(active.tenant)
            if tenant is None:  # the tenants file dropped it: its batches wait
                active.queued.appendleft(line)
                active.retry_after = self._clock() + _RETRY_S
                continue
            task = asyncio.ensure_future(self._run_line(active, line, tenant))
            active.tasks[line.line_no] = task

    def _next(self) -> tuple[_Active, PendingLine] | None:
        """The next line by fair share: the tenant with the fewest lines in flight, then
        its batch with the fewest."""
        now = self._clock()
        ready = [b for b in self._batches.values()
                 if b.row["status"] == "in_progress" and b.retry_after <= now
                 and self._has_line(b) and self._tenant_has_room(b)]
        if not ready:
            return None
        by_tenant: dict[str, int] = {}
        for b in self._batches.values():
            by_tenant[b.tenant] = by_tenant.get(b.tenant, 0) + len(b.tasks)
        tenants = sorted({b.tenant for b in ready})
        self._turn += 1
        rotated = tenants[self._turn % len(tenants):] + tenants[:self._turn % len(tenants)]
        tenant = min(rotated, key=lambda t: by_tenant[t])
        active = min((b for b in ready if b.tenant == tenant),
                     key=lambda b: (len(b.tasks), b.row["seq"]))
        return active, active.queued.popleft()

    def _has_line(self, active: _Active) -> bool:
        if not active.queued and not active.exhausted:
            lines = self._store.pending_lines(active.id, active.cursor, _READ_AHEAD)
            lines = [line for line in lines if line.line_no not in active.tasks]
            active.queued.extend(lines)
            if lines:
                active.cursor = lines[-1].line_no
            else:
                active.exhausted = True
        return bool(active.queued)

    def _tenant_has_room(self, active: _Active) -> bool:
        tenant = self._tenants.by_name(active.tenant)
        seats = None if tenant is None else tenant.spec.max_in_flight
        if seats is None:
            return True
        in_flight = sum(len(b.tasks) for b in self._batches.values()
                        if b.tenant == active.tenant)
        return in_flight < max(1, seats // 2)

    async def _run_line(self, active: _Active, line: PendingLine, tenant: Tenant) -> None:
        try:
            result = await self._runner.run(active.row["endpoint"], line.body, tenant)
            self._commit(line, result)
        except Retry:
            active.queued.appendleft(line)
            active.retry_after = self._clock() + _RETRY_S
        finally:
            active.tasks.pop(line.line_no, None)
            self._wake.set()

    def _commit(self, line: PendingLine, result: LineResult) -> None:
        status = DONE if result.is_done else FAILED
        text = response_line(line.custom_id, result.status_code, result.body)
        try:
            committed = self._store.finish_line(line, status, text)
        except StoreError as exc:
            logger.error("a batch line's result is not kept (it will run again): %s", exc)
            raise Retry(str(exc)) from exc
        if committed:
            self._metrics.ended(status)
