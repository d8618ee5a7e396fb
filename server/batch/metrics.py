"""The Batch API's Prometheus series, in the engine's registry (served by GET /metrics).

pagedserve_batch_lines_total{status}: lines ended (done, failed, expired, cancelled): its
rate is the lines per second. pagedserve_batch_lines_in_flight: lines in the engine now.
pagedserve_batch_lines_pending: lines of the active batches not yet ended. The batch
class's share of the engine's steps is pagedserve_num_requests_running_by_priority at
--batch-priority against all running.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class BatchMetrics:
    """The series, each with the served model's `model_name` as every series has."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._model_name = model_name
        self._lines = Counter("pagedserve_batch_lines", "Batch lines ended, by status.",
                              ["model_name", "status"], registry=registry)
        self.in_flight = Gauge("pagedserve_batch_lines_in_flight", "Batch lines in the engine.",
                               ["model_name"], registry=registry).labels(model_name)
        self.pending = Gauge("pagedserve_batch_lines_pending",
                             "Lines of the active batches not yet ended.", ["model_name"],
                             registry=registry).labels(model_name)

    def ended(self, status: str, num_lines: int = 1) -> None:
        self._lines.labels(self._model_name, status).inc(num_lines)
