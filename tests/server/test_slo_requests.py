"""Latency targets on a request: the `slo` field through every route into the placement,
tenant and server defaults, 400s naming the field, and the refusal at the door (503 with
Retry-After, nothing held: no seat, no tokens, no tenant charge)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from scheduler.placement import Placement
from server.app import build_app
from server.config import ServerConfig
from server.slo import SloTargets
from server.tenants import Tenant, TenantRegistry, TenantSpec
from tests.conftest import CountingTokenizer

ROUTES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
}

Client = tuple[TestClient, list[Placement], Tenant, list[str]]


@pytest.fixture
def slo_client(make_fake_engine) -> Iterator[Callable[..., Client]]:
    """make(tenant_slo=None, soonest_s=None, **config): a client of one tenant (2 seats)
    over a fake slo engine that records each request's placement (`soonest_s`: its
    predicted first token); the tenant; the tokenizer's work."""
    made: list[TestClient] = []

    def make(tenant_slo: SloTargets | None = None, soonest_s: float | None = None,
             **config: Any) -> Client:
        calls: list[str] = []
        engine = make_fake_engine(policy="slo", start=False)
        engine.info.tokenizer = CountingTokenizer(calls)
        if soonest_s is not None:  # what the step-cost model predicts
            engine.soonest_first_token_s = lambda: soonest_s
        placements: list[Placement] = []
        add = engine.add_request

        def recording_add(request: Any, on_done: Any = None) -> Any:
            placements.append(request.placement)
            return add(request, on_done)

        engine.add_request = recording_add  # type: ignore[method-assign]
        spec = TenantSpec.model_construct(name="default", api_key_sha256=[], max_in_flight=2,
                                          tokens_per_minute=1000, slo=tenant_slo, admin=True)
        tenants = TenantRegistry([spec], keys_required=False)
        client = TestClient(build_app(engine, ServerConfig(**config), tenants))
        client.__enter__()
        made.append(client)
        return client, placements, tenants.identify(None), calls

    yield make
    for client in made:
        client.__exit__(None, None, None)


@pytest.mark.parametrize("route", list(ROUTES))
def test_slo_travels_in_the_placement_on_every_route(slo_client, route: str) -> None:
    client, placements, _, _ = slo_client()
    body = {**ROUTES[route], "slo": {"ttft_ms": 500, "tpot_ms": 80}}
    response = client.post(route, json=body)
    assert response.status_code == 200, response.text
    (placement,) = placements
    assert placement.tpot_s == pytest.approx(0.08) and placement.ttft_deadline is not None
    assert placement.reject_late is False
    if route != "/v1/responses":  # each choice says whether its targets were met
        assert response.json()["choices"][0]["slo"]["ttft_met"] is True
        assert set(response.json()["choices"][0]["slo"]) == {"ttft_met", "tpot_met"}
    plain = client.post(route, json=ROUTES[route])
    assert plain.status_code == 200
    if route != "/v1/responses":
        assert "slo" not in plain.json()["choices"][0]
    assert (placements[1].ttft_deadline, placements[1].tpot_s) == (None, None)


def test_targets_come_from_request_then_tenant_then_server(slo_client) -> None:
    tenant_slo = SloTargets(tpot_ms=50, on_miss="reject")
    client, placements, _, _ = slo_client(tenant_slo, default_slo_ttft_ms=2000,
                                          default_slo_tpot_ms=300)
    body = ROUTES["/v1/completions"]
    assert client.post("/v1/completions", json=body).status_code == 200
    assert client.post("/v1/completions", json={**body, "slo": {"tpot_ms": 90}}
                       ).status_code == 200
    first, second = placements
    assert first.tpot_s == pytest.approx(0.05) and first.reject_late  # the tenant's
    assert first.ttft_deadline is not None  # the server's ttft: reject applies to it
    assert second.tpot_s == pytest.approx(0.09)  # the request's own wins
    metrics = client.get("/metrics").text
    labels = '{model_name="fake-model",priority="0",tenant="default"}'
    assert f"pagedserve_slo_ttft_met_total{labels} 2.0" in metrics
    assert f"pagedserve_slo_goodput_requests_total{labels} 2.0" in metrics


