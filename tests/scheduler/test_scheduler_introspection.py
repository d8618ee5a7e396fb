"""Introspection: the JSON snapshot for GET /scheduler/state and the stats for metrics."""

from __future__ import annotations

import json

import pytest

from tests.support.scheduler_helpers import (
    add_all,
    make_requests,
    make_scheduler,
    run_until_done,
    step,
)


def test_snapshot_is_json_ready() -> None:
    scheduler = make_scheduler(policy="priority", max_num_seqs=1)
    add_all(scheduler, make_requests(2, 6, 4, priorities=[1, 0]))
    step(scheduler)
    snap = json.loads(json.dumps(scheduler.snapshot()))
    assert snap["policy"] == "priority"
    (running,) = snap["running"]
    assert running["request_id"] == "r1" and running["num_blocks"] == 2
    assert running["status"] == "RUNNING" and running["num_computed_tokens"] == 6
    assert [w["request_id"] for w in snap["waiting"]] == ["r0"]
    assert set(snap["waiting"][0]) >= {"priority", "arrival_time", "num_preemptions"}
    assert snap["kv_cache"] == {
        "num_blocks": 32,
        "num_free_blocks": 30,
        "num_cached_blocks": 1,
        "block_size": 4,
        "usage": pytest.approx(2 / 32),
    }


def test_stats_and_counts() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    add_all(scheduler, make_requests(2, 5, 2))
    assert scheduler.has_unfinished_requests()
    step(scheduler)
    stats = scheduler.stats
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)
    assert stats.num_blocks == 32 and stats.num_free_blocks == 30
    assert stats.kv_cache_usage == pytest.approx(2 / 32)
    assert stats.num_preemptions_total == 0
    assert "r1" in scheduler.requests


def test_snapshot_caps_the_waiting_list() -> None:
    scheduler = make_scheduler(policy="priority", max_num_seqs=1, num_blocks=512)
    add_all(scheduler, make_requests(50, 4, 2, priorities=[i % 5 for i in range(50)]))
    step(scheduler)
    snap = scheduler.snapshot(max_waiting=10)
    assert snap["num_waiting"] == 49
    assert [w["request_id"] for w in snap["waiting"]] == [
        r.request_id for r in list(scheduler.waiting)[:10]
    ]


def test_stats_count_by_priority() -> None:
    scheduler = make_scheduler(policy="priority", max_num_seqs=2, num_blocks=6)
    add_all(scheduler, make_requests(4, 7, 6, priorities=[3, 3, 1, 3]))
    step(scheduler)  # r2 (level 1), then r0 (level 3) a step later
    step(scheduler)
    stats = scheduler.stats
    assert stats.num_running_by_priority == {1: 1, 3: 1}
    assert stats.num_waiting_by_priority == {3: 2}
    run_until_done(scheduler)
    assert sum(scheduler.stats.num_preemptions_by_priority.values()) == (
        scheduler.num_preemptions_total
    )
