"""The output processor: the core's messages turned into each handler's outputs, on the
API process's event loop.

One asyncio task owns every choice's state: it turns a step's new tokens into text
(incremental detokenization, stop strings: a match finishes the request in the core),
holds a choice's tokens back for --stream-interval, records the metrics and pushes each
output to its handler's stream. The core client's thread only hands it each message
(`put`: at most one event-loop wakeup per message, one for all that arrive before the
task reads them); requests join and leave on the same loop (`add`, `abort`), so nothing
takes a lock.

The task runs on the loop that first adds a request or starts the engine; once that loop
has stopped, the next one takes over (tests run one `asyncio.run` after another), and
messages wait in the inbox meanwhile. From another thread, `call` runs a function on the
loop and waits for it (shutdown, the grace period's aborts).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.detokenizer import IncrementalDetokenizer, Tokenizer
from engine.messages import (
    Command,
    CoreMessage,
    FinishRequests,
    RequestDelta,
    SnapshotReply,
    StepOutputs,
    StepScheduled,
)
from engine.metrics import ServerMetrics
from engine.outputs import EngineDeadError, RequestOutput, RequestStream, slo_verdict
from engine.request import EngineRequest
from scheduler.introspection import SchedulerStats
from scheduler.output import PromptLogprobs, SampleLogprobs
from scheduler.speculation import SpecDecodeStats

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

@dataclass(frozen=True)
class CoreDied:
    """Put after the core's last message: every pending request fails with `reason`."""

    reason: str


@dataclass
class _Prompt:
    """What the choices of one prompt share: its prompt logprobs, which the core sends
    once, with the first of those choices to get tokens."""

    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class _Choice:
    """The state of one scheduler request (one choice of an HTTP request)."""

    request_id: str  # the scheduler's
    request: EngineRequest
    index: int
    stream: RequestStream
    num_prompt_tokens: int
    detokenizer: IncrementalDetokenizer
    prompt: _Prompt
    num_output_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    held: RequestOutput | None = None  # output held back by --stream-interval


