"""A request's own (trusted) chat template runs in a worker process killed at
--chat-template-timeout-s whatever it does: one stuck in a single C call (that holds the
GIL) is a 400 at its deadline while the server serves on; a normal one renders the text
it renders in process; a worker killed or dead is replaced (server/template_worker.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from server.limits import RequestLimits
from server.template_worker import (
    TemplateFailed,
    TemplateTimeout,
    TemplateUnavailable,
    TemplateWorkers,
)
from tests.server.conftest import JinjaTokenizer
from tests.support.reliability_helpers import assert_openai_error

USER = {"role": "user", "content": "hi"}
OWN = ("{% for m in messages %}[{{ m.role }}] {{ m.content | upper }}{% endfor %}"
       "{% if add_generation_prompt %}>{% endif %}")
# ~6.5 s in one C call (a 31-million-digit power) that holds the GIL all along
IN_C = "{{ (9 ** 10000000) > 1 }}"
DEADLINE_S = 0.5


class Unpicklable(JinjaTokenizer):
    def __reduce__(self) -> Any:
        return (_cannot_load, ())


def _cannot_load() -> None:
    raise RuntimeError("this tokenizer does not load here")


@pytest.fixture(scope="module")
def workers():
    pool = TemplateWorkers(JinjaTokenizer())
    yield pool
    pool.close()


def test_a_trusted_template_renders_what_it_renders_in_process(workers) -> None:
    tokenizer = JinjaTokenizer()
    for generation_prompt in (False, True):
        expected = tokenizer.apply_chat_template([USER], add_generation_prompt=generation_prompt,
                                                 chat_template=OWN)
        assert workers.render([USER], generation_prompt, {"chat_template": OWN}, 30.0,
                              1000) == expected
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = "{{ tools[0].function.name }}:{{ messages[0].content }}"
    assert workers.render([USER], True, {"chat_template": with_tools, "tools": tools}, 30.0,
                          1000) == "f:hi"


def test_the_templates_own_errors_and_oversized_text_are_template_failures(workers) -> None:
    with pytest.raises(TemplateFailed, match="no such thing"):
        workers.render([USER], False, {"chat_template": "{{ raise_exception('no such thing') }}"},
                       30.0, 1000)
    with pytest.raises(TemplateFailed, match="rendered 2000 characters, more than the 1000"):
        workers.render([USER], False, {"chat_template": "{{ 'x' * 2000 }}"}, 30.0, 1000)
    with pytest.raises(TemplateFailed, match="more memory"):  # its address space is capped
        workers.render([USER], False, {"chat_template": "{{ 'x' * (2 ** 34) }}"}, 30.0,
                       2**40)
    assert workers.render([USER], False, {"chat_template": OWN}, 30.0, 1000) == "[user] HI"


def test_a_worker_past_the_deadline_is_killed_and_replaced(workers) -> None:
    workers.render([USER], False, {"chat_template": OWN}, 30.0, 1000)  # one worker is up
    started = workers.num_started
    began = time.monotonic()
    with pytest.raises(TemplateTimeout):
        workers.render([USER], False, {"chat_template": IN_C}, DEADLINE_S, 1000)
    assert time.monotonic() - began < 30  # NOTE: not the ~6.5 s it takes: see the timing test
    assert workers.num_started == started + 1  # its replacement
    assert workers.render([USER], False, {"chat_template": OWN}, 30.0, 1000) == "[user] HI"


def test_a_worker_that_cannot_start_is_unavailable_not_a_hang() -> None:
    pool = TemplateWorkers(Unpicklable(), start_timeout_s=60.0)
    try:
        with pytest.raises(TemplateUnavailable, match="does not load here"):
            pool.render([USER], False, {"chat_template": OWN}, 30.0, 1000)
    finally:
        pool.close()


def test_a_tokenizer_that_cannot_be_sent_makes_only_own_templates_unavailable() -> None:
    tokenizer = JinjaTokenizer()
    tokenizer.hook = lambda: None  # type: ignore[attr-defined]  # not picklable
    pool = TemplateWorkers(tokenizer)
    pool.start()
    assert pool.num_started == 0
    with pytest.raises(TemplateUnavailable, match="cannot be sent to a worker process"):
        pool.render([USER], False, {"chat_template": OWN}, 30.0, 1000)
    pool.close()


# ------------------------------------------------------------------ over HTTP


def _chat(server: Any, template: str) -> httpx.Response:
    body = {"messages": [USER], "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": template}}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


@pytest.fixture
def trusting_server(make_fake_engine, live_servers):
    engine = make_fake_engine(start=False)
    engine.info.tokenizer = JinjaTokenizer()
    limits = RequestLimits(chat_template_timeout_s=DEADLINE_S, trust_request_chat_template=True)
    return live_servers(engine, limits=limits)


def test_a_trusted_template_renders_the_same_tokens_over_http(trusting_server) -> None:
    plain = httpx.post(f"{trusting_server.url}/tokenize", json={"messages": [USER]}, timeout=30)
    assert bytes(plain.json()["tokens"]) == b"<user>hi\n"  # the server's own, in process
    response = httpx.post(f"{trusting_server.url}/tokenize", timeout=120, json={
        "messages": [USER], "chat_template_kwargs": {"chat_template": OWN}})
    assert response.status_code == 200, response.text
    assert bytes(response.json()["tokens"]) == b"[user] HI>"
    error = assert_openai_error(_chat(trusting_server, "{{ raise_exception('nope') }}"), 400,
                                "Cannot apply the chat template: nope")
    assert error["param"] == "messages"


@pytest.mark.timing
def test_a_template_stuck_in_c_is_a_400_at_the_deadline_and_the_server_serves_on(
        trusting_server) -> None:
    assert _chat(trusting_server, OWN).status_code == 200  # the worker is up
    health: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            sent = time.monotonic()
            assert httpx.get(f"{trusting_server.url}/health", timeout=30).status_code == 200
            health.append(time.monotonic() - sent)
            time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    began = time.monotonic()
    try:
        response = _chat(trusting_server, IN_C)
    finally:
        elapsed = time.monotonic() - began
        done.set()
        prober.join()
    assert_openai_error(response, 400, "--chat-template-timeout-s", f"the limit is {DEADLINE_S}")
    assert elapsed < DEADLINE_S + 1.5, elapsed  # in process: ~6.5 s, the GIL held
    assert health and max(health) < 1.0, health
    assert _chat(trusting_server, OWN).status_code == 200
    response = httpx.post(f"{trusting_server.url}/v1/completions", timeout=30,
                          json={"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200, response.text
