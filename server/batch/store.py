"""`BatchStore`: every file's, batch's and line's state in one SQLite database (the
standard library's sqlite3, WAL mode) under the data directory, the files' bytes beside it.

A line's result and its "done" mark are one UPDATE, so one transaction: a server killed
at any moment has each line either done (its result kept, never run again) or pending (run
again). An output or error file is written whole (temp file, fsync, rename) before the
transaction that names it commits. One server per data directory (an exclusive lock).
Failures of the disk or the database raise `StoreError`, one message naming the path.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, filename TEXT NOT NULL,
    purpose TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, tenant TEXT NOT NULL,
    endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, status TEXT NOT NULL,
    created_at INTEGER NOT NULL, expires_at REAL NOT NULL, metadata TEXT,
    errors TEXT, output_file_id TEXT, error_file_id TEXT, times TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT NOT NULL,
    body TEXT NOT NULL, status TEXT NOT NULL, result TEXT,
    PRIMARY KEY (batch_id, line_no));
CREATE INDEX IF NOT EXISTS lines_by_status ON lines (batch_id, status, line_no);
"""

# A line's states: pending until its result is committed with one of the others.
PENDING, DONE, FAILED, EXPIRED, CANCELLED = "pending", "done", "failed", "expired", "cancelled"
# The batch statuses whose lines the feeder still owes work.
ACTIVE = ("in_progress", "finalizing", "cancelling")


class StoreError(RuntimeError):
    """The store cannot read or write (disk full, corrupt database, taken directory)."""


@dataclass(frozen=True)
class PendingLine:
    batch_id: str
    line_no: int
    custom_id: str
    body: str


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


