"""The engine front end in the API process: requests in, text out, over an engine core.

HTTP handlers never touch the scheduler. `Engine.add_request` turns an HTTP request into
scheduler requests (one per choice) and sends them to the core; the core answers with
one `StepOutputs` message per step, which the engine turns into text (incremental
detokenization, stop strings: a match finishes the request in the core), metrics and
one output per choice, handed to each handler's stream with one event-loop wakeup per
step. A stream holds one merging slot per choice, so a client that stops reading holds
no growing queue.

The core runs in its own process (`create_engine`, or `start_engine` and
`EngineStart.wait`: engine/core_client.py) or, for the unit tests, on a thread of this
one (`Engine.in_process`: `InProcessCoreClient`). If the core dies, every pending request
fails at once and `is_alive` turns False with the reason.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from engine.core import EngineCore, Runner, run_core_loop
from engine.core_client import ProcessCoreClient
from engine.core_process import CoreConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.messages import (
    AddRequests,
    Command,
    CoreMessage,
    FinishRequests,
    NewRequest,
    Shutdown,
    SnapshotQuery,
    SnapshotReply,
    StepOutputs,
    StepScheduled,
)
from engine.metrics import ServerMetrics
from model_runner.config import ModelConfig
from model_runner.loader import load_model_spec
from scheduler.config import SchedulerConfig
from scheduler.output import PromptLogprobs, SampleLogprobs, SchedulerOutput
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerStats
from structured.compiler import build_ll_tokenizer
from structured.matchers import StructuredOutputs

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core is not running (it died, or the server is shutting down)."""


class EngineStepError(RuntimeError):
    """A step that included this request failed (or the core died), or the request
    failed alone by its own fault (`status_code` 400: its grammar); the request ended."""

    def __init__(self, message: str, status_code: int = 500) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclass
class RequestOutput:
    """What one or more steps produced for one choice of a request.

    `text` and `token_ids` are new since the previous output. `finish_reason` is set on
    the choice's last output; `error` is set instead when a step failed.
    `prompt_logprobs` (when asked for) comes whole with the first output that has tokens;
    the choices of a prompt that share them (n > 1) hold the very same object.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[SampleLogprobs] | None
    finish_reason: str | None
    num_preemptions: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None
    error_status: int = 500
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def merged(self, later: RequestOutput) -> RequestOutput:
        """This output followed by `later` (of the same choice) as one."""
        logprobs = self.logprobs
        if later.logprobs is not None:
            logprobs = [*(logprobs or []), *later.logprobs]
        return replace(
            later,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
        )


class RequestStream:
    """The handler's end of a request: yields the outputs of all its choices until every
    choice finished; raises EngineStepError when a step failed it.

    Outputs not yet read merge into one pending output per choice; an error is raised
    once the outputs before it are read."""

    def __init__(self, request_id: str, num_choices: int) -> None:
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self._pending: dict[int, RequestOutput] = {}
        self._error: EngineStepError | None = None  # raised once the text is out
        self._ready = asyncio.Event()
        self._num_unfinished = num_choices

    @property
    def finished(self) -> bool:
        return self._num_unfinished == 0

    def push(self, output: RequestOutput) -> None:
        """On the stream's event loop."""
        if output.error is not None:
            self._error = self._error or EngineStepError(output.error, output.error_status)
        else:
            earlier = self._pending.get(output.index)
            self._pending[output.index] = output if earlier is None else earlier.merged(output)
        self._ready.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self._num_unfinished:
            if self._pending:
                outputs = list(self._pending.values())
                self._pending.clear()
                for output in outputs:
                    if output.finished:
                        self._num_unfinished -= 1
                    yield output
            elif self._error is not None:
                self._num_unfinished = 0
                raise self._error
            else:
                self._ready.clear()
                await self._ready.wait()


