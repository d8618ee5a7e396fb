"""The sampling parameters of the requests that sample, kept on the device between steps
(vLLM's persistent batch).

A request gets a row the first time it samples: its temperature, top-k, top-p, min-p and
penalties are written to the device then, in one copy with every other row that joined
in the step, and every later step reads them by index (it sends the device only its rows'
slots; no parameter tensor is built from Python lists). A row also keeps on the host what
a step decides without reading the device: the kinds of work it asks for (`needs`, bits
below) and the tokens that min_tokens holds back. A row lives until its request finishes
(`forget`); a preempted request keeps it for its resumption, as the token counts do.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from model_runner.cuda_graphs import host_to_device
from scheduler.output import ScheduledRequest
from scheduler.sampling_params import SamplingParams

# What a row asks of the sampler: the bits of `SamplingRow.needs`.
GREEDY = 1
TOP_K_OR_P = 2
MIN_P = 4
PENALTIES = 8
REPETITION = 16  # a repetition penalty (one of the PENALTIES)
TOKEN_MASK = 32  # allowed_token_ids or logit_bias
LOGPROBS = 64
MIN_TOKENS = 128  # stop tokens to hold back while the output is short
_ALL_NEEDS = 255


class Column(IntEnum):
    """The columns of a row on the device, float32. NOTE: top_k as a float is exact
    (vocabularies are far below 2**24), inf for no cut; a greedy row's temperature is 1
    (nothing to scale)."""

    TEMPERATURE = 0
    IS_GREEDY = 1
    TOP_K = 2
    TOP_P = 3
    MIN_P = 4
    REPETITION_PENALTY = 5
    FREQUENCY_PENALTY = 6
    PRESENCE_PENALTY = 7


@dataclass(slots=True)
class SamplingRow:
    """One request's row: its slot on the device, and on the host what it was written from
    (its params: a request under a known id with other params gets its row written again)
    and what the sampler needs to know of it without reading the device."""

    slot: int
    params: SamplingParams
    needs: int
    stop_ids: list[int]  # masked while the output is shorter than params.min_tokens


class StepRows:
    """The rows of one step's sampling requests, in order: what any or all of them need
    (host ints), and their parameters on the device, gathered once when first read."""

    def __init__(self, rows: list[SamplingRow], any_needs: int, all_needs: int,
                 table: torch.Tensor) -> None:
        self.rows = rows
        self._any_needs = any_needs
        self._all_needs = all_needs
        self._table = table

    def any(self, need: int) -> bool:
        return bool(self._any_needs & need)

    def all(self, need: int) -> bool:
        return self._all_needs & need == need

    @functools.cached_property
    def values(self) -> torch.Tensor:
        """The rows' parameters: [n, len(Column)] float32 on the device."""
        slots = device_index([row.slot for row in self.rows], self._table.device)
        return self._table.index_select(0, slots)

    def column(self, column: Column) -> torch.Tensor:
        """One parameter of every row: [n] float32 on the device."""
        return self.values[:, column]


class SamplingBatch:
    """The rows of the requests that sample, by request id, over one device table
    [capacity, len(Column)] float32, grown on demand."""

    def __init__(self, device: torch.device, eos_token_ids: frozenset[int]) -> None:
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.num_writes = 0  # rows written so far (tests count them)
        self._rows: dict[str, SamplingRow] = {}  # request id -> row
        self._free_slots: list[int] = []
        self._table = torch.zeros(0, len(Column), device=device)

    @property
    def num_rows(self) -> int:
        """Requests holding a row."""
        return len(self._rows)

    def select(self, requests: Sequence[ScheduledRequest]) -> StepRows:
        """The rows of `requests` in order; the requests that sample for the first time
        (or under a known id with other params) get theirs written first."""
        rows: list[SamplingRow] = []
        joined: list[SamplingRow] = []
        any_needs, all_needs = 0, _ALL_NEEDS
        for request in requests:
            row = self._rows.get(request.request_id)
            if row is None or row.params is not request.sampling_params:
                row = self._join(request.request_id, request.sampling_params, row)
                joined.append(row)
            rows.append(row)
            any_needs |= row.needs
            all_needs &= row.needs
        if joined:
            self._write(joined)
        return StepRows(rows, any_needs, all_needs, self._table)

    def forget(self, request_ids: Sequence[str]) -> None:
        """Free the rows of finished requests (ids without a row are ignored)."""
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self._free_slots.append(row.slot)

    def _join(self, request_id: str, params: SamplingParams,
              old: SamplingRow | None) -> SamplingRow:
        slot = old.slot if old is not None else self._take()
        stop_ids: list[int] = []
        if params.min_tokens:
            stop_ids = sorted(set(params.stop_token_ids)
                              | (set() if params.ignore_eos else self.eos_token_ids))
        row = SamplingRow(slot, params, _needs(params, bool(stop_ids)), stop_ids)
        self._rows[request_id] = row
        return row

    def _write(self, joined: list[SamplingRow]) -> None:
        values = np.array([_values(row.params) for row in joined], dtype=np.float32)
        slots = device_index([row.slot for row in joined], self.device)
        self._table.index_copy_(0, slots, host_to_device(values, torch.float32, self.device))
        self.num_writes += len(joined)

    def _take(self) -> int:
        if not self._free_slots:
            capacity = len(self._table)
            new_capacity = max(8, 2 * capacity)
            table = torch.zeros(new_capacity, len(Column), device=self.device)
            table[:capacity] = self._table
            self._table = table
            self._free_slots += range(new_capacity - 1, capacity - 1, -1)
        return self._free_slots.pop()


def device_index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Indices [len(values)] int64 on `device`, without waiting for it (pinned and
    non_blocking on CUDA)."""
    return host_to_device(np.asarray(values, dtype=np.int64), torch.int64, device)


def _needs(params: SamplingParams, holds_stop_ids: bool) -> int:
    flags = (
        (GREEDY, params.greedy),
        (TOP_K_OR_P, params.top_k > 0 or params.top_p < 1.0),
        (MIN_P, params.min_p > 0.0),
        (PENALTIES, params.has_penalties),
        (REPETITION, params.repetition_penalty != 1.0),
        (TOKEN_MASK, params.has_token_mask),
        (LOGPROBS, params.logprobs is not None),
        (MIN_TOKENS, holds_stop_ids),
    )
    return sum(bit for bit, wanted in flags if wanted)


def _values(params: SamplingParams) -> tuple[float, ...]:
    """A row's values, in the order of `Column`."""
    return (
        1.0 if params.greedy else params.temperature,
        float(params.greedy),
        float(params.top_k) if params.top_k > 0 else math.inf,
        params.top_p,
        params.min_p,
        params.repetition_penalty,
        params.frequency_penalty,
        params.presence_penalty,
    )
