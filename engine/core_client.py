"""The API process's client of the engine core process (engine/core_process.py).

`ProcessCoreClient` starts the core with the `spawn` method (never fork: CUDA may be
initialised) and binds two pyzmq `ipc://` sockets in a private temp dir (commands out,
messages in, msgpack-encoded by msgspec); `wait_ready` waits for the core's `Ready` (or
its `LoadFailed`, raised as the same exception as an in-process load) within a timeout,
so that several cores (data parallelism) load at once. A receiver thread reads the
core's messages and hands them to the engine front end; when the core process is gone
(crash, SIGKILL, OOM) it reports the death within ~0.1 s.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable

import zmq

from engine.core_process import CoreConfig, core_main
from engine.messages import (
    Command,
    CoreInfo,
    CoreMessage,
    LoadFailed,
    Ready,
    Shutdown,
    command_encoder,
    output_decoder,
)
from model_runner.process_lifetime import WORKER_DIED_EXIT_CODE

logger = logging.getLogger(__name__)

_POLL_MS = 100  # the receiver notices a dead core within this
_LOAD_ERRORS: dict[str, type[Exception]] = {
    "FileNotFoundError": FileNotFoundError, "ValueError": ValueError,
}


class EngineStartError(RuntimeError):
    """The core process did not become ready (it crashed, or the timeout ran out)."""


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
        _start_without_main(self.process)

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


def _start_without_main(process: multiprocessing.process.BaseProcess) -> None:
    """Start a spawned process that needs nothing of this process's main module.

    NOTE: `spawn` imports the parent's main module in the child first (server.cli: FastAPI,
    the routes' models, uvicorn: ~0.7 s of the core's start and ~25 MB it kept). The child
    is told of none (a main module without a spec or file) while it is started, on the
    thread that starts it (the main thread, before the server runs)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        process.start()
    finally:
        sys.modules["__main__"] = main


def _exit_reason(exitcode: int) -> str:
    if exitcode == WORKER_DIED_EXIT_CODE:
        return "a tensor-parallel worker process died (the engine core exited)"
    if exitcode < 0:
        return f"the engine core process was killed by {signal.Signals(-exitcode).name}"
    return f"the engine core process exited with code {exitcode}"
