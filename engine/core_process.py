"""The engine core process: `core_main`, started by the API process's client of it
(engine/core_client.py) with the `spawn` method.

It dies with the API process (PR_SET_PDEATHSIG, plus a parent check while idle), ignores
SIGINT (the API process drains, then sends `Shutdown`), loads the model on its main
thread, answers `Ready` (or `LoadFailed`) and runs `run_core_loop` there, between two
pyzmq sockets (commands in, messages out, msgpack-encoded by msgspec).
NOTE: the model runs on the thread that loaded it. Run on a second thread after the
loading thread had opened OpenMP parallel regions, a CPU decode step was ~40% slower.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from engine.messages import (
    Command,
    CoreMessage,
    LoadFailed,
    Ready,
    command_decoder,
    output_encoder,
)
from model_runner.config import ModelConfig
from model_runner.process_lifetime import die_with_parent
from scheduler.config import SchedulerConfig
from structured.compiler import return_free_memory

if TYPE_CHECKING:
    from engine.core import EngineCore

logger = logging.getLogger(__name__)

_PARENT_CHECK_MS = 1000  # an idle core checks its parent this often


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


def freeze_startup_objects() -> None:
    """Leave what start-up made (modules, tokenizer, model objects) out of the garbage
    collector's full passes. NOTE: each full pass walks every tracked object; with the
    hundreds of thousands start-up leaves, a request that allocates much (a body of 10,000
    tools) paid ~0.2 s of them on the event loop, every stream with it (vLLM freezes too).
    The heap start-up freed (the tokenizer files' parse, llguidance's) goes back to the
    system."""
    gc.collect()
    gc.freeze()
    return_free_memory()


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

    core = _load_core(config, clock, send)
    if core is None:
        outputs.close(linger=5000)
        sys.exit(1)
    from engine.core import run_core_loop

    try:
        run_core_loop(core, _command_receiver(commands, parent_pid), send)
    except BaseException:
        logger.exception("the engine core loop died")
        os._exit(1)
    outputs.close(linger=5000)
    commands.close(linger=0)
    context.term()


def _load_core(
    config: CoreConfig, clock: Any, send: Callable[[CoreMessage], None]
) -> EngineCore | None:
    """Load the model and build the core on it, then send `Ready`; on a load error, send
    `LoadFailed` and return None."""
    from engine.core import EngineCore
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
        return None
    send(Ready(info))
    freeze_startup_objects()
    return EngineCore(scheduler, runner, frozenset(info.eos_token_ids), clock, structured)


def _command_receiver(
    commands: zmq.Socket[bytes], parent_pid: int
) -> Callable[[float | None], list[Command]]:
    """`run_core_loop`'s `receive` on the commands socket; waiting without a timeout, it
    exits the process once the API process is gone."""

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

    return receive
