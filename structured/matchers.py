"""The grammar state of constrained requests in the engine core.

A request whose sampling params carry a grammar enters the scheduler only once its
grammar is compiled (`add`, then `take_compiled`): while it compiles it holds no KV block
and no seat, and that time counts as queue time (it is measured from arrival). Each step,
`bitmask(plan)` fills the token masks of the plan's constrained sampling rows on a small
thread pool (its threads take the rows one at a time), so that the forward pass runs
meanwhile; the runner waits for the future before sampling. The future is ready once
every row is, or at the step's mask deadline (`step_timeout_s` after `bitmask`): a row
late by then, or whose matcher failed (e.g. its lexer ran out of fuel), is left out of
the masks and named in `GrammarBitmask.failed`, and the core fails its request alone.
After the step, `accept` feeds each request's new tokens to its matcher. A matcher lives
as long as its request: preemption keeps it (the tokens it saw are kept, recompute
samples nothing again), `free` drops it on finish or abort.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import threading
import time
from collections import deque

import numpy as np
from llguidance import LLMatcher

from scheduler.output import GrammarBitmask, SchedulerOutput
from scheduler.request import Request
from structured.compiler import GrammarCompiler, matcher_error

logger = logging.getLogger(__name__)

NUM_MASK_THREADS = 4


class GrammarState(enum.Enum):
    """What a request's latest tokens did to its grammar."""

    OPEN = 0  # more tokens may follow
    ENDED = 1  # the grammar is complete: the request should stop
    VIOLATED = 2  # a token the grammar forbids, or the matcher failed (`error` says why)


