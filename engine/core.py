"""The engine core: the scheduler and the model runner, stepped on one thread.

`EngineCore` takes the API side's commands (engine/messages.py) and runs each step as
three calls (`schedule`, `launch`, `update` with the launched step's result): `step`. With
`async_scheduling` the next step is scheduled and launched before the last one's result
is read, so the host work of one overlaps the device work of the other:
`step_overlapped`. `step_fn` is the one of the two the scheduler's config asks for.
Once scheduled, a step is announced by a small `StepScheduled` message, and what it did
leaves as one `StepOutputs` message: the new token ids of every request that got one,
finish reasons, preemption counts, logprobs and the scheduler's stats (when they changed).
It knows no text, no HTTP and no transport: `run_core_loop` drives it between a command
source and a message sink, on a thread of the API process (tests) or as the main loop of
the core process (engine/core_process.py).

A step that raises fails the requests it scheduled or had in flight (an `error` delta)
and aborts them, freeing their blocks (`_fail`); the loop goes on. Any other exception
ends the loop.

Requests with a grammar go through `StructuredOutputs` (structured/matchers.py): they
reach the scheduler once their grammar is compiled, each step's plan carries the masks of
their sampling rows (one per verified position for speculation, whose drafts the scheduler
checks against the grammar through `num_valid_drafts`), and a request whose grammar is
complete stops there. A request whose
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

from engine.lora_loader import LoRALoader
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
    UpdateLoRA,
)
from scheduler.introspection import SchedulerStats, changed_stats
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler
from structured.matchers import GrammarState, StructuredOutputs

logger = logging.getLogger(__name__)

# With work that cannot be scheduled now (e.g. a full pool), wait this long for a command
# instead of spinning.
STUCK_WAIT_S = 0.01

OnScheduled = Callable[[StepScheduled], None]


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

    An Exception a step raises (the scheduler's or the runner's) fails that step; any
    other BaseException ends the loop.
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
        if structured is not None and scheduler.speculation is not None:
            scheduler.speculation.check_drafts = structured.num_valid_drafts
        self.runner = runner
        # LoRA adapters the scheduler asks for, read on a thread (engine/lora_loader.py)
        self.lora_loader = None if scheduler.loras is None else LoRALoader(
            getattr(runner, "loras", None))
        self.eos_token_ids = eos_token_ids
        # NOTE: not `step_clock or ...`: a ctypes double of 0.0 is falsy.
        self.step_clock: StepClock = LocalStepClock() if step_clock is None else step_clock
        # NOTE: chosen once, as vLLM V1 does (step_fn): overlapped steps need a scheduler
        # that leaves placeholders for the tokens being sampled.
        self.step_fn: Callable[..., StepOutputs] = (
            self.step_overlapped if scheduler.config.async_scheduling else self.step
        )
        self.stuck = False  # the last step scheduled nothing
        self._num_sent: dict[str, int] = {}  # tokens already reported, by request id
        self._scheduled_once: set[str] = set()
        self._pending: list[RequestDelta] = []  # errors of rejected adds
        self._num_added = 0
        self._dirty = False  # commands changed the state since the last message
        self._in_flight: _InFlight | None = None  # overlapped steps: launched, not finished
        # a plain step's end, while the next follows straight on (None: after idle, stuck)
        self._last_step_end: float | None = None
        self._stats_sent: SchedulerStats | None = None

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
        elif isinstance(command, UpdateLoRA):
            error: str | None = "LoRA adapters are off: start the server with --enable-lora"
            if self.lora_loader is not None and self.scheduler.loras is not None:
                error = self.lora_loader.update(command.name, command.path, self.scheduler.loras)
            return SnapshotReply(command.query_id, {"error": error})
        return None

    def _add(self, command: AddRequests) -> None:
        for request in command.scheduler_requests(self.eos_token_ids):
            self._num_added += 1
            if request.sampling_params.grammar is not None:
                try:
                    if not self._constrain(request):
                        self._num_sent[request.request_id] = 0
                        continue  # scheduled once its grammar is compiled
                except ValueError as exc:
                    self._pending.append(_request_error(request.request_id, str(exc)))
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

    def _take_loaded_loras(self) -> None:
        """Hand the scheduler the adapters loaded since the last step; the requests of an
        adapter that failed to load fail alone (a 400 naming why)."""
        if self.lora_loader is None or not self.lora_loader.num_loading:
            return
        loaded, failed = self.lora_loader.take_done()
        for name in loaded:
            self.scheduler.lora_loaded(name)
        for name, error in failed.items():
            ids = self.scheduler.lora_failed(name)
            self._pending += self._abort_with_errors(dict.fromkeys(ids, error), 400)

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

    def step(self, on_scheduled: OnScheduled | None = None) -> StepOutputs:
        """One plain step: schedule it, launch it, update with its result; its message.
        `on_scheduled` gets the step's `StepScheduled` before it runs."""
        start, deltas = self._begin_step()
        previous_end, self._last_step_end = self._last_step_end, None
        plan: SchedulerOutput | None = None
        try:
            plan = self._schedule(start, on_scheduled)
            work, launched_at = self.scheduler.last_step_work, time.monotonic()
            launched = self._launch(plan)
            deltas += self._update(launched)
            if not plan.is_empty:  # the step-cost model learns from plain steps' times,
                # the planner from the gap its decodes saw (the engine's time between too)
                end = self._last_step_end = time.monotonic()
                gap = None if previous_end is None else end - previous_end
                self.scheduler.observe_step(work, end - launched_at, gap)
        except Exception as exc:
            deltas += self._fail([plan], exc)
        finally:
            self.step_clock.value = 0.0
        self.stuck = plan is not None and plan.is_empty
        return self._message(deltas)

    def step_overlapped(self, on_scheduled: OnScheduled | None = None) -> StepOutputs:
        """One overlapped step (`async_scheduling`): schedule and launch step n+1, then
        update with step n's result, which the device computed meanwhile; its message.
        Step n is read first when scheduling n+1 needs its tokens on the host (a grammar,
        penalties, min_tokens, a request that speculates: its drafts follow its last
        token), and an empty step n+1 is read at once."""
        start, deltas = self._begin_step()
        last, self._in_flight = self._in_flight, None  # step n, launched by the last call
        plan: SchedulerOutput | None = None
        try:
            unread = last
            if last is not None and self._needs_host_tokens(last.plan):
                deltas += self._update(last)
                unread = None
            plan = self._schedule(start, on_scheduled)
            launched = self._launch(plan)
            if unread is not None:
                deltas += self._update(unread)
            if plan.is_empty:
                deltas += self._update(launched)
            else:
                self._in_flight = launched
        except Exception as exc:
            deltas += self._fail([plan, last.plan if last is not None else None], exc)
        finally:
            self.step_clock.value = 0.0
        self.stuck = plan is not None and plan.is_empty and last is None  # nothing moved
        return self._message(deltas)

    def _needs_host_tokens(self, plan: SchedulerOutput) -> bool:
        speculation = self.scheduler.speculation
        return _needs_host_tokens(plan) or (
            speculation is not None and speculation.any_speculates(plan, self.scheduler.requests)
        )

    def _begin_step(self) -> tuple[float, list[RequestDelta]]:
        """Start the step clock and hand the scheduler the requests whose grammar is now
        compiled: the step's start and the deltas waiting to go out (rejected adds)."""
        start = time.monotonic()
        self.step_clock.value = start
        self._schedule_compiled()
        self._take_loaded_loras()
        deltas, self._pending = self._pending, []
        return start, deltas

    def _schedule(self, start: float, on_scheduled: OnScheduled | None) -> SchedulerOutput:
        """The scheduler's plan, with the masks of its grammar rows (filled while the step
        runs), announced to `on_scheduled`."""
        plan = self.scheduler.schedule()
        if plan.lora_loads and self.lora_loader is not None:
            self.lora_loader.start(plan.lora_loads)
        if self.structured is not None:
            plan.grammar_bitmask = self.structured.bitmask(plan)
        first = self._first_scheduled(plan)
        if on_scheduled is not None:
            num_added, self._num_added = self._num_added, 0
            on_scheduled(StepScheduled(start, first, self.scheduler.num_waiting, num_added,
                                       plan.num_scheduled_tokens))
        return plan

    def _first_scheduled(self, plan: SchedulerOutput) -> list[str]:
        """The requests `plan` schedules for the first time."""
        first = []
        for scheduled in plan.scheduled:
            if scheduled.request_id not in self._scheduled_once:
                self._scheduled_once.add(scheduled.request_id)
                first.append(scheduled.request_id)
        return first

    def _launch(self, plan: SchedulerOutput) -> _InFlight:
        """Start `plan` on the device. NOTE: an empty plan too: its finished ids reach the
        runner, and its update returns the requests whose deadline passed in schedule()."""
        return _InFlight(plan, self.runner.launch(plan))

    def _update(self, in_flight: _InFlight) -> list[RequestDelta]:
        """Wait for a launched step's tokens and apply them: the deltas of its requests."""
        runner_output = in_flight.launched.result()
        updated = self.scheduler.update(in_flight.plan, runner_output)
        failed: dict[str, str] = {}
        if self.structured is not None:
            failed = self._advance_grammars(self.structured, in_flight.plan, updated)
        deltas = [self._delta(request) for request in updated
                  if request.request_id not in failed]
        return deltas + self._abort_with_errors(failed, 400)

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

    def _fail(self, plans: list[SchedulerOutput | None], exc: Exception) -> list[RequestDelta]:
        """A step raised `exc`: fail the requests of the plans it scheduled or launched
        (every request, when it raised before any) with an internal error (a 500)."""
        error_id = f"err-{uuid.uuid4().hex}"
        logger.error("engine step failed (error id %s); aborting its requests", error_id,
                     exc_info=exc)
        scheduled = [plan for plan in plans if plan is not None]
        ids = ([s.request_id for plan in scheduled for s in plan.scheduled] if scheduled
               else list(self._num_sent))
        message = (f"internal error in an engine step (error id {error_id}; the server "
                   "log has the details)")
        return self._abort_with_errors(dict.fromkeys(ids, message), 500)

    def _abort_with_errors(self, errors: dict[str, str], status: int) -> list[RequestDelta]:
        """End these requests with an error (not a finish reason) of HTTP `status`, freeing
        their blocks; the token a step sampled for them is not sent."""
        ids = [request_id for request_id in errors if request_id in self._num_sent]
        self._finish(ids, RequestStatus.FINISHED_ABORTED)
        return [RequestDelta(request_id, [], error=errors[request_id], error_status=status)
                for request_id in ids]

    def idle_message(self) -> StepOutputs | None:
        """Between steps: the errors and stats that commands produced, if any."""
        if not self._dirty and not self._pending:
            return None
        deltas, self._pending = self._pending, []
        return self._message(deltas)

    def on_idle(self) -> None:
        self._last_step_end = None  # the next step's gap is not a decode's
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
        return StepOutputs(deltas, self._changed_stats(), num_added)

    def _changed_stats(self) -> SchedulerStats | None:
        """The scheduler's stats if they changed since the last sent, else None."""
        stats = changed_stats(self.scheduler, self._stats_sent)
        if stats is not None:
            self._stats_sent = stats
        return stats


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
            send(core.step_fn(send))
        else:
            message = core.idle_message()
            if message is not None:
                send(message)