class BatchStore:
    """The database and the files directory of one data directory (thread-safe: one
    connection behind a lock, as batches are validated on a worker thread)."""

    def __init__(self, data_dir: Path) -> None:
        self.files_dir = data_dir / "files"
        self.path = data_dir / "batches.sqlite3"
        try:
            self.files_dir.mkdir(parents=True, exist_ok=True)
            self._lock_file = open(data_dir / "lock", "a+")  # noqa: SIM115 (held open)
        except OSError as exc:
            raise StoreError(f"cannot use --data-dir {data_dir}: {exc}") from exc
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._lock_file.close()
            raise StoreError(f"--data-dir {data_dir} is used by another server: give each "
                             "server its own") from exc
        self._lock = threading.Lock()
        self._db = self._connect()

    def _connect(self) -> sqlite3.Connection:
        try:
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            # NOTE: in WAL mode NORMAL keeps every commit through a crash of the process
            # (SIGKILL); only a power loss may drop the last ones, which then run again.
            db.execute("PRAGMA synchronous=NORMAL")
            verdict = db.execute("PRAGMA quick_check").fetchone()[0]
            if verdict != "ok":
                raise sqlite3.DatabaseError(verdict)
            db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise StoreError(f"the batch store {self.path} is unreadable ({exc}): move it "
                             "away to start afresh") from exc
        return db

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._lock_file.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One transaction (committed whole or not at all); StoreError on any failure."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                except BaseException:
                    if self._db.in_transaction:  # NOTE: SQLITE_FULL rolls back on its own
                        self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                raise StoreError(f"the batch store {self.path} cannot be written: {exc}") from exc

    def _query(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        with self._lock:
            try:
                cursor = self._db.execute(sql, args)
                names = [d[0] for d in cursor.description]
                return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
            except sqlite3.Error as exc:
                raise StoreError(f"the batch store {self.path} cannot be read: {exc}") from exc

    # ------------------------------------------------------------ files

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, file_id: str, tenant: str, filename: str, purpose: str,
                 num_bytes: int) -> dict[str, Any]:
        """The row of a file whose bytes are already at `file_path(file_id)`."""
        row = dict(id=file_id, tenant=tenant, filename=filename, purpose=purpose,
                   bytes=num_bytes, created_at=int(time.time()))
        with self._transaction() as db:
            db.execute("INSERT INTO files VALUES (:id, :tenant, :filename, :purpose, :bytes, "
                       ":created_at)", row)
        return row

    def get_file(self, file_id: str, tenant: str) -> dict[str, Any] | None:
        rows = self._query("SELECT * FROM files WHERE id = ? AND tenant = ?", file_id, tenant)
        return rows[0] if rows else None

    def list_files(self, tenant: str, purpose: str | None, limit: int) -> list[dict[str, Any]]:
        return self._query(
            "SELECT * FROM files WHERE tenant = ? AND (? IS NULL OR purpose = ?) "
            "ORDER BY created_at DESC, id LIMIT ?", tenant, purpose, purpose, limit)

    def delete_file(self, file_id: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.file_path(file_id).unlink(missing_ok=True)

    # ------------------------------------------------------------ batches

    def create_batch(self, row: dict[str, Any], lines: list[tuple[str, str]] | None,
                     errors: dict[str, Any] | None) -> None:
        """A batch and its lines (`(custom_id, body)` each) in one transaction: in
        progress, or failed with OpenAI's `errors` object when `lines` is None."""
        now = int(time.time())
        status = "in_progress" if lines is not None else "failed"
        times = {"in_progress_at": now} if lines is not None else {"failed_at": now}
        with self._transaction() as db:
            db.execute(
                "INSERT INTO batches (id, tenant, endpoint, input_file_id, status, "
                "created_at, expires_at, metadata, errors, times) VALUES (?, ?, ?, ?, ?, ?, "
                "?, ?, ?, ?)",
                (row["id"], row["tenant"], row["endpoint"], row["input_file_id"], status,
                 row["created_at"], row["expires_at"], json.dumps(row["metadata"]),
                 json.dumps(errors) if errors else None, json.dumps(times)))
            db.executemany(
                "INSERT INTO lines VALUES (?, ?, ?, ?, 'pending', NULL)",
                ((row["id"], i, custom_id, body) for i, (custom_id, body)
                 in enumerate(lines or ())))

    def get_batch(self, batch_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        rows = self._query("SELECT * FROM batches WHERE id = ? AND (? IS NULL OR tenant = ?)",
                           batch_id, tenant, tenant)
        return rows[0] if rows else None

    def list_batches(self, tenant: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        """Newest first; those created before the batch `after`, when given."""
        return self._query(
            "SELECT * FROM batches WHERE tenant = ? AND seq < COALESCE((SELECT seq FROM "
            "batches WHERE id = ?), 1 << 62) ORDER BY seq DESC LIMIT ?", tenant, after, limit)

    def active_batches(self) -> list[dict[str, Any]]:
        marks = ", ".join("?" * len(ACTIVE))
        return self._query(f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY seq",
                           *ACTIVE)

    def set_status(self, batch_id: str, status: str) -> None:
        with self._transaction() as db:
            _set_status(db, batch_id, status)

    def counts(self, batch_id: str) -> dict[str, int]:
        rows = self._query("SELECT status, COUNT(*) AS n FROM lines WHERE batch_id = ? "
                           "GROUP BY status", batch_id)
        return {r["status"]: r["n"] for r in rows}

    # ------------------------------------------------------------ lines

    def pending_lines(self, batch_id: str, after: int, limit: int) -> list[PendingLine]:
        """Pending lines past line `after`, in order."""
        rows = self._query("SELECT line_no, custom_id, body FROM lines WHERE batch_id = ? "
                           "AND status = 'pending' AND line_no > ? ORDER BY line_no LIMIT ?",
                           batch_id, after, limit)
        return [PendingLine(batch_id, r["line_no"], r["custom_id"], r["body"]) for r in rows]

    def finish_line(self, line: PendingLine, status: str, result: str) -> bool:
        """A line's result and its status, committed together; False when the line had
        already ended (expired or cancelled meanwhile: the result is dropped)."""
        with self._transaction() as db:
            cursor = db.execute("UPDATE lines SET status = ?, result = ? WHERE batch_id = ? "
                                "AND line_no = ? AND status = 'pending'",
                                (status, result, line.batch_id, line.line_no))
        return cursor.rowcount == 1

    def end_pending(self, batch_id: str, status: str, error: dict[str, str]) -> int:
        """Every pending line of the batch ended as `status` with `error` (OpenAI's error
        line); how many."""
        rows = self._query("SELECT line_no, custom_id FROM lines WHERE batch_id = ? AND "
                           "status = 'pending'", batch_id)
        with self._transaction() as db:
            db.executemany(
                "UPDATE lines SET status = ?, result = ? WHERE batch_id = ? AND line_no = ? "
                "AND status = 'pending'",
                ((status, error_line(r["custom_id"], error), batch_id, r["line_no"])
                 for r in rows))
        return len(rows)

    def finalize(self, batch: dict[str, Any], status: str) -> None:
        """The batch's output file (its done lines) and error file (the rest), each written
        whole before one transaction names them and sets the final `status`."""
        batch_id, tenant = batch["id"], batch["tenant"]
        file_ids: dict[str, str | None] = {}
        new_files = []
        for kind, where in (("output", "status = 'done'"), ("error", "status != 'done'")):
            rows = self._query(f"SELECT result FROM lines WHERE batch_id = ? AND {where} "
                               "AND result IS NOT NULL ORDER BY line_no", batch_id)
            if not rows:
                file_ids[kind] = None
                continue
            file_id = new_id("file-")
            num_bytes = self._write_whole(file_id, "".join(r["result"] + "\n" for r in rows))
            file_ids[kind] = file_id
            new_files.append((file_id, tenant, f"{batch_id}_{kind}.jsonl", "batch_output",
                              num_bytes, int(time.time())))
        with self._transaction() as db:
            db.executemany("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)", new_files)
            db.execute("UPDATE batches SET output_file_id = ?, error_file_id = ? WHERE id = ?",
                       (file_ids["output"], file_ids["error"], batch_id))
            _set_status(db, batch_id, status)

    def _write_whole(self, file_id: str, text: str) -> int:
        """`text` at `file_path(file_id)`, complete or not there at all."""
        path = self.file_path(file_id)
        temp = path.with_suffix(".tmp")
        data = text.encode()
        try:
            with open(temp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)
        except OSError as exc:
            temp.unlink(missing_ok=True)
            raise StoreError(f"cannot write {path}: {exc}") from exc
        return len(data)


def _set_status(db: sqlite3.Connection, batch_id: str, status: str) -> None:
    """The batch's status and its `<status>_at` time."""
    (times,) = db.execute("SELECT times FROM batches WHERE id = ?", (batch_id,)).fetchone()
    stamped = {**json.loads(times), f"{status}_at": int(time.time())}
    db.execute("UPDATE batches SET status = ?, times = ? WHERE id = ?",
               (status, json.dumps(stamped), batch_id))


def error_line(custom_id: str, error: dict[str, str]) -> str:
    """An error-file line without a response (expired, cancelled), OpenAI's shape."""
    return json.dumps({"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
                       "error": error})


def response_line(custom_id: str, status_code: int, body: Any) -> str:
    """An output- or error-file line holding the route's response, OpenAI's shape."""
    return json.dumps({"id": new_id("batch_req_"), "custom_id": custom_id,
                       "response": {"status_code": status_code,
                                    "request_id": new_id("req_"), "body": body},
                       "error": None})
