"""Prometheus metrics with the SPEC's names, in a registry of their own.

prometheus-client appends `_total` to counter names, so counters are declared without
it. Every series carries `model_name`; TTFT, queue time, the per-priority gauges and the
per-priority preemption counter also carry `priority`, bounded to the first
MAX_PRIORITY_LABELS distinct values (later ones are "other"). The `pagedserve_tenant_*`
series carry `tenant`, a name from the tenants file (or "default"), so they are bounded.
The engine front end writes (under its lock), the HTTP handlers count rejections;
/metrics reads through `render()`.
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

MAX_PRIORITY_LABELS = 16
OTHER_PRIORITY = "other"

# NOTE: no `*_created` series: the exposed names are exactly the SPEC's.
prometheus_client.disable_created_metrics()

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


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
    the other cores are views made with `shared=` the first one's, on the same registry.
    """

    def __init__(
        self, model_name: str, engine: str | None = None, shared: ServerMetrics | None = None
    ) -> None:
        self._base = (model_name,) if engine is None else (model_name, engine)
        if shared is not None:
            self.__dict__.update({
                name: value for name, value in vars(shared).items()
                if isinstance(value, (Counter, Gauge, Histogram, CollectorRegistry,
                                      PriorityLabels))
            })
        else:
            self._define(["model_name"] if engine is None else ["model_name", "engine"])
        self._children()

    def _define(self, m: list[str]) -> None:
        self.registry = CollectorRegistry()
        self.priority_label = PriorityLabels()
        r = self.registry
        self.num_preemptions = Counter(
            "pagedserve_num_preemptions", "Preemptions of running requests.", m, registry=r
        )
        self.prompt_tokens = Counter(
            "pagedserve_prompt_tokens", "Prompt tokens of requests that started decoding.",
            m, registry=r,
        )
        self.generation_tokens = Counter(
            "pagedserve_generation_tokens", "Generated tokens.", m, registry=r
        )
        self.request_success = Counter(
            "pagedserve_request_success", "Finished requests by finish reason.",
            [*m, "finished_reason"], registry=r,
        )
        self.prefix_cache_queries = Counter(
            "pagedserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            m, registry=r,
        )
        self.prefix_cache_hits = Counter(
            "pagedserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
            m, registry=r,
        )
        self.num_requests_running = Gauge(
            "pagedserve_num_requests_running", "Requests running.", m, registry=r
        )
        self.num_requests_waiting = Gauge(
            "pagedserve_num_requests_waiting", "Requests waiting (preempted ones included).",
            m, registry=r,
        )
        self.kv_cache_usage_perc = Gauge(
            "pagedserve_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).",
            m, registry=r,
        )
        self.time_to_first_token = Histogram(
            "pagedserve_time_to_first_token_seconds", "Arrival to first generated token.",
            [*m, "priority"], buckets=_TTFT_BUCKETS, registry=r,
        )
        self.inter_token_latency = Histogram(
            "pagedserve_inter_token_latency_seconds", "Time between generated tokens.",
            m, buckets=_ITL_BUCKETS, registry=r,
        )
        self.e2e_request_latency = Histogram(
            "pagedserve_e2e_request_latency_seconds", "Arrival to finish.",
            m, buckets=_REQUEST_BUCKETS, registry=r,
        )
        self.request_queue_time = Histogram(
            "pagedserve_request_queue_time_seconds", "Arrival to first scheduled.",
            [*m, "priority"], buckets=_REQUEST_BUCKETS, registry=r,
        )
        p = [*m, "priority"]
        self.num_requests_waiting_by_priority = Gauge(
            "pagedserve_num_requests_waiting_by_priority", "Requests waiting, by priority.",
            p, registry=r,
        )
        self.num_requests_running_by_priority = Gauge(
            "pagedserve_num_requests_running_by_priority", "Requests running, by priority.",
            p, registry=r,
        )
        self.num_preemptions_by_priority = Counter(
            "pagedserve_num_preemptions_by_priority", "Preemptions, by the victim's priority.",
            p, registry=r,
        )
        self.request_prefill_time = Histogram(
            "pagedserve_request_prefill_time_seconds",
            "First scheduled to first generated token (the prompt's computation).",
            m, buckets=_REQUEST_BUCKETS, registry=r,
        )
        self.request_decode_time = Histogram(
            "pagedserve_request_decode_time_seconds", "First generated token to finish.",
            m, buckets=_REQUEST_BUCKETS, registry=r,
        )
        self.iteration_tokens = Histogram(
            "pagedserve_iteration_tokens", "Tokens computed per engine step.",
            m, buckets=_ITERATION_TOKEN_BUCKETS, registry=r,
        )
        t = [*m, "tenant"]
        self.tenant_requests = Counter(
            "pagedserve_tenant_requests", "Finished requests by tenant and finish reason.",
            [*t, "finished_reason"], registry=r,
        )
        self.tenant_prompt_tokens = Counter(
            "pagedserve_tenant_prompt_tokens", "Prompt tokens by tenant.", t, registry=r
        )
        self.tenant_generation_tokens = Counter(
            "pagedserve_tenant_generation_tokens", "Generated tokens by tenant.", t, registry=r
        )
        self.tenant_rejections = Counter(
            "pagedserve_tenant_rejections",
            "Requests refused by a tenant limit, by reason (priority, in_flight, rate).",
            [*t, "reason"], registry=r,
        )
        self.tenant_queue_time = Histogram(
            "pagedserve_tenant_request_queue_time_seconds", "Arrival to first scheduled.",
            t, buckets=_REQUEST_BUCKETS, registry=r,
        )

    def _children(self) -> None:
        base = self._base
        self._tenant_children: dict[tuple[Any, ...], Any] = {}
        # Create the label-only series up front so that they are exposed before traffic.
        for metric in (self.num_preemptions, self.prompt_tokens, self.generation_tokens,
                       self.prefix_cache_queries, self.prefix_cache_hits,
                       self.num_requests_running, self.num_requests_waiting,
                       self.kv_cache_usage_perc, self.inter_token_latency,
                       self.e2e_request_latency, self.request_prefill_time,
                       self.request_decode_time, self.iteration_tokens):
            metric.labels(*base)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(*base, reason)
        # NOTE: `.labels()` costs a lock and a dict lookup per call: the hot paths (every
        # token) use these children, looked up once.
        self._preemptions = self.num_preemptions.labels(*base)
        self._prompt_tokens = self.prompt_tokens.labels(*base)
        self._generation_tokens = self.generation_tokens.labels(*base)
        self._prefix_cache_queries = self.prefix_cache_queries.labels(*base)
        self._prefix_cache_hits = self.prefix_cache_hits.labels(*base)
        self._num_requests_running = self.num_requests_running.labels(*base)
        self._num_requests_waiting = self.num_requests_waiting.labels(*base)
        self._kv_cache_usage_perc = self.kv_cache_usage_perc.labels(*base)
        self._inter_token_latency = self.inter_token_latency.labels(*base)
        self._e2e_request_latency = self.e2e_request_latency.labels(*base)
        self._request_prefill_time = self.request_prefill_time.labels(*base)
        self._request_decode_time = self.request_decode_time.labels(*base)
        self._iteration_tokens = self.iteration_tokens.labels(*base)
        self._waiting_by_priority: dict[str, Any] = {}  # by priority label, ever seen
        self._running_by_priority: dict[str, Any] = {}
        self._preemptions_by_priority: dict[str, Any] = {}
        self._request_success: dict[str, Any] = {}
        self._ttft: dict[str, Any] = {}  # by priority label
        self._queue_time: dict[str, Any] = {}

    def inc_preemptions(self, n: int) -> None:
        if n > 0:
            self._preemptions.inc(n)

    def inc_prompt_tokens(self, n: int, tenant: str) -> None:
        self._prompt_tokens.inc(n)
        self._tenant(self.tenant_prompt_tokens, tenant).inc(n)

    def inc_generation_tokens(self, n: int, by_tenant: dict[str, int]) -> None:
        if n > 0:
            self._generation_tokens.inc(n)
        for tenant, tokens in by_tenant.items():
            self._tenant(self.tenant_generation_tokens, tenant).inc(tokens)

    def inc_request_success(self, finished_reason: str, tenant: str) -> None:
        child = self._request_success.get(finished_reason)
        if child is None:
            child = self.request_success.labels(*self._base, finished_reason)
            self._request_success[finished_reason] = child
        child.inc()
        self._tenant(self.tenant_requests, tenant, finished_reason).inc()

    def inc_tenant_rejection(self, tenant: str, reason: str) -> None:
        self._tenant(self.tenant_rejections, tenant, reason).inc()

    def inc_prefix_cache(self, queries: int, hits: int) -> None:
        if queries > 0:
            self._prefix_cache_queries.inc(queries)
        if hits > 0:
            self._prefix_cache_hits.inc(hits)

    def set_scheduler_gauges(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        self._num_requests_running.set(running)
        self._num_requests_waiting.set(waiting)
        self._kv_cache_usage_perc.set(kv_cache_usage)

    def set_priority_stats(
        self,
        waiting: dict[int, int],
        running: dict[int, int],
        new_preemptions: dict[int, int],
    ) -> None:
        """Requests waiting and running per priority now (a label seen before and absent
        now reads 0), and the preemptions per priority since the last call."""
        for gauge, children, counts in (
            (self.num_requests_waiting_by_priority, self._waiting_by_priority, waiting),
            (self.num_requests_running_by_priority, self._running_by_priority, running),
        ):
            by_label: dict[str, int] = {}
            for priority, n in counts.items():
                label = self.priority_label(priority)
                by_label[label] = by_label.get(label, 0) + n
            for label in by_label.keys() - children.keys():
                children[label] = gauge.labels(*self._base, label)
            for label, child in children.items():
                child.set(by_label.get(label, 0))
        for priority, n in new_preemptions.items():
            if n > 0:
                self._by_priority(
                    self.num_preemptions_by_priority, self._preemptions_by_priority, priority
                ).inc(n)

    def observe_iteration_tokens(self, num_tokens: int) -> None:
        self._iteration_tokens.observe(num_tokens)

    def observe_request_phases(self, prefill_s: float | None, decode_s: float | None) -> None:
        """A finished request's prefill time (first scheduled to first token) and decode
        time (first token to finish); None when it never got that far."""
        if prefill_s is not None:
            self._request_prefill_time.observe(prefill_s)
        if decode_s is not None:
            self._request_decode_time.observe(decode_s)

    def observe_ttft(self, seconds: float, priority: int) -> None:
        self._by_priority(self.time_to_first_token, self._ttft, priority).observe(seconds)

    def observe_queue_time(self, seconds: float, priority: int, tenant: str) -> None:
        self._by_priority(self.request_queue_time, self._queue_time, priority).observe(seconds)
        self._tenant(self.tenant_queue_time, tenant).observe(seconds)

    def observe_inter_token_latency(self, seconds: float) -> None:
        self._inter_token_latency.observe(seconds)

    def observe_e2e_latency(self, seconds: float) -> None:
        self._e2e_request_latency.observe(seconds)

    def _by_priority(
        self, metric: Histogram | Counter, children: dict[str, Any], priority: int
    ) -> Any:
        label = self.priority_label(priority)
        child = children.get(label)
        if child is None:
            child = children[label] = metric.labels(*self._base, label)
        return child

    def _tenant(self, metric: Histogram | Counter, tenant: str, *labels: str) -> Any:
        key = (metric, tenant, *labels)
        child = self._tenant_children.get(key)
        if child is None:
            child = self._tenant_children[key] = metric.labels(*self._base, tenant, *labels)
        return child

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return prometheus_client.generate_latest(self.registry)
