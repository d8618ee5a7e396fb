"""The grammar state of constrained requests in the engine core.

A request whose sampling params carry a grammar enters the scheduler only once its
grammar is compiled (`add`, then `take_compiled`): while it compiles it holds no KV block
and no seat, and that time counts as queue time (it is measured from arrival). Each step,
`bitmask(plan)` fills the token masks of the plan's constrained sampling rows, one row
per task on a small thread pool, so that the forward pass runs meanwhile; the runner
waits for the future before sampling. The future is ready once every row is, or at the
step's mask deadline (`step_timeout_s` after `bitmask`): a row late by then, or whose
matcher failed (e.g. its lexer ran out of fuel), is left out of the masks and named in
`GrammarBitmask.failed`, and the core fails its request alone. After the step, `accept`
feeds each request's new tokens to its matcher. A matcher lives as long as its request:
preemption keeps it (the tokens it saw are kept, recompute samples nothing again),
`free` drops it on finish or abort.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import time
from collections.abc import Callable, Iterable

import numpy as np
from llguidance import LLMatcher

from scheduler.output import GrammarBitmask, SchedulerOutput
from scheduler.request import Request
from structured.compiler import GrammarCompiler, matcher_error

logger = logging.getLogger(__name__)

NUM_MASK_THREADS = 4

_Futures = Iterable[concurrent.futures.Future[np.ndarray]]
# concurrent.futures.wait(futures, timeout): (done, not done)
WaitFn = Callable[[_Futures, float | None], tuple[set, set]]


class GrammarState(enum.Enum):
    """What a request's latest tokens did to its grammar."""

    OPEN = 0  # more tokens may follow
    ENDED = 1  # the grammar is complete: the request should stop
    VIOLATED = 2  # a token the grammar forbids, or the matcher failed (`error` says why)


class StructuredOutputs:
    """Matchers of the constrained requests, by request id.

    `step_timeout_s` is the step's mask deadline (None: none); `wait` is how the masks
    are waited for (concurrent.futures.wait; the tests' own decides which rows are late).
    """

    def __init__(
        self,
        compiler: GrammarCompiler,
        step_timeout_s: float | None = None,
        wait: WaitFn = concurrent.futures.wait,
    ) -> None:
        self.compiler = compiler
        self.step_timeout_s = step_timeout_s
        self._wait = wait
        self._matchers: dict[str, LLMatcher] = {}
        self._num_consumed: dict[str, int] = {}
        # requests waiting for their grammar, in arrival order
        self._compiling: dict[str, tuple[Request, concurrent.futures.Future[LLMatcher]]] = {}
        # NOTE: a late row's task runs on (llguidance cannot stop it, its limits bound it):
        # the rows of later steps take the other threads. llguidance drops the GIL.
        self._mask_pool = concurrent.futures.ThreadPoolExecutor(
            NUM_MASK_THREADS, thread_name_prefix="grammar-mask"
        )
        self._collector = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="grammar-masks"
        )
        self.mask_seconds = 0.0  # time spent filling masks (bench/structured_bench.py)

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
        futures = {self._mask_pool.submit(self._row_mask, matcher): request_id
                   for request_id, matcher in rows}
        return self._collector.submit(self._collect, futures, deadline)

    def _row_mask(self, matcher: LLMatcher) -> np.ndarray:
        """One row's mask; a ValueError when the matcher fails (e.g. out of lexer fuel)."""
        words = (self.compiler.vocab_size + 31) // 32
        mask = np.empty(words, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
        if matcher.is_error():
            raise ValueError(f"its grammar failed: {matcher_error(matcher)}")
        return mask

    def _collect(
        self, futures: dict[concurrent.futures.Future[np.ndarray], str], deadline: float | None
    ) -> GrammarBitmask:
        """The rows' masks once all are ready or the deadline has passed."""
        start = time.perf_counter()
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, _ = self._wait(futures, timeout)
        rows: dict[str, int] = {}
        masks: list[np.ndarray] = []
        failed: dict[str, str] = {}
        for future, request_id in futures.items():
            if future not in done:
                failed[request_id] = (
                    f"its grammar's token mask took longer than the step allows "
                    f"({self.step_timeout_s:g} s, --grammar-step-timeout-s)"
                )
            elif future.exception() is not None:
                failed[request_id] = str(future.exception())
            else:
                rows[request_id] = len(masks)
                masks.append(future.result())
        words = (self.compiler.vocab_size + 31) // 32
        bitmask = np.stack(masks) if masks else np.empty((0, words), dtype=np.int32)
        self.mask_seconds += time.perf_counter() - start
        return GrammarBitmask(rows, bitmask, failed)

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
        return f"its grammar failed: {matcher_error(self._matchers[request_id])}"
