"""Fixtures and doubles shared by the server's tests: a client of one counted tenant, a
client whose engine samples what a grammar allows, a tokenizer with a real jinja chat
template."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from model_runner.chat_jinja import render_chat
from server.app import build_app
from server.config import ServerConfig
from server.limits import RequestLimits
from server.tenants import Tenant, TenantRegistry, TenantSpec
from tests.conftest import ByteTokenizer, CountingTokenizer
from tests.support.structured_helpers import MaskedRandomRunner, make_structured


class JinjaTokenizer(ByteTokenizer):
    """The byte tokenizer with a real jinja chat template (rendered as the served tokenizer
    renders one: model_runner/chat_jinja.py); picklable, so a template worker can render
    with it."""

    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = False,
                            chat_template: str | None = None, tools: list[dict] | None = None,
                            **kwargs: Any) -> str:
        return render_chat(chat_template or self.chat_template, messages, tools=tools,
                           documents=None, add_generation_prompt=add_generation_prompt,
                           continue_final_message=False, variables=kwargs)


@pytest.fixture
def tenant_client(make_fake_engine) -> Iterator[tuple[TestClient, Tenant, list[str]]]:
    """A client of one tenant: 1 seat, 100 tokens a minute (the engine's context: 128);
    the tenant, and the tokenizer's work (`CountingTokenizer.calls`)."""
    calls: list[str] = []
    engine = make_fake_engine(start=False)
    engine.info.tokenizer = CountingTokenizer(calls)
    spec = TenantSpec.model_construct(name="default", api_key_sha256=[], max_in_flight=1,
                                      tokens_per_minute=100, admin=True)
    tenants = TenantRegistry([spec], keys_required=False)
    with TestClient(build_app(engine, ServerConfig(), tenants)) as client:
        yield client, tenants.identify(None), calls


@pytest.fixture
def structured_client(make_fake_engine, open_client) -> Callable[..., TestClient]:
    """`make(**limits)`: a client whose engine samples what each request's grammar allows,
    under those request limits."""
    def make(**limits: Any) -> TestClient:
        engine = make_fake_engine(runner=MaskedRandomRunner(), structured=make_structured(),
                                  start=False)
        return open_client(engine, ServerConfig(limits=RequestLimits(**limits)))

    return make