class OutputProcessor:
    """Every pending choice of an engine, and the scheduler's figures as of its last step.

    `send` takes commands to the core (the requests a stop string finished). Every method
    but `put` and `call` runs on the event loop."""

    def __init__(self, tokenizer: Tokenizer, metrics: ServerMetrics, stream_interval: int,
                 send: Callable[[Command], None]) -> None:
        self.metrics = metrics
        self.stream_interval = stream_interval
        self._tokenizer = tokenizer
        self._send = send
        self._choices: dict[str, _Choice] = {}  # by scheduler id
        self._groups: dict[str, set[str]] = {}  # HTTP request id -> its pending choices
        self._on_done: dict[str, Callable[[], None]] = {}  # by HTTP request id, see add
        self._snapshots: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._query_ids = itertools.count()
        self._num_pending_adds = 0  # choices the core has not taken in yet
        self._num_waiting = 0
        self._stats = SchedulerStats()  # none yet: all zero
        self._inbox: deque[CoreMessage | CoreDied] = deque()
        self._binding: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._waking = False  # a wakeup is on its way to the task (see put)
        self._task: asyncio.Task[None] | None = None  # NOTE: the loop holds it weakly

    # ------------------------------------------------------------ the event loop

    def bind(self) -> None:
        """On an event loop: the task runs there from now on (it runs on one loop at a
        time: another may take over only once the previous one stopped)."""
        loop = asyncio.get_running_loop()
        if self._binding is not None:
            bound = self._binding[0]
            if bound is loop:
                return
            if bound.is_running():
                raise RuntimeError("the engine serves another event loop")
        wakeup = asyncio.Event()
        self._binding = (loop, wakeup)
        self._waking = False  # one sent to the previous loop is lost
        self._task = loop.create_task(self._run(wakeup), name="output-processor")
        if self._inbox:
            wakeup.set()

    def put(self, item: CoreMessage | CoreDied) -> None:
        """From any thread (the core client's): a message of the core, or its death."""
        self._inbox.append(item)
        # NOTE: no wakeup while one is on its way: the task clears `_waking` before it
        # reads the inbox, so it reads this item too (a step's two messages, one wakeup
        # when the loop is busy).
        binding = self._binding
        if binding is None or self._waking:
            return
        self._waking = True
        try:
            binding[0].call_soon_threadsafe(binding[1].set)
        except RuntimeError:
            self._waking = False  # that loop is closed: the next loop's task reads the inbox

    def call(self, fn: Callable[[], _T]) -> _T:
        """`fn()` from any thread: on the event loop while it runs on another thread
        (waiting for it), here otherwise."""
        loop = self._binding[0] if self._binding is not None else None
        if loop is None or not loop.is_running() or _running_loop() is loop:
            return fn()

        async def on_loop() -> _T:
            return fn()

        return asyncio.run_coroutine_threadsafe(on_loop(), loop).result()

    def close(self, reason: str) -> None:
        """From any thread, once the core has stopped: its last messages, then every
        request and snapshot still pending fails with `reason`."""

        def close_here() -> None:
            self._drain()
            self.fail_all(reason)

        self.call(close_here)

    async def _run(self, wakeup: asyncio.Event) -> None:
        while True:
            await wakeup.wait()
            wakeup.clear()
            self._waking = False
            try:
                self._drain()
            except Exception:  # a bug here must not leave every stream waiting forever
                logger.exception("the output processor failed")
                ids = list(self._choices)
                self.fail_all("the engine's output processing failed")
                self._send(FinishRequests(ids))

    def _drain(self) -> None:
        inbox = self._inbox
        while inbox:
            item = inbox.popleft()
            if isinstance(item, StepOutputs):
                self._on_outputs(item)
            elif isinstance(item, StepScheduled):
                self._on_scheduled(item)
            elif isinstance(item, SnapshotReply):
                future = self._snapshots.pop(item.query_id, None)
                if future is not None and not future.done():
                    future.set_result(item.state)
            elif isinstance(item, CoreDied):
                self.fail_all(item.reason)

    # ------------------------------------------------------------ requests

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a seat (as of the last step) plus those not yet queued."""
        return self._num_waiting + self._num_pending_adds

    def soonest_first_token_s(self) -> float:
        """The predicted step of a new one-token prompt beside the running batch (the
        fitted step-cost model as of the last step; 0 before any)."""
        stats = self._stats
        fixed, per_decode, per_prefill, *_ = stats.step_cost
        return fixed + per_decode * stats.num_running + per_prefill

    def load(self, priority: int) -> tuple[int, float]:
        """What a request of `priority` would queue behind: the waiting requests of equal
        or better priority (as of the last step, counting those not yet queued as such)
        and the KV cache's usage (0 to 1)."""
        stats = self._stats
        ahead = sum(n for p, n in stats.num_waiting_by_priority.items() if p <= priority)
        return ahead + self._num_pending_adds, stats.kv_cache_usage

    def add(self, request: EngineRequest, on_done: Callable[[], None] | None) -> RequestStream:
        """The choices of `request` join (the caller sends them to the core); `on_done` is
        called once every choice has ended, however it ended."""
        stream = RequestStream(request.request_id, request.num_choices)
        group: set[str] = set()
        for p, prompt in enumerate(request.prompts):
            shared = _Prompt()
            for i in range(request.n):
                index = p * request.n + i
                detokenizer = IncrementalDetokenizer(
                    self._tokenizer, prompt, request.stop, request.skip_special_tokens,
                    request.include_stop_str_in_output,
                )
                choice = _Choice(request.choice_id(index), request, index, stream, len(prompt),
                                 detokenizer, shared)
                self._choices[choice.request_id] = choice
                group.add(choice.request_id)
        self._groups[request.request_id] = group
        if on_done is not None:
            self._on_done[request.request_id] = on_done
        self._num_pending_adds += len(group)
        return stream

    def abort(self, request_id: str) -> list[str]:
        """Every pending choice of a request ends with "abort"; returns their scheduler ids
        (the caller tells the core)."""
        ids = list(self._groups.get(request_id, ()))
        self._abort(ids)
        return ids

    def abort_all(self) -> list[str]:
        """`abort` for every pending request."""
        ids = list(self._choices)
        self._abort(ids)
        return ids

    def expect_snapshot(self) -> tuple[int, asyncio.Future[dict[str, Any]]]:
        """A new query's id and the future of the core's reply."""
        query_id = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        self._snapshots[query_id] = future
        return query_id, future

    def forget_snapshot(self, query_id: int) -> None:
        self._snapshots.pop(query_id, None)

    def fail_all(self, reason: str) -> None:
        """Every pending request and snapshot fails at once (the core died or stopped)."""
        now = time.monotonic()
        for choice in list(self._choices.values()):
            choice.stream.push(self._output(choice, "", [], None, None, error=reason))
            self._forget(choice, None, now)
        for future in self._snapshots.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._snapshots.clear()
        self._num_pending_adds = 0

    def _abort(self, request_ids: list[str]) -> None:
        now = time.monotonic()
        for request_id in request_ids:
            choice = self._choices[request_id]
            output = self._output(choice, "", [], None, "abort")
            if choice.held is not None:
                output = choice.held.merged(output)
                choice.held = None
            choice.stream.push(output)
            self._forget(choice, "abort", now)

    # ------------------------------------------------------------ core messages

    def _on_scheduled(self, message: StepScheduled) -> None:
        self._num_pending_adds = max(0, self._num_pending_adds - message.num_added)
        self._num_waiting = message.num_waiting
        self.metrics.observe_iteration_tokens(message.num_scheduled_tokens)
        for request_id in message.first_scheduled:
            choice = self._choices.get(request_id)
            if choice is not None:
                choice.first_scheduled_time = message.step_start
                request = choice.request
                self.metrics.observe_queue_time(message.step_start - request.arrival_time,
                                                request.placement.priority,
                                                request.placement.tenant)

    def _on_outputs(self, message: StepOutputs) -> None:
        """One step: text, finishes and metrics of each request it advanced; the requests
        a stop string finished here are finished in the core."""
        now = time.monotonic()
        self._num_pending_adds = max(0, self._num_pending_adds - message.num_added)
        stopped: list[str] = []
        num_tokens = 0
        tokens_by_tenant: dict[str, int] = {}
        for delta in message.deltas:
            choice = self._choices.get(delta.request_id)
            if choice is None:
                continue  # aborted or stopped here already
            if delta.error is not None:
                choice.stream.push(self._output(choice, "", [], None, None, error=delta.error,
                                                error_status=delta.error_status))
                self._forget(choice, "abort", now)
                continue
            num_new = len(delta.new_token_ids)
            if num_new:
                num_tokens += num_new
                tenant = choice.request.placement.tenant
                tokens_by_tenant[tenant] = tokens_by_tenant.get(tenant, 0) + num_new
                self._observe_tokens(choice, num_new, now)
            if self._on_delta(choice, delta, now):
                stopped.append(choice.request_id)
        self.metrics.inc_generation_tokens(num_tokens, tokens_by_tenant)  # once per step
        self._record_stats(message.stats)
        if stopped:
            self._send(FinishRequests(stopped, stopped=True))

    def _on_delta(self, choice: _Choice, delta: RequestDelta, now: float) -> bool:
        """A choice's new text (and end) to its stream; True when a stop string ended it
        here, not in the core."""
        text_delta = choice.detokenizer.step(delta.new_token_ids)
        text, finish_reason = text_delta.text, delta.finish_reason
        if text_delta.stopped:
            finish_reason = "stop"
        elif finish_reason is not None:
            text += choice.detokenizer.flush()
        prompt_logprobs = delta.prompt_logprobs
        if prompt_logprobs is not None:
            choice.prompt.prompt_logprobs = prompt_logprobs
        elif delta.shares_prompt_logprobs:
            prompt_logprobs = choice.prompt.prompt_logprobs
        verdict = None
        if finish_reason in ("stop", "length"):
            verdict = slo_verdict(choice.request.placement, choice.first_token_time,
                                  choice.last_token_time, choice.num_output_tokens)
        output = self._hold_back(choice, self._output(
            choice, text, delta.new_token_ids, delta.logprobs, finish_reason,
            num_preemptions=delta.num_preemptions, num_cached_tokens=delta.num_cached_tokens,
            prompt_logprobs=prompt_logprobs, slo=verdict,
        ))
        if output is not None:
            choice.stream.push(output)
        if finish_reason is not None:
            self._forget(choice, finish_reason, now, verdict)
        return text_delta.stopped and delta.finish_reason is None

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

    def _observe_tokens(self, choice: _Choice, num_new: int, now: float) -> None:
        if choice.last_token_time is None:
            choice.first_token_time = now
            placement = choice.request.placement
            self.metrics.observe_ttft(now - choice.request.arrival_time, placement.priority)
            self.metrics.inc_prompt_tokens(choice.num_prompt_tokens, placement.tenant)
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
        slo: dict[str, bool] | None = None,
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
            slo=slo,
        )

    def _forget(self, choice: _Choice, finish_reason: str | None, now: float,
                verdict: dict[str, bool] | None = None) -> None:
        """Drop an ended choice; count it in the metrics unless `finish_reason` is None
        (with `verdict`, its latency targets met or missed)."""
        del self._choices[choice.request_id]
        group_id = choice.request.request_id
        group = self._groups.get(group_id)
        if group is not None:
            group.discard(choice.request_id)
            if not group:
                del self._groups[group_id]
                on_done = self._on_done.pop(group_id, None)
                if on_done is not None:
                    on_done()
        placement = choice.request.placement
        if finish_reason == "rejected":
            self.metrics.inc_slo_refused(placement.priority, placement.tenant)
        elif finish_reason in ("stop", "length"):
            self.metrics.observe_slo(placement.priority, placement.tenant, verdict)
        if finish_reason is not None:
            self.metrics.inc_request_success(finish_reason, placement.tenant)
            if placement.lora_name is not None:
                self.metrics.inc_lora_request(placement.lora_name, finish_reason)
            self.metrics.observe_e2e_latency(now - choice.request.arrival_time)
            first_token, first_scheduled = choice.first_token_time, choice.first_scheduled_time
            self.metrics.observe_request_phases(
                first_token - first_scheduled
                if first_token is not None and first_scheduled is not None
                else None,
                now - first_token if first_token is not None else None,
            )

    def _record_stats(self, stats: SchedulerStats | None) -> None:
        """The scheduler's counters and gauges (None: unchanged since the last ones)."""
        if stats is None:
            return
        seen, metrics = self._stats, self.metrics
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
        metrics.set_step_cost(stats.step_cost,
                              stats.num_steps_over_tpot - seen.num_steps_over_tpot)
        if stats.spec_decode is not None:
            metrics.inc_spec_decode(stats.spec_decode, seen.spec_decode or SpecDecodeStats())
        if stats.max_loras:
            metrics.set_lora_info(stats.max_loras, stats.running_loras, stats.waiting_loras)
        self._stats = stats
        self._num_waiting = stats.num_waiting


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
