"""The runner's persistent block tables: rows follow the scheduler's tables by what they
gained, and a freed row never leaks into a new request."""

from __future__ import annotations

import numpy as np
import pytest

from model_runner.block_tables import BlockTables
from scheduler.output import ScheduledRequest
from scheduler.sampling_params import SamplingParams


def scheduled(request_id: str, table: list[int], context_len: int) -> ScheduledRequest:
    return ScheduledRequest(request_id, [0], context_len - 1, table, True, SamplingParams(),
                            [], [])


def test_rows_follow_tables_that_grow_and_widen() -> None:
    tables = BlockTables(block_size=4, num_rows=1, width=1)
    a, b = [3], [7, 8]
    rows = tables.rows([scheduled("a", a, 4), scheduled("b", b, 5)], np.array([4, 5]))
    assert tables.gather(rows, 2).tolist() == [[3, 0], [7, 8]]
    a += [4, 5]  # the scheduler's list grows at its end; the row copies only the new ids
    rows = tables.rows([scheduled("a", a, 9)], np.array([9]))
    assert tables.gather(rows, 3).tolist() == [[3, 4, 5]]
    assert len(tables) == 2


def test_a_forgotten_row_is_reused_from_scratch() -> None:
    tables = BlockTables(block_size=4)
    tables.rows([scheduled("a", [1, 2, 3], 12)], np.array([12]))
    tables.forget(["a", "unknown"])
    assert len(tables) == 0
    rows = tables.rows([scheduled("b", [9], 2)], np.array([2]))
    assert tables.gather(rows, 1).tolist() == [[9]]
    # the same id readmitted with a new, shorter table (preempted, freed, readmitted)
    tables.rows([scheduled("c", [1, 2, 3], 12)], np.array([12]))
    rows = tables.rows([scheduled("c", [5, 6], 8)], np.array([8]))
    assert tables.gather(rows, 2).tolist() == [[5, 6]]


def test_a_table_too_short_for_its_context_is_an_error() -> None:
    with pytest.raises(ValueError, match="2 blocks cannot hold 9 tokens"):
        BlockTables(block_size=4).rows([scheduled("a", [1, 2], 9)], np.array([9]))
