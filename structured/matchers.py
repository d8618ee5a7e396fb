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

Speculative decoding: the scheduler asks `num_valid_drafts` how many of a request's
proposed tokens to keep (those the grammar accepts in order, short of one that ends it,
so that only a step's last token can end the grammar, as in a plain step). A row that
verifies d drafts gets d + 1 masks, consecutive in the bitmask: mask i is the grammar's
state after the first i drafts (a copy of the matcher advanced through them, so that the
matcher itself is never touched by a mask thread once the first mask is done); its
accepted tokens reach the matcher through `accept` like any others. Late masks: the
request fails only when its first mask is late or failed (as without drafts); draft
masks done by the deadline are used (`GrammarBitmask.num_draft_rows`), and the drafts
past them are not accepted that step (the last masked position gives the request's
token): the matcher, no longer read by the late thread, goes on as usual.
"""

from __future__ import annotations

import concurrent.futures
import enum
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

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

    def num_valid_drafts(self, request_id: str, draft_token_ids: list[int]) -> int:
        """How many of `draft_token_ids` (proposed after the request's tokens so far) to
        verify: the longest prefix its grammar accepts in which no token ends the grammar
        (the grammar must end on a step's last token, as without drafts). The matcher is
        left as it was."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return 0
        valid = draft_token_ids[:matcher.validate_tokens(draft_token_ids)]
        num_kept = len(valid)
        for i, token_id in enumerate(valid):  # NOTE: valid tokens only: no error state
            matcher.consume_token(token_id)
            if matcher.is_stopped():
                num_kept = i
                break
        matcher.rollback(min(num_kept + 1, len(valid)))
        return num_kept

    def bitmask(self, plan: SchedulerOutput) -> concurrent.futures.Future[GrammarBitmask] | None:
        """The masks of the plan's constrained sampling rows, being filled (None when no
        row is constrained): one per row, and one more per draft it verifies."""
        tasks = [
            MaskTask(scheduled.request_id, self._matchers[scheduled.request_id],
                     scheduled.draft_token_ids)
            for scheduled in plan.scheduled
            if scheduled.sample and scheduled.request_id in self._matchers
        ]
        if not tasks:
            return None
        deadline = None if self.step_timeout_s is None else time.monotonic() + self.step_timeout_s
        masks = StepMasks(tasks, (self.compiler.vocab_size + 31) // 32)
        for _ in range(min(NUM_MASK_THREADS, len(tasks))):
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


@dataclass(frozen=True)
class MaskTask:
    """A constrained row's masks for one step: its first mask from `matcher`, then one
    per draft in `draft_token_ids` (empty: none)."""

    request_id: str
    matcher: LLMatcher
    draft_token_ids: list[int]


class StepMasks:
    """The masks of one step's constrained rows, filled by the mask threads: each takes
    the next task not yet taken (`fill`), so that a slow one holds up only its thread.
    A task's masks are consecutive rows of `bitmask`, from `first_rows[index]`."""

    def __init__(self, tasks: list[MaskTask], words: int) -> None:
        self.tasks = tasks
        self.first_rows = list(itertools.accumulate(
            (1 + len(task.draft_token_ids) for task in tasks), initial=0))
        self.bitmask = np.full((self.first_rows.pop(), words), -1, dtype=np.int32)
        self._todo = deque(range(len(tasks)))
        self._errors: dict[int, str] = {}  # task index -> why its first mask failed
        self._done: set[int] = set()  # tasks whose first mask is done
        self._num_draft_rows: dict[int, int] = {}  # task index -> draft masks done
        self._num_finished = 0  # tasks with every mask done
        self._cond = threading.Condition()
        self._max_pending = 0  # the waiter wakes once no more tasks than this are pending

    def fill(self) -> None:
        """On a mask thread: compute tasks until none is left to take."""
        while True:
            try:
                index = self._todo.popleft()
            except IndexError:
                return
            task, first = self.tasks[index], self.first_rows[index]
            error = self._compute(task.matcher, first)
            # NOTE: copied before the first mask counts as done: from then on the engine
            # may feed the matcher, even while this thread is still on the drafts' masks
            ahead = task.matcher.deep_copy() if task.draft_token_ids and error is None else None
            with self._cond:
                if error is not None:
                    self._errors[index] = grammar_failed(error)
                self._done.add(index)
            if ahead is not None:
                self._fill_drafts(index, ahead, task.draft_token_ids, first)
            with self._cond:
                self._num_finished += 1
                if self._num_pending() <= self._max_pending:
                    self._cond.notify_all()

    def _fill_drafts(self, index: int, ahead: LLMatcher, draft_token_ids: list[int],
                     first: int) -> None:
        """The mask after each draft, on `ahead` (a copy of the task's matcher), up to one
        that the grammar rejects or whose mask failed."""
        for num_drafts, token_id in enumerate(draft_token_ids, 1):
            if (not ahead.consume_token(token_id)
                    or self._compute(ahead, first + num_drafts) is not None):
                return
            with self._cond:
                self._num_draft_rows[index] = num_drafts

    def _compute(self, matcher: LLMatcher, row_index: int) -> str | None:
        """Fill one row of `bitmask` from `matcher`: None, or why it failed."""
        row = self.bitmask[row_index]
        try:
            matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            return matcher_error(matcher) if matcher.is_error() else None
        except Exception as exc:  # NOTE: a row is never left undone
            logger.exception("grammar mask failed")
            return str(exc)

    def wait(self, deadline: float | None, max_pending: int = 0) -> None:
        """Until every task is done (at most `max_pending` tasks are not: the tests'
        deadline), or `deadline` (monotonic; None: none) has passed."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        with self._cond:
            self._max_pending = max_pending
            self._cond.wait_for(lambda: self._num_pending() <= max_pending, timeout)

    def _num_pending(self) -> int:
        return len(self.tasks) - self._num_finished

    def result(self, late: str) -> GrammarBitmask:
        """The rows done so far; those whose first mask is not done fail (`late` says why).
        NOTE: the array is the one the late masks are still written into, at their own
        rows, which the result does not name."""
        with self._cond:
            done, errors = set(self._done), dict(self._errors)
            num_draft_rows = dict(self._num_draft_rows)
        rows: dict[str, int] = {}
        draft_rows: dict[str, int] = {}
        failed: dict[str, str] = {}
        for index, task in enumerate(self.tasks):
            request_id = task.request_id
            if index not in done:
                failed[request_id] = late
            elif index in errors:
                failed[request_id] = errors[index]
            else:
                rows[request_id] = self.first_rows[index]
                if index in num_draft_rows:
                    draft_rows[request_id] = num_draft_rows[index]
        return GrammarBitmask(rows, self.bitmask, failed, draft_rows)
