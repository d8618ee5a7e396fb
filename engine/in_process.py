"""The unit tests' engine core: an `EngineCore` stepped by a thread of this process
(`EngineClient.in_process`), behind the same client interface as the core process
(engine/core_client.py)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from engine.core import EngineCore, run_core_loop
from engine.messages import Command, CoreMessage, Shutdown

logger = logging.getLogger(__name__)


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