class StructuredOutputs:
    """Matchers of the constrained requests, by request id.

    `step_timeout_s` is the step's mask deadline (None: none).
    """

    def __init__(self, compiler: GrammarCompiler, step_timeout_s: float | None = None) -> None:
        self.compiler = compiler
        self.step_timeout_s = step_timeout_s
        self._matchers: dict[str, LLMatcher] = {}
        self._num_consumed: dict[str, int] = {}
        # requests waiting for their grammar, in arrival order
        self._compiling: dict[str, tuple[Request, concurrent.futures.Future[LLMatcher]]] = {}
        # NOTE: a late row's mask is computed on (llguidance cannot stop it, its limits
        # bound it): the rows of later steps take the other threads. It drops the GIL.
        self._mask_pool = concurrent.futures.ThreadPoolExecutor(
            NUM_MASK_THREADS, thread_name_prefix="grammar-mask"
        )
        self._collector = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="grammar-masks"
        )

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._matchers

    def add(self, request: Request) -> bool:
        """Start constraining `request` (its params have a grammar): True when it can be
        scheduled now (the grammar was compiled already), False while it compiles."""
        grammar = request.sampling_params.grammar
        if grammar is None:
            raise ValueError(f"request {request.request_id!r} has no grammar")
        future = self.compiler.compile(grammar)
        if future.done() and not self._compiling:
            self._start(request, future)
            return True
        self._compiling[request.request_id] = (request, future)
        return False

    def take_compiled(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose grammar is ready, in arrival order (stopping at the first still
        compiling, so that none overtakes an earlier one), and those whose grammar failed
        to compile, with why."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for request_id, (request, future) in list(self._compiling.items()):
            if not future.done():
                break
            del self._compiling[request_id]
            try:
                self._start(request, future)
            except ValueError as exc:
                failed.append((request, str(exc)))
                continue
            ready.append(request)
        return ready, failed

    def _start(self, request: Request, future: concurrent.futures.Future[LLMatcher]) -> None:
        template = future.result()  # raises the compile's ValueError
        self._matchers[request.request_id] = template.deep_copy()
        self._num_consumed[request.request_id] = 0

    def free(self, request_id: str) -> None:
        """Drop a finished or aborted request's state (unknown ids are ignored)."""
        self._matchers.pop(request_id, None)
        self._num_consumed.pop(request_id, None)
        self._compiling.pop(request_id, None)

    def bitmask(self, plan: SchedulerOutput) -> concurrent.futures.Future[GrammarBitmask] | None:
        """The masks of the plan's constrained sampling rows, being filled (None when no
        row is constrained)."""
        rows = [
            (scheduled.request_id, self._matchers[scheduled.request_id])
            for scheduled in plan.scheduled
            if scheduled.sample and scheduled.request_id in self._matchers
        ]
        if not rows:
            return None
        deadline = None if self.step_timeout_s is None else time.monotonic() + self.step_timeout_s
        masks = StepMasks(rows, (self.compiler.vocab_size + 31) // 32)
        for _ in range(min(NUM_MASK_THREADS, len(rows))):
            self._mask_pool.submit(masks.fill)
        return self._collector.submit(self._collect, masks, deadline)

    def _collect(self, masks: StepMasks, deadline: float | None) -> GrammarBitmask:
        masks.wait(deadline)
        return masks.result(
            f"its grammar's token mask took longer than the step allows "
            f"({self.step_timeout_s} s, --grammar-step-timeout-s)"
        )

    def accept(self, request: Request) -> GrammarState:
        """Feed the request's tokens generated since the last call to its matcher."""
        matcher = self._matchers[request.request_id]
        consumed = self._num_consumed[request.request_id]
        new_ids = request.output_token_ids[consumed:]
        self._num_consumed[request.request_id] = len(request.output_token_ids)
        if matcher.is_stopped():
            return GrammarState.ENDED
        if not matcher.consume_tokens(new_ids):
            logger.warning("request %s: a token outside its grammar: %s",
                           request.request_id, matcher.get_error())
            return GrammarState.VIOLATED
        return GrammarState.ENDED if matcher.is_stopped() else GrammarState.OPEN

    def error(self, request_id: str) -> str:
        """Why a request's matcher failed (after a VIOLATED)."""
        return grammar_failed(matcher_error(self._matchers[request_id]))


def grammar_failed(error: str) -> str:
    """The error a request whose matcher failed ends with."""
    return f"its grammar failed: {error}"


class StepMasks:
    """The masks of one step's constrained rows, filled by the mask threads: each takes
    the next row not yet taken (`fill`), so that a slow row holds up only its thread."""

    def __init__(self, rows: list[tuple[str, LLMatcher]], words: int) -> None:
        self.request_ids = [request_id for request_id, _ in rows]
        self.bitmask = np.full((len(rows), words), -1, dtype=np.int32)
        self._todo = deque(enumerate(matcher for _, matcher in rows))
        self._errors: dict[int, str] = {}
        self._done: set[int] = set()
        self._cond = threading.Condition()
        self._max_pending = 0  # the waiter wakes once no more rows than this are pending

    def fill(self) -> None:
        """On a mask thread: compute rows until none is left to take."""
        while True:
            try:
                index, matcher = self._todo.popleft()
            except IndexError:
                return
            row = self.bitmask[index]
            try:
                matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
                error = matcher_error(matcher) if matcher.is_error() else None
            except Exception as exc:  # NOTE: a row is never left undone
                logger.exception("grammar mask failed")
                error = str(exc)
            with self._cond:
                if error is not None:
                    self._errors[index] = grammar_failed(error)
                self._done.add(index)
                if self._num_pending() <= self._max_pending:
                    self._cond.notify_all()

    def wait(self, deadline: float | None, max_pending: int = 0) -> None:
        """Until every row is done (at most `max_pending` rows are not: the tests'
        deadline), or `deadline` (monotonic; None: none) has passed."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        with self._cond:
            self._max_pending = max_pending
            self._cond.wait_for(lambda: self._num_pending() <= max_pending, timeout)

    def _num_pending(self) -> int:
        return len(self.request_ids) - len(self._done)

    def result(self, late: str) -> GrammarBitmask:
        """The rows done so far; the others fail (`late` says why for those not done).
        NOTE: the array is the one the late rows are still written into, at their own
        rows, which `rows` does not name."""
        with self._cond:
            done, errors = set(self._done), dict(self._errors)
        rows: dict[str, int] = {}
        failed: dict[str, str] = {}
        for index, request_id in enumerate(self.request_ids):
            if index not in done:
                failed[request_id] = late
            elif index in errors:
                failed[request_id] = errors[index]
            else:
                rows[request_id] = index
        return GrammarBitmask(rows, self.bitmask, failed)
