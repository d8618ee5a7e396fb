"""POST /v1/batches, GET /v1/batches/{id}, GET /v1/batches (`after`, `limit`), POST
/v1/batches/{id}/cancel: OpenAI's shapes, each batch its tenant's alone (another tenant's
key gets 404).

A batch is validated when it is created: an input file over --max-batch-lines is a 400
naming the flag; one that is not JSONL, names another endpoint or repeats a custom_id is a
`failed` batch with OpenAI's `errors` (server/batch/input_file.py); otherwise its lines are
stored and it is `in_progress`, for the feeder (server/batch/feeder.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from server.admission import Admission
from server.batch.config import BatchConfig
from server.batch.feeder import Feeder
from server.batch.file_routes import file_of, tenant_name
from server.batch.input_file import InputLines, read_input
from server.batch.store import DONE, FAILED, BatchStore, StoreError, new_id
from server.errors import APIError, server_error
from server.limits import over_limit

_MAX_LIST = 100
_TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
          "cancelling_at", "cancelled_at")
_FINAL = ("completed", "failed", "expired", "cancelled")


class CreateBatchRequest(BaseModel):
    """POST /v1/batches' body."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(max_length=64)
    endpoint: Literal["/v1/completions", "/v1/chat/completions", "/v1/responses"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


def batch_object(row: dict[str, Any], counts: dict[str, int]) -> dict[str, Any]:
    """OpenAI's batch object of a store row and its lines' counts by status."""
    times = json.loads(row["times"])
    return {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"],
        "errors": json.loads(row["errors"]) if row["errors"] else None,
        "input_file_id": row["input_file_id"], "completion_window": "24h",
        "status": row["status"], "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"], "created_at": row["created_at"],
        "expires_at": int(row["expires_at"]), **{name: times.get(name) for name in _TIMES},
        "request_counts": {"total": sum(counts.values()), "completed": counts.get(DONE, 0),
                           "failed": counts.get(FAILED, 0)},
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
    }


def install_batch_routes(app: FastAPI, admission: Admission, store: BatchStore,
                         feeder: Feeder, config: BatchConfig) -> None:
    def shown(row: dict[str, Any]) -> dict[str, Any]:
        return batch_object(row, store.counts(row["id"]))

    def batch_of(raw: Request, batch_id: str) -> dict[str, Any]:
        row = store.get_batch(batch_id, tenant_name(raw))
        if row is None:
            raise APIError(404, f"No such Batch object: {batch_id[:64]}", param="batch_id",
                           code="batch_not_found")
        return row

    @app.post("/v1/batches")
    async def create(raw: Request) -> dict[str, Any]:
        body = await admission.parse_json(raw, CreateBatchRequest)
        batch_id = await _create(store, config, file_of(store, raw, body.input_file_id), body)
        created = batch_of(raw, batch_id)
        if created["status"] == "in_progress":
            feeder.add(created)
        return shown(created)

    @app.get("/v1/batches/{batch_id}")
    async def get(raw: Request, batch_id: str) -> dict[str, Any]:
        return shown(batch_of(raw, batch_id))

    @app.get("/v1/batches")
    async def list_batches(raw: Request, after: str | None = None,
                           limit: int = 20) -> dict[str, Any]:
        limit = max(1, min(limit, _MAX_LIST))
        rows = store.list_batches(tenant_name(raw), after, limit + 1)
        data = [shown(r) for r in rows[:limit]]
        return {"object": "list", "data": data, "has_more": len(rows) > limit,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None}

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(raw: Request, batch_id: str) -> dict[str, Any]:
        row = batch_of(raw, batch_id)
        if row["status"] == "in_progress":
            store.set_status(batch_id, "cancelling")
            feeder.cancel(batch_id)
        elif row["status"] in _FINAL and row["status"] != "cancelled":
            raise APIError(409, f"Batch {batch_id} is {row['status']}: it can no longer be "
                           "cancelled.", param="batch_id", code="batch_not_cancellable")
        return shown(batch_of(raw, batch_id))


async def _create(store: BatchStore, config: BatchConfig, source: dict[str, Any],
                  body: CreateBatchRequest) -> str:
    """The batch of `source` (the tenant's file) stored, in progress or failed; its id."""
    if source["purpose"] != "batch":
        raise APIError(400, f"File {source['id']} has purpose {source['purpose']!r}, "
                       "not 'batch'.", param="input_file_id")
    lines = await asyncio.to_thread(_read, store, source["id"], body.endpoint)
    if len(lines.lines) > config.max_lines:
        raise APIError(400, over_limit(
            f"The input file has {len(lines.lines)} lines", config.max_lines,
            "max_batch_lines"), param="input_file_id", code="too_many_lines")
    now = time.time()
    row = {"id": new_id("batch_"), "tenant": source["tenant"], "endpoint": body.endpoint,
           "input_file_id": source["id"], "created_at": int(now),
           "expires_at": now + config.completion_window_s, "metadata": body.metadata}
    try:
        await asyncio.to_thread(store.create_batch, row,
                                None if lines.errors else lines.lines, lines.errors)
    except StoreError as exc:
        raise server_error(507, str(exc)) from exc
    return str(row["id"])


def _read(store: BatchStore, file_id: str, endpoint: str) -> InputLines:
    """The input file's lines (on a worker thread: it may be hundreds of megabytes)."""
    try:
        data = store.file_path(file_id).read_bytes()
    except OSError as exc:
        raise server_error(500, f"The input file cannot be read: {exc}.") from exc
    return read_input(data, endpoint)


