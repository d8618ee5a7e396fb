"""The engine core in its own process, and the API process's client of it.

`ProcessCoreClient` starts the core with the `spawn` method (never fork: CUDA may be
initialised) and binds two pyzmq `ipc://` sockets in a private temp dir (commands out,
messages in, msgpack-encoded by msgspec); `wait_ready` waits for the core's `Ready` (or
its `LoadFailed`, raised as the same exception as an in-process load) within a timeout,
so that several cores (data parallelism) load at once. A receiver thread reads the
core's messages and hands them to the engine front end; when the core process is gone
(crash, SIGKILL, OOM) it reports the death within ~0.1 s.

`core_main` is the core process: it dies with the API process (PR_SET_PDEATHSIG, plus a
parent check while idle), ignores SIGINT (the API process drains, then sends
`Shutdown`), loads the model on its main thread and runs `run_core_loop` there.
NOTE: the model runs on the thread that loaded it. Run on a second thread after the
loading thread had opened OpenMP parallel regions, a CPU decode step was ~40% slower.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from engine.messages import (
    Command,
    CoreInfo,
    CoreMessage,
    LoadFailed,
    Ready,
    Shutdown,
    command_decoder,
    command_encoder,
    output_decoder,
    output_encoder,
)
from model_runner.config import ModelConfig
from model_runner.distributed.tp_workers import WORKER_DIED_EXIT_CODE
from model_runner.process_lifetime import die_with_parent
from scheduler.config import SchedulerConfig

logger = logging.getLogger(__name__)

_POLL_MS = 100  # the receiver notices a dead core within this
_PARENT_CHECK_MS = 1000  # an idle core checks its parent this often
_LOAD_ERRORS: dict[str, type[Exception]] = {
    "FileNotFoundError": FileNotFoundError, "ValueError": ValueError,
}


class EngineStartError(RuntimeError):
    """The core process did not become ready (it crashed, or the timeout ran out)."""


@dataclass(frozen=True)
class CoreConfig:
    """Everything the core process needs to build itself (picklable, for `spawn`)."""

    model: ModelConfig
    scheduler: SchedulerConfig
    enable_prefix_caching: bool = True
    served_model_name: str | None = None
    simulate_step_ms: float | None = None
    log_level: str = "info"
    num_threads: int | None = None  # torch's CPU threads (None: its default)
    name: str = "core"  # in the core's log lines (data parallelism: core0, core1, ...)
    grammar_step_timeout_s: float | None = None  # the steps' grammar-mask deadline


class ProcessCoreClient:
    """The API process's end of a core process."""

    def __init__(self, config: CoreConfig) -> None:
        """Start the core process (loading; `wait_ready` waits for it)."""
        context = multiprocessing.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="pagedserve-core-")
        commands_path, outputs_path = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._zmq = zmq.Context()
        self._commands = self._zmq.socket(zmq.PUSH)
        # NOTE: no high-water mark, so that a send to a live core never blocks the event
        # loop (a burst of requests during a long step); sends are NOBLOCK, so that one to
        # a dead core (no peer: a PUSH would block forever) is dropped instead.
        self._commands.setsockopt(zmq.SNDHWM, 0)
        self._commands.bind(commands_path)
        self._outputs = self._zmq.socket(zmq.PULL)
        self._outputs.bind(outputs_path)
        self._send_lock = threading.Lock()  # zmq sockets are not thread-safe
        self._clock = context.Value("d", 0.0, lock=False)
        self._stopping = False
        self._closed = False
        self._receiver: threading.Thread | None = None
        self.process = context.Process(
            target=core_main, name=f"pagedserve-{config.name}", daemon=True,
            args=(config, commands_path, outputs_path, self._clock, os.getpid()),
        )
        self.process.start()

    def wait_ready(self, timeout_s: float = 600.0) -> CoreInfo:
        """Wait for the core's `Ready` and return its info; on a load error, a crash or
        the timeout, stop the core and raise (see the module docstring)."""
        try:
            return self._wait_ready(timeout_s)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout_s: float) -> CoreInfo:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._outputs.poll(_POLL_MS):
                message = output_decoder.decode(self._outputs.recv())
                if isinstance(message, Ready):
                    return message.info
                if isinstance(message, LoadFailed):
                    raise _LOAD_ERRORS.get(message.kind, EngineStartError)(message.message)
            elif self.process.exitcode is not None:
                raise EngineStartError(
                    f"the engine core exited with code {self.process.exitcode} while loading"
                )
        raise EngineStartError(f"the engine core was not ready within {timeout_s:g} s")

    @property
    def step_started(self) -> float:
        """Monotonic start of the core's running step, 0.0 between steps."""
        return float(self._clock.value)

    @property
    def is_running(self) -> bool:
        return self.process.exitcode is None

    def start(
        self, on_message: Callable[[CoreMessage], None], on_death: Callable[[str], None]
    ) -> None:
        """Start the receiver thread (idempotent)."""
        if self._receiver is None:
            self._receiver = threading.Thread(
                target=self._receive, args=(on_message, on_death), name="core-receiver",
                daemon=True,
            )
            self._receiver.start()

    def send(self, command: Command) -> None:
        """Thread-safe; never blocks; a no-op once the client is closed or the core is
        gone."""
        data = command_encoder.encode(command)
        with self._send_lock:
            if self._closed:
                return
            try:
                self._commands.send(data, zmq.NOBLOCK)
            except zmq.Again:  # no core to take it: it died (the receiver reports that)
                logger.warning("the engine core is gone; dropped %s", type(command).__name__)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core (it aborts what is left), wait for it, release the sockets."""
        if not self._stopping and self.is_running:
            self._stopping = True
            self.send(Shutdown())
        self._stopping = True
        self.process.join(timeout_s)
        if self._receiver is not None:
            self._receiver.join(timeout_s)
        self.kill()

    def kill(self) -> None:
        """Stop the core at once (SIGKILL, if it still runs) and release the sockets."""
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(5)
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
        if self._receiver is not None and self._receiver is not threading.current_thread():
            self._receiver.join(5)
        self._commands.close(linger=0)
        self._outputs.close(linger=0)
        self._zmq.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _receive(
        self, on_message: Callable[[CoreMessage], None], on_death: Callable[[str], None]
    ) -> None:
        while True:
            if self._outputs.poll(_POLL_MS):
                while True:
                    try:
                        data = self._outputs.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    on_message(output_decoder.decode(data))
            elif self.process.exitcode is not None:
                if not self._stopping or self.process.exitcode != 0:
                    on_death(_exit_reason(self.process.exitcode))
                return


def _exit_reason(exitcode: int) -> str:
    if exitcode == WORKER_DIED_EXIT_CODE:
        return "a tensor-parallel worker process died (the engine core exited)"
    if exitcode < 0:
        return f"the engine core process was killed by {signal.Signals(-exitcode).name}"
    return f"the engine core process exited with code {exitcode}"


# ------------------------------------------------------------------ core process


def freeze_startup_objects() -> None:
    """Leave what start-up made (modules, tokenizer, model objects) out of the garbage
    collector's full passes. NOTE: each full pass walks every tracked object; with the
    hundreds of thousands start-up leaves, a request that allocates much (a body of 10,000
    tools) paid ~0.2 s of them on the event loop, every stream with it (vLLM freezes too)."""
    gc.collect()
    gc.freeze()


def core_main(
    config: CoreConfig, commands_path: str, outputs_path: str, clock: Any, parent_pid: int
) -> None:
    """The core process's entry point (see the module docstring)."""
    die_with_parent(parent_pid)
    # NOTE: Ctrl-C reaches the whole process group; the API process drains, then stops
    # the core. SIGTERM keeps its default: multiprocessing's exit handler terminates
    # (SIGTERM) then joins a child left over, which must not hang.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s [{config.name}]: %(message)s",
    )
    if config.num_threads is not None:
        import torch

        torch.set_num_threads(config.num_threads)
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(commands_path)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(outputs_path)

    def send(message: CoreMessage) -> None:
        outputs.send(output_encoder.encode(message))

    from engine.core import EngineCore, run_core_loop
    from engine.core_setup import build_core_parts

    try:
        scheduler, runner, info, structured = build_core_parts(
            config.model, config.scheduler, enable_prefix_caching=config.enable_prefix_caching,
            served_model_name=config.served_model_name,
            simulate_step_ms=config.simulate_step_ms,
            grammar_step_timeout_s=config.grammar_step_timeout_s,
        )
    except Exception as exc:
        send(LoadFailed(type(exc).__name__, str(exc)))
        outputs.close(linger=5000)
        sys.exit(1)
    send(Ready(info))
    freeze_startup_objects()
    core = EngineCore(scheduler, runner, frozenset(info.eos_token_ids), clock, structured)

    def receive(timeout_s: float | None) -> list[Command]:
        while timeout_s is None and not commands.poll(_PARENT_CHECK_MS):
            if os.getppid() != parent_pid:
                logger.error("the API process is gone; the engine core exits")
                sys.exit(1)
        if timeout_s is not None and not commands.poll(int(timeout_s * 1000)):
            return []
        received = []
        while True:
            try:
                received.append(command_decoder.decode(commands.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return received

    try:
        run_core_loop(core, receive, send)
    except BaseException:
        logger.exception("the engine core loop died")
        os._exit(1)
    outputs.close(linger=5000)
    commands.close(linger=0)
    context.term()
