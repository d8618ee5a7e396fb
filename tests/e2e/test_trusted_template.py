"""The hostile suite's attacks that need a server trusting request templates
(--trust-request-chat-template; the suite's own server refuses them): each is answered as
expected within the suite's bounds (tests/support/isolation.py) while another tenant
streams. A template stuck in one C call is a 400 at --chat-template-timeout-s: its worker
process is killed, the API process never stalls."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import ServerProcess, _require_default_model
from tests.support.attacks import (
    SERVER_FLAGS,
    TRUSTED_TEMPLATE_ATTACKS,
    TRUSTED_TEMPLATE_FLAGS,
    UNATTACKED,
    Attack,
    RunConfig,
    tenants_yaml,
)
from tests.support.isolation import run_attack, server_pids

# NOTE: timing: the victim's gap and /health bounds are wall-clock
pytestmark = [pytest.mark.e2e, pytest.mark.timing]

CONFIG = RunConfig(timeout_s=30.0, stream_s=2.0, min_window_s=1.0, baseline_s=2.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    _require_default_model()
    tenants = tmp_path_factory.mktemp("trusted") / "tenants.yaml"
    tenants.write_text(tenants_yaml())
    server = ServerProcess(*SERVER_FLAGS, *TRUSTED_TEMPLATE_FLAGS, "--tenants", str(tenants))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def unattacked_itl_median_s(server) -> float:
    measure = asyncio.run(run_attack(server.url, server_pids(server), UNATTACKED, CONFIG))
    assert not measure.problem and not measure.victim_error, measure.summary()
    return statistics.median(measure.itl_s)


@pytest.mark.parametrize("attack", TRUSTED_TEMPLATE_ATTACKS, ids=lambda a: a.name)
def test_attack_on_a_trusting_server_is_refused_or_bounded(
        server, unattacked_itl_median_s: float, attack: Attack) -> None:
    measure = asyncio.run(run_attack(server.url, server_pids(server), attack, CONFIG))
    assert not measure.problem, measure.problem
    violations = measure.violations(unattacked_itl_median_s)
    assert not violations, (violations, measure.summary())
