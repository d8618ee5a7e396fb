"""Prometheus metrics with the SPEC's names, in a registry of their own.

Every series is declared once, in `SERIES` (kind, name, help, labels, buckets).
prometheus-client appends `_total` to counter names, so counters are declared without
it. Every series carries `model_name` (and `engine` with data parallelism); TTFT, queue
time, the per-priority gauges and the per-priority preemption counter also carry
`priority`, bounded to the first MAX_PRIORITY_LABELS distinct values (later ones are
"other"), as do speculation's counters by priority (their `position` is bounded by the
draft length). The `pagedserve_tenant_*` series carry `tenant`, a name from the tenants file
(or "default"), so they are bounded. The engine's output processing records, the HTTP
handlers count tenant rejections; /metrics reads through `render()`.

Beside them, `VllmAliases` exposes what the Gateway API Inference Extension's endpoint
picker (llm-d's router) reads by default, under vLLM's names: `vllm:num_requests_waiting`,
`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, `vllm:cache_config_info` and,
with LoRA adapters, `vllm:lora_requests_info`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcache.config import CacheConfig
from scheduler.speculation import SpecDecodeStats

MAX_PRIORITY_LABELS = 16
OTHER_PRIORITY = "other"

# NOTE: no `*_created` series: the exposed names are exactly the SPEC's.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class Series:
    """One metric: `key` names it in `ServerMetrics`; `labels` come after `model_name`
    (and `engine`); `buckets` are a histogram's; `exposed` are values of its one label
    exposed before any traffic (a series without labels of its own always is)."""

    key: str
    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    exposed: tuple[str, ...] = ()

    def create(self, base_labels: list[str], registry: CollectorRegistry) -> Any:
        labels = [*base_labels, *self.labels]
        if self.buckets is not None:
            return Histogram(self.name, self.help, labels, registry=registry,
                             buckets=self.buckets)
        return self.kind(self.name, self.help, labels, registry=registry)


_P, _T = ("priority",), ("tenant",)
_PT = ("priority", "tenant")

# In exposition order.
SERIES = (
    Series("num_preemptions", Counter, "pagedserve_num_preemptions",
           "Preemptions of running requests."),
    Series("prompt_tokens", Counter, "pagedserve_prompt_tokens",
           "Prompt tokens of requests that started decoding."),
    Series("generation_tokens", Counter, "pagedserve_generation_tokens", "Generated tokens."),
    Series("request_success", Counter, "pagedserve_request_success",
           "Finished requests by finish reason.", ("finished_reason",),
           exposed=("stop", "length", "abort")),
    Series("prefix_cache_queries", Counter, "pagedserve_prefix_cache_queries",
           "Prompt tokens looked up in the prefix cache."),
    Series("prefix_cache_hits", Counter, "pagedserve_prefix_cache_hits",
           "Prompt tokens found in the prefix cache."),
    Series("num_requests_running", Gauge, "pagedserve_num_requests_running", "Requests running."),
    Series("num_requests_waiting", Gauge, "pagedserve_num_requests_waiting",
           "Requests waiting (preempted ones included)."),
    Series("kv_cache_usage_perc", Gauge, "pagedserve_kv_cache_usage_perc",
           "Fraction of KV cache blocks in use (0 to 1)."),
    Series("time_to_first_token", Histogram, "pagedserve_time_to_first_token_seconds",
           "Arrival to first generated token.", _P, _TTFT_BUCKETS),
    Series("inter_token_latency", Histogram, "pagedserve_inter_token_latency_seconds",
           "Time between generated tokens.", buckets=_ITL_BUCKETS),
    Series("e2e_request_latency", Histogram, "pagedserve_e2e_request_latency_seconds",
           "Arrival to finish.", buckets=_REQUEST_BUCKETS),
    Series("request_queue_time", Histogram, "pagedserve_request_queue_time_seconds",
           "Arrival to first scheduled.", _P, _REQUEST_BUCKETS),
    Series("num_requests_waiting_by_priority", Gauge,
           "pagedserve_num_requests_waiting_by_priority", "Requests waiting, by priority.", _P),
    Series("num_requests_running_by_priority", Gauge,
           "pagedserve_num_requests_running_by_priority", "Requests running, by priority.", _P),
    Series("num_preemptions_by_priority", Counter, "pagedserve_num_preemptions_by_priority",
           "Preemptions, by the victim's priority.", _P),
    Series("request_prefill_time", Histogram, "pagedserve_request_prefill_time_seconds",
           "First scheduled to first generated token (the prompt's computation).",
           buckets=_REQUEST_BUCKETS),
    Series("request_decode_time", Histogram, "pagedserve_request_decode_time_seconds",
           "First generated token to finish.", buckets=_REQUEST_BUCKETS),
    Series("iteration_tokens", Histogram, "pagedserve_iteration_tokens",
           "Tokens computed per engine step.", buckets=_ITERATION_TOKEN_BUCKETS),
    Series("spec_decode_num_drafts", Counter, "pagedserve_spec_decode_num_drafts",
           "Verifications of draft tokens (speculative decoding)."),
    Series("spec_decode_num_draft_tokens", Counter, "pagedserve_spec_decode_num_draft_tokens",
           "Draft tokens proposed and verified."),
    Series("spec_decode_num_accepted_tokens", Counter,
           "pagedserve_spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    Series("spec_decode_num_accepted_tokens_per_pos", Counter,
           "pagedserve_spec_decode_num_accepted_tokens_per_pos",
           "Draft tokens accepted, by position in the draft (0: the first).", ("position",)),
    Series("spec_decode_num_draft_tokens_by_priority", Counter,
           "pagedserve_spec_decode_num_draft_tokens_by_priority",
           "Draft tokens proposed and verified, by the request's priority.", _P),
    Series("spec_decode_num_accepted_tokens_by_priority", Counter,
           "pagedserve_spec_decode_num_accepted_tokens_by_priority",
           "Draft tokens accepted, by the request's priority.", _P),
    Series("tenant_requests", Counter, "pagedserve_tenant_requests",
           "Finished requests by tenant and finish reason.", (*_T, "finished_reason")),
    Series("tenant_prompt_tokens", Counter, "pagedserve_tenant_prompt_tokens",
           "Prompt tokens by tenant.", _T),
    Series("tenant_generation_tokens", Counter, "pagedserve_tenant_generation_tokens",
           "Generated tokens by tenant.", _T),
    Series("tenant_rejections", Counter, "pagedserve_tenant_rejections",
           "Requests refused by a tenant limit, by reason (priority, in_flight, rate).",
           (*_T, "reason")),
    Series("tenant_queue_time", Histogram, "pagedserve_tenant_request_queue_time_seconds",
           "Arrival to first scheduled.", _T, _REQUEST_BUCKETS),
    Series("slo_ttft_met", Counter, "pagedserve_slo_ttft_met",
           "Finished requests with a TTFT target that met it.", _PT),
    Series("slo_ttft_missed", Counter, "pagedserve_slo_ttft_missed",
           "Finished requests with a TTFT target that missed it.", _PT),
    Series("slo_tpot_met", Counter, "pagedserve_slo_tpot_met",
           "Finished requests with a TPOT target whose mean gap met it.", _PT),
    Series("slo_tpot_missed", Counter, "pagedserve_slo_tpot_missed",
           "Finished requests with a TPOT target whose mean gap missed it.", _PT),
    Series("slo_refused", Counter, "pagedserve_slo_refused",
           "Requests refused (503) because their first token could not be on time.", _PT),
    Series("slo_goodput_requests", Counter, "pagedserve_slo_goodput_requests",
           "Requests finished meeting every latency target they carry (rate(): goodput).",
           _PT),
    Series("slo_steps_over_tpot", Counter, "pagedserve_slo_steps_over_tpot",
           "Steps (slo policy) whose decodes, with the margin for the steps' jitter, "
           "left no prefill room within their tightest TPOT target."),
    Series("step_cost", Gauge, "pagedserve_step_cost_seconds",
           "The fitted step-cost model: seconds per step, per decode row, per prefill "
           "token, per key a prefill token attends to, per key a decode row attends "
           "to, per prompt chunk and per position of context before a chunk.", ("part",)),
    Series("lora_requests", Counter, "pagedserve_lora_requests",
           "Finished requests by the LoRA adapter they ran and finish reason.",
           ("lora_name", "finished_reason")),
)


# Our gauge -> vLLM's name for it (vllm/v1/metrics/loggers.py).
VLLM_GAUGES = (
    ("num_requests_running", "vllm:num_requests_running"),
    ("num_requests_waiting", "vllm:num_requests_waiting"),
    ("kv_cache_usage_perc", "vllm:kv_cache_usage_perc"),
)
VLLM_CACHE_CONFIG_INFO = "vllm:cache_config_info"
# The labels of vLLM's CacheConfig that we have (vLLM lists every field; the endpoint
# picker reads block_size and num_gpu_blocks), with `engine`, as vLLM's.
VLLM_CACHE_CONFIG_LABELS = ("block_size", "num_gpu_blocks", "enable_prefix_caching", "engine")
# vLLM's gauge of the adapters running and waiting: its value the time they last changed
# (the endpoint picker reads the newest sample's labels, names joined by commas).
VLLM_LORA_REQUESTS_INFO = "vllm:lora_requests_info"
VLLM_LORA_LABELS = ("running_lora_adapters", "max_lora", "waiting_lora_adapters")


@dataclass(frozen=True)
class LoRAInfo:
    """What `vllm:lora_requests_info` says of one core: its adapters, at `when` (time.time)."""

    max_lora: int
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    when: float


class VllmAliases(Collector):
    """vLLM's names for our scheduler gauges and KV pool, read at scrape time.

    Each `vllm:` gauge is our gauge of the same key, read when /metrics renders: the same
    values (no work per step), under vLLM's labels, `model_name` and `engine` ("0" without
    data parallelism; with it, one series per core, as vLLM's). `vllm:cache_config_info`
    is 1 per core, its KV pool in the labels, with no `model_name` (as vLLM's).
    """

    def __init__(self, families: dict[str, Any], cache_configs: dict[str, CacheConfig],
                 loras: dict[str, LoRAInfo]) -> None:
        self._families = families
        self._cache_configs = cache_configs  # engine label -> its core's KV pool
        self._loras = loras  # engine label -> its adapters (none without LoRA)

    def collect(self) -> Iterator[Metric]:
        for key, name in VLLM_GAUGES:
            (ours,) = self._families[key].collect()
            alias = GaugeMetricFamily(name, f"{ours.documentation} (vLLM's name)",
                                      labels=("model_name", "engine"))
            for sample in ours.samples:
                labels = sample.labels
                alias.add_metric((labels["model_name"], labels.get("engine", "0")),
                                 sample.value)
            yield alias
        info = GaugeMetricFamily(VLLM_CACHE_CONFIG_INFO, "The KV cache's configuration "
                                 "(vLLM's name and labels).", labels=VLLM_CACHE_CONFIG_LABELS)
        for engine, config in self._cache_configs.items():
            info.add_metric((str(config.block_size), str(config.num_blocks),
                             str(config.enable_prefix_caching), engine), 1)
        yield info
        if self._loras:
            lora = GaugeMetricFamily(VLLM_LORA_REQUESTS_INFO, "Running and waiting LoRA "
                                     "adapters (vLLM's name and labels).",
                                     labels=VLLM_LORA_LABELS)
            for state in self._loras.values():
                lora.add_metric((",".join(state.running), str(state.max_lora),
                                 ",".join(state.waiting)), state.when)
            yield lora


class PriorityLabels:
    """Maps priorities to label values: the first `limit` distinct ones as themselves."""

    def __init__(self, limit: int = MAX_PRIORITY_LABELS) -> None:
        self._limit = limit
        self._seen: set[int] = set()

    def __call__(self, priority: int) -> str:
        if priority in self._seen:
            return str(priority)
        if len(self._seen) < self._limit:
            self._seen.add(priority)
            return str(priority)
        return OTHER_PRIORITY


class ServerMetrics:
    """The server's metrics for one served model, or for one of its engine cores.

    With `engine` (data parallelism) every series also carries `engine`; the metrics of
    the other cores are views made with `shared=` the first one's, on the same registry
    (and the same priority labels).
    """

    def __init__(
        self, model_name: str, engine: str | None = None, shared: ServerMetrics | None = None
    ) -> None:
        self._base = (model_name,) if engine is None else (model_name, engine)
        self.registry: CollectorRegistry
        self.priority_label: PriorityLabels
        if shared is not None:
            self.registry = shared.registry
            self.priority_label = shared.priority_label
            self._families: dict[str, Any] = shared._families
            self._cache_configs: dict[str, CacheConfig] = shared._cache_configs
            self._loras: dict[str, LoRAInfo] = shared._loras
        else:
            self.registry = CollectorRegistry()
            self.priority_label = PriorityLabels()
            base_labels = ["model_name"] if engine is None else ["model_name", "engine"]
            self._families = {s.key: s.create(base_labels, self.registry) for s in SERIES}
            self._cache_configs = {}
            self._loras = {}
            self.registry.register(VllmAliases(self._families, self._cache_configs,
                                               self._loras))
        self._engine_label = engine or "0"
        # NOTE: `.labels()` costs a lock and a dict lookup per call: the hot paths (every
        # token) use the children of the series without labels of their own, made once
        # (which also exposes them before traffic); the others' children are made once
        # per label values, by `_child`.
        self._unlabelled = {s.key: self._families[s.key].labels(*self._base)
                            for s in SERIES if not s.labels}
        self._labelled: dict[str, dict[tuple[str, ...], Any]] = {
            s.key: {} for s in SERIES if s.labels
        }
        for series in SERIES:
            for value in series.exposed:
                self._child(series.key, value)

    def set_cache_config(self, cache_config: CacheConfig) -> None:
        """This core's KV pool, for `vllm:cache_config_info`."""
        self._cache_configs[self._engine_label] = cache_config

    def inc_preemptions(self, n: int) -> None:
        if n > 0:
            self._unlabelled["num_preemptions"].inc(n)

    def inc_prompt_tokens(self, n: int, tenant: str) -> None:
        self._unlabelled["prompt_tokens"].inc(n)
        self._child("tenant_prompt_tokens", tenant).inc(n)

    def inc_generation_tokens(self, n: int, by_tenant: dict[str, int]) -> None:
        if n > 0:
            self._unlabelled["generation_tokens"].inc(n)
        for tenant, tokens in by_tenant.items():
            self._child("tenant_generation_tokens", tenant).inc(tokens)

    def inc_request_success(self, finished_reason: str, tenant: str) -> None:
        self._child("request_success", finished_reason).inc()
        self._child("tenant_requests", tenant, finished_reason).inc()

    def inc_lora_request(self, lora_name: str, finished_reason: str) -> None:
        self._child("lora_requests", lora_name, finished_reason).inc()

    def set_lora_info(self, max_lora: int, running: tuple[str, ...],
                      waiting: tuple[str, ...]) -> None:
        """This core's adapters for `vllm:lora_requests_info`, stamped now when changed."""
        last = self._loras.get(self._engine_label)
        if last is None or (last.running, last.waiting) != (running, waiting):
            self._loras[self._engine_label] = LoRAInfo(max_lora, running, waiting, time.time())

    def inc_tenant_rejection(self, tenant: str, reason: str) -> None:
        self._child("tenant_rejections", tenant, reason).inc()

    def inc_prefix_cache(self, queries: int, hits: int) -> None:
        if queries > 0:
            self._unlabelled["prefix_cache_queries"].inc(queries)
        if hits > 0:
            self._unlabelled["prefix_cache_hits"].inc(hits)

    def set_scheduler_gauges(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        unlabelled = self._unlabelled
        unlabelled["num_requests_running"].set(running)
        unlabelled["num_requests_waiting"].set(waiting)
        unlabelled["kv_cache_usage_perc"].set(kv_cache_usage)

    def set_priority_stats(
        self,
        waiting: dict[int, int],
        running: dict[int, int],
        new_preemptions: dict[int, int],
    ) -> None:
        """Requests waiting and running per priority now (a label seen before and absent
        now reads 0), and the preemptions per priority since the last call."""
        for key, counts in (("num_requests_waiting_by_priority", waiting),
                            ("num_requests_running_by_priority", running)):
            by_labels: dict[tuple[str, ...], int] = {}
            for priority, n in counts.items():
                labels: tuple[str, ...] = (self.priority_label(priority),)
                by_labels[labels] = by_labels.get(labels, 0) + n
            children = self._labelled[key]
            for labels in by_labels:
                if labels not in children:
                    self._child(key, *labels)
            for seen, child in children.items():
                child.set(by_labels.get(seen, 0))
        for priority, n in new_preemptions.items():
            if n > 0:
                label = self.priority_label(priority)
                self._child("num_preemptions_by_priority", label).inc(n)

    def inc_spec_decode(self, stats: SpecDecodeStats, seen: SpecDecodeStats) -> None:
        """Speculation's counters, from the scheduler's cumulative `stats` and those `seen`
        last time."""
        unlabelled = self._unlabelled
        for key, now, before in (
            ("spec_decode_num_drafts", stats.num_drafts, seen.num_drafts),
            ("spec_decode_num_draft_tokens", stats.num_draft_tokens, seen.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", stats.num_accepted_tokens,
             seen.num_accepted_tokens),
        ):
            if now > before:
                unlabelled[key].inc(now - before)
        before_per_pos = seen.accepted_per_position
        for position, n in enumerate(stats.accepted_per_position):
            new = n - (before_per_pos[position] if position < len(before_per_pos) else 0)
            if new > 0:
                self._child("spec_decode_num_accepted_tokens_per_pos", str(position)).inc(new)
        for key, counts, before_counts in (
            ("spec_decode_num_draft_tokens_by_priority", stats.draft_tokens_by_priority,
             seen.draft_tokens_by_priority),
            ("spec_decode_num_accepted_tokens_by_priority", stats.accepted_tokens_by_priority,
             seen.accepted_tokens_by_priority),
        ):
            for priority, n in counts.items():
                if n > before_counts.get(priority, 0):
                    self._child(key, self.priority_label(priority)).inc(
                        n - before_counts.get(priority, 0))

    def observe_iteration_tokens(self, num_tokens: int) -> None:
        self._unlabelled["iteration_tokens"].observe(num_tokens)

    def observe_request_phases(self, prefill_s: float | None, decode_s: float | None) -> None:
        """A finished request's prefill time (first scheduled to first token) and decode
        time (first token to finish); None when it never got that far."""
        if prefill_s is not None:
            self._unlabelled["request_prefill_time"].observe(prefill_s)
        if decode_s is not None:
            self._unlabelled["request_decode_time"].observe(decode_s)

    def observe_ttft(self, seconds: float, priority: int) -> None:
        self._child("time_to_first_token", self.priority_label(priority)).observe(seconds)

    def observe_queue_time(self, seconds: float, priority: int, tenant: str) -> None:
        self._child("request_queue_time", self.priority_label(priority)).observe(seconds)
        self._child("tenant_queue_time", tenant).observe(seconds)

    def observe_slo(self, priority: int, tenant: str, verdict: dict[str, bool] | None) -> None:
        """A finished request's latency targets, each met or missed (`verdict`, None
        without targets), and goodput (every target it carries met)."""
        labels = (self.priority_label(priority), tenant)
        for target, met in (verdict or {}).items():
            name = target.removesuffix("_met")
            self._child(f"slo_{name}_met" if met else f"slo_{name}_missed", *labels).inc()
        if verdict is None or all(verdict.values()):
            self._child("slo_goodput_requests", *labels).inc()

    def inc_slo_refused(self, priority: int, tenant: str) -> None:
        self._child("slo_refused", self.priority_label(priority), tenant).inc()

    def set_step_cost(self, cost: tuple[float, ...], new_steps_over: int) -> None:
        """The fitted step-cost model, and the steps over their TPOT target since the
        last call."""
        parts = ("fixed", "per_decode", "per_prefill", "per_prefill_key", "per_decode_key",
                 "per_chunk", "per_chunk_context")
        for part, value in zip(parts, cost, strict=True):
            self._child("step_cost", part).set(value)
        if new_steps_over > 0:
            self._unlabelled["slo_steps_over_tpot"].inc(new_steps_over)

    def observe_inter_token_latency(self, seconds: float) -> None:
        self._unlabelled["inter_token_latency"].observe(seconds)

    def observe_e2e_latency(self, seconds: float) -> None:
        self._unlabelled["e2e_request_latency"].observe(seconds)

    def _child(self, key: str, *labels: str) -> Any:
        """Series `key`'s child of these label values (after `model_name`, `engine`)."""
        children = self._labelled[key]
        child = children.get(labels)
        if child is None:
            child = children[labels] = self._families[key].labels(*self._base, *labels)
        return child

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return prometheus_client.generate_latest(self.registry)
