"""What a request costs the API process before and after its tenant's seat: /tokenize and
/detokenize take a seat and count their tokens in the tenant's window, a prompt refused
after tokenizing is charged the tokens it cost, tool-call arguments nest within
--max-tool-arguments-depth, the Responses input is translated in linear time, and the echo
of a prompt that never ran is not scored token by token. On the scripted engine (a byte
tokenizer): no model needed."""

from __future__ import annotations

from server.tenants import TenantRefused, TenantRegistry, TenantSpec

RATE_KEY = "rate-key"


def rate_registry(tokens_per_minute: int = 100, max_in_flight: int | None = None
                  ) -> TenantRegistry:
    spec = TenantSpec(name="t", api_key_env=["T_KEY"], tokens_per_minute=tokens_per_minute,
                      max_in_flight=max_in_flight)
    return TenantRegistry([spec], environ={"T_KEY": RATE_KEY})


def test_spent_tokens_count_past_the_rate_and_expire_with_the_window() -> None:
    tenant = rate_registry(100).identify(RATE_KEY.encode())
    assert tenant is not None
    seat = tenant.admit(1, now=0.0)
    seat.spend(250, now=0.0)  # the work is done: counted whole, nothing refused
    seat.release()
    try:
        tenant.admit(1, now=59.0)
    except TenantRefused as exc:
        assert exc.status_code == 429 and exc.retry_after_s == 1.0
    else:
        raise AssertionError("a window holding 250 of 100 tokens admitted a request")
    tenant.admit(100, now=60.0).release()  # expired with the window
