"""OpenAI's Batch API through the official `openai` client on a tiny random model (the
default model's tokenizer): a batch's outputs are the live routes' answers to the same
requests, its error file holds exactly the lines the routes refuse; each batch and file
is its tenant's alone; the limits are 4xx naming their flags; a cancelled batch leaves
nothing in the engine; a server killed mid-batch (SIGKILL) and started again on its data
directory completes it without running again a line done before the kill.
"""

from __future__ import annotations

import hashlib
import json
import signal
import sqlite3
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import ServerProcess
from tests.support.metrics import metric
from tests.support.model_helpers import CONFIGS, make_model_folder
from tests.support.waits import wait_idle

pytestmark = pytest.mark.e2e

KEY_A, KEY_B = "batch-alpha-key", "batch-beta-key"
MAX_LINES = 150
MAX_FILE_BYTES = 256 * 1024
NUM_GOOD = 95  # per endpoint, with 5 malformed: 200 lines in all
NUM_DURABLE = 100
SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6}},
          "required": ["word"], "additionalProperties": False}
WORDS = ["apple", "river", "stone", "cloud", "green", "north", "piano", "tiger", "lemon",
         "storm", "maple", "ocean"]


def tenants_yaml() -> str:
    return "tenants:\n" + "".join(
        f"  - name: {name}\n    api_key_sha256: \"{hashlib.sha256(key.encode()).hexdigest()}\"\n"
        "    admin: true\n" for name, key in (("alpha", KEY_A), ("beta", KEY_B)))


def tiny_server(tmp: Path, *flags: str) -> ServerProcess:
    """The tiny model (made once per folder) served on CPU with the priority policy."""
    model = tmp / "model"
    if not model.exists():
        make_model_folder(model, CONFIGS["smollm2"]())
    return ServerProcess("--model", str(model), "--device", "cpu", "--scheduling-policy",
                         "priority", "--num-kv-blocks", "256", "--max-num-seqs", "8",
                         "--data-dir", str(tmp / "data"), *flags)


