"""Data parallelism: N engine cores behind one API process (`--data-parallel-size N`).

Each core is a whole engine (its own scheduler, KV cache and model runner, in its own
process, with its share of the CPU threads); `DataParallelEngine` puts them behind the
one interface the HTTP app uses. Per request the balancer picks the live core where it
would start soonest: the fewest waiting requests of equal or better priority, then the
most KV headroom, then prefix affinity (the core that last took a prompt sharing the
longest prefix, whose prefix cache likely holds it), then the lowest index. A core that
dies fails its own requests; the others go on serving, and /health names the dead ones.
Metrics carry an `engine` label (vLLM's); `sum without (engine)` adds them up.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from engine.client import EngineClient, EngineStart
from engine.metrics import ServerMetrics
from engine.outputs import EngineDeadError, RequestStream
from engine.request import EngineRequest

AFFINITY_CHUNK_TOKENS = 16
AFFINITY_MAX_CHUNKS = 128  # prefixes up to 2048 tokens
AFFINITY_CAPACITY = 200_000  # prefix chunks remembered (LRU)


class PrefixAffinity:
    """Which core last took a prompt with a given prefix, in chunks of 16 tokens (a hash
    chain per chunk, as the KV cache keys its blocks); LRU-bounded."""

    def __init__(self, capacity: int = AFFINITY_CAPACITY) -> None:
        self._owner: OrderedDict[int, int] = OrderedDict()
        self._capacity = capacity

    @staticmethod
    def _keys(prompt: Sequence[int]) -> list[int]:
        keys, key = [], 0
        num_chunks = min(len(prompt) // AFFINITY_CHUNK_TOKENS, AFFINITY_MAX_CHUNKS)
        for i in range(num_chunks):
            chunk = prompt[i * AFFINITY_CHUNK_TOKENS:(i + 1) * AFFINITY_CHUNK_TOKENS]
            key = hash((key, *chunk))
            keys.append(key)
        return keys

    def lookup(self, prompt: Sequence[int]) -> int | None:
        """The core holding the longest known prefix of `prompt` (None: no prefix known)."""
        owner = None
        for key in self._keys(prompt):
            found = self._owner.get(key)
            if found is None:
                break
            owner = found
        return owner

    def record(self, prompt: Sequence[int], core: int) -> None:
        for key in self._keys(prompt):
            self._owner[key] = core
            self._owner.move_to_end(key)
        while len(self._owner) > self._capacity:
            self._owner.popitem(last=False)


class DataParallelEngine:
    """The engines of N cores behind the `EngineClient` interface the HTTP app uses."""

    def __init__(self, engines: Sequence[EngineClient]) -> None:
        if not engines:
            raise ValueError("data parallelism needs at least one engine")
        self.engines = list(engines)
        self.info = engines[0].info
        self.metrics = engines[0].metrics  # every core's metrics share its registry
        self.affinity = PrefixAffinity()
        self._owner: dict[str, int] = {}  # HTTP request id -> core index, while in flight

    # ---- lifecycle ----

    def start(self) -> None:
        for engine in self.engines:
            engine.start()

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()

    def abort_all(self) -> None:
        for engine in self.engines:
            engine.abort_all()

    @property
    def is_alive(self) -> bool:
        """While any core serves."""
        return any(engine.is_alive for engine in self.engines)

    def dead_engines(self) -> dict[int, str]:
        """The cores that do not serve, with why."""
        return {i: engine.unavailable_reason() for i, engine in enumerate(self.engines)
                if not engine.is_alive}

    def unavailable_reason(self) -> str:
        return "; ".join(f"engine {i}: {why}" for i, why in self.dead_engines().items())

    @property
    def num_waiting(self) -> int:
        return sum(engine.num_waiting for engine in self.engines if engine.is_alive)

    def soonest_first_token_s(self) -> float:
        """Seconds to a new request's first token on the live core where it is soonest."""
        live = [e.soonest_first_token_s() for e in self.engines if e.is_alive]
        return min(live, default=0.0)

    # ---- requests ----

    def pick(self, prompt: Sequence[int], priority: int) -> int:
        """The live core where a request would start soonest (see the module docstring);
        EngineDeadError when none serves."""
        live = [i for i, engine in enumerate(self.engines) if engine.is_alive]
        if not live:
            raise EngineDeadError(self.unavailable_reason())
        affine = self.affinity.lookup(prompt)

        def key(i: int) -> tuple[int, float, bool, int]:
            ahead, kv_usage = self.engines[i].load(priority)
            return ahead, kv_usage, i != affine, i

        return min(live, key=key)

    def add_request(
        self, request: EngineRequest, on_done: Callable[[], None] | None = None
    ) -> RequestStream:
        """`EngineClient.add_request` on the core `pick` chooses: all of a request's choices on
        one core, so that n > 1 shares its prompt."""
        request_id = request.request_id
        core = self.pick(request.prompts[0], request.placement.priority)
        self.affinity.record(request.prompts[0], core)

        def done() -> None:
            self._owner.pop(request_id, None)
            if on_done is not None:
                on_done()

        self._owner[request_id] = core
        try:
            return self.engines[core].add_request(request, on_done=done)
        except BaseException:
            self._owner.pop(request_id, None)
            raise

    def abort(self, request_id: str) -> None:
        core = self._owner.get(request_id)
        if core is not None:
            self.engines[core].abort(request_id)

    async def snapshot(
        self, check_integrity: bool = False, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Every live core's state under `engines`, and the running and waiting requests
        and the KV pool of all of them together (`integrity` "ok" only if every core's
        is)."""
        live = [(i, e) for i, e in enumerate(self.engines) if e.is_alive]
        if not live:
            raise EngineDeadError(self.unavailable_reason())
        states = await asyncio.gather(*(e.snapshot(check_integrity, timeout_s) for _, e in live))
        merged: dict[str, Any] = {
            "policy": states[0]["policy"],
            "running": [r for s in states for r in s["running"]],
            "waiting": [r for s in states for r in s["waiting"]],
            "num_waiting": sum(s["num_waiting"] for s in states),
            "kv_cache": {
                **{key: sum(s["kv_cache"][key] for s in states)
                   for key in ("num_blocks", "num_free_blocks", "num_cached_blocks")},
                "block_size": states[0]["kv_cache"]["block_size"],
            },
            "num_preemptions_total": sum(s["num_preemptions_total"] for s in states),
            "engines": {str(i): s for (i, _), s in zip(live, states, strict=True)},
        }
        kv = merged["kv_cache"]
        kv["usage"] = 1.0 - kv["num_free_blocks"] / kv["num_blocks"] if kv["num_blocks"] else 0.0
        if check_integrity:
            failed = [f"engine {i}: {s['integrity']}" for (i, _), s in zip(live, states,
                                                                            strict=True)
                      if s["integrity"] != "ok"]
            merged["integrity"] = "; ".join(failed) or "ok"
        return merged


def create_data_parallel_engine(
    data_parallel_size: int, start: Callable[..., EngineStart], **kwargs: Any
) -> DataParallelEngine:
    """`data_parallel_size` engines from `start` (engine.client.start_engine and its
    `kwargs`), core i named "core<i>", with its share of the CPU's threads and of the host's
    memory (model_config.memory_share, for an automatic KV budget) and its view of
    one set of metrics labelled `engine="<i>"`; on CUDA core i sees only the i-th visible
    GPU, or with tensor parallelism the i-th group of tensor_parallel_size GPUs
    (CUDA_VISIBLE_DEVICES, inherited by its process and its workers). Every core starts
    before any is waited for, so they load at once; if one fails, the others are stopped."""
    threads = max(1, len(os.sched_getaffinity(0)) // data_parallel_size)
    kwargs["model_config"] = replace(kwargs["model_config"], memory_share=1 / data_parallel_size)
    gpus = _visible_gpus(kwargs["model_config"].device)
    per_core = kwargs["model_config"].tensor_parallel_size
    if gpus is not None and len(gpus) < data_parallel_size * per_core:
        raise ValueError(f"--data-parallel-size {data_parallel_size} x --tensor-parallel-size "
                         f"{per_core} needs as many GPUs; {len(gpus)} visible")
    starts: list[EngineStart] = []
    engines: list[EngineClient] = []
    parent_gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        for i in range(data_parallel_size):
            if gpus is not None:
                # the core's, at its spawn
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * per_core:(i + 1) * per_core])
            starts.append(start(**kwargs, core_name=f"core{i}", num_threads=threads))
        for i, starting in enumerate(starts):
            shared = engines[0].metrics if engines else None
            engines.append(starting.wait(
                metrics_factory=functools.partial(ServerMetrics, engine=str(i), shared=shared),
            ))
    except BaseException:
        for engine in engines:
            engine.shutdown()
        for starting in starts[len(engines):]:
            starting.cancel()
        raise
    finally:
        if gpus is not None:
            if parent_gpus is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = parent_gpus
    return DataParallelEngine(engines)


def _visible_gpus(device: str) -> list[str] | None:
    """The GPUs the cores share out (None: the cores run on the CPU)."""
    if device == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        if device == "cuda":
            raise ValueError("--device cuda, but no CUDA device is available")
        return None
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        return [d.strip() for d in listed.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]
