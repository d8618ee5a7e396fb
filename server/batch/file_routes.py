"""POST /v1/files (multipart: `file`, `purpose` "batch"), GET /v1/files, GET
/v1/files/{id}, GET /v1/files/{id}/content, DELETE /v1/files/{id}: OpenAI's shapes, each
file its tenant's alone (another tenant's key gets 404). An upload is written to disk as
it arrives, held to --max-batch-file-bytes (413 naming it), and named in the store only
once whole.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.responses import FileResponse

from server.batch.config import BatchConfig
from server.batch.store import BatchStore, StoreError, new_id
from server.errors import APIError, server_error
from server.limits import over_limit

_CHUNK_BYTES = 1 << 20
_MAX_LIST = 10_000
# the purposes a client may upload; batch_output is the server's own files'
UPLOAD_PURPOSES = ("batch",)


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's file object of a store row."""
    return {"id": row["id"], "object": "file", "bytes": row["bytes"],
            "created_at": row["created_at"], "filename": row["filename"],
            "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


def tenant_name(raw: Request) -> str:
    return str(raw.state.tenant.name)


def file_of(store: BatchStore, raw: Request, file_id: str) -> dict[str, Any]:
    """The tenant's file `file_id`, else 404 (another tenant's file is no different)."""
    row = store.get_file(file_id, tenant_name(raw))
    if row is None:
        raise APIError(404, f"No such File object: {file_id[:64]}", param="file_id",
                       code="file_not_found")
    return row


def install_file_routes(app: FastAPI, store: BatchStore, config: BatchConfig) -> None:
    @app.post("/v1/files")
    async def upload(raw: Request, file: UploadFile = File(...),  # noqa: B008
                     purpose: str = Form(...)) -> dict[str, Any]:
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(400, f"purpose {purpose[:64]!r} is not supported: this server "
                           "takes files for 'batch'.", param="purpose")
        file_id = new_id("file-")
        num_bytes = await _save(file, store, file_id, config.max_file_bytes)
        try:
            row = store.add_file(file_id, tenant_name(raw), file.filename or "upload.jsonl",
                                 purpose, num_bytes)
        except StoreError as exc:
            store.file_path(file_id).unlink(missing_ok=True)
            raise server_error(507, str(exc)) from exc
        return file_object(row)

    @app.get("/v1/files")
    async def list_files(raw: Request, purpose: str | None = None,
                         limit: int = _MAX_LIST) -> dict[str, Any]:
        rows = store.list_files(tenant_name(raw), purpose, max(1, min(limit, _MAX_LIST)))
        return {"object": "list", "data": [file_object(r) for r in rows],
                "has_more": False, "first_id": rows[0]["id"] if rows else None,
                "last_id": rows[-1]["id"] if rows else None}

    @app.get("/v1/files/{file_id}")
    async def get_file(raw: Request, file_id: str) -> dict[str, Any]:
        return file_object(file_of(store, raw, file_id))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(raw: Request, file_id: str) -> FileResponse:
        row = file_of(store, raw, file_id)
        return FileResponse(store.file_path(row["id"]), media_type="application/jsonl",
                            filename=row["filename"])

    @app.delete("/v1/files/{file_id}")
    async def delete_file(raw: Request, file_id: str) -> dict[str, Any]:
        row = file_of(store, raw, file_id)
        try:
            store.delete_file(row["id"])
        except StoreError as exc:
            raise server_error(507, str(exc)) from exc
        return {"id": row["id"], "object": "file", "deleted": True}


async def _save(file: UploadFile, store: BatchStore, file_id: str, limit: int) -> int:
    """The upload's bytes at the file's path, within `limit` (413 naming the flag; 507 when
    the disk refuses them); nothing stays on disk on a failure."""
    path = store.file_path(file_id)
    num_bytes = 0
    try:
        with open(path, "wb") as out:
            while chunk := await file.read(_CHUNK_BYTES):
                num_bytes += len(chunk)
                if num_bytes > limit:
                    raise APIError(413, over_limit(
                        f"The file is larger than {limit} bytes", limit,
                        "max_batch_file_bytes"), param="file", code="file_too_large")
                out.write(chunk)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise server_error(507, f"The file cannot be stored: {exc}.") from exc
    except APIError:
        path.unlink(missing_ok=True)
        raise
    return num_bytes