@pytest.mark.parametrize(("slo", "field"), [
    ({"ttft_ms": 0}, "slo.ttft_ms"),
    ({"tpot_ms": -5}, "slo.tpot_ms"),
    ({"ttft_ms": "fast"}, "slo.ttft_ms"),
    ({"on_miss": "drop"}, "slo.on_miss"),
    ({"ttft_ms": 10, "p99": 1}, "slo.p99"),
    ("500ms", "slo"),
])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/responses"])
def test_invalid_targets_are_a_400_naming_the_field(slo_client, route: str, slo: Any,
                                                    field: str) -> None:
    client, placements, tenant, _ = slo_client()
    response = client.post(route, json={**ROUTES[route], "slo": slo})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in error["message"] or error.get("param") == field
    assert not placements and tenant.in_flight == 0


def test_a_request_that_cannot_be_on_time_is_refused_at_the_door(slo_client) -> None:
    client, placements, tenant, calls = slo_client(soonest_s=0.8)
    body = {**ROUTES["/v1/chat/completions"],
            "slo": {"ttft_ms": 500, "on_miss": "reject"}}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "slo_unattainable"
    assert not placements and not calls  # never tokenized, never submitted
    assert tenant.in_flight == 0 and tenant.admit(1000) is not None  # no seat, no charge
    metrics = client.get("/metrics").text
    assert 'pagedserve_slo_refused_total{model_name="fake-model",priority="0",' in metrics
    # served late instead when it does not ask to be refused, or when it can be on time
    served = client.post("/v1/chat/completions",
                         json={**body, "slo": {"ttft_ms": 500}})
    assert served.status_code == 200
    roomy = client.post("/v1/chat/completions",
                        json={**body, "slo": {"ttft_ms": 900, "on_miss": "reject"}})
    assert roomy.status_code == 200


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_says_in_its_last_chunk_whether_its_targets_were_met(slo_client,
                                                                      route: str) -> None:
    client, _, _, _ = slo_client()
    body = {**ROUTES[route], "stream": True, "slo": {"ttft_ms": 60_000}}
    with client.stream("POST", route, json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines]
    last = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert last and last[-1]["choices"][0]["slo"] == {"ttft_met": True}
    assert all("slo" not in c["choices"][0] for c in chunks if c not in last)


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_says_in_its_usage_whether_its_targets_were_met(slo_client,
                                                                   stream: bool) -> None:
    client, _, _, _ = slo_client()
    body = {**ROUTES["/v1/responses"], "stream": stream, "slo": {"ttft_ms": 60_000}}
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = [json.loads(line.removeprefix("data: "))
                  for line in response.text.splitlines() if line.startswith("data: {")]
        [completed] = [e for e in events if e["type"] == "response.completed"]
        usage = completed["response"]["usage"]
    else:
        usage = response.json()["usage"]
    assert usage["slo"] == {"ttft_met": True}
    plain = client.post("/v1/responses", json=ROUTES["/v1/responses"]).json()
    assert "slo" not in plain["usage"]  # no target, no verdict


def test_a_request_that_turns_late_in_the_queue_is_a_503_when_it_asked(slo_client) -> None:
    # the door lets it in (the model says it could be on time if it went next), but its
    # 1 ms target has passed by the scheduler's next step: refused there, holding nothing
    client, placements, tenant, _ = slo_client(soonest_s=0.0)
    body = {**ROUTES["/v1/completions"], "slo": {"ttft_ms": 1, "on_miss": "reject"}}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "slo_unattainable"
    assert len(placements) == 1 and tenant.in_flight == 0
    state = client.get("/scheduler/state").json()
    assert state["running"] == [] and state["kv_cache"]["num_free_blocks"] == 64
