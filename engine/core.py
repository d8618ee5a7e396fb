"""The engine core: the scheduler and the model runner, stepped on one thread.

`EngineCore` takes the API side's commands (engine/messages.py) and runs each step as
three calls (`schedule`, `launch`, `update` with the launched step's result); with
`async_scheduling` the next step is scheduled and launched before the last one's result
is read, so the host work of one overlaps the device work of the other (see `step`).
Once scheduled, a step is announced by a small `StepScheduled` message, and what it did
leaves as one `StepOutputs` message: the new token ids of every request that got one,
finish reasons, preemption counts, logprobs and the scheduler's stats. It knows no text,
no HTTP and no transport: `run_core_loop` drives it between a command source and a
message sink, on a thread of the API process (tests) or as the main loop of the core
process (engine/core_process.py).

A step that raises fails the requests it scheduled (an `error` delta) and aborts them,
freeing their blocks; the loop goes on. Any other exception ends the loop.

Requests with a grammar go through `StructuredOutputs` (structured/matchers.py): they
reach the scheduler once their grammar is compiled, each step's plan carries the masks of
their sampling rows, and a request whose grammar is complete stops there. A request whose
mask missed the step's deadline, or whose grammar failed, ends with an `error` delta
alone; the step goes on for the others.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from engine.messages import (
    AddRequests,
    Command,
    CoreMessage,
    FinishRequests,
    RequestDelta,
    Shutdown,
    SnapshotQuery,
    SnapshotReply,
    StepOutputs,
    StepScheduled,
)
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler
from structured.matchers import GrammarState, StructuredOutputs

logger = logging.getLogger(__name__)

# With work that cannot be scheduled now (e.g. a full pool), wait this long for a command
# instead of spinning.
STUCK_WAIT_S = 0.01


class LaunchedStep(Protocol):
    def result(self) -> ModelRunnerOutput: ...


class Runner(Protocol):
    """model_runner's ModelRunner or SimulatedRunner: `launch` starts a step on the
    device and returns at once where the device runs on its own (CUDA)."""

    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep: ...


class StepClock(Protocol):
    """Where the core writes the monotonic start of the running step (0.0 between
    steps): a plain object in-process, a shared `multiprocessing.Value` across processes."""

    value: float


@dataclasses.dataclass
class LocalStepClock:
    value: float = 0.0


@dataclasses.dataclass
class _InFlight:
    """A launched step and its plan, waiting to be finished."""

    plan: SchedulerOutput
    launched: LaunchedStep


def _needs_host_tokens(plan: SchedulerOutput) -> bool:
    """Whether scheduling the step after `plan` needs the tokens `plan` samples on the host:
    a sampling row with a grammar (its next mask), penalties (its counts) or still short
    of min_tokens (its stop-token mask)."""
    for scheduled in plan.scheduled:
        params = scheduled.sampling_params
        if scheduled.sample and (
            params.grammar is not None
            or params.has_penalties
            or len(scheduled.output_token_ids) < params.min_tokens
        ):
            return True
    return False


def _request_error(request_id: str, message: str) -> RequestDelta:
    """The end of a request that failed by its own fault (a 400 to its client)."""
    return RequestDelta(request_id, [], error=message, error_status=400)


class EngineCore:
    """Scheduler + runner behind commands and per-step messages; single-threaded.

    `fault_hook` is for tests only: when set, every step calls it with the plan, after
    `schedule()` and before `execute()`; an Exception it raises fails that step, any other
    BaseException ends the loop.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        eos_token_ids: frozenset[int],
        step_clock: StepClock | None = None,
        structured: StructuredOutputs | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.structured = structured
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        # NOTE: not `step_clock or ...`: a ctypes double of 0.0 is falsy.
        self.step_clock: StepClock = LocalStepClock() if step_clock is None else step_clock
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None
        self.stuck = False  # the last step scheduled nothing
        self._num_sent: dict[str, int] = {}  # tokens already reported, by request id
        self._scheduled_once: set[str] = set()
        self._pending: list[RequestDelta] = []  # errors of rejected adds
        self._num_added = 0
        self._dirty = False  # commands changed the state since the last message
        self._in_flight: _InFlight | None = None  # overlapped steps: launched, not finished

    @property
    def has_work(self) -> bool:
        compiling = self.structured is not None and self.structured.num_compiling > 0
        return (compiling or self._in_flight is not None
                or self.scheduler.has_unfinished_requests())

    # ------------------------------------------------------------ commands

    def apply(self, command: Command) -> CoreMessage | None:
        """Run one command; the reply of a snapshot query, else None."""
        self._dirty = True
        if isinstance(command, AddRequests):
            self._add(command)
        elif isinstance(command, FinishRequests):
            status = (RequestStatus.FINISHED_STOPPED if command.stopped
                      else RequestStatus.FINISHED_ABORTED)
            self._finish(command.request_ids, status)
        elif isinstance(command, SnapshotQuery):
            return SnapshotReply(command.query_id, self.snapshot(command.check_integrity))
        elif isinstance(command, Shutdown):
            self.abort_all()
        return None

    def _add(self, command: AddRequests) -> None:
        for new, params in zip(command.requests, command.sampling_params(), strict=True):
            request = Request(
                new.request_id, new.prompt_token_ids, params,
                eos_token_ids=self.eos_token_ids, priority=new.priority,
                arrival_time=new.arrival_time, prompt_leader_id=new.prompt_leader_id,
                tenant=new.tenant, weight=new.weight, deadline=new.deadline,
                cache_salt=new.cache_salt, priority_bound=new.priority_bound,
            )
            self._num_added += 1
            if params.grammar is not None:
                try:
                    if not self._constrain(request):
                        self._num_sent[new.request_id] = 0
                        continue  # scheduled once its grammar is compiled
                except ValueError as exc:
                    self._pending.append(_request_error(new.request_id, str(exc)))
                    continue
            self._schedule_new(request)

    def _schedule_new(self, request: Request) -> None:
        try:
            self.scheduler.add_request(request)
        except ValueError as exc:  # the HTTP checks should have caught it
            self._pending.append(_request_error(request.request_id, str(exc)))
            self._forget(request.request_id)
            return
        self._num_sent[request.request_id] = 0

    def _constrain(self, request: Request) -> bool:
        """Give `request` its grammar: True when it can be scheduled now."""
        if self.structured is None:
            raise ValueError("structured outputs are not available in this engine")
        return self.structured.add(request)

    def _schedule_compiled(self) -> None:
        """Hand the requests whose grammar is now compiled to the scheduler."""
        if self.structured is None or not self.structured.num_compiling:
            return
        ready, failed = self.structured.take_compiled()
        for request in ready:
            self._schedule_new(request)
        for request, error in failed:
            self._pending.append(_request_error(request.request_id, error))
            self._forget(request.request_id)

    def _finish(self, request_ids: list[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(request_ids, status)
        for request_id in request_ids:
            self._forget(request_id)

    def abort_all(self) -> None:
        self._finish(list(self._num_sent), RequestStatus.FINISHED_ABORTED)

    def snapshot(self, check_integrity: bool = False) -> dict[str, Any]:
        """`Scheduler.snapshot()`, with `integrity` ("ok", or why the check failed) when
        `check_integrity`."""
        state = self.scheduler.snapshot()
        if check_integrity:
            try:
                self.scheduler.check_integrity()
                state["integrity"] = "ok"
            except Exception as exc:
                state["integrity"] = f"failed: {exc}"
        return state

    # ------------------------------------------------------------ steps

    def step(self, on_scheduled: Callable[[StepScheduled], None] | None = None) -> StepOutputs:
        """One step: schedule and launch it (`on_scheduled` once scheduled), then finish a
        step (its tokens, update, grammars) and return its message. That is this step,
        or with overlapped steps (`async_scheduling`) the one launched before, which ran
        on the device while this one was scheduled. A step in flight whose requests need
        its tokens on the host to schedule the next (a grammar, penalties, min_tokens) is
        finished first."""
        start = time.monotonic()
        self.step_clock.value = start
        plan: SchedulerOutput | None = None
        previous = self._in_flight  # launched by the last call, still to finish
        overlapped: _InFlight | None = None  # finished after this step is launched
        self._schedule_compiled()
        deltas, first = self._pending, []
        self._pending = []
        try:
            if previous is not None and _needs_host_tokens(previous.plan):
                self._in_flight = None
                deltas.extend(self._finish_step(previous))
            elif previous is not None:
                overlapped = previous
            plan = self.scheduler.schedule()
            if self.structured is not None:
                plan.grammar_bitmask = self.structured.bitmask(plan)
            for scheduled in plan.scheduled:
                if scheduled.request_id not in self._scheduled_once:
                    self._scheduled_once.add(scheduled.request_id)
                    first.append(scheduled.request_id)
            if on_scheduled is not None:
                num_added, self._num_added = self._num_added, 0
                on_scheduled(StepScheduled(start, first, self.scheduler.num_waiting, num_added,
                                           plan.num_scheduled_tokens))
            if self.fault_hook is not None:
                self.fault_hook(plan)
            # NOTE: an empty plan too: its finished ids reach the runner, and its update
            # returns the requests whose deadline passed in schedule()
            current = _InFlight(plan, self.runner.launch(plan))
            self._in_flight = current
            if overlapped is not None:
                deltas.extend(self._finish_step(overlapped))
            if plan.is_empty or not self.scheduler.config.async_scheduling:
                self._in_flight = None
                deltas.extend(self._finish_step(current))
        except Exception:
            error_id = f"err-{uuid.uuid4().hex}"
            logger.exception("engine step failed (error id %s); aborting its requests", error_id)
            in_flight = [f.plan for f in (previous, self._in_flight) if f is not None]
            plans = [p for p in (plan, *in_flight) if p is not None]
            self._in_flight = None
            ids = ([s.request_id for p in plans for s in p.scheduled] if plans
                   else list(self._num_sent))
            ids = list(dict.fromkeys(i for i in ids if i in self._num_sent))
            message = (f"internal error in an engine step (error id {error_id}; the server "
                       "log has the details)")
            deltas.extend(RequestDelta(i, [], error=message) for i in ids)
            self._finish(ids, RequestStatus.FINISHED_ABORTED)
        finally:
            self.step_clock.value = 0.0
        self.stuck = plan is not None and plan.is_empty and previous is None  # nothing moved
        return self._message(deltas)

    def _finish_step(self, in_flight: _InFlight) -> list[RequestDelta]:
        """Wait for a launched step's tokens and apply them: the deltas of its requests."""
        runner_output = in_flight.launched.result()
        updated = self.scheduler.update(in_flight.plan, runner_output)
        failed: dict[str, str] = {}
        if self.structured is not None:
            failed = self._advance_grammars(self.structured, in_flight.plan, updated)
        deltas = [self._delta(request) for request in updated
                  if request.request_id not in failed]
        return deltas + self._fail(failed)

    def _advance_grammars(
        self, structured: StructuredOutputs, plan: SchedulerOutput, updated: list[Request]
    ) -> dict[str, str]:
        """Feed the new tokens to the matchers and stop the requests whose grammar ended;
        returns the requests to fail, with why: their mask was missing in this step (late,
        or the grammar failed), or their matcher failed on the new tokens."""
        failed = {} if plan.grammar_bitmask is None else dict(plan.grammar_bitmask.result().failed)
        done = []
        for request in updated:
            request_id = request.request_id
            if (request_id in failed or request.is_finished
                    or not structured.is_constrained(request_id)):
                continue
            state = structured.accept(request)
            if state is GrammarState.ENDED:
                done.append(request_id)
            elif state is GrammarState.VIOLATED:
                failed[request_id] = structured.error(request_id)
        if done:
            self.scheduler.finish_requests(done, RequestStatus.FINISHED_STOPPED)
        return failed

    def _fail(self, errors: dict[str, str]) -> list[RequestDelta]:
        """End these requests with an error (not a finish reason), freeing their blocks;
        the token a step sampled for them is not sent."""
        ids = [request_id for request_id in errors if request_id in self._num_sent]
        self._finish(ids, RequestStatus.FINISHED_ABORTED)
        return [_request_error(request_id, errors[request_id]) for request_id in ids]

    def idle_message(self) -> StepOutputs | None:
        """Between steps: the errors and stats that commands produced, if any."""
        if not self._dirty and not self._pending:
            return None
        deltas, self._pending = self._pending, []
        return self._message(deltas)

    def on_idle(self) -> None:
        try:
            self.scheduler.check_integrity()
        except Exception:
            logger.exception("KV cache integrity check failed while idle")

    def _delta(self, request: Request) -> RequestDelta:
        request_id = request.request_id
        sent = self._num_sent[request_id]
        new_ids = request.output_token_ids[sent:]
        logprobs = None
        if request.sampling_params.logprobs is not None:
            logprobs = request.output_logprobs[sent:]
        prompt_logprobs = request.prompt_logprobs if sent == 0 and new_ids else None
        shared = prompt_logprobs is not None and request.shares_prompt_logprobs
        self._num_sent[request_id] = len(request.output_token_ids)
        finish_reason = request.finish_reason if request.is_finished else None
        if request.is_finished:
            self._forget(request_id)
        return RequestDelta(request_id, new_ids, request.num_preemptions,
                            request.num_cached_tokens, logprobs, finish_reason,
                            prompt_logprobs=None if shared else prompt_logprobs,
                            shares_prompt_logprobs=shared)

    def _forget(self, request_id: str) -> None:
        self._num_sent.pop(request_id, None)
        self._scheduled_once.discard(request_id)
        if self.structured is not None:
            self.structured.free(request_id)

    def _message(self, deltas: list[RequestDelta]) -> StepOutputs:
        num_added, self._num_added, self._dirty = self._num_added, 0, False
        return StepOutputs(deltas, dataclasses.asdict(self.scheduler.stats), num_added)


def run_core_loop(
    core: EngineCore,
    receive: Callable[[float | None], list[Command]],
    send: Callable[[CoreMessage], None],
) -> None:
    """Step `core` until a Shutdown command: `receive(timeout)` returns the commands that
    arrived (waiting up to `timeout` seconds for one, None: as long as it takes, 0: not
    at all); every step's message and every reply goes to `send`. With nothing to do, the
    KV cache's integrity is checked once per idle period."""
    went_idle = True
    while True:
        timeout: float | None = 0.0
        if not core.has_work:
            if not went_idle:
                core.on_idle()
                went_idle = True
            timeout = None
        elif core.stuck:
            timeout = STUCK_WAIT_S
        for command in receive(timeout):
            reply = core.apply(command)
            if reply is not None:
                send(reply)
            if isinstance(command, Shutdown):
                message = core.idle_message()
                if message is not None:
                    send(message)
                return
        if core.has_work:
            went_idle = False
            send(core.step(send))
        else:
            message = core.idle_message()
            if message is not None:
                send(message)
