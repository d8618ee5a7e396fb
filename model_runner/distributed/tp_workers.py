"""Tensor-parallel worker processes: rank 0 starts ranks 1..N-1 and sends them each step's
plan; `worker_main` is one worker.

`start_tensor_parallel` (rank 0, in the engine core) checks that the model shards, opens
the rendezvous store, starts one fresh interpreter per worker rank (spawned, never forked;
a multiprocessing child could not be started from the daemonic core process), joins the
process group, loads rank 0's shard and returns its ModelRunner, which sends each step's
plan (model_runner/distributed/tp_plan.py) down one socket per worker before its own forward.

Lifetimes: a worker dies with rank 0's process (PR_SET_PDEATHSIG, and the EOF of its socket
ends its loop). Rank 0 watches every worker and calls `on_death` when one goes; in the
engine core that exits the process, which the API process reports as a dead core (/health
503, in-flight requests failed), instead of a step that hangs in a collective.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from model_runner.config import ModelConfig
from model_runner.distributed.tensor_parallel import (
    HOST,
    TIMEOUT,
    TensorParallel,
    init_tensor_parallel,
    open_store,
)
from model_runner.distributed.tp_lora import LoRAMirror, WorkerLoRAs
from model_runner.distributed.tp_plan import BlockTables, PlanWriter
from model_runner.loader import LoadedModel, load_model, load_model_spec, resolve_device
from model_runner.lora_layers import LoRAModel
from model_runner.models.registry import model_class
from model_runner.process_lifetime import WORKER_DIED_EXIT_CODE, die_with_parent
from model_runner.runner import ModelRunner
from scheduler.output import ScheduledRequest

logger = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker needs to build its rank (pickled down its socket)."""

    rank: int
    world_size: int
    store_port: int
    model: ModelConfig
    num_threads: int
    parent_pid: int
    log_level: int


class Workers:
    """Rank 0's handle on the worker processes of ranks 1..N-1.

    `send_step` hands every worker the plan of a step; `forget` names requests whose block
    tables were freed; `send_loras` what changed of rank 0's LoRA adapters. A watcher
    thread per worker calls `on_death(reason)` when it exits before `close`.
    """

    def __init__(
        self, config: ModelConfig, store_port: int, num_threads: int,
        on_death: Callable[[str], None],
    ) -> None:
        self._plans = PlanWriter()
        self._loras = LoRAMirror()
        self._lora_news: bytes | None = None
        self._closing = False
        self._on_death = on_death
        self.processes: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        for rank in range(1, config.tensor_parallel_size):
            ours, theirs = socket.socketpair()
            fd = theirs.fileno()
            entry = (
                "from model_runner.distributed.tp_workers import worker_main; "
                f"worker_main({fd})"
            )
            process = subprocess.Popen([sys.executable, "-c", entry], pass_fds=(fd,))
            theirs.close()
            conn = Connection(ours.detach())
            conn.send(WorkerSetup(rank, config.tensor_parallel_size, store_port, config,
                                  num_threads, os.getpid(), logging.getLogger().level))
            self.processes.append(process)
            self._conns.append(conn)
            threading.Thread(target=self._watch, args=(rank, process),
                             name=f"tp-watch-{rank}", daemon=True).start()

    def forget(self, request_ids: Sequence[str]) -> None:
        self._plans.forget(request_ids)

    def send_loras(self, loras: LoRAModel, loads: Sequence[str]) -> None:
        """The workers' adapters brought level with `loras` (rank 0's) and the reads of
        `loads` started, before the next step (at once: its plan may never come)."""
        news = self._loras.news(loras, loads)
        if news is not None:
            self._send(self._plans.plan([], news))

    def send_step(self, requests: Sequence[ScheduledRequest]) -> None:
        """Every worker runs `requests` (in this order) with rank 0."""
        self._send(self._plans.plan(requests))

    def _send(self, data: bytes) -> None:
        for conn in self._conns:
            conn.send_bytes(data)

    def close(self) -> None:
        """End the workers (EOF on their sockets; killed if they do not exit)."""
        self._closing = True
        for conn in self._conns:
            conn.close()
        for process in self.processes:
            try:
                process.wait(_CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def check_deaths(self, wait_s: float) -> None:
        """After rank 0's collective failed: if a worker is dead, or dies within wait_s
        (its socket can close before it is reaped), that is the cause: `on_death` now,
        rather than after the caller has ended the core for another reason."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, process in enumerate(self.processes, start=1):
                if process.poll() is not None:
                    self._died(rank, process.returncode)
                    return
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)

    def _watch(self, rank: int, process: subprocess.Popen[bytes]) -> None:
        self._died(rank, process.wait())

    def _died(self, rank: int, code: int) -> None:
        if not self._closing:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            self._on_death(f"tensor-parallel worker rank {rank} died ({how})")


def exit_on_worker_death(reason: str) -> None:
    """The engine core's reaction to a dead worker: exit at once (see the module docstring)."""
    logger.error("%s; the engine core exits", reason)
    os._exit(WORKER_DIED_EXIT_CODE)


def start_tensor_parallel(
    config: ModelConfig, on_death: Callable[[str], None] = exit_on_worker_death
) -> tuple[LoadedModel, ModelRunner]:
    """Rank 0: start the workers, join them, load rank 0's shard; its runner.

    On the CPU every rank gets an equal share of torch's threads. Raises ValueError when
    the model does not shard over config.tensor_parallel_size ranks (before any worker
    starts) and the loader's errors.
    """
    world_size = config.tensor_parallel_size
    device = resolve_device(config.device)
    if device.type == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"--tensor-parallel-size {world_size} needs {world_size} GPUs, "
                         f"this host has {torch.cuda.device_count()}")
    with torch.device("meta"):  # the shape checks of every rank, on no memory
        hf_config = load_model_spec(config).hf_config
        model_class(hf_config)(
            hf_config, TensorParallel(0, world_size, dist.group.WORLD, dist.group.WORLD)
        )
    num_threads = torch.get_num_threads()
    if device.type == "cpu":
        num_threads = max(1, num_threads // world_size)
        torch.set_num_threads(num_threads)
    store = open_store(world_size)
    workers = Workers(config, store.port, num_threads, on_death)
    try:
        tp = init_tensor_parallel(0, world_size, store, device)
        loaded = load_model(config, tp)
        return loaded, ModelRunner(loaded, config, workers)
    except BaseException:
        workers.close()
        raise


# ------------------------------------------------------------------ worker process


def worker_main(fd: int) -> None:
    """One worker rank: build it as its WorkerSetup says, then run rank 0's plans until its
    socket closes."""
    conn = Connection(fd)
    setup: WorkerSetup = conn.recv()
    die_with_parent(setup.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when to stop
    logging.basicConfig(
        level=setup.log_level,
        format=f"%(asctime)s %(levelname)s %(name)s [tp rank {setup.rank}]: %(message)s",
    )
    torch.set_num_threads(setup.num_threads)
    device = resolve_device(setup.model.device)
    store = dist.TCPStore(HOST, setup.store_port, setup.world_size, is_master=False,
                          timeout=TIMEOUT)
    tp = init_tensor_parallel(setup.rank, setup.world_size, store, device)
    runner = ModelRunner(load_model(setup.model, tp), setup.model)
    loras = None if runner.loras is None else WorkerLoRAs(runner.loras)
    tables = BlockTables()
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:  # rank 0 closed it, or is gone
            break
        requests, freed_ids, news = tables.apply(data)
        if news is not None and loras is not None:
            loras.apply(news)
        runner.execute_worker(requests, freed_ids)
    tp.close()
