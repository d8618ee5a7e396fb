"""A server that does nothing but answer: the load generator's own ceiling.

`python -m bench.null_server --port P` answers /v1/models and streams, for every
/v1/completions request, max_tokens one-token completion chunks (then usage and
[DONE]): as fast as it can, or with `--step-ms MS` one chunk per stream every MS ms, all
streams at once (as an engine step would), so that `pagedserve bench` against it
measures how many tokens per second the client itself can take in. A figure from a real
server near that ceiling measures the client, not the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import uvicorn

_CHUNK = (
    b'data: {"id":"cmpl-null","object":"text_completion","created":0,"model":"null",'
    b'"choices":[{"index":0,"text":" x","logprobs":null,"finish_reason":null}]}\n\n'
)
_MODELS = json.dumps({"object": "list", "data": [{"id": "null", "object": "model"}]}).encode()


class _Ticker:
    """Wakes every stream once per step (None: never waits)."""

    def __init__(self, step_s: float | None) -> None:
        self.step_s = step_s
        self._tick: asyncio.Event | None = None

    async def wait(self) -> None:
        if self.step_s is None:
            return
        if self._tick is None:
            self._tick = asyncio.Event()
            asyncio.get_running_loop().create_task(self._run())
        await self._tick.wait()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s or 0)
            tick, self._tick = self._tick, asyncio.Event()
            assert tick is not None
            tick.set()


_ticker = _Ticker(None)


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
        await _ticker.wait()
        await send({"type": "http.response.body", "body": _CHUNK, "more_body": True})
    usage = {"choices": [], "usage": {"prompt_tokens": 0, "completion_tokens": max_tokens,
                                      "total_tokens": max_tokens}}
    tail = f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()
    await send({"type": "http.response.body", "body": tail})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--step-ms", type=float, default=None,
                        help="one chunk per stream per MS ms (default: as fast as it can)")
    args = parser.parse_args()
    global _ticker
    _ticker = _Ticker(None if args.step_ms is None else args.step_ms / 1000)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
