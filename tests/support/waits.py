"""Waiting for a condition, or for an idle engine over HTTP or in process: until nothing runs
or waits, then the KV pool is whole (no block held) and the scheduler's integrity check
passes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx


def assert_whole(state: dict) -> dict:
    """An idle snapshot's KV pool holds no block and its integrity check passed."""
    kv = state["kv_cache"]
    assert kv["num_free_blocks"] == kv["num_blocks"] and kv["usage"] == 0, kv
    assert state["integrity"] == "ok", state["integrity"]
    return state


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    """Polls `condition` until true; fails saying `what` never happened after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def wait_idle(url: str, headers: dict | None = None, timeout_s: float = 10.0) -> dict:
    """Polls GET /scheduler/state until idle, asserts the pool whole; returns the state."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = httpx.get(f"{url}/scheduler/state?check=1", headers=headers, timeout=10).json()
        if not state["running"] and not state["waiting"]:
            return assert_whole(state)
        assert time.monotonic() < deadline, f"still in flight: {state}"
        time.sleep(0.05)


async def wait_engine_idle(engine: Any, timeout_s: float = 10.0) -> dict:
    """Polls an in-process engine's snapshot until idle, asserts the pool whole; returns the
    state."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = await engine.snapshot(check_integrity=True)
        if not state["running"] and not state["waiting"]:
            return assert_whole(state)
        assert time.monotonic() < deadline, f"engine never went idle: {state}"
        await asyncio.sleep(0.01)
