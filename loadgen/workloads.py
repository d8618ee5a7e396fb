"""The benchmark workloads of docs/benchmarks.md, as plain request lists.

Every workload is drawn from a fixed seed, so pagedserve, llama.cpp's server and Hugging
Face `generate` all see exactly the same requests: token-id prompts, but for the
input-copying workloads (WE, WEP), whose prompts are text to rewrite (loadgen/edits.py).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from loadgen.edits import edit_prompts


@dataclass(frozen=True)
class BenchItem:
    prompt: str | list[int]
    max_tokens: int
    priority: int = 0
    send_at_s: float | None = None  # fixed arrival offset, outside the concurrency gate
    model: str | None = None  # the model (or LoRA adapter) it names; None: the run's


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    requests: list[BenchItem]  # prompts are token-id lists; outputs forced (ignore_eos)
    concurrency: int


# NOTE: ids below 1000 hold the special and byte tokens of SmolLM2's vocabulary; plain
# word pieces above it keep every peer's tokenizer round trip out of the picture.
_LOW_TOKEN, _HIGH_TOKEN = 1000, 40000


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(_LOW_TOKEN, _HIGH_TOKEN) for _ in range(length)]


def w0(scale: float = 1.0, seed: int = 0) -> Workload:
    """One request at a time, 32 tokens in, 64 out: per-token latency."""
    rng = random.Random(seed)
    n = max(2, round(8 * scale))
    reqs = [BenchItem(_prompt(rng, 32), 64) for _ in range(n)]
    return Workload("W0", f"{n} requests, 32 in / 64 out, 1 in flight", reqs, 1)


def w1(scale: float = 1.0, seed: int = 0) -> Workload:
    """64 requests, 128 in / 128 out, 16 in flight."""
    rng = random.Random(seed)
    n = max(4, round(64 * scale))
    reqs = [BenchItem(_prompt(rng, 128), 128) for _ in range(n)]
    return Workload("W1", f"{n} requests, 128 in / 128 out, 16 in flight", reqs, 16)


def wv(scale: float = 1.0, seed: int = 0) -> Workload:
    """128 requests, input 32..512 and output 16..256 at random, 64 in flight."""
    rng = random.Random(seed)
    n = max(8, round(128 * scale))
    reqs = [
        BenchItem(_prompt(rng, rng.randint(32, 512)), rng.randint(16, 256)) for _ in range(n)
    ]
    return Workload("WV", f"{n} requests, 32..512 in / 16..256 out, 64 in flight", reqs, 64)


def wp(scale: float = 1.0, seed: int = 0, high_every_s: float = 2.0) -> Workload:
    """48 low-priority requests (priority 10, 128 in / 256 out, 32 in flight) plus one
    high-priority request (priority -10, 128 in / 32 out) every `high_every_s` seconds."""
    rng = random.Random(seed)
    n_low = max(4, round(48 * scale))
    low = [BenchItem(_prompt(rng, 128), 256, priority=10) for _ in range(n_low)]
    n_high = max(2, round(12 * scale))
    high = [
        BenchItem(_prompt(rng, 128), 32, priority=-10, send_at_s=(i + 1) * high_every_s)
        for i in range(n_high)
    ]
    return Workload(
        "WP",
        f"{n_low} low (prio 10, 128/256, 32 in flight) + {n_high} high (prio -10, 128/32) "
        f"every {high_every_s:g} s",
        low + high,
        32,
    )


def wps(scale: float = 1.0, seed: int = 0) -> Workload:
    """The saturating priority load of the priority-at-scale issue: low-priority requests
    (priority 10, 128 in / 96 out) kept 48 in flight, 15% of all requests at priority -10
    (128 in / 96 out) in the same stream of arrivals. Compare the -10 TTFT with an idle
    server's and the low ITL (a loaded step)."""
    rng = random.Random(seed)
    n = max(20, round(160 * scale))
    reqs = [
        BenchItem(_prompt(rng, 128), 96, priority=-10 if rng.random() < 0.15 else 10)
        for _ in range(n)
    ]
    return Workload("WPS", f"{n} requests, 128 in / 96 out, 15% at priority -10, 48 in flight",
                    reqs, 48)


