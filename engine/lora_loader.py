"""LoRA adapters loaded off the step: read and checked on a thread, handed to the runner
between steps.

The scheduler asks for an adapter (`SchedulerOutput.lora_loads`); `LoRALoader.start`
reads its PEFT folder on one worker thread while steps go on; at the start of a later
step `take_done` gives the runner the adapters read (a quick copy onto the device) and
says which failed. A runner without adapters (the simulated one) loads nothing: its
adapters are ready at once. `update` serves a new adapter or stops serving one at run
time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from scheduler.lora_slots import LoRASlots

if TYPE_CHECKING:
    from model_runner.lora_layers import ReadyAdapter


class LoRAHolder(Protocol):
    """The runner's adapters (model_runner/lora_layers.py's `LoRAModel`)."""

    paths: dict[str, str]

    def read(self, name: str, path: str) -> ReadyAdapter: ...

    def check(self, name: str, path: str) -> None: ...

    def add(self, ready: ReadyAdapter) -> None: ...

    def remove(self, name: str) -> None: ...


class LoRALoader:
    """Adapters being read on a thread, for the core's step loop."""

    def __init__(self, holder: LoRAHolder | None) -> None:
        self.holder = holder
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self._loading: dict[str, Future[ReadyAdapter | None]] = {}

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    def start(self, names: Iterable[str]) -> None:
        for name in names:
            if name not in self._loading:
                self._loading[name] = self._pool.submit(self._read, name)

    def _read(self, name: str) -> ReadyAdapter | None:
        if self.holder is None:
            return None
        path = self.holder.paths.get(name)
        if path is None:
            raise ValueError(f"LoRA adapter {name!r} is not known (it was unloaded)")
        return self.holder.read(name, path)

    def take_done(self) -> tuple[list[str], dict[str, str]]:
        """The adapters read since the last call, now held by the runner, and those that
        failed, with why."""
        loaded, failed = [], {}
        for name, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[name]
            try:
                adapter = future.result()
            except Exception as exc:  # the folder's fault: its requests fail, alone
                failed[name] = f"LoRA adapter {name!r} failed to load: {exc}"
                continue
            if adapter is not None and self.holder is not None:
                self.holder.add(adapter)
            loaded.append(name)
        return loaded, failed

    def update(self, name: str, path: str | None, slots: LoRASlots) -> str | None:
        """Serve the adapter in `path` as `name` (its folder checked now from its config
        and weight shapes, a few milliseconds on the step's thread; its weights read off
        the step when its requests come), or stop serving `name` (`path` None): why not,
        or None. An adapter its unfinished requests want is not unloaded."""
        holder = self.holder
        known = holder is None or name in holder.paths
        if path is not None:
            if holder is None:
                return None
            if known:
                return f"The LoRA adapter {name!r} has already been loaded."
            # NOTE: here, in the core only: the API process imports this module, not torch
            from model_runner.lora_adapters import AdapterError

            try:
                holder.check(name, path)
            except AdapterError as exc:
                return str(exc)
            holder.paths[name] = path
            return None
        if not known:
            return f"The LoRA adapter {name!r} cannot be found."
        if name in slots.wanted() or name in self._loading:
            return f"The LoRA adapter {name!r} is in use by requests: unload it once they end."
        if holder is not None:
            del holder.paths[name]
            holder.remove(name)
        slots.evicted(name)
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
