"""Trusted request templates rendered in worker processes, stopped at the deadline whatever
they do.

A request's own chat template (only with --trust-request-chat-template) is the client's
code. The trace-based deadline of server/chat_template.py stops a template at its first
Python call past --chat-template-timeout-s, but not one that spends seconds inside a single
C call (`{{ (9 ** 10000000) > 1 }}`), which also holds the GIL: the whole API process would
stall. `TemplateWorkers` renders such templates in a small pool of worker processes
(`spawn`, started at the first such request): the tokenizer thread waits for the answer
without holding the GIL, and a worker still rendering at the deadline is killed (SIGKILL)
and replaced. Each worker holds a copy of the tokenizer (sent pickled once), so a template
sees what it sees in process; it runs at a lower CPU priority, its address space capped,
and it dies with the API process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import queue
import resource
import signal
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from model_runner.process_lifetime import die_with_parent

logger = logging.getLogger(__name__)

NUM_WORKERS = 2  # one renders while the other (re)starts
START_TIMEOUT_S = 120.0  # a worker's start (not counted in a render's deadline)
MAX_WORKER_MEMORY_BYTES = 1024**3  # address space a worker may add to what it starts with


class TemplateTimeout(Exception):
    """The template was still rendering at its deadline: its worker was killed."""


class TemplateFailed(Exception):
    """The template did not render: the message says why (the template's own error, or
    its worker's death while rendering it)."""


class TemplateUnavailable(Exception):
    """No worker could be started: the message says why."""


@dataclass(eq=False)  # by identity: a set holds them
class _Worker:
    process: BaseProcess
    conn: Connection


class TemplateWorkers:
    """A pool of `num_workers` processes rendering chat templates with a copy of
    `tokenizer`: the first started at the first `render`, the others one by one once it
    is up; one killed or dead is replaced at once."""

    def __init__(self, tokenizer: Any, num_workers: int = NUM_WORKERS,
                 start_timeout_s: float = START_TIMEOUT_S,
                 max_memory_bytes: int = MAX_WORKER_MEMORY_BYTES) -> None:
        self._start_error = ""
        self._payload: bytes | None = None
        try:
            self._payload = pickle.dumps(tokenizer)
        except Exception as exc:  # no worker can have it: each render is unavailable
            self._start_error = f"the tokenizer cannot be sent to a worker process: {exc!r}"
        self._num_workers = num_workers
        self._start_timeout_s = start_timeout_s
        self._max_memory_bytes = max_memory_bytes
        self._context = multiprocessing.get_context("spawn")
        # ready workers; None: a start failed (`_start_error` says why)
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: set[_Worker] = set()  # ready (those starting are only counted)
        self._num_alive = 0  # ready or starting
        self._num_started = 0
        self._closed = False
        self._starts: queue.SimpleQueue[bool] = queue.SimpleQueue()  # False: stop
        self._starter: threading.Thread | None = None

    @property
    def num_started(self) -> int:
        """Workers started so far (replacements included)."""
        return self._num_started

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               kwargs: dict[str, Any], timeout_s: float, max_chars: int) -> str:
        """`tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=
        add_generation_prompt, **kwargs)` in a worker: TemplateTimeout past `timeout_s`
        (the worker killed), TemplateFailed when the template raised, its text is longer
        than `max_chars`, or the worker died; TemplateUnavailable when none starts. The
        wait for a worker to start is not counted in `timeout_s`."""
        worker = self._take()
        try:
            worker.conn.send((messages, add_generation_prompt, kwargs, max_chars))
            if not worker.conn.poll(timeout_s):
                self._replace(worker)
                raise TemplateTimeout
            status, value = worker.conn.recv()
        except (EOFError, OSError) as exc:
            self._replace(worker)
            raise TemplateFailed("the chat template's worker process died rendering it "
                                 f"({_exit_of(worker)})") from exc
        self._idle.put(worker)
        if status != "ok":
            raise TemplateFailed(value)
        return str(value)

    def start(self) -> None:
        """Start the first worker now (once; not waited for): the first request's own
        template then need not wait for it."""
        with self._lock:
            if self._payload is None or self._num_started or self._closed:
                return  # NOTE: once: a failed start is retried by the next render
            self._start_soon()

    def close(self) -> None:
        """Kill every worker; `render` is not to be called after."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, set()
            self._starts.put(False)
        for worker in workers:
            _kill(worker)

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise TemplateUnavailable("the chat template workers are closed")
            if self._payload is None:
                raise TemplateUnavailable(self._start_error)
            if self._num_alive == 0:  # lazily, if `start` was not called
                self._start_soon()
        try:
            worker = self._idle.get(timeout=self._start_timeout_s)
        except queue.Empty:
            raise TemplateUnavailable("no chat template worker was free in "
                                      f"{self._start_timeout_s:g} s") from None
        if worker is None:
            raise TemplateUnavailable(f"no chat template worker started: {self._start_error}")
        return worker

    def _start_soon(self) -> None:
        """Have the starter thread start a worker, idle once ready (a spawn start takes
        seconds: the child imports the tokenizer's library); the caller holds the lock."""
        self._num_alive += 1
        self._num_started += 1
        if self._starter is None:
            # NOTE: one thread that lives as long as the pool starts them all: a child's
            # PR_SET_PDEATHSIG fires when the thread that started it ends
            self._starter = threading.Thread(target=self._start_each, daemon=True,
                                             name="chat-template-start")
            self._starter.start()
        self._starts.put(True)

    def _start_each(self) -> None:
        while self._starts.get():
            self._start()

    def _start(self) -> None:
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=_serve, args=(child, self._payload, os.getpid(), self._max_memory_bytes),
            name="chat-template", daemon=True,
        )
        worker = _Worker(process, parent)
        try:
            process.start()
            child.close()
            if not parent.poll(self._start_timeout_s):
                raise TemplateUnavailable(f"it did not start in {self._start_timeout_s:g} s")
            status, value = parent.recv()
            if status != "ready":
                raise TemplateUnavailable(value)
        except (TemplateUnavailable, EOFError, OSError) as exc:
            _kill(worker)
            why = str(exc) if isinstance(exc, TemplateUnavailable) else _exit_of(worker)
            if not self._closed:  # NOTE: closed, it was killed on purpose (at exit too)
                logger.warning("a chat template worker did not start: %s", why)
            with self._lock:
                self._num_alive -= 1
                self._start_error = why
            self._idle.put(None)
            return
        with self._lock:
            if self._closed:
                _kill(worker)
                return
            self._workers.add(worker)
            # NOTE: the next one only now: starts compete with requests for the CPU
            if self._num_alive < self._num_workers:
                self._start_soon()
        self._idle.put(worker)

    def _replace(self, worker: _Worker) -> None:
        """Kill `worker` and start another in its place (not waited for: it gets ready
        while the next request is on its way)."""
        _kill(worker)
        with self._lock:
            self._workers.discard(worker)
            self._num_alive -= 1
            if not self._closed:
                self._start_soon()