def wpp(scale: float = 1.0, seed: int = 0) -> Workload:
    """WPS's low-priority load with the urgent requests on a clock of their own: 136
    low-priority requests (priority 10, 128 in / 96 out) kept 48 in flight, and 24
    priority -10 probes (128 in / 16 out) sent one per 2 s window from 10 s on, each at a
    random point of its window, as users unrelated to the load send them. In WPS the -10
    requests come from the load's own closed loop, so each is sent when an earlier
    request's last token arrives, i.e. just after the next step has started; a probe here
    lands anywhere in a step. 16 tokens out keep the batch at about the 48 of the load."""
    rng = random.Random(seed)
    n_low = max(48, round(136 * scale))
    low = [BenchItem(_prompt(rng, 128), 96, priority=10) for _ in range(n_low)]
    n_high = max(4, round(24 * scale))
    high = [
        BenchItem(_prompt(rng, 128), 16, priority=-10, send_at_s=10.0 + 2.0 * (i + rng.random()))
        for i in range(n_high)
    ]
    return Workload("WPP", f"{n_low} low (prio 10, 128/96, 48 in flight) + {n_high} high "
                    "(prio -10, 128/16), one per 2 s at a random phase from 10 s", low + high, 48)


def wl(scale: float = 1.0, seed: int = 0) -> Workload:
    """A long urgent prefill among streams: 16 low-priority requests (priority 10, 128 in /
    192 out) arriving 0.3 s apart, then one priority -10 request of 2,000 tokens in / 16
    out at 6 s. The low ITL p99 shows the stall the long prefill causes."""
    rng = random.Random(seed)
    n_low = max(4, round(16 * scale))
    low = [
        BenchItem(_prompt(rng, 128), 192, priority=10, send_at_s=0.3 * i) for i in range(n_low)
    ]
    high = BenchItem(_prompt(rng, 2000), 16, priority=-10, send_at_s=6.0)
    return Workload("WL", f"{n_low} low (prio 10, 128/192, 0.3 s apart) + 1 high (prio -10, "
                    "2000/16) at 6 s", [*low, high], n_low)


def we(scale: float = 1.0, seed: int = 0) -> Workload:
    """Input copying, one stream at a time: rewrite a given block of code or prose (256 to
    512 tokens) with a small edit, the answer as long as the block (256 to 512 tokens, about
    all of it copied from the prompt). What n-gram speculation speeds up."""
    prompts = edit_prompts(max(2, round(6 * scale)), random.Random(seed))
    reqs = [BenchItem(p.prompt, p.answer_tokens) for p in prompts]
    return Workload("WE", f"{len(reqs)} edits, 256..512 in / 256..512 out, 1 in flight",
                    reqs, 1)


def wep(scale: float = 1.0, seed: int = 0, high_every_s: float = 3.0) -> Workload:
    """WE under saturation: edits at priority 10 (128 tokens out) kept 24 in flight, and
    urgent edits at priority -10 (128 out) sent one every `high_every_s` seconds from 5 s on.
    Speculation should shorten the urgent requests' time per token and keep the low ones'
    throughput."""
    rng = random.Random(seed)
    n_low, n_high = max(32, round(48 * scale)), max(2, round(8 * scale))
    prompts = edit_prompts(n_low + n_high, rng)
    low = [BenchItem(p.prompt, 128, priority=10) for p in prompts[:n_low]]
    high = [
        BenchItem(p.prompt, 128, priority=-10, send_at_s=5.0 + high_every_s * i)
        for i, p in enumerate(prompts[n_low:])
    ]
    return Workload("WEP", f"{n_low} low edits (prio 10, 128 out, 24 in flight) + {n_high} "
                    f"urgent (prio -10, 128 out) every {high_every_s:g} s", low + high, 24)


def in_vocabulary(workload: Workload, token_ids: Sequence[int]) -> Workload:
    """`workload` with each token-id prompt's ids drawn from `token_ids` instead (id i
    becomes token_ids[i % len]: the same for every system), for a model whose vocabulary
    is not SmolLM2's; text prompts as they are."""
    requests = [
        r if isinstance(r.prompt, str)
        else replace(r, prompt=[token_ids[i % len(token_ids)] for i in r.prompt])
        for r in workload.requests
    ]
    return replace(workload, requests=requests)


WORKLOADS = {"W0": w0, "W1": w1, "WV": wv, "WP": wp, "WPS": wps, "WPP": wpp, "WL": wl,
             "WE": we, "WEP": wep}
