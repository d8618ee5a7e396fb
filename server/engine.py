"""The engine loop: one thread that owns the Scheduler and the ModelRunner.

HTTP handlers never touch the scheduler. They send commands (add, abort, snapshot)
through a list guarded by a condition variable; the engine thread drains it at the start
of every step, runs the step as three calls (schedule, execute, update), detokenizes,
applies stop strings (finishing the request in the same step), updates the metrics and
hands every request's new text to its handler's asyncio queue with
`loop.call_soon_threadsafe`. With nothing to do, the thread sleeps on the condition and
checks the KV cache's integrity once.

A step that raises fails the requests it scheduled (their handlers get an error) and
aborts them, freeing their blocks; the loop goes on. If the loop itself dies, every
pending request fails and `is_alive` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvcache.config import CacheConfig
from model_runner.config import ModelConfig
from model_runner.loader import ModelSpec, load_model, load_model_spec
from model_runner.runner import ModelRunner
from model_runner.simulated_runner import SimulatedRunner
from scheduler.config import SchedulerConfig
from scheduler.output import SampleLogprobs, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from server.detokenizer import IncrementalDetokenizer
from server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

_STUCK_WAIT_S = 0.01


class EngineDeadError(RuntimeError):
    """The engine loop is not running (it died, or the server is shutting down)."""


class EngineStepError(RuntimeError):
    """A step that included this request failed; the request was aborted."""


@dataclass
class RequestOutput:
    """What one step produced for one choice of a request.

    `text` and `token_ids` are new since the previous output. `finish_reason` is set on
    the choice's last output; `error` is set instead when the step failed.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[SampleLogprobs] | None
    finish_reason: str | None
    num_preemptions: int
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class RequestStream:
    """The handler's end of a request: yields the outputs of all its choices, in order,
    until every choice finished; raises EngineStepError when a step failed it."""

    def __init__(self, request_id: str, num_choices: int) -> None:
        self.request_id = request_id
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._num_unfinished = num_choices

    @property
    def finished(self) -> bool:
        return self._num_unfinished == 0

    def put(self, output: RequestOutput) -> None:
        """Thread-safe: called by the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, output)
        except RuntimeError:
            pass  # the handler's event loop is gone (shutdown): nobody is listening

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self._num_unfinished:
            output = await self._queue.get()
            if output.error is not None:
                raise EngineStepError(output.error)
            if output.finished:
                self._num_unfinished -= 1
            yield output


@dataclass
class _Choice:
    """Engine-side state of one scheduler request (one choice of an HTTP request)."""

    request: Request
    stream: RequestStream
    group_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    arrival_time: float  # time.monotonic() when the HTTP request arrived
    want_logprobs: bool
    num_sent_tokens: int = 0
    first_scheduled_time: float | None = None
    last_token_time: float | None = None


@dataclass
class _Add:
    group_id: str
    choices: list[_Choice]


@dataclass
class _Abort:
    group_id: str


@dataclass
class _AbortAll:
    pass


@dataclass
class _Snapshot:
    future: concurrent.futures.Future[dict[str, Any]]


@dataclass
class _Stop:
    pass


_Command = _Add | _Abort | _AbortAll | _Snapshot | _Stop


@dataclass
class _StatsSeen:
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0


@dataclass
class EngineInfo:
    """What the HTTP front end needs to know about the served model."""

    model_name: str
    max_model_len: int
    vocab_size: int
    policy: str
    tokenizer: Any = field(repr=False)
    eos_token_ids: frozenset[int] = frozenset()


class Engine:
    """Runs scheduler + runner steps in a thread and streams outputs to HTTP handlers.

    `runner` needs only `execute(SchedulerOutput) -> ModelRunnerOutput`. The tokenizer is
    copied for the engine thread's own decoding, so handlers may keep encoding with it.
    `fault_hook` is for tests only: when set, every step calls it with the plan, after
    `schedule()` and before `execute()`; an exception it raises fails that step.
    A step running longer than `step_timeout_s` counts as a hung engine: `is_alive` turns
    False (so /health and new requests get 503) until the step returns.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner: Any,
        info: EngineInfo,
        metrics: ServerMetrics | None = None,
        step_timeout_s: float | None = None,
    ) -> None:
        self.info = info
        self.step_timeout_s = step_timeout_s
        self._step_started: float | None = None  # monotonic start of the running step
        self.metrics = metrics or ServerMetrics(info.model_name)
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None
        self._scheduler = scheduler
        self._runner = runner
        self._decode_tokenizer = copy.deepcopy(info.tokenizer)
        self._cond = threading.Condition()
        self._commands: list[_Command] = []  # guarded by _cond
        self._num_pending_adds = 0  # guarded by _cond
        self._num_waiting = 0
        self._stopping = False
        self._dead: BaseException | None = None
        self._closed = False  # the thread has exited (or is exiting); guarded by _cond
        self._thread: threading.Thread | None = None
        self._choices: dict[str, _Choice] = {}  # engine thread only, by scheduler id
        self._groups: dict[str, set[str]] = {}  # engine thread only
        self._stats_seen = _StatsSeen()

    # ------------------------------------------------------------ handler side

    @property
    def is_alive(self) -> bool:
        return (
            self._dead is None
            and not self._stopping
            and not self.is_stalled
            and self._thread is not None
            and self._thread.is_alive()
        )

    @property
    def is_stalled(self) -> bool:
        """Whether the running step has outlived `step_timeout_s`."""
        started, timeout = self._step_started, self.step_timeout_s
        return started is not None and timeout is not None and (
            time.monotonic() - started > timeout
        )

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a seat (as of the last step) plus those not yet queued."""
        return self._num_waiting + self._num_pending_adds

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
            self._thread.start()

    def run_on_this_thread(self, on_alive: Callable[[], None]) -> None:
        """Make the calling thread the engine thread: call `on_alive` once the engine takes
        requests, then run the loop until shutdown (see `create_engine`)."""
        if self._thread is not None:
            raise RuntimeError("the engine already has a thread")
        self._thread = threading.current_thread()
        on_alive()
        self._loop()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort whatever is still in flight and stop the thread."""
        with self._cond:
            self._stopping = True
            self._commands.append(_Stop())
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def add_request(
        self,
        request_id: str,
        prompts: Sequence[list[int]],
        sampling_params: SamplingParams,
        *,
        n: int = 1,
        stop: Sequence[str] = (),
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Queue one HTTP request: n choices per prompt, each its own scheduler request.

        Choice `p * n + i` (prompt p, sample i) has the scheduler id `<request_id>-<p*n+i>`;
        with a seed, sample i uses seed + i so that the n samples differ. Must be called
        from the event loop that will consume the returned stream.
        """
        if not self.is_alive:
            raise EngineDeadError(self.unavailable_reason())
        arrival = time.monotonic() if arrival_time is None else arrival_time
        stream = RequestStream(request_id, len(prompts) * n)
        choices = []
        for p, prompt in enumerate(prompts):
            for i in range(n):
                params = sampling_params
                if i > 0 and params.seed is not None:
                    params = replace(params, seed=params.seed + i)
                index = p * n + i
                request = Request(
                    f"{request_id}-{index}",
                    list(prompt),
                    params,
                    eos_token_ids=self.info.eos_token_ids,
                    priority=priority,
                    arrival_time=arrival,
                    prompt_leader_id=f"{request_id}-{p * n}" if i > 0 else None,
                )
                detokenizer = IncrementalDetokenizer(self._decode_tokenizer, prompt, stop)
                choices.append(
                    _Choice(request, stream, request_id, index, detokenizer, arrival,
                            want_logprobs=params.logprobs is not None)
                )
        with self._cond:
            if not self.is_alive:
                raise EngineDeadError(self.unavailable_reason())
            self._commands.append(_Add(request_id, choices))
            self._num_pending_adds += len(choices)
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort every unfinished choice of a request (e.g. its client went away)."""
        with self._cond:
            self._commands.append(_Abort(request_id))
            self._cond.notify()

    def abort_all(self) -> None:
        """Abort every request queued so far (the shutdown's grace period is over);
        thread-safe, and a no-op once the thread has exited."""
        with self._cond:
            self._commands.append(_AbortAll())
            self._cond.notify()

    async def snapshot(self) -> dict[str, Any]:
        """The scheduler's state (`Scheduler.snapshot()`), taken by the engine thread, with
        `integrity`: "ok", or why `check_integrity()` failed."""
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        with self._cond:
            if self._thread is None or self._closed:
                return self._snapshot()  # no thread mutates the scheduler now
            self._commands.append(_Snapshot(future))
            self._cond.notify()
        return await asyncio.wrap_future(future)

    def unavailable_reason(self) -> str:
        """Why the engine takes no requests now (meaningful when `is_alive` is False)."""
        if self._dead is not None:
            return f"engine loop died: {self._dead!r}"
        if self.is_stalled:
            return f"engine step has run for over {self.step_timeout_s:g} s (--step-timeout-s)"
        return "engine is not running" if not self._stopping else "server is shutting down"

    # ------------------------------------------------------------- engine side

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            logger.exception("engine loop died")
            self._die(exc)
        finally:
            self._close()

    def _run(self) -> None:
        went_idle = True
        while True:
            with self._cond:
                while not self._commands and not self._scheduler.has_unfinished_requests():
                    if not went_idle:
                        self._on_idle()
                        went_idle = True
                    self._cond.wait()
                commands, self._commands = self._commands, []
                self._num_pending_adds = 0
            if not self._apply(commands):
                return
            if self._scheduler.has_unfinished_requests():
                went_idle = False
                self._step()

    def _apply(self, commands: list[_Command]) -> bool:
        """Run the handlers' commands; False when one of them says stop."""
        stop = False
        for command in commands:
            if isinstance(command, _Add):
                added = {c.request.request_id for c in command.choices if self._add(c)}
                if added:
                    self._groups[command.group_id] = added
            elif isinstance(command, _Abort):
                self._abort(list(self._groups.get(command.group_id, ())))
            elif isinstance(command, _AbortAll):
                self._abort(list(self._choices))
            elif isinstance(command, _Snapshot):
                command.future.set_result(self._snapshot())
            else:
                stop = True
        if stop:
            self._abort(list(self._choices))
        self._record_stats()
        return not stop

    def _close(self) -> None:
        """The thread is exiting: answer the snapshots that raced with the stop."""
        with self._cond:
            self._closed = True
            commands, self._commands = self._commands, []
        for command in commands:
            if isinstance(command, _Snapshot):
                try:
                    command.future.set_result(self._snapshot())
                except Exception as exc:
                    command.future.set_exception(exc)

    def _snapshot(self) -> dict[str, Any]:
        state = self._scheduler.snapshot()
        try:
            self._scheduler.check_integrity()
            state["integrity"] = "ok"
        except Exception as exc:
            state["integrity"] = f"failed: {exc}"
        return state

    def _add(self, choice: _Choice) -> bool:
        try:
            self._scheduler.add_request(choice.request)
        except ValueError as exc:  # the HTTP checks should have caught it
            choice.stream.put(self._output(choice, "", [], None, None, error=str(exc)))
            return False
        self._choices[choice.request.request_id] = choice
        return True

    def _step(self) -> None:
        self._step_started = time.monotonic()
        try:
            self._run_step()
        finally:
            self._step_started = None

    def _run_step(self) -> None:
        plan: SchedulerOutput | None = None
        try:
            plan = self._scheduler.schedule()
            self._num_waiting = self._scheduler.num_waiting
            self._note_scheduled(plan)
            if self.fault_hook is not None:
                self.fault_hook(plan)
            runner_output = self._runner.execute(plan)
            updated = self._scheduler.update(plan, runner_output)
            self._process(updated)
        except Exception as exc:
            logger.exception("engine step failed; aborting its requests")
            if plan is not None:
                ids = [scheduled.request_id for scheduled in plan.scheduled]
            else:
                ids = list(self._choices)
            self._fail(ids, f"internal error in engine step: {exc!r}")
        self._record_stats()
        if plan is not None and plan.is_empty:
            # Nothing could be scheduled: wait for a command instead of spinning.
            with self._cond:
                if not self._commands:
                    self._cond.wait(_STUCK_WAIT_S)

    def _note_scheduled(self, plan: SchedulerOutput) -> None:
        now = time.monotonic()
        for scheduled in plan.scheduled:
            choice = self._choices.get(scheduled.request_id)
            if choice is not None and choice.first_scheduled_time is None:
                choice.first_scheduled_time = now
                self.metrics.observe_queue_time(
                    now - choice.arrival_time, choice.request.priority
                )

    def _process(self, updated: list[Request]) -> None:
        """Detokenize, apply stop strings, update metrics and stream the step's outputs."""
        now = time.monotonic()
        for request in updated:
            choice = self._choices.get(request.request_id)
            if choice is None:
                continue
            new_ids = request.output_token_ids[choice.num_sent_tokens :]
            logprobs = None
            if choice.want_logprobs:
                logprobs = request.output_logprobs[choice.num_sent_tokens :]
            choice.num_sent_tokens = len(request.output_token_ids)
            if new_ids:
                self._observe_tokens(choice, len(new_ids), now)
            delta = choice.detokenizer.step(new_ids)
            text, finish_reason = delta.text, None
            if delta.stopped:
                if not request.is_finished:
                    self._scheduler.finish_requests(
                        [request.request_id], RequestStatus.FINISHED_STOPPED
                    )
                finish_reason = "stop"
            elif request.is_finished:
                text += choice.detokenizer.flush()
                finish_reason = request.finish_reason or "stop"
            choice.stream.put(self._output(choice, text, new_ids, logprobs, finish_reason))
            if finish_reason is not None:
                self._forget(choice, finish_reason, now)

    def _observe_tokens(self, choice: _Choice, num_new: int, now: float) -> None:
        if choice.last_token_time is None:
            self.metrics.observe_ttft(now - choice.arrival_time, choice.request.priority)
            self.metrics.inc_prompt_tokens(len(choice.request.prompt_token_ids))
        else:
            self.metrics.observe_inter_token_latency(now - choice.last_token_time)
        choice.last_token_time = now
        self.metrics.inc_generation_tokens(num_new)

    def _output(
        self,
        choice: _Choice,
        text: str,
        token_ids: list[int],
        logprobs: list[SampleLogprobs] | None,
        finish_reason: str | None,
        error: str | None = None,
    ) -> RequestOutput:
        request = choice.request
        return RequestOutput(
            index=choice.index,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish_reason,
            num_preemptions=request.num_preemptions,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=len(request.output_token_ids),
            error=error,
        )

    def _forget(self, choice: _Choice, finish_reason: str, now: float) -> None:
        request_id = choice.request.request_id
        del self._choices[request_id]
        group = self._groups.get(choice.group_id)
        if group is not None:
            group.discard(request_id)
            if not group:
                del self._groups[choice.group_id]
        self.metrics.inc_request_success(finish_reason)
        self.metrics.observe_e2e_latency(now - choice.arrival_time)

    def _abort(self, request_ids: list[str]) -> None:
        live = [i for i in request_ids if i in self._choices]
        if not live:
            return
        self._scheduler.abort_requests(live)
        now = time.monotonic()
        for request_id in live:
            choice = self._choices[request_id]
            choice.stream.put(self._output(choice, "", [], None, "abort"))
            self._forget(choice, "abort", now)

    def _fail(self, request_ids: list[str], message: str) -> None:
        live = [i for i in request_ids if i in self._choices]
        for request_id in live:
            choice = self._choices[request_id]
            choice.stream.put(self._output(choice, "", [], None, None, error=message))
        self._scheduler.abort_requests(live)
        now = time.monotonic()
        for request_id in live:
            self._forget(self._choices[request_id], "abort", now)

    def _record_stats(self) -> None:
        stats = self._scheduler.stats
        seen = self._stats_seen
        self.metrics.inc_preemptions(stats.num_preemptions_total - seen.num_preemptions)
        self.metrics.inc_prefix_cache(
            stats.prefix_cache_queries_tokens - seen.prefix_queries,
            stats.prefix_cache_hits_tokens - seen.prefix_hits,
        )
        self._stats_seen = _StatsSeen(
            stats.num_preemptions_total,
            stats.prefix_cache_queries_tokens,
            stats.prefix_cache_hits_tokens,
        )
        self.metrics.set_scheduler_gauges(
            stats.num_running, stats.num_waiting, stats.kv_cache_usage
        )
        self._num_waiting = stats.num_waiting

    def _on_idle(self) -> None:
        self._record_stats()
        try:
            self._scheduler.check_integrity()
        except Exception:
            logger.exception("KV cache integrity check failed while idle")

    def _die(self, exc: BaseException) -> None:
        with self._cond:
            self._dead = exc
            adds = [cmd for cmd in self._commands if isinstance(cmd, _Add)]
            self._commands = [cmd for cmd in self._commands if not isinstance(cmd, _Add)]
            self._num_pending_adds = 0
        message = f"engine loop died: {exc!r}"
        pending = [choice for add in adds for choice in add.choices]
        for choice in [*self._choices.values(), *pending]:
            choice.stream.put(self._output(choice, "", [], None, None, error=message))
        try:  # best effort: free the blocks of what was in flight
            self._scheduler.abort_requests(list(self._choices))
        except Exception:
            logger.exception("could not abort the requests of the dead engine loop")
        self._choices.clear()
        self._groups.clear()


def create_engine(
    model_config: ModelConfig,
    scheduler_config: SchedulerConfig,
    *,
    enable_prefix_caching: bool = True,
    served_model_name: str | None = None,
    step_timeout_s: float | None = None,
    simulate_step_ms: float | None = None,
) -> Engine:
    """`build_engine_parts` on a new thread that then runs the engine loop: the engine
    comes back started.

    The context length is the model's (or model_config.max_model_len), capped to what
    the KV cache holds. Loading errors are raised here.

    NOTE: the model runs on the thread that loaded it. Run on a second thread after the
    loading thread had opened OpenMP parallel regions, every parallel op (the GEMMs,
    SDPA) was slower and a decode step ~40% slower on a 2-core CPU (22 -> 32 ms at batch 1
    on float16 weights; measured, cause in libgomp not pinned down).
    """
    built: concurrent.futures.Future[Engine] = concurrent.futures.Future()

    def load_then_run() -> None:
        try:
            engine = _build_engine(
                model_config, scheduler_config, enable_prefix_caching, served_model_name,
                step_timeout_s, simulate_step_ms,
            )
        except BaseException as exc:
            built.set_exception(exc)
            return
        engine.run_on_this_thread(on_alive=lambda: built.set_result(engine))

    threading.Thread(target=load_then_run, name="engine", daemon=True).start()
    return built.result()


def _build_engine(
    model_config: ModelConfig,
    scheduler_config: SchedulerConfig,
    enable_prefix_caching: bool,
    served_model_name: str | None,
    step_timeout_s: float | None,
    simulate_step_ms: float | None = None,
) -> Engine:
    """The engine of `create_engine`, built on the calling thread, not started."""
    scheduler, runner, info = build_engine_parts(
        model_config, scheduler_config, enable_prefix_caching=enable_prefix_caching,
        served_model_name=served_model_name, simulate_step_ms=simulate_step_ms,
    )
    return Engine(scheduler, runner, info, step_timeout_s=step_timeout_s)


def build_engine_parts(
    model_config: ModelConfig,
    scheduler_config: SchedulerConfig,
    *,
    enable_prefix_caching: bool = True,
    served_model_name: str | None = None,
    simulate_step_ms: float | None = None,
) -> tuple[Scheduler, ModelRunner | SimulatedRunner, EngineInfo]:
    """Load the model (with `simulate_step_ms`, only its tokenizer and config, for a
    SimulatedRunner), size the KV cache and build the scheduler that matches it."""
    runner: ModelRunner | SimulatedRunner
    if simulate_step_ms is not None:
        spec = load_model_spec(model_config)
        runner = SimulatedRunner(spec, model_config, simulate_step_ms)
    else:
        loaded = load_model(model_config)
        spec = ModelSpec(loaded.hf_config, loaded.tokenizer, loaded.eos_token_ids,
                         loaded.max_model_len, loaded.served_model_name, Path(loaded.model_path))
        runner = ModelRunner(loaded, model_config)
    cache_config = CacheConfig(
        num_blocks=runner.num_kv_blocks,
        block_size=runner.block_size,
        enable_prefix_caching=enable_prefix_caching,
    )
    scheduler_config = replace(scheduler_config, max_model_len=spec.max_model_len)
    scheduler = Scheduler(scheduler_config, cache_config)
    # NOTE: the scheduler caps a request's length to what the KV pool holds, so that a
    # lone request can always run to its end; the HTTP checks use that same limit.
    max_model_len = scheduler.max_request_len
    if max_model_len < spec.max_model_len:
        logger.warning(
            "max_model_len %d capped to %d, what the KV cache holds (%d blocks of %d)",
            spec.max_model_len, max_model_len, runner.num_kv_blocks, runner.block_size,
        )
    info = EngineInfo(
        model_name=served_model_name or spec.served_model_name,
        max_model_len=max_model_len,
        vocab_size=int(spec.hf_config.vocab_size),
        policy=scheduler_config.policy,
        tokenizer=spec.tokenizer,
        eos_token_ids=spec.eos_token_ids,
    )
    return scheduler, runner, info
