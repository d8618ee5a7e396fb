"""`BatchAPI`: the Batch API of one app: its store opened (StoreError: the server does not
start), its routes installed, its feeder run by the app's lifespan."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI

from engine.client import EngineClient
from engine.data_parallel import DataParallelEngine
from server.admission import Admission
from server.batch.batch_routes import install_batch_routes
from server.batch.config import BatchConfig
from server.batch.feeder import Feeder
from server.batch.file_routes import install_file_routes
from server.batch.line_runner import LineRunner, Route
from server.batch.metrics import BatchMetrics
from server.batch.store import BatchStore
from server.tenants import TenantRegistry

# what a multipart upload adds to its file's bytes, at most (the body's limit on /v1/files)
MULTIPART_OVERHEAD_BYTES = 64 * 1024


class BatchAPI:
    def __init__(self, app: FastAPI, admission: Admission, routes: dict[str, Route],
                 tenants: TenantRegistry, config: BatchConfig,
                 engine: EngineClient | DataParallelEngine) -> None:
        assert config.data_dir is not None
        self.store = BatchStore(config.data_dir)
        metrics = BatchMetrics(engine.metrics.registry, engine.info.model_name)
        runner = LineRunner(admission, routes, config.priority)
        self.feeder = Feeder(self.store, runner, tenants, config.max_in_flight,
                             lambda: engine.num_waiting, metrics)
        metrics.pending.set_function(self.feeder.num_pending)
        install_file_routes(app, self.store, config)
        install_batch_routes(app, admission, self.store, self.feeder, config)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Resume the batches a previous server left, then feed (on the app's loop)."""
        self.feeder.resume()
        self._task = asyncio.ensure_future(self.feeder.run())

    async def stop(self) -> None:
        """Stop feeding: the lines in the engine are aborted and stay pending."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.store.close()
