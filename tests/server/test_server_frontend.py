"""The front end's fast paths and limits: --stream-interval, orjson chunks equal to the
chunk models' JSON, one merging slot per stream, a 408 for a slow body, tokenizing off
the event loop, --limit-concurrency."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest

from engine.outputs import RequestOutput, RequestStream
from engine.request import EngineRequest
from scheduler.sampling_params import SamplingParams
from server.cli import build_configs, build_parser
from server.responses import (
    ChatCompletionChunk,
    ChatCompletionStreamChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
)
from server.streaming import chunk_head, fast_chunk
from tests.support.live_server import LiveServer

SCRIPT = "Hello, wörld! Bye."


async def outputs_of(engine, max_tokens: int = 64) -> list[RequestOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    stream = engine.add_request(EngineRequest("r", [list(b"hi")], params))
    return [out async for out in stream]


@pytest.mark.parametrize("interval", [1, 4, 7])
def test_stream_interval_sends_every_n_tokens_but_never_holds_the_first_or_last(
    make_fake_engine, monkeypatch, interval: int
) -> None:
    engine = make_fake_engine(stream_interval=interval)
    sent: list[RequestOutput] = []  # what the engine hands the stream, step by step
    push = RequestStream.push
    monkeypatch.setattr(RequestStream, "push",
                        lambda stream, output: (sent.append(output), push(stream, output)))
    outputs = asyncio.run(outputs_of(engine))
    assert "".join(o.text for o in outputs) == "".join(o.text for o in sent) == SCRIPT
    sizes = [len(o.token_ids) for o in sent]
    assert sum(sizes) == len(SCRIPT.encode()) + 1  # and the EOS
    assert sizes[0] == 1  # the first token is never held back
    assert all(size == interval for size in sizes[1:-1]), sizes
    assert 1 <= sizes[-1] <= interval  # nor the last
    assert sent[-1].finish_reason == "stop" and not any(o.finished for o in sent[:-1])


def test_a_stream_not_read_holds_one_merged_output_per_choice(make_fake_engine) -> None:
    engine = make_fake_engine()

    async def run():
        params = SamplingParams(temperature=0.0, max_tokens=64)
        stream = engine.add_request(EngineRequest("r", [list(b"hi")], params, n=2))
        for _ in range(200):  # let the engine finish while nobody reads
            await asyncio.sleep(0.01)
            if len(stream._pending) == 2 and all(o.finished for o in stream._pending.values()):
                break
        assert len(stream._pending) == 2  # one slot per choice, not one per token
        return [out async for out in stream]

    outputs = asyncio.run(run())
    assert [o.text for o in outputs] == [SCRIPT, SCRIPT]
    assert all(o.finished for o in outputs)


@pytest.mark.parametrize("finish_reason", [None, "length"])
@pytest.mark.parametrize("text", ["", "plain", 'qu"ote\\ \n naïve 日本 🙂 \u2028'])
def test_fast_chunks_are_the_chunk_models_json(finish_reason, text) -> None:
    output = RequestOutput(2, text, [1], None, finish_reason, 3, 5)
    num_preemptions = 3 if finish_reason else None
    completion = CompletionStreamResponse(id="cmpl-x", created=7, model="m é", choices=[
        CompletionStreamChoice(index=2, text=text, finish_reason=finish_reason,
                               num_preemptions=num_preemptions)
    ])
    head = chunk_head("cmpl-x", "text_completion", 7, "m é")
    expected = f"data: {completion.model_dump_json()}\n\n".encode()
    assert fast_chunk(head, output, {"text": text}) == expected
    chat = ChatCompletionChunk(id="chat-x", created=7, model="m", choices=[
        ChatCompletionStreamChoice(index=2, delta=DeltaMessage(content=text or None),
                                   finish_reason=finish_reason,
                                   num_preemptions=num_preemptions)
    ])
    head = chunk_head("chat-x", "chat.completion.chunk", 7, "m")
    delta = {"content": text} if text else {}
    expected = f"data: {chat.model_dump_json()}\n\n".encode()
    assert fast_chunk(head, output, {"delta": delta}) == expected


@pytest.fixture
def live_server(make_fake_engine, live_servers):
    def make(**config) -> LiveServer:
        return live_servers(make_fake_engine(start=False), **config)

    return make


def test_a_body_that_does_not_arrive_is_a_408(live_server) -> None:
    """The 408 is --body-timeout-s's (it names the configured 0.3 s) and comes no sooner;
    the socket's own timeout only stops a server that never answers."""
    server = live_server(body_timeout_s=0.3)
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro")
        answer = sock.recv(4096).decode()
        waited = time.monotonic() - start
    assert answer.startswith("HTTP/1.1 408"), answer
    assert '"code":"request_timeout"' in answer and "within 0.3 s" in answer, answer
    assert waited > 0.25  # no sooner (an asyncio timer may fire a clock tick early)
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_tokenizing_runs_off_the_event_loop(live_server, monkeypatch) -> None:
    """While a prompt is being tokenized (held until released), /health still answers: the
    event loop is not the one waiting."""
    server = live_server()
    serving = server.server.config.loaded_app
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()
    tokenizer = server.engine.info.tokenizer
    original = type(tokenizer).encode

    def slow_encode(self, text, add_special_tokens=True):
        if text == "slow":
            entered.set()
            release.wait(60)
            returned.set()
        return original(self, text, add_special_tokens)

    monkeypatch.setattr(type(tokenizer), "encode", slow_encode)
    assert serving is not None
    thread = threading.Thread(target=httpx.post, args=(f"{server.url}/v1/completions",),
                              kwargs={"json": {"prompt": "slow", "max_tokens": 2}, "timeout": 10})
    thread.start()
    assert entered.wait(5)
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert not returned.is_set()  # answered while the prompt is still being tokenized
    release.set()
    thread.join(10)


def test_front_end_flags_reach_the_server_config() -> None:
    args = build_parser().parse_args(["serve", "--limit-concurrency", "300",
                                      "--body-timeout-s", "5", "--stream-interval", "4"])
    configs = build_configs(args, cuda=False)
    assert configs.server.limit_concurrency == 300 and configs.server.body_timeout_s == 5
    assert configs.stream_interval == 4
    for flags in (["--stream-interval", "0"], ["--limit-concurrency", "0"],
                  ["--body-timeout-s", "0"]):
        with pytest.raises(ValueError):
            build_configs(build_parser().parse_args(["serve", *flags]), cuda=False)
