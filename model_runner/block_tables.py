"""The block tables of the running requests, kept between steps (vLLM's persistent batch).

A request gets a row the first time it is scheduled; each later step copies only the
blocks its table gained since (the scheduler's tables grow only at their end), so laying
out a step costs O(requests + new blocks), not O(context). A row is freed when the
request finishes or is preempted (its blocks were freed; a readmission starts a new row).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from scheduler.output import ScheduledRequest


class BlockTables:
    """Rows of block ids in one host array [rows, width] int64, grown on demand."""

    def __init__(self, block_size: int, num_rows: int = 8, width: int = 8) -> None:
        self.block_size = block_size
        self._table = np.zeros((num_rows, width), dtype=np.int64)
        self._num_known = np.zeros(num_rows, dtype=np.int64)  # blocks filled in each row
        self._rows: dict[str, int] = {}  # request id -> row
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def __len__(self) -> int:
        """Requests holding a row."""
        return len(self._rows)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Free the rows of finished or preempted requests (unknown ids are ignored)."""
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self._free_rows.append(row)

    def rows(self, requests: Sequence[ScheduledRequest], context_lens: np.ndarray) -> np.ndarray:
        """The rows of `requests` [num_seqs] int64, each brought up to date with its
        scheduler-side table. ValueError when a table cannot hold its context_lens[i]
        tokens."""
        rows = np.empty(len(requests), dtype=np.int64)
        block_size = self.block_size
        for i, r in enumerate(requests):
            row = self._rows.get(r.request_id)
            if row is None:
                row = self._rows[r.request_id] = self._take_row()
                self._num_known[row] = 0
            table, known = r.block_table, int(self._num_known[row])
            if len(table) < known:  # a new table under a known id: start the row again
                known = self._num_known[row] = 0
            if len(table) > known:
                if len(table) > self._table.shape[1]:
                    self._widen(len(table))
                self._table[row, known : len(table)] = table[known:]
                self._num_known[row] = len(table)
            context_len = int(context_lens[i])
            if len(table) * block_size < context_len:
                raise ValueError(
                    f"request {r.request_id}: {len(table)} blocks cannot hold "
                    f"{context_len} tokens"
                )
            rows[i] = row
        return rows

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """The first `width` block ids of each row, [len(rows), width] (a new array)."""
        return self._table[rows, :width]

    def _take_row(self) -> int:
        if not self._free_rows:
            num_rows = len(self._table)
            self._table = np.concatenate([self._table, np.zeros_like(self._table)])
            self._num_known = np.concatenate([self._num_known, np.zeros_like(self._num_known)])
            self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        return self._free_rows.pop()

    def _widen(self, width: int) -> None:
        new_width = max(width, 2 * self._table.shape[1])
        table = np.zeros((len(self._table), new_width), dtype=np.int64)
        table[:, : self._table.shape[1]] = self._table
        self._table = table
