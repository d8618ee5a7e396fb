"""The batch store alone (server/batch/store.py) and the input file's rules
(server/batch/input_file.py): recovery after a restart, a full disk and a corrupt store
each one clear error with nothing half-written served as done."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest

from server.batch.input_file import read_input
from server.batch.store import (
    DONE,
    EXPIRED,
    BatchStore,
    StoreError,
    response_line,
)

URL = "/v1/completions"


def make_batch(store: BatchStore, num_lines: int, batch_id: str = "batch_1") -> dict:
    row = {"id": batch_id, "tenant": "alpha", "endpoint": URL, "input_file_id": "file-1",
           "created_at": int(time.time()), "expires_at": time.time() + 60, "metadata": None}
    store.create_batch(row, [(f"c{i}", json.dumps({"prompt": str(i)}))
                             for i in range(num_lines)], None)
    return store.get_batch(batch_id)


def finish(store: BatchStore, batch_id: str, line_nos: list[int]) -> None:
    for line in store.pending_lines(batch_id, -1, 1000):
        if line.line_no in line_nos:
            assert store.finish_line(line, DONE, response_line(line.custom_id, 200, {"n": 1}))


def test_a_restart_finds_the_done_lines_done_and_the_rest_pending(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    make_batch(store, 5)
    finish(store, "batch_1", [0, 3])
    store.close()  # as after a kill: nothing else was written
    store = BatchStore(tmp_path)
    assert [b["id"] for b in store.active_batches()] == ["batch_1"]
    assert [line.line_no for line in store.pending_lines("batch_1", -1, 100)] == [1, 2, 4]
    assert store.counts("batch_1") == {"done": 2, "pending": 3}


def test_one_server_per_data_directory(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    with pytest.raises(StoreError, match="used by another server"):
        BatchStore(tmp_path)
    store.close()
    BatchStore(tmp_path).close()


def test_a_corrupt_store_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "batches.sqlite3").write_bytes(b"not a database" * 512)
    with pytest.raises(StoreError, match="unreadable.*move it away"):
        BatchStore(tmp_path)


def test_a_full_disk_leaves_the_line_pending(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    make_batch(store, 2)
    (page_count,) = store._db.execute("PRAGMA page_count").fetchone()
    store._db.execute(f"PRAGMA max_page_count = {page_count}")  # SQLITE_FULL from here
    line = store.pending_lines("batch_1", -1, 1)[0]
    with pytest.raises(StoreError, match="cannot be written.*full"):
        store.finish_line(line, DONE, response_line(line.custom_id, 200, {"x": "y" * 100_000}))
    assert store.counts("batch_1") == {"pending": 2}


def test_a_file_the_disk_refuses_is_not_named_done(tmp_path: Path, monkeypatch) -> None:
    store = BatchStore(tmp_path)
    batch = make_batch(store, 2)
    finish(store, "batch_1", [0, 1])

    def no_space(_: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(StoreError, match="No space left"):
        store.finalize(batch, "completed")
    assert store.get_batch("batch_1")["status"] == "in_progress"
    assert list(store.files_dir.iterdir()) == []
    monkeypatch.undo()
    store.finalize(batch, "completed")
    done = store.get_batch("batch_1")
    assert done["status"] == "completed" and done["error_file_id"] is None
    output = store.file_path(done["output_file_id"]).read_text().splitlines()
    assert [json.loads(line)["custom_id"] for line in output] == ["c0", "c1"]


def test_ended_lines_keep_their_first_result(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    make_batch(store, 3)
    finish(store, "batch_1", [0])
    line = store.pending_lines("batch_1", 0, 1)[0]
    assert store.end_pending("batch_1", EXPIRED, {"code": "batch_expired", "message": "late"}) == 2
    assert not store.finish_line(line, DONE, "{}")  # came back after its batch expired
    assert store.counts("batch_1") == {"done": 1, "expired": 2}


def test_input_file_rules() -> None:
    good = json.dumps({"custom_id": "a", "method": "POST", "url": URL, "body": {}})
    assert read_input(f"{good}\n\n".encode(), URL).lines == [("a", "{}")]
    assert read_input(b"", URL).errors["data"][0]["code"] == "empty_file"
    assert read_input(b"\xff\xfe", URL).errors["data"][0]["code"] == "invalid_file"
    other = json.dumps({"custom_id": "b", "url": URL, "body": []})
    codes = [(e["code"], e["line"]) for e in read_input(
        f"{good}\n{good}\n[1]\n{other}\n".encode(), "/v1/chat/completions").errors["data"]]
    assert codes == [("mismatched_endpoint", 1), ("mismatched_endpoint", 2),
                     ("invalid_json_line", 3), ("mismatched_endpoint", 4)]
    codes = [e["code"] for e in read_input(f"{good}\n{good}\n{other}\n".encode(),
                                           URL).errors["data"]]
    assert codes == ["duplicate_custom_id", "invalid_request"]
