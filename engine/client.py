"""The engine in the API process: requests in, text out, over an engine core.

HTTP handlers never touch the scheduler. `EngineClient.add_request` takes one
`EngineRequest` (engine/request.py), registers its choices with the output processor and
sends them to the core as scheduler requests; the core answers with one `StepOutputs`
message per step, which the output processor (engine/output_processor.py) turns into
text, metrics and outputs on the handlers' streams (engine/outputs.py), on the event loop.

The core runs in its own process (`create_engine`, or `start_engine` and
`EngineStart.wait`: engine/core_client.py) or, for the unit tests, on a thread of this
one (`EngineClient.in_process`: engine/in_process.py). If the core dies, every pending
request fails at once and `is_alive` turns False with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from engine.core import EngineCore, Runner
from engine.core_client import ProcessCoreClient
from engine.core_process import CoreConfig
from engine.in_process import InProcessCoreClient
from engine.messages import (
    AddRequests,
    Command,
    CoreMessage,
    FinishRequests,
    SnapshotQuery,
    UpdateLoRA,
)
from engine.metrics import ServerMetrics
from engine.output_processor import CoreDied, OutputProcessor
from engine.outputs import EngineDeadError, RequestStream
from engine.request import EngineRequest
from kvcache.config import CacheConfig
from model_runner.config import ModelConfig
from model_runner.model_source import resolve_model_folder
from model_runner.served_config import read_config_json, served_eos_token_ids
from model_runner.text_tokenizer import load_tokenizer
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler
from structured.compiler import build_ll_tokenizer, fast_tokenizer_json
from structured.matchers import StructuredOutputs

logger = logging.getLogger(__name__)


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
    cache_config: CacheConfig | None = None  # the core's KV pool (None: not told)
    loras: dict[str, str] | None = None  # LoRA adapters served, name -> path (None: off)


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


class EngineClient:
    """Streams outputs of an engine core to HTTP handlers.

    Requests are added, aborted and snapshots taken on the event loop that serves the
    handlers; `abort_all` and `shutdown` work from any thread. A step running longer than
    `step_timeout_s` counts as a hung engine: `is_alive` turns False (so /health and new
    requests get 503) until the step returns. With `stream_interval` N > 1 a choice's
    tokens reach its handler every N tokens (the first and the last are never held back).
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
        self.metrics = metrics or ServerMetrics(info.model_name)
        if info.cache_config is not None:
            self.metrics.set_cache_config(info.cache_config)
        # NOTE: one tokenizer for the handlers' threads and the output processor: it is
        # read-only (model_runner/text_tokenizer.py)
        self._processor = OutputProcessor(info.tokenizer, self.metrics, stream_interval,
                                          client.send)
        self._client = client
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
    ) -> EngineClient:
        """An engine whose core runs on a thread of this process (not started); the
        core's grammar tokenizer is this process's too, its KV pool the scheduler's."""
        info = replace(info, cache_config=scheduler.cache_config)
        if structured is not None:
            info = replace(info, grammar_tokenizer=structured.compiler.tokenizer)
        core = EngineCore(scheduler, runner, info.eos_token_ids, structured=structured)
        return cls(InProcessCoreClient(core), info, metrics, step_timeout_s, stream_interval)

    # ------------------------------------------------------------ state

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
        return self._processor.num_waiting

    def soonest_first_token_s(self) -> float:
        """Seconds to a new request's first token if it went next (step-cost model)."""
        return self._processor.soonest_first_token_s()

    def load(self, priority: int) -> tuple[int, float]:
        """What a request of `priority` would queue behind here: the waiting requests of
        equal or better priority (as of the last step, counting those not yet queued as
        such) and the KV cache's usage (0 to 1)."""
        return self._processor.load(priority)

    def unavailable_reason(self) -> str:
        """Why the engine takes no requests now (meaningful when `is_alive` is False)."""
        if self._dead is not None:
            return self._dead
        if self.is_stalled:
            return f"engine step has run for over {self.step_timeout_s:g} s (--step-timeout-s)"
        if self._stopping:
            return "server is shutting down"
        return "engine is not running"

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start taking outputs from the core (idempotent); on an event loop, serve it."""
        if not self._started:
            self._client.start(self._processor.put, self._on_death)
            self._started = True
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # the output processor starts on the first request's loop
        self._processor.bind()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort whatever is still in flight and stop the core (from any thread)."""
        self._stopping = True
        self.abort_all()
        self._client.shutdown(timeout_s)
        self._processor.close("server is shutting down")

    def _on_death(self, reason: str) -> None:
        """On the client's thread: the core is gone; fail everything pending."""
        logger.error("the engine core died: %s", reason)
        self._dead = f"engine core died: {reason}"
        self._processor.put(CoreDied(self._dead))

    # ------------------------------------------------------------ requests

    def add_request(
        self, request: EngineRequest, on_done: Callable[[], None] | None = None
    ) -> RequestStream:
        """Queue one HTTP request (n choices per prompt, each its own scheduler request);
        returns its stream, to be read on this event loop. `on_done` is called on the
        loop once every choice has ended, however it ended."""
        if not self.is_alive:
            raise EngineDeadError(self.unavailable_reason())
        self._processor.bind()
        stream = self._processor.add(request, on_done)
        self._client.send(AddRequests(request.new_requests()))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort every unfinished choice of a request (e.g. its client went away)."""
        ids = self._processor.abort(request_id)
        if ids:
            self._client.send(FinishRequests(ids))

    def abort_all(self) -> None:
        """Abort every request queued so far (the shutdown's grace period is over); from
        any thread."""
        ids = self._processor.call(self._processor.abort_all)
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
        if self._dead is not None or not client.is_running:
            raise EngineDeadError(self.unavailable_reason())
        self._processor.bind()
        query_id, reply = self._processor.expect_snapshot()
        client.send(SnapshotQuery(query_id, check_integrity))
        try:
            return await asyncio.wait_for(reply, timeout_s)
        except TimeoutError:
            raise EngineDeadError(
                f"the engine core did not answer within {timeout_s:g} s "
                "(a step is running long)"
            ) from None
        finally:
            self._processor.forget_snapshot(query_id)

    async def update_lora(self, name: str, path: str | None) -> str | None:
        """Have the core serve the LoRA adapter in `path` as `name`, or stop serving it
        (`path` None): why not, or None. EngineDeadError when the core is gone."""
        if self._dead is not None or not self._client.is_running:
            raise EngineDeadError(self.unavailable_reason())
        self._processor.bind()
        query_id, reply = self._processor.expect_snapshot()
        self._client.send(UpdateLoRA(query_id, name, path))
        try:
            error: str | None = (await reply)["error"]
            return error
        finally:
            self._processor.forget_snapshot(query_id)


class EngineStart:
    """An engine whose core process `start_engine` started and is loading: `wait` for
    it, or `cancel` it. Data parallelism starts every core first and waits after, so
    that they load at once."""

    def __init__(self, client: ProcessCoreClient, tokenizer: Any, grammar_tokenizer: Any,
                 step_timeout_s: float | None, stream_interval: int,
                 ready_timeout_s: float) -> None:
        self._client = client
        self._tokenizer = tokenizer
        self._grammar_tokenizer = grammar_tokenizer
        self._step_timeout_s = step_timeout_s
        self._stream_interval = stream_interval
        self._ready_timeout_s = ready_timeout_s

    def wait(
        self, metrics_factory: Callable[[str], ServerMetrics] = ServerMetrics
    ) -> EngineClient:
        """The engine, started, once the core is ready (`metrics_factory`: the metrics
        for the served model's name). Raises what `create_engine` raises."""
        core_info = self._client.wait_ready(self._ready_timeout_s)
        # the core read the same tokenizer with the same vocabulary size and EOS ids
        grammar_tokenizer = self._grammar_tokenizer if core_info.structured_outputs else None
        info = EngineInfo(
            model_name=core_info.model_name,
            max_model_len=core_info.max_model_len,
            vocab_size=core_info.vocab_size,
            policy=core_info.policy,
            tokenizer=self._tokenizer,
            eos_token_ids=frozenset(core_info.eos_token_ids),
            structured_outputs=core_info.structured_outputs,
            grammar_tokenizer=grammar_tokenizer,
            cache_config=core_info.cache_config,
            loras=core_info.loras,
        )
        engine = EngineClient(self._client, info, step_timeout_s=self._step_timeout_s,
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

    The tokenizer (and its grammar tokenizer) loads here while the core loads the model,
    from the model's folder alone (no torch or transformers here for a folder with a
    tokenizer.json); a GGUF's config and tokenizer folder is written first, once.
    `core_name` and `num_threads` are for data parallelism (engine/data_parallel.py);
    `grammar_step_timeout_s` is the steps' grammar-mask deadline (--grammar-step-timeout-s).
    NOTE: call it on the thread that will outlive the core (the main thread): the core
    dies with the thread that started it (PR_SET_PDEATHSIG).
    """
    folder, _ = resolve_model_folder(model_config.model)
    client = ProcessCoreClient(CoreConfig(
        model_config, scheduler_config, enable_prefix_caching, served_model_name,
        simulate_step_ms, log_level, num_threads, core_name, grammar_step_timeout_s,
    ))
    try:
        tokenizer = load_tokenizer(folder)
        grammar_tokenizer = _grammar_tokenizer(folder, tokenizer)
    except BaseException:
        client.kill()
        raise
    return EngineStart(client, tokenizer, grammar_tokenizer, step_timeout_s,
                       stream_interval, ready_timeout_s)


def _grammar_tokenizer(folder: Path, tokenizer: Any) -> Any:
    """llguidance's tokenizer of the model in `folder`, for the grammars compiled in this
    process (the vocabulary size and EOS ids the core reads); None where llguidance cannot
    read it (the core then turns structured outputs off)."""
    config = read_config_json(folder)
    eos_token_ids = served_eos_token_ids(folder, config, tokenizer.eos_token_id)
    try:
        return build_ll_tokenizer(fast_tokenizer_json(tokenizer), int(config["vocab_size"]),
                                  sorted(eos_token_ids))
    except (ValueError, KeyError):
        return None


def create_engine(model_config: ModelConfig, scheduler_config: SchedulerConfig,
                  **options: Any) -> EngineClient:
    """`start_engine(model_config, scheduler_config, **options)`, then wait for it: the
    engine, started, once the core is ready. Loading errors are raised here:
    FileNotFoundError and ValueError as an in-process load raises them, EngineStartError
    when the core crashed or was not ready within `ready_timeout_s`."""
    return start_engine(model_config, scheduler_config, **options).wait()
