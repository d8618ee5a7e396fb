"""Reaching past the unit tests' in-process engine (`EngineClient.in_process`) to its core."""

from __future__ import annotations

from engine.client import EngineClient
from engine.core import EngineCore
from engine.in_process import InProcessCoreClient


def core_of(engine: EngineClient) -> EngineCore:
    """The EngineCore an in-process engine steps: its scheduler, and its `fault_hook`
    (called with each step's plan before the runner: a test injects faults and delays)."""
    client = engine._client
    assert isinstance(client, InProcessCoreClient), "only an in-process engine has a core here"
    return client.core
