"""Which LoRA adapters a step runs, which load next and which are evicted: by priority.

Each step, the adapters wanted by unfinished requests are ranked by the most urgent
(base) priority among their requests, then by the step they last ran (the most recent
first, so that a running adapter keeps its slot against an equal one); the first
`max_loras` hold the step's slots. An adapter that holds a slot but is not loaded is
asked for (`SchedulerOutput.lora_loads`): the engine core reads it on a thread and tells
the scheduler when it is loaded (`lora_loaded`) or failed (`lora_failed`, which fails its
requests alone). Its slot stays reserved meanwhile: low-priority requests of a warm
adapter are not admitted into the slot an urgent request's adapter is loading for;
requests without an adapter, and those of the other slots, run on.

Requests of an adapter without a slot, or not loaded yet, wait without holding the step:
a running one is not scheduled (its blocks kept), a waiting one is held here, out of the
waiting queue, until its adapter is in a slot and loaded. At most `max_cpu_loras`
adapters are loaded or loading; to load another, the loaded adapter without a slot whose
most urgent request is the least urgent (no request: least of all) is evicted, the least
recently run among equals (a paused running request of it waits for its reload).
`LoRAScheduling` holds the Scheduler's methods over these slots.
"""

from __future__ import annotations

from collections import Counter

from scheduler.request import Request
from scheduler.request_queue import RequestQueue

_NONE_WANTS_IT = 1 << 62  # the rank of an adapter no unfinished request wants


class LoRASlots:
    """The adapters' state for the scheduler: wanted, loaded, loading, in this step."""

    def __init__(self, max_loras: int, max_cpu_loras: int) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.loaded: dict[str, int] = {}  # name -> the step it last ran
        self.loading: set[str] = set()
        self.slots: frozenset[str] = frozenset()
        self.held: dict[str, list[Request]] = {}  # waiting requests off the slots, by adapter
        self._wanted: dict[str, Counter[int]] = {}  # adapter -> its requests' priorities
        self._step = 0

    # ---- requests ----

    def want(self, request: Request) -> None:
        """Count a new request's adapter as wanted at its priority."""
        name = request.lora_name
        if name is not None:
            self._wanted.setdefault(name, Counter())[request.priority] += 1

    def forget(self, request: Request) -> None:
        """A finished request no longer wants its adapter."""
        name = request.lora_name
        if name is None:
            return
        wanted = self._wanted[name]
        wanted[request.priority] -= 1
        if not wanted[request.priority]:
            del wanted[request.priority]
        if not wanted:
            del self._wanted[name]
            self.held.pop(name, None)

    def runs(self, request: Request) -> bool:
        """Whether `request` may compute in this step: no adapter, or a loaded one with a
        slot."""
        name = request.lora_name
        return name is None or (name in self.slots and name in self.loaded)

    def hold(self, request: Request) -> None:
        """Keep a waiting request whose adapter cannot run in this step."""
        assert request.lora_name is not None
        self.held.setdefault(request.lora_name, []).append(request)

    def unhold(self, request: Request) -> bool:
        """Take a finished request out of the held ones: whether it was held."""
        held = self.held.get(request.lora_name or "", [])
        if request in held:
            held.remove(request)
            return True
        return False

    def held_requests(self) -> list[Request]:
        return [request for held in self.held.values() for request in held]

    def wanted(self) -> set[str]:
        """The adapters of unfinished requests."""
        return set(self._wanted)

    # ---- one step ----

    def begin_step(self) -> tuple[list[str], list[str], list[Request]]:
        """Rank the wanted adapters into the step's slots: the adapters to load now, those
        to evict for them, and the held requests whose adapter can now run."""
        self._step += 1
        ranked = sorted(self._wanted, key=self._rank)
        self.slots = frozenset(ranked[: self.max_loras])
        loads, evictions = [], []
        for name in ranked[: self.max_loras]:
            if name in self.loaded or name in self.loading:
                continue
            if len(self.loaded) + len(self.loading) >= self.max_cpu_loras:
                victim = self._victim()
                if victim is None:
                    break
                del self.loaded[victim]
                evictions.append(victim)
            self.loading.add(name)
            loads.append(name)
        released = []
        for name in self.slots & self.loaded.keys():
            self.loaded[name] = self._step
            released += self.held.pop(name, [])
        return loads, evictions, released

    def loaded_now(self, name: str) -> list[Request]:
        """The core loaded `name`: the held requests it frees when it holds a slot."""
        self.loading.discard(name)
        self.loaded[name] = self._step
        return self.held.pop(name, []) if name in self.slots else []

    def failed(self, name: str) -> list[Request]:
        """Loading `name` failed: its held requests (the caller fails them and the rest of
        its requests)."""
        self.loading.discard(name)
        return self.held.pop(name, [])

    def evicted(self, name: str) -> None:
        """Forget a loaded adapter (unloaded from outside)."""
        self.loaded.pop(name, None)

    def _rank(self, name: str) -> tuple[int, int]:
        return (min(self._wanted[name]), -self.loaded.get(name, -2))

    def _victim(self) -> str | None:
        """The loaded adapter to evict for a load, or None when each has a slot or a
        running request (the load then waits)."""
        candidates = [name for name in self.loaded if name not in self.slots]
        if not candidates:
            return None

        def worth(name: str) -> tuple[int, int]:
            wanted = self._wanted.get(name)
            return (min(wanted) if wanted else _NONE_WANTS_IT, self.loaded[name])

        return max(candidates, key=lambda name: (worth(name)[0], -worth(name)[1]))


class LoRAScheduling:
    """The Scheduler's methods over its adapters' slots; mixed into the Scheduler."""

    loras: LoRASlots | None
    waiting: RequestQueue
    requests: dict[str, Request]

    def _begin_lora_step(self) -> tuple[list[str], list[str]]:
        """The step's adapter slots: the adapters to load and to evict."""
        if self.loras is None:
            return [], []
        loads, evictions, released = self.loras.begin_step()
        for request in released:
            self.waiting.add(request)
        return loads, evictions

    def lora_loaded(self, name: str) -> None:
        """The runner holds adapter `name` now: its held requests may run."""
        if self.loras is not None:
            for request in self.loras.loaded_now(name):
                self.waiting.add(request)

    def lora_failed(self, name: str) -> list[str]:
        """Loading adapter `name` failed: the ids of its requests, for the caller to
        finish (they alone fail). O(requests), once a failure."""
        if self.loras is None:
            return []
        for request in self.loras.failed(name):
            self.waiting.add(request)
        return [r.request_id for r in self.requests.values() if r.lora_name == name]
