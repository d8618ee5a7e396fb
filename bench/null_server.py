"""A server that does nothing but answer: the load generator's own ceiling.

`python -m bench.null_server --port P` answers /v1/models and streams, for every
/v1/completions request, max_tokens one-token completion chunks (then usage and
[DONE]) as fast as it can, so that `pagedserve bench` against it measures how many
tokens per second the client itself can take in. A figure from a real server near that
ceiling measures the client, not the server.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import uvicorn

_CHUNK = (
    b'data: {"id":"cmpl-null","object":"text_completion","created":0,"model":"null",'
    b'"choices":[{"index":0,"text":" x","logprobs":null,"finish_reason":null}]}\n\n'
)
_MODELS = json.dumps({"object": "list", "data": [{"id": "null", "object": "model"}]}).encode()


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/v1/models":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": _MODELS})
        return
    max_tokens = int(json.loads(body or b"{}").get("max_tokens", 16))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    for _ in range(max_tokens):
        await send({"type": "http.response.body", "body": _CHUNK, "more_body": True})
    usage = {"choices": [], "usage": {"prompt_tokens": 0, "completion_tokens": max_tokens,
                                      "total_tokens": max_tokens}}
    tail = f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()
    await send({"type": "http.response.body", "body": tail})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
