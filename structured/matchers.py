"""The grammar state of constrained requests in the engine core.

A request whose sampling params carry a grammar enters the scheduler only once its
grammar is compiled (`add`, then `take_compiled`): while it compiles it holds no KV block
and no seat, and that time counts as queue time (it is measured from arrival). Each step,
`bitmask(plan)` fills the token masks of the plan's constrained sampling rows on a
thread of its own, so that the forward pass runs meanwhile; the runner waits for the
future before sampling. After the step, `accept` feeds each request's new tokens to its
matcher. A matcher lives as long as its request: preemption keeps it (the tokens it saw
are kept, recompute samples nothing again), `free` drops it on finish or abort.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import time

import llguidance
import numpy as np
from llguidance import LLMatcher

from scheduler.output import GrammarBitmask, SchedulerOutput
from scheduler.request import Request
from structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


class GrammarState(enum.Enum):
    """What a request's latest tokens did to its grammar."""

    OPEN = 0  # more tokens may follow
    ENDED = 1  # the grammar is complete: the request should stop
    VIOLATED = 2  # a token the grammar forbids (not sampled under its mask)


class StructuredOutputs:
    """Matchers of the constrained requests, by request id."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[str, LLMatcher] = {}
        self._num_consumed: dict[str, int] = {}
        # requests waiting for their grammar, in arrival order
        self._compiling: dict[str, tuple[Request, concurrent.futures.Future[LLMatcher]]] = {}
        self._executor = llguidance.LLExecutor()
        self._mask_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="grammar-mask"
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
        rows: dict[str, int] = {}
        matchers: list[tuple[LLMatcher, int]] = []
        for scheduled in plan.scheduled:
            matcher = self._matchers.get(scheduled.request_id)
            if matcher is not None and scheduled.sample:
                matchers.append((matcher, len(rows)))
                rows[scheduled.request_id] = len(rows)
        if not rows:
            return None
        return self._mask_thread.submit(self._fill, rows, matchers)

    def _fill(self, rows: dict[str, int], matchers: list[tuple[LLMatcher, int]]) -> GrammarBitmask:
        start = time.perf_counter()
        words = (self.compiler.vocab_size + 31) // 32
        bitmask = np.full((len(rows), words), -1, dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr(
            matchers, bitmask.ctypes.data, words * 4, len(rows)
        )
        self.mask_seconds += time.perf_counter() - start
        return GrammarBitmask(rows, bitmask)

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
