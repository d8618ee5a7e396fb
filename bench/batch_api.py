"""The Batch API's isolation and throughput, over HTTP with the openai client.

    python -m bench.batch_api [--scale 1.0] [--model-flags "--num-kv-blocks 512"]

One server (priority policy, 16 seats, prefix caching off so that no phase reuses
another's prompts), W1-shaped lines (128 token ids in, 128 out, EOS ignored):
- idle: a priority-0 stream alone, one request at a time (TTFT p50, ITL p50 and p99);
- live: the W1 lines sent as live requests, 16 in flight (output tok/s);
- batch alone: the same lines as one batch, created to completed (output tok/s; the
  target: at least 0.9x live);
- batch + interactive: a batch of 4x the lines saturating the server while the priority-0
  stream runs again (the targets: its TTFT p50 within idle + 2 loaded steps, a loaded
  step being the stream's ITL p50 under load; its ITL p99 within 1.5x idle's); the batch
  is cancelled afterwards.
"""

from __future__ import annotations

import argparse
import io
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from bench.compare import run_client, server_in_tree, warm_up
from loadgen.workloads import BenchItem, w1
from tests.support.server_process import free_port, pagedserve_command

SEATS = 16
INTERACTIVE = 8  # priority-0 requests, one at a time
INTERACTIVE_TOKENS = 32


def lines_file(items: list[BenchItem], tag: str) -> io.BytesIO:
    text = "".join(json.dumps({
        "custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/completions",
        "body": {"prompt": item.prompt, "max_tokens": item.max_tokens, "ignore_eos": True,
                 "temperature": 0}}) + "\n" for i, item in enumerate(items))
    return io.BytesIO(text.encode())


def start_batch(api: openai.OpenAI, items: list[BenchItem], tag: str) -> str:
    upload = api.files.create(file=(f"{tag}.jsonl", lines_file(items, tag)), purpose="batch")
    return api.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                              completion_window="24h").id


def wait_status(api: openai.OpenAI, batch_id: str, statuses: tuple[str, ...]) -> Any:
    while (batch := api.batches.retrieve(batch_id)).status not in statuses:
        time.sleep(0.05)
    return batch


def interactive(url: str, seed: int) -> dict[str, float]:
    """The priority-0 stream: TTFT p50, ITL p50 and p99 (ms)."""
    items = [BenchItem(item.prompt, INTERACTIVE_TOKENS)
             for item in w1(INTERACTIVE / 64, seed=seed).requests]
    summary = run_client(url, items, 1)["all"]
    return {"ttft_p50": summary["ttft_s"]["p50"] * 1e3,
            "itl_p50": summary["itl_s"]["p50"] * 1e3, "itl_p99": summary["itl_s"]["p99"] * 1e3}


def phase(name: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {name}", file=sys.stderr, flush=True)


def measure(url: str, scale: float) -> dict[str, Any]:
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    warm_up(url)
    phase("idle")
    idle = interactive(url, seed=10)
    phase("live")
    live_items = w1(scale, seed=1).requests
    live = run_client(url, live_items, SEATS)["output_token_throughput"]
    phase("batch alone")
    batch_items = w1(scale, seed=2).requests  # W1's shape, prompts of their own
    started = time.monotonic()
    batch_id = start_batch(api, batch_items, "alone")
    wait_status(api, batch_id, ("completed",))
    alone = sum(i.max_tokens for i in batch_items) / (time.monotonic() - started)
    phase("batch and interactive")
    load_id = start_batch(api, w1(4 * scale, seed=3).requests, "load")
    time.sleep(2.0)  # the feeder fills the seats
    loaded = interactive(url, seed=11)
    batch = api.batches.cancel(load_id)
    wait_status(api, batch.id, ("cancelled",))
    return {"idle": idle, "loaded": loaded, "live_tok_s": live, "batch_tok_s": alone}


def report(result: dict[str, Any]) -> str:
    idle, loaded = result["idle"], result["loaded"]
    steps = (loaded["ttft_p50"] - idle["ttft_p50"]) / loaded["itl_p50"]
    ratio = result["batch_tok_s"] / result["live_tok_s"]
    return "\n".join([
        "| measure | idle | batch saturating | target |", "|---|---|---|---|",
        f"| interactive TTFT p50 (ms) | {idle['ttft_p50']:.1f} | {loaded['ttft_p50']:.1f} "
        f"({steps:+.2f} loaded steps of {loaded['itl_p50']:.1f} ms) | within idle + 2 steps |",
        f"| interactive ITL p99 (ms) | {idle['itl_p99']:.1f} | {loaded['itl_p99']:.1f} "
        f"({loaded['itl_p99'] / idle['itl_p99']:.2f}x) | within 1.5x idle |",
        f"| W1 lines, output tok/s | live {result['live_tok_s']:.1f} | batch alone "
        f"{result['batch_tok_s']:.1f} ({ratio:.2f}x) | at least 0.9x live |",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="W1's 64 lines times this")
    parser.add_argument("--model-flags", default="", help="more `serve` flags")
    parser.add_argument("--log", type=Path, default=None, help="keep the server's log here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="batch-bench-") as tmp:
        port = free_port()
        flags = ["--scheduling-policy", "priority", "--max-num-seqs", str(SEATS),
                 "--no-enable-prefix-caching", "--log-level", "warning",
                 "--data-dir", str(Path(tmp) / "data"), *shlex.split(args.model_flags)]
        log = args.log or Path(tmp) / "server.log"
        with server_in_tree(pagedserve_command(port, flags), port, log) as url:
            result = measure(url, args.scale)
    print(json.dumps(result, indent=1))
    print(report(result))


if __name__ == "__main__":
    main()
