"""HTTP server configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from server.batch.config import BatchConfig
from server.limits import RequestLimits
from server.slo import MAX_TARGET_MS


@dataclass(frozen=True)
class ServerConfig:
    """Where to listen and what the HTTP front end accepts.

    served_model_name: the name clients send as `model` and responses report (None: the
    loaded model's name); model_aliases: more names clients may send. chat_template: a
    Jinja template's text instead of the tokenizer's. tool_call_parser, reasoning_parser:
    names from server/tool_parsers.py and server/reasoning.py (None: off).
    api_key: when set, every route but /health and /metrics needs
    `Authorization: Bearer <key>`; it is left out of repr so it never reaches a log.
    metrics_api_key: when set, GET /metrics needs it as its bearer key (else it is open,
    as Prometheus expects); left out of repr too.
    max_waiting: new requests get 503 while this many requests wait (None: no limit).
    shutdown_grace_s: on SIGTERM, how long in-flight requests may run before they are
    aborted. limits: what one request may ask for (server/limits.py). step_timeout_s: an engine step
    running longer makes /health and new requests answer 503 (None: no limit).
    snapshot_timeout_s: GET /scheduler/state answers 503 when the core takes longer.
    body_timeout_s: a request body not fully received by then is a 408.
    limit_concurrency: uvicorn answers 503 beyond this many connections and tasks (None:
    no limit). tenants_file: the tenants, their keys and limits (server/tenants.py);
    exclusive with api_key, reloaded on SIGHUP. batch: the Batch API (server/batch/config.py;
    off without a data directory). default_slo_ttft_ms,
    default_slo_tpot_ms: latency targets of requests that (and whose tenant) give none
    (server/slo.py).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    model_aliases: tuple[str, ...] = ()
    chat_template: str | None = field(default=None, repr=False)
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    api_key: str | None = field(default=None, repr=False)
    metrics_api_key: str | None = field(default=None, repr=False)
    tenants_file: str | None = None
    max_waiting: int | None = None
    shutdown_grace_s: float = 30.0
    step_timeout_s: float | None = 300.0
    limits: RequestLimits = field(default_factory=RequestLimits)
    batch: BatchConfig = field(default_factory=BatchConfig)
    retry_after_s: int = 1
    snapshot_timeout_s: float = 5.0
    body_timeout_s: float = 30.0
    limit_concurrency: int | None = None
    log_level: str = "info"
    runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter, unload (server/lora.py)
    default_slo_ttft_ms: int | None = None
    default_slo_tpot_ms: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in [0, 65535]")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.metrics_api_key is not None and not self.metrics_api_key:
            raise ValueError("metrics_api_key must not be empty")
        if self.api_key is not None and self.tenants_file is not None:
            raise ValueError("give either an API key or a tenants file (its tenants have keys)")
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")
        if self.step_timeout_s is not None and self.step_timeout_s <= 0:
            raise ValueError("step_timeout_s must be > 0")
        if self.body_timeout_s <= 0:
            raise ValueError("body_timeout_s must be > 0")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError("limit_concurrency must be >= 1")
        if self.snapshot_timeout_s <= 0:
            raise ValueError("snapshot_timeout_s must be > 0")
        if self.retry_after_s < 1:
            raise ValueError("retry_after_s must be >= 1")
        for name in ("default_slo_ttft_ms", "default_slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= MAX_TARGET_MS:
                raise ValueError(f"--{name.replace('_', '-')} must be in [1, {MAX_TARGET_MS}]")
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ValueError(f"unknown log level {self.log_level!r}")
