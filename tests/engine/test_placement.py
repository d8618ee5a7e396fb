"""One request record, `Placement`, carried whole from the API process to the scheduler's
request: through `EngineRequest`, the `NewRequest` message and `AddRequests`."""

from __future__ import annotations

import pytest

from engine.messages import AddRequests, command_decoder, command_encoder
from engine.request import EngineRequest
from scheduler.placement import DEFAULT_TENANT, Placement
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams

FULL = Placement(priority=-3, tenant="alpha", weight=2.5, priority_bound=-5, deadline=123.5,
                 cache_salt="s\x00t")


def test_every_choice_carries_the_placement_whole_to_the_schedulers_request() -> None:
    request = EngineRequest("r", [[1, 2], [3]], SamplingParams(seed=1), n=2, placement=FULL,
                            arrival_time=7.0)
    command = command_decoder.decode(command_encoder.encode(AddRequests(request.new_requests())))
    assert isinstance(command, AddRequests)
    scheduled = command.scheduler_requests(frozenset({0}))
    assert [r.request_id for r in scheduled] == ["r-0", "r-1", "r-2", "r-3"]
    assert all(r.placement == FULL for r in scheduled)
    assert all(r.priority == -3 and r.cache_salt == "s\x00t" for r in scheduled)
    assert [r.prompt_leader_id for r in scheduled] == [None, "r-0", None, "r-2"]
    assert all(r.arrival_time == 7.0 and r.eos_token_ids == {0} for r in scheduled)
    assert [r.sampling_params.seed for r in scheduled] == [1, 2, 1, 2]


def test_the_default_placement_is_the_default_tenant_at_priority_0() -> None:
    request = Request("r", [1], SamplingParams())
    assert request.placement == Placement() and request.priority == 0
    assert request.effective_priority == 0
    assert Placement().tenant == DEFAULT_TENANT == EngineRequest("e", [[1]],
                                                                 SamplingParams()).placement.tenant


def test_the_placement_travels_by_position_not_by_name() -> None:
    """array_like: the message carries no field names for it (it is in every NewRequest)."""
    encoded = command_encoder.encode(FULL)
    assert b"priority" not in encoded and b"alpha" in encoded


def test_a_weight_of_zero_or_less_is_refused() -> None:
    with pytest.raises(ValueError, match="weight must be > 0"):
        Placement(weight=0.0)
