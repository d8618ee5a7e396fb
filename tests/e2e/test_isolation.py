"""The hostile-client suite (issue 28) on the default model with two tenants: each attack
of tests/support/attacks.py's ATTACKS gets its expected 4xx or is served within bounds, while the
other tenant's stream keeps its pace (its largest gap between tokens within max(1 s, 8x
its unattacked median)), /health answers within 1 s, no server process grows more than
400 MB, and the pool is idle afterwards. A new attack is one line of ATTACKS.

The attacks that need a server trusting request templates (TRUSTED_TEMPLATE_ATTACKS,
--trust-request-chat-template; the suite's own server refuses them) run on a second
server under the same bounds: a template stuck in one C call is a 400 at
--chat-template-timeout-s, its worker process killed, the API process never stalled."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import ServerProcess, _require_default_model
from tests.support.attacks import (
    ATTACKS,
    SERVER_FLAGS,
    TRUSTED_TEMPLATE_ATTACKS,
    TRUSTED_TEMPLATE_FLAGS,
    UNATTACKED,
    Attack,
    RunConfig,
    tenants_yaml,
)
from tests.support.isolation import run_attack, server_pids

# NOTE: timing: the victim's gap and /health bounds are wall-clock; `make test` runs them
# apart from the rest, with one retry.
pytestmark = [pytest.mark.e2e, pytest.mark.timing]

# Each attack a few seconds at most: streaming attacks read for 2 s; a trusted template's
# first render also waits for its worker to start.
CONFIG = RunConfig(timeout_s=20.0, stream_s=2.0, min_window_s=1.0, baseline_s=2.0)
TRUSTING_CONFIG = RunConfig(timeout_s=30.0, stream_s=2.0, min_window_s=1.0, baseline_s=2.0)


def _server(folder: Path, *flags: str) -> Iterator[ServerProcess]:
    _require_default_model()
    tenants = folder / "tenants.yaml"
    tenants.write_text(tenants_yaml())
    server = ServerProcess(*SERVER_FLAGS, *flags, "--tenants", str(tenants))
    yield server
    server.stop()


def _unattacked_itl_median_s(server: ServerProcess, config: RunConfig) -> float:
    """The victim's median gap between tokens with no attack, on the same server."""
    measure = asyncio.run(run_attack(server.url, server_pids(server), UNATTACKED, config))
    assert not measure.problem and not measure.victim_error, measure.summary()
    return statistics.median(measure.itl_s)


def _assert_refused_or_bounded(server: ServerProcess, attack: Attack, config: RunConfig,
                               unattacked_itl_median_s: float) -> None:
    measure = asyncio.run(run_attack(server.url, server_pids(server), attack, config))
    assert not measure.problem, measure.problem
    violations = measure.violations(unattacked_itl_median_s)
    assert not violations, (violations, measure.summary())


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    yield from _server(tmp_path_factory.mktemp("isolation"))


@pytest.fixture(scope="module")
def trusting_server(tmp_path_factory) -> Iterator[ServerProcess]:
    yield from _server(tmp_path_factory.mktemp("trusted"), *TRUSTED_TEMPLATE_FLAGS)


@pytest.fixture(scope="module")
def unattacked_itl_median_s(server) -> float:
    return _unattacked_itl_median_s(server, CONFIG)


@pytest.fixture(scope="module")
def trusting_unattacked_itl_median_s(trusting_server) -> float:
    return _unattacked_itl_median_s(trusting_server, TRUSTING_CONFIG)


def test_attack_names_are_unique() -> None:
    names = [a.name for a in (*ATTACKS, *TRUSTED_TEMPLATE_ATTACKS)]
    assert len(set(names)) == len(names) and UNATTACKED.name not in names


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.name)
def test_attack_is_refused_or_bounded(server, unattacked_itl_median_s: float,
                                      attack: Attack) -> None:
    _assert_refused_or_bounded(server, attack, CONFIG, unattacked_itl_median_s)


@pytest.mark.parametrize("attack", TRUSTED_TEMPLATE_ATTACKS, ids=lambda a: a.name)
def test_attack_on_a_trusting_server_is_refused_or_bounded(
        trusting_server, trusting_unattacked_itl_median_s: float, attack: Attack) -> None:
    _assert_refused_or_bounded(trusting_server, attack, TRUSTING_CONFIG,
                               trusting_unattacked_itl_median_s)