def _kill(worker: _Worker) -> None:
    process = worker.process
    if process.pid is not None:  # NOTE: started
        process.kill()
        process.join(timeout=5)
    worker.conn.close()


def _exit_of(worker: _Worker) -> str:
    code = worker.process.exitcode
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


# ------------------------------------------------------------------ the worker process


def _serve(conn: Connection, payload: bytes, parent_pid: int, max_memory_bytes: int) -> None:
    """A worker's main: render each (messages, add_generation_prompt, kwargs, max_chars)
    it is sent, answer ("ok", text) or ("error", why); exit when the API process closes its end."""
    die_with_parent(parent_pid)
    try:
        os.nice(10)  # NOTE: a template competes with no request's tokenizing
        tokenizer = pickle.loads(payload)
        _cap_memory(max_memory_bytes)
    except Exception as exc:  # the API process reads why
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", ""))
    while True:
        try:
            messages, add_generation_prompt, kwargs, max_chars = conn.recv()
        except EOFError:
            return
        conn.send(_render(tokenizer, messages, add_generation_prompt, kwargs, max_chars))


def _render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
            kwargs: dict[str, Any], max_chars: int) -> tuple[str, str]:
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
    except MemoryError:
        return "error", "the template needs more memory than a chat template may use"
    except Exception as exc:  # jinja's: the messages do not fit it
        return "error", str(exc)
    if not isinstance(text, str):
        return "error", "the template did not render text"
    if len(text) > max_chars:
        return "error", (f"the template rendered {len(text)} characters, more than the "
                         f"{max_chars} a request's chat template may render")
    return "ok", text


def _cap_memory(max_memory_bytes: int) -> None:
    """At most `max_memory_bytes` of address space more than the worker holds now (a
    MemoryError in the template beyond)."""
    try:
        with open("/proc/self/statm") as statm:
            size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no /proc: no cap
        return
    limit = size + max_memory_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