class Served:
    """The module's server, which the durability test kills and starts again."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        tenants = tmp / "tenants.yaml"
        tenants.write_text(tenants_yaml())
        self.flags = ("--tenants", str(tenants), "--max-batch-lines", str(MAX_LINES),
                      "--max-batch-file-bytes", str(MAX_FILE_BYTES))
        self.server = tiny_server(tmp, *self.flags)

    def kill(self) -> None:
        self.server.proc.send_signal(signal.SIGKILL)
        self.server.proc.wait()
        self.server.remove_log()

    def restart(self) -> None:
        self.server = tiny_server(self.tmp, *self.flags)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    served = Served(tmp_path_factory.mktemp("batch"))
    yield served
    served.server.stop()


@pytest.fixture
def server(served) -> ServerProcess:
    return served.server


def client(server: ServerProcess, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def completion_body(i: int) -> dict:
    return {"prompt": f"The {WORDS[i % len(WORDS)]} number {i} is", "max_tokens": 6 + i % 5,
            "temperature": 0}


def chat_body(i: int) -> dict:
    body = {"messages": [{"role": "user", "content": f"Name a {WORDS[i % len(WORDS)]} {i}."}],
            "max_tokens": 8, "temperature": 0}
    if i % 4 == 0:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "word", "schema": SCHEMA}}
        body["max_tokens"] = 32
    return body


MALFORMED = {  # bodies the live routes refuse with a 400
    "/v1/completions": [{"prompt": "x", "temperature": -1}, {"max_tokens": 4},
                        {"prompt": "x", "max_tokens": 10**6}, {"prompt": "x", "n": "two"},
                        {"prompt": "x", "logprobs": 99}],
    "/v1/chat/completions": [{"messages": []}, {"messages": "hi"},
                             {"messages": [{"role": "user", "content": "x"}], "top_p": 7},
                             {"messages": [{"role": "wizard", "content": "x"}]},
                             {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}],
}


def jsonl(url: str, bodies: dict[str, dict]) -> bytes:
    return "".join(json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})
                   + "\n" for cid, body in bodies.items()).encode()


def start_batch(api: openai.OpenAI, url: str, bodies: dict[str, dict], num_completed: int
                ) -> openai.types.Batch:
    """A batch of `bodies` for `url`, once `num_completed` of its lines are done."""
    upload = api.files.create(file=("lines.jsonl", jsonl(url, bodies)), purpose="batch")
    batch = api.batches.create(input_file_id=upload.id, endpoint=url, completion_window="24h")
    deadline = time.monotonic() + 120
    while api.batches.retrieve(batch.id).request_counts.completed < num_completed:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return batch


def wait_batch(api: openai.OpenAI, batch_id: str, statuses: tuple[str, ...],
               timeout_s: float = 240.0):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = api.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.2)


def lines_of(api: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    text = api.files.content(file_id).text
    lines = [json.loads(line) for line in text.splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a custom_id appears twice"
    return by_id


def comparable(url: str, body: dict) -> list:
    """What must agree between a batch line's response and the live one (the prefix cache's
    hits may differ)."""
    tokens = (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])
    if url == "/v1/completions":
        return [(c["text"], c["finish_reason"]) for c in body["choices"]] + [tokens]
    return [(c["message"]["content"], c["finish_reason"]) for c in body["choices"]] + [tokens]


def test_batch_outputs_equal_live_requests_and_errors_are_the_malformed_lines(server):
    api = client(server)
    batches = {}
    bodies = {}
    for url, make in (("/v1/completions", completion_body), ("/v1/chat/completions", chat_body)):
        good = {f"{url[4:]}-{i}": make(i) for i in range(NUM_GOOD)}
        bad = {f"{url[4:]}-bad-{i}": b for i, b in enumerate(MALFORMED[url])}
        bodies[url] = (good, bad)
        upload = api.files.create(file=("in.jsonl", jsonl(url, {**good, **bad})),
                                  purpose="batch")
        batches[url] = api.batches.create(input_file_id=upload.id, endpoint=url,
                                          completion_window="24h", metadata={"run": "e2e"})
        assert batches[url].status == "in_progress"
    for url, created in batches.items():
        good, bad = bodies[url]
        batch = wait_batch(api, created.id, ("completed",))
        assert batch.request_counts.total == len(good) + len(bad)
        assert batch.request_counts.completed == len(good)
        assert batch.request_counts.failed == len(bad)
        outputs, errors = lines_of(api, batch.output_file_id), lines_of(api, batch.error_file_id)
        assert set(outputs) == set(good) and set(errors) == set(bad)
        assert all(e["response"]["status_code"] == 400 for e in errors.values())
        with ThreadPoolExecutor(8) as pool, httpx.Client(
                base_url=server.url, timeout=60,
                headers={"Authorization": f"Bearer {KEY_A}"}) as http:
            live = dict(zip(good, pool.map(lambda b, url=url: http.post(url, json=b),
                                           good.values()), strict=True))
        for cid, line in outputs.items():
            assert line["response"]["status_code"] == 200
            assert live[cid].status_code == 200, live[cid].text
            assert comparable(url, line["response"]["body"]) == comparable(url, live[cid].json())
    assert metric(server, "pagedserve_batch_lines_total", status="done") == 2 * NUM_GOOD
    assert metric(server, "pagedserve_batch_lines_total", status="failed") == 10
    chats = lines_of(api, api.batches.retrieve(batches["/v1/chat/completions"].id)
                     .output_file_id)
    structured = [chats[f"chat/completions-{i}"]["response"]["body"]["choices"][0]
                  for i in range(0, NUM_GOOD, 4)]
    stopped = [c for c in structured if c["finish_reason"] == "stop"]
    assert stopped and all(set(json.loads(c["message"]["content"])) == {"word"} for c in stopped)


def test_another_tenant_sees_nothing_of_a_batch(server):
    alpha, beta = client(server, KEY_A), client(server, KEY_B)
    url = "/v1/completions"
    upload = alpha.files.create(file=("a.jsonl", jsonl(url, {"one": completion_body(1)})),
                                purpose="batch")
    batch = alpha.batches.create(input_file_id=upload.id, endpoint=url,
                                 completion_window="24h")
    for call in (lambda: beta.batches.retrieve(batch.id),
                 lambda: beta.batches.cancel(batch.id),
                 lambda: beta.files.retrieve(upload.id),
                 lambda: beta.files.content(upload.id),
                 lambda: beta.files.delete(upload.id),
                 lambda: beta.batches.create(input_file_id=upload.id, endpoint=url,
                                             completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in beta.batches.list()]
    assert upload.id not in [f.id for f in beta.files.list()]
    done = wait_batch(alpha, batch.id, ("completed",))
    with pytest.raises(openai.NotFoundError):
        beta.files.content(done.output_file_id)
    assert batch.id in [b.id for b in alpha.batches.list(limit=100)]
    assert alpha.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        alpha.files.retrieve(upload.id)


def test_responses_lines(server):
    api = client(server)
    url = "/v1/responses"
    lines = {f"r{i}": {"input": f"Say {WORDS[i]}.", "max_output_tokens": 6, "temperature": 0}
             for i in range(3)}
    upload = api.files.create(file=("r.jsonl", jsonl(url, lines)), purpose="batch")
    batch = api.batches.create(input_file_id=upload.id, endpoint=url, completion_window="24h")
    done = wait_batch(api, batch.id, ("completed",))
    outputs = lines_of(api, done.output_file_id)
    assert set(outputs) == set(lines)
    assert {o["response"]["body"]["object"] for o in outputs.values()} == {"response"}


def test_limits_are_4xx_naming_their_flags(server):
    api = client(server)
    url = "/v1/completions"
    too_many = jsonl(url, {f"l{i}": completion_body(i) for i in range(MAX_LINES + 1)})
    upload = api.files.create(file=("many.jsonl", too_many), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="--max-batch-lines"):
        api.batches.create(input_file_id=upload.id, endpoint=url, completion_window="24h")
    with pytest.raises(openai.APIStatusError, match="--max-batch-file-bytes") as error:
        api.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert error.value.status_code == 413


def test_an_invalid_input_file_fails_the_batch_with_errors(server):
    api = client(server)
    url = "/v1/completions"
    text = (jsonl(url, {"same": completion_body(0)}) * 2 + b"not json\n"
            + jsonl("/v1/chat/completions", {"other": chat_body(0)}))
    upload = api.files.create(file=("bad.jsonl", text), purpose="batch")
    batch = api.batches.create(input_file_id=upload.id, endpoint=url, completion_window="24h")
    assert batch.status == "failed"
    assert [(e.code, e.line) for e in batch.errors.data] == [
        ("duplicate_custom_id", 2), ("invalid_json_line", 3), ("mismatched_endpoint", 4)]


def test_cancel_leaves_nothing_in_the_engine(server):
    api = client(server)
    url = "/v1/completions"
    long = {f"c{i}": {**completion_body(i), "max_tokens": 48, "ignore_eos": True}
            for i in range(MAX_LINES)}
    batch = start_batch(api, url, long, num_completed=3)
    assert api.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    cancelled = wait_batch(api, batch.id, ("cancelled",))
    assert 3 <= cancelled.request_counts.completed < MAX_LINES
    wait_idle(server.url, headers={"Authorization": f"Bearer {KEY_A}"})
    errors = lines_of(api, cancelled.error_file_id)
    outputs = lines_of(api, cancelled.output_file_id)
    assert len(errors) + len(outputs) == MAX_LINES
    assert {e["error"]["code"] for e in errors.values()} == {"batch_cancelled"}


def test_a_batch_survives_sigkill_without_recomputing_its_done_lines(served):
    api = client(served.server)
    url = "/v1/completions"
    lines = {f"d{i}": {**completion_body(i), "max_tokens": 24, "ignore_eos": True}
             for i in range(NUM_DURABLE)}
    batch = start_batch(api, url, lines, num_completed=20)
    served.kill()
    # counted before the restart: the new server's feeder starts at once
    with sqlite3.connect(served.tmp / "data" / "batches.sqlite3") as store:
        (num_done,) = store.execute("SELECT COUNT(*) FROM lines WHERE batch_id = ? AND "
                                    "status = 'done'", (batch.id,)).fetchone()
    served.restart()
    assert 20 <= num_done < NUM_DURABLE
    api = client(served.server)
    done = wait_batch(api, batch.id, ("completed",))
    assert done.request_counts.completed == NUM_DURABLE
    assert set(lines_of(api, done.output_file_id)) == set(lines)  # each custom_id once
    # the engine of the new server ran exactly the lines not done before the kill
    assert metric(served.server, "pagedserve_request_success_total") == NUM_DURABLE - num_done