def _deliver(outputs: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in outputs:
        stream.push(output)


@dataclass
class _Prompt:
    """What the choices of one prompt share: its prompt logprobs, which the core sends
    once, with the first of those choices to get tokens."""

    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class _Choice:
    """Front-end state of one scheduler request (one choice of an HTTP request)."""

    request_id: str
    stream: RequestStream
    group_id: str
    index: int
    priority: int
    tenant: str
    num_prompt_tokens: int
    detokenizer: IncrementalDetokenizer
    arrival_time: float  # time.monotonic() when the HTTP request arrived
    prompt: _Prompt
    num_output_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    held: RequestOutput | None = None  # output held back by --stream-interval


DEFAULT_TENANT = "default"  # the tenant of a server without a tenants file


@dataclass(frozen=True)
class Tenancy:
    """Whose a request is (server/tenants.py): the tenant and its fair-share weight, the
    deadline (time.monotonic()), the prefix-cache salt and the tenant's priority bound
    (aging stops there)."""

    tenant: str = DEFAULT_TENANT
    weight: float = 1.0
    deadline: float | None = None
    cache_salt: str | None = None
    priority_bound: int | None = None


NO_TENANCY = Tenancy()
# The core's stats before its first message: nothing counted yet.
_NO_STATS = SchedulerStats(
    num_running=0, num_waiting=0, num_preemptions_total=0, kv_cache_usage=0.0,
    prefix_cache_queries_tokens=0, prefix_cache_hits_tokens=0, num_free_blocks=0,
    num_cached_blocks=0, num_blocks=0,
)


@dataclass
class EngineInfo:
    """What the HTTP front end needs to know about the served model."""

    model_name: str
    max_model_len: int
    vocab_size: int
    policy: str
    tokenizer: Any = field(repr=False)
    eos_token_ids: frozenset[int] = frozenset()
    structured_outputs: bool = False  # the core can enforce grammars
    # the llguidance tokenizer the API process compiles grammars with (server/serving.py);
    # None without structured outputs
    grammar_tokenizer: Any = field(default=None, repr=False)


class CoreClient(Protocol):
    """A transport to an engine core: commands out, messages to `on_message`."""

    @property
    def step_started(self) -> float: ...

    @property
    def is_running(self) -> bool: ...

    def start(
        self, on_message: Callable[[CoreMessage], None], on_death: Callable[[str], None]
    ) -> None: ...

    def send(self, command: Command) -> None: ...

    def shutdown(self, timeout_s: float = 10.0) -> None: ...


class InProcessCoreClient:
    """An EngineCore stepped by a thread of this process (the unit tests' engine)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._cond = threading.Condition()
        self._commands: list[Command] = []  # guarded by _cond
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def step_started(self) -> float:
        return self.core.step_clock.value

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    @property
    def closed(self) -> bool:
        """The thread has exited: nothing mutates the scheduler any more."""
        return self._closed

    def start(
        self, on_message: Callable[[CoreMessage], None], on_death: Callable[[str], None]
    ) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, args=(on_message, on_death), name="engine-core", daemon=True
            )
            self._thread.start()

    def send(self, command: Command) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self.send(Shutdown())
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _receive(self, timeout_s: float | None) -> list[Command]:
        with self._cond:
            if not self._commands and timeout_s != 0:
                self._cond.wait_for(lambda: bool(self._commands), timeout_s)
            commands, self._commands = self._commands, []
        return commands

    def _run(
        self, on_message: Callable[[CoreMessage], None], on_death: Callable[[str], None]
    ) -> None:
        try:
            run_core_loop(self.core, self._receive, on_message)
        except BaseException as exc:
            logger.exception("engine core loop died")
            on_death(f"its loop raised {exc!r}")
            try:  # best effort: free the blocks of what was in flight
                self.core.abort_all()
            except Exception:
                logger.exception("could not abort the requests of the dead engine loop")
        finally:
            self._closed = True


class Engine:
    """Streams outputs of an engine core to HTTP handlers.

    A step running longer than `step_timeout_s` counts as a hung engine: `is_alive` turns
    False (so /health and new requests get 503) until the step returns. With
    `stream_interval` N > 1 a choice's tokens reach its handler every N tokens (the first
    and the last are never held back).
    """

    def __init__(
        self,
        client: CoreClient,
        info: EngineInfo,
        metrics: ServerMetrics | None = None,
        step_timeout_s: float | None = None,
        stream_interval: int = 1,
    ) -> None:
        if stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")
        self.info = info
        self.step_timeout_s = step_timeout_s
        self.stream_interval = stream_interval
        self.metrics = metrics or ServerMetrics(info.model_name)
        # NOTE: a fast tokenizer is not thread-safe; handlers encode with info.tokenizer.
        self._decode_tokenizer = copy.deepcopy(info.tokenizer)
        self._client = client
        self._lock = threading.Lock()  # guards what both the loop and the client touch
        self._choices: dict[str, _Choice] = {}  # by scheduler id
        self._groups: dict[str, set[str]] = {}
        self._on_done: dict[str, Callable[[], None]] = {}  # by group, see add_request
        self._snapshots: dict[int, concurrent.futures.Future[dict[str, Any]]] = {}
        self._query_ids = itertools.count()
        self._num_pending_adds = 0
        self._num_waiting = 0
        self._stats = _NO_STATS
        self._started = False
        self._stopping = False
        self._dead: str | None = None

    @classmethod
    def in_process(
        cls,
        scheduler: Scheduler,
        runner: Runner,
        info: EngineInfo,
        metrics: ServerMetrics | None = None,
        step_timeout_s: float | None = None,
        stream_interval: int = 1,
        structured: StructuredOutputs | None = None,
    ) -> Engine:
        """An engine whose core runs on a thread of this process (not started); the
        core's grammar tokenizer is this process's too."""
        if structured is not None:
            info = replace(info, grammar_tokenizer=structured.compiler.tokenizer)
        core = EngineCore(scheduler, runner, info.eos_token_ids, structured=structured)
        return cls(InProcessCoreClient(core), info, metrics, step_timeout_s, stream_interval)

    @property
    def fault_hook(self) -> Callable[[SchedulerOutput], None] | None:
        """The in-process core's test hook (see EngineCore)."""
        return self._in_process_core().fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: Callable[[SchedulerOutput], None] | None) -> None:
        self._in_process_core().fault_hook = hook

    def _in_process_core(self) -> EngineCore:
        if not isinstance(self._client, InProcessCoreClient):
            raise TypeError("only an in-process engine core has a fault hook")
        return self._client.core

    # ------------------------------------------------------------ handler side

    @property
    def is_alive(self) -> bool:
        return (
            self._dead is None
            and self._started
            and not self._stopping
            and not self.is_stalled
            and self._client.is_running
        )

    @property
    def is_stalled(self) -> bool:
        """Whether the running step has outlived `step_timeout_s`."""
        started, timeout = self._client.step_started, self.step_timeout_s
        return bool(started) and timeout is not None and time.monotonic() - started > timeout

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a seat (as of the last step) plus those not yet queued."""
        return self._num_waiting + self._num_pending_adds

    def load(self, priority: int) -> tuple[int, float]:
        """What a request of `priority` would queue behind here: the waiting requests of
        equal or better priority (as of the last step, counting those not yet queued as
        such) and the KV cache's usage (0 to 1)."""
        with self._lock:
            by_priority = self._stats.num_waiting_by_priority
            ahead = sum(n for p, n in by_priority.items() if p <= priority)
            return ahead + self._num_pending_adds, self._stats.kv_cache_usage

    def start(self) -> None:
        """Start taking outputs from the core (idempotent)."""
        if not self._started:
            self._client.start(self._on_message, self._on_death)
            self._started = True

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort whatever is still in flight and stop the core."""
        self._stopping = True
        self.abort_all()
        self._client.shutdown(timeout_s)
        self._fail_all("server is shutting down")

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
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        tenancy: Tenancy = NO_TENANCY,
        on_done: Callable[[], None] | None = None,
    ) -> RequestStream:
        """Queue one HTTP request: n choices per prompt, each its own scheduler request.

        Choice `p * n + i` (prompt p, sample i) has the scheduler id `<request_id>-<p*n+i>`;
        with a seed, sample i uses seed + i so that the n samples differ; choices i > 0
        name choice p * n as their prompt leader. Must be called from the event loop that
        will consume the returned stream. `on_done` is called (on the engine's thread, or
        the caller's) once every choice has ended, however it ended.
        """
        if not self.is_alive:
            raise EngineDeadError(self.unavailable_reason())
        arrival = time.monotonic() if arrival_time is None else arrival_time
        stream = RequestStream(request_id, len(prompts) * n)
        choices: list[_Choice] = []
        new_requests: list[NewRequest] = []
        for p, prompt in enumerate(prompts):
            shared = _Prompt()
            for i in range(n):
                params = sampling_params
                if i > 0 and params.seed is not None:
                    params = replace(params, seed=params.seed + i)
                shares_token_lists = bool(new_requests) and params.has_token_mask
                if shares_token_lists:  # sent once, with the first choice
                    params = replace(params, allowed_token_ids=None, logit_bias=())
                index = p * n + i
                scheduler_id = f"{request_id}-{index}"
                new_requests.append(NewRequest(
                    request_id=scheduler_id, prompt_token_ids=list(prompt),
                    sampling_params=params, arrival_time=arrival, priority=priority,
                    tenant=tenancy.tenant, weight=tenancy.weight,
                    priority_bound=tenancy.priority_bound, deadline=tenancy.deadline,
                    cache_salt=tenancy.cache_salt,
                    prompt_leader_id=f"{request_id}-{p * n}" if i > 0 else None,
                    shares_token_lists=shares_token_lists,
                ))
                detokenizer = IncrementalDetokenizer(
                    self._decode_tokenizer, prompt, stop, skip_special_tokens,
                    include_stop_str_in_output,
                )
                choices.append(_Choice(scheduler_id, stream, request_id, index, priority,
                                       tenancy.tenant, len(prompt), detokenizer, arrival,
                                       shared))
        with self._lock:
            if not self.is_alive:
                raise EngineDeadError(self.unavailable_reason())
            for choice in choices:
                self._choices[choice.request_id] = choice
            self._groups[request_id] = {c.request_id for c in choices}
            if on_done is not None:
                self._on_done[request_id] = on_done
            self._num_pending_adds += len(choices)
        self._client.send(AddRequests(new_requests))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort every unfinished choice of a request (e.g. its client went away)."""
        with self._lock:
            ids = list(self._groups.get(request_id, ()))
            self._end_choices(ids, "abort")
        if ids:
            self._client.send(FinishRequests(ids))

    def abort_all(self) -> None:
        """Abort every request queued so far (the shutdown's grace period is over)."""
        with self._lock:
            ids = list(self._choices)
            self._end_choices(ids, "abort")
        if ids and self._client.is_running:
            self._client.send(FinishRequests(ids))

    async def snapshot(
        self, check_integrity: bool = False, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """The scheduler's state (`Scheduler.snapshot()`), taken by the core between steps,
        with `integrity` ("ok", or why `check_integrity()` failed) when asked for.
        EngineDeadError when the core is gone or does not answer within `timeout_s`."""
        client = self._client
        if isinstance(client, InProcessCoreClient) and (client.closed or not self._started):
            return client.core.snapshot(check_integrity)  # no thread mutates the scheduler
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        with self._lock:
            if self._dead is not None or not client.is_running:
                raise EngineDeadError(self.unavailable_reason())
            query_id = next(self._query_ids)
            self._snapshots[query_id] = future
        client.send(SnapshotQuery(query_id, check_integrity))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError:
            raise EngineDeadError(
                f"the engine core did not answer within {timeout_s:g} s "
                "(a step is running long)"
            ) from None
        finally:
            with self._lock:
                self._snapshots.pop(query_id, None)

    def unavailable_reason(self) -> str:
        """Why the engine takes no requests now (meaningful when `is_alive` is False)."""
        if self._dead is not None:
            return self._dead
        if self.is_stalled:
            return f"engine step has run for over {self.step_timeout_s:g} s (--step-timeout-s)"
        if self._stopping:
            return "server is shutting down"
        return "engine is not running"

    # ------------------------------------------------------------- core side

    def _on_message(self, message: CoreMessage) -> None:
        """On the client's thread: one message of the core."""
        if isinstance(message, StepOutputs):
            with self._lock:
                outputs, stopped = self._process(message)
            self._dispatch(outputs)
            if stopped:
                self._client.send(FinishRequests(stopped, stopped=True))
        elif isinstance(message, StepScheduled):
            with self._lock:
                self._num_pending_adds = max(0, self._num_pending_adds - message.num_added)
                self._num_waiting = message.num_waiting
                self.metrics.observe_iteration_tokens(message.num_scheduled_tokens)
                for request_id in message.first_scheduled:
                    choice = self._choices.get(request_id)
                    if choice is not None:
                        choice.first_scheduled_time = message.step_start
                        self.metrics.observe_queue_time(
                            message.step_start - choice.arrival_time, choice.priority,
                            choice.tenant,
                        )
        elif isinstance(message, SnapshotReply):
            with self._lock:
                future = self._snapshots.pop(message.query_id, None)
            if future is not None and not future.done():
                future.set_result(message.state)

    def _process(
        self, message: StepOutputs
    ) -> tuple[list[tuple[RequestStream, RequestOutput]], list[str]]:
        """Detokenize, apply stop strings and update the metrics of one step; returns the
        outputs to deliver and the ids of requests a stop string finished."""
        now = time.monotonic()
        self._num_pending_adds = max(0, self._num_pending_adds - message.num_added)
        outputs: list[tuple[RequestStream, RequestOutput]] = []
        stopped: list[str] = []
        num_tokens = 0
        tokens_by_tenant: dict[str, int] = {}
        for delta in message.deltas:
            choice = self._choices.get(delta.request_id)
            if choice is None:
                continue  # aborted or stopped here already
            if delta.error is not None:
                outputs.append((choice.stream, self._output(
                    choice, "", [], None, None, error=delta.error,
                    error_status=delta.error_status)))
                self._forget(choice, "abort", now)
                continue
            new_ids = delta.new_token_ids
            if new_ids:
                num_tokens += len(new_ids)
                tokens_by_tenant[choice.tenant] = tokens_by_tenant.get(choice.tenant, 0) + len(
                    new_ids
                )
                self._observe_tokens(choice, len(new_ids), now)
            text_delta = choice.detokenizer.step(new_ids)
            text, finish_reason = text_delta.text, None
            if text_delta.stopped:
                if delta.finish_reason is None:
                    stopped.append(choice.request_id)
                finish_reason = "stop"
            elif delta.finish_reason is not None:
                text += choice.detokenizer.flush()
                finish_reason = delta.finish_reason
            prompt_logprobs = delta.prompt_logprobs
            if prompt_logprobs is not None:
                choice.prompt.prompt_logprobs = prompt_logprobs
            elif delta.shares_prompt_logprobs:
                prompt_logprobs = choice.prompt.prompt_logprobs
            output = self._output(choice, text, new_ids, delta.logprobs, finish_reason,
                                  num_preemptions=delta.num_preemptions,
                                  num_cached_tokens=delta.num_cached_tokens,
                                  prompt_logprobs=prompt_logprobs)
            output = self._hold_back(choice, output)
            if output is not None:
                outputs.append((choice.stream, output))
            if finish_reason is not None:
                self._forget(choice, finish_reason, now)
        self.metrics.inc_generation_tokens(num_tokens, tokens_by_tenant)  # once per step
        self._record_stats(message.stats)
        return outputs, stopped

    def _hold_back(self, choice: _Choice, output: RequestOutput) -> RequestOutput | None:
        """--stream-interval: the output to send now, or None while it is held back."""
        if self.stream_interval == 1:
            return output
        if choice.held is not None:
            output = choice.held.merged(output)
            choice.held = None
        first = output.num_output_tokens == len(output.token_ids)
        if output.finished or first or len(output.token_ids) >= self.stream_interval:
            return output
        choice.held = output
        return None

    def _dispatch(self, outputs: list[tuple[RequestStream, RequestOutput]]) -> None:
        """One wakeup per event loop (one loop serves the HTTP app) for a step's outputs."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for stream, output in outputs:
            by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:
                pass  # the handler's event loop is gone (shutdown): nobody is listening

    def _observe_tokens(self, choice: _Choice, num_new: int, now: float) -> None:
        if choice.last_token_time is None:
            choice.first_token_time = now
            self.metrics.observe_ttft(now - choice.arrival_time, choice.priority)
            self.metrics.inc_prompt_tokens(choice.num_prompt_tokens, choice.tenant)
        else:
            self.metrics.observe_inter_token_latency(now - choice.last_token_time)
        choice.last_token_time = now
        choice.num_output_tokens += num_new

    def _output(
        self,
        choice: _Choice,
        text: str,
        token_ids: list[int],
        logprobs: list[SampleLogprobs] | None,
        finish_reason: str | None,
        *,
        error: str | None = None,
        error_status: int = 500,
        num_preemptions: int | None = None,
        num_cached_tokens: int = 0,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> RequestOutput:
        held = choice.held
        if num_preemptions is None:
            num_preemptions = held.num_preemptions if held is not None else 0
        return RequestOutput(
            index=choice.index,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish_reason,
            num_preemptions=num_preemptions,
            num_output_tokens=choice.num_output_tokens,
            num_cached_tokens=num_cached_tokens,
            error=error,
            error_status=error_status,
            prompt_logprobs=prompt_logprobs,
        )

    def _end_choices(self, request_ids: list[str], finish_reason: str) -> None:
        """Under the lock: finish these choices here (the core is told by the caller)."""
        now = time.monotonic()
        outputs = []
        for request_id in request_ids:
            choice = self._choices.get(request_id)
            if choice is None:
                continue
            output = self._output(choice, "", [], None, finish_reason)
            if choice.held is not None:
                output = choice.held.merged(output)
                choice.held = None
            outputs.append((choice.stream, output))
            self._forget(choice, finish_reason, now)
        self._dispatch(outputs)

    def _forget(self, choice: _Choice, finish_reason: str | None, now: float) -> None:
        """Drop a finished choice; count it in the metrics unless `finish_reason` is None."""
        del self._choices[choice.request_id]
        group = self._groups.get(choice.group_id)
        if group is not None:
            group.discard(choice.request_id)
            if not group:
                del self._groups[choice.group_id]
                on_done = self._on_done.pop(choice.group_id, None)
                if on_done is not None:
                    on_done()
        if finish_reason is not None:
            self.metrics.inc_request_success(finish_reason, choice.tenant)
            self.metrics.observe_e2e_latency(now - choice.arrival_time)
            first_token, first_scheduled = choice.first_token_time, choice.first_scheduled_time
            self.metrics.observe_request_phases(
                first_token - first_scheduled
                if first_token is not None and first_scheduled is not None
                else None,
                now - first_token if first_token is not None else None,
            )

    def _record_stats(self, stats: SchedulerStats | None) -> None:
        """The core's stats, when they changed (None: those of its last message)."""
        if stats is None:
            return
        seen = self._stats
        metrics = self.metrics
        metrics.inc_preemptions(stats.num_preemptions_total - seen.num_preemptions_total)
        metrics.inc_prefix_cache(
            stats.prefix_cache_queries_tokens - seen.prefix_cache_queries_tokens,
            stats.prefix_cache_hits_tokens - seen.prefix_cache_hits_tokens,
        )
        metrics.set_scheduler_gauges(stats.num_running, stats.num_waiting, stats.kv_cache_usage)
        seen_preemptions = seen.num_preemptions_by_priority
        metrics.set_priority_stats(
            stats.num_waiting_by_priority,
            stats.num_running_by_priority,
            {p: n - seen_preemptions.get(p, 0)
             for p, n in stats.num_preemptions_by_priority.items()},
        )
        self._stats = stats
        self._num_waiting = stats.num_waiting

    def _on_death(self, reason: str) -> None:
        """On the client's thread: the core is gone; fail everything pending."""
        logger.error("the engine core died: %s", reason)
        self._dead = f"engine core died: {reason}"
        self._fail_all(self._dead)

    def _fail_all(self, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            outputs = [
                (choice.stream, self._output(choice, "", [], None, None, error=reason))
                for choice in self._choices.values()
            ]
            for choice in list(self._choices.values()):
                self._forget(choice, None, now)
            snapshots = list(self._snapshots.values())
            self._snapshots.clear()
            self._num_pending_adds = 0
        self._dispatch(outputs)
        for future in snapshots:
            if not future.done():
                future.set_exception(EngineDeadError(reason))


class EngineStart:
    """An engine whose core process `start_engine` started and is loading: `wait` for
    it, or `cancel` it. Data parallelism starts every core first and waits after, so
    that they load at once."""

    def __init__(self, client: ProcessCoreClient, tokenizer: Any, step_timeout_s: float | None,
                 stream_interval: int, ready_timeout_s: float) -> None:
        self._client = client
        self._tokenizer = tokenizer
        self._step_timeout_s = step_timeout_s
        self._stream_interval = stream_interval
        self._ready_timeout_s = ready_timeout_s

    def wait(
        self, metrics_factory: Callable[[str], ServerMetrics] = ServerMetrics
    ) -> Engine:
        """The engine, started, once the core is ready (`metrics_factory`: the metrics
        for the served model's name). Raises what `create_engine` raises."""
        core_info = self._client.wait_ready(self._ready_timeout_s)
        grammar_tokenizer = None
        if core_info.structured_outputs:  # the core read this tokenizer: so can we
            grammar_tokenizer = build_ll_tokenizer(self._tokenizer, core_info.vocab_size,
                                                   core_info.eos_token_ids)
        info = EngineInfo(
            model_name=core_info.model_name,
            max_model_len=core_info.max_model_len,
            vocab_size=core_info.vocab_size,
            policy=core_info.policy,
            tokenizer=self._tokenizer,
            eos_token_ids=frozenset(core_info.eos_token_ids),
            structured_outputs=core_info.structured_outputs,
            grammar_tokenizer=grammar_tokenizer,
        )
        engine = Engine(self._client, info, step_timeout_s=self._step_timeout_s,
                        stream_interval=self._stream_interval,
                        metrics=metrics_factory(info.model_name))
        engine.start()
        return engine

    def cancel(self) -> None:
        """Stop the core without waiting for it."""
        self._client.kill()


def start_engine(
    model_config: ModelConfig,
    scheduler_config: SchedulerConfig,
    *,
    enable_prefix_caching: bool = True,
    served_model_name: str | None = None,
    step_timeout_s: float | None = None,
    simulate_step_ms: float | None = None,
    stream_interval: int = 1,
    ready_timeout_s: float = 600.0,
    log_level: str = "info",
    core_name: str = "core",
    num_threads: int | None = None,
    grammar_step_timeout_s: float | None = None,
) -> EngineStart:
    """Start the engine core in its own process (it loads the model, sizes the KV cache
    and builds the matching scheduler; see `build_core_parts`); `EngineStart.wait` gives
    the engine once the core is ready.

    The tokenizer is loaded here, before the core starts (so a GGUF is converted once).
    `core_name` and `num_threads` are for data parallelism (engine/data_parallel.py);
    `grammar_step_timeout_s` is the steps' grammar-mask deadline (--grammar-step-timeout-s).
    NOTE: call it on the thread that will outlive the core (the main thread): the core
    dies with the thread that started it (PR_SET_PDEATHSIG).
    """
    spec = load_model_spec(model_config)
    client = ProcessCoreClient(CoreConfig(
        model_config, scheduler_config, enable_prefix_caching, served_model_name,
        simulate_step_ms, log_level, num_threads, core_name, grammar_step_timeout_s,
    ))
    return EngineStart(client, spec.tokenizer, step_timeout_s, stream_interval,
                       ready_timeout_s)


def create_engine(model_config: ModelConfig, scheduler_config: SchedulerConfig,
                  **options: Any) -> Engine:
    """`start_engine(model_config, scheduler_config, **options)`, then wait for it: the
    engine, started, once the core is ready. Loading errors are raised here:
    FileNotFoundError and ValueError as an in-process load raises them, EngineStartError
    when the core crashed or was not ready within `ready_timeout_s`."""
    return start_engine(model_config, scheduler_config, **options).wait()
