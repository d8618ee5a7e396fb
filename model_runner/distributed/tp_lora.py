"""LoRA adapters under tensor parallelism: every rank holds its slice of each adapter rank 0
holds (model_runner/lora_layers.py cuts it), read from the same PEFT folder.

Rank 0's engine core loads adapters as on one rank (engine/lora_loader.py). `LoRAMirror`
(rank 0) tells the workers, with the next step's plan, what changed since the last one:
the reads the scheduler asked for (each worker starts its own on a thread, as rank 0 did),
the adapters rank 0 now holds and those it dropped. `WorkerLoRAs` (a worker) applies that
before the step: an adapter to hold is taken from its finished read (waited for, if it is
not done yet), or read then (one held from the start, whose read no plan announced).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

from model_runner.lora_adapters import LoRAAdapter
from model_runner.lora_layers import LoRAModel, ReadyAdapter


class LoRANews(msgspec.Struct, array_like=True):
    """Rank 0's adapters since the last plan: reads to start and adapters to hold, each
    (name, PEFT folder), and the names of those dropped (before the others apply)."""

    reads: list[tuple[str, str]]
    holds: list[tuple[str, str]]
    drops: list[str]


class LoRAMirror:
    """Rank 0's record of the adapters the workers hold."""

    def __init__(self) -> None:
        self._held: dict[str, LoRAAdapter] = {}

    def news(self, loras: LoRAModel, loads: Sequence[str]) -> LoRANews | None:
        """What brings the workers level with `loras` (rank 0's), the reads of `loads`
        started; None: nothing changed."""
        now = dict(loras.adapters)
        reads = [(name, loras.paths[name]) for name in loads if name in loras.paths]
        drops = [name for name, adapter in self._held.items() if now.get(name) is not adapter]
        holds = [(name, adapter.path) for name, adapter in now.items()
                 if self._held.get(name) is not adapter]
        self._held = now
        return LoRANews(reads, holds, drops) if reads or holds or drops else None


class WorkerLoRAs:
    """A worker's adapters, kept level with rank 0's by its news."""

    def __init__(self, loras: LoRAModel) -> None:
        self.loras = loras
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self._reading: dict[str, tuple[str, Future[ReadyAdapter]]] = {}

    def apply(self, news: LoRANews) -> None:
        """Drop, start reading and hold what rank 0 did. A read that fails here, after rank
        0's succeeded on the same folder, raises (the worker then dies, and the core)."""
        for name in news.drops:
            self.loras.remove(name)
        for name, path in news.reads:
            self._reading[name] = (path, self._pool.submit(self.loras.read, name, path))
        for name, path in news.holds:
            reading = self._reading.pop(name, None)
            if reading is not None and reading[0] == path:
                ready = reading[1].result()
            else:
                ready = self.loras.read(name, path)
            self.loras.add(ready)
