"""LoRA adapters over HTTP: a server's throughput and TPOT with adapters against the base
model's in the same run, and other streams' inter-token latency while adapters load.

`python -m bench.lora_bench --http [--rank 16] [--scale 1.0] [--rounds 2]`

One pagedserve server (float32, the default model) serving four random adapters of
`--rank` on all seven projections (`--max-loras 4`) and five more kept cold
(`--max-cpu-loras 4`), driven by loadgen.client:
- W1 (64 requests, 128 in / 128 out, 16 in flight), the base model's against the same
  requests spread over the four adapters, in `--rounds` parts taken in turn so that a
  shared machine disturbs both alike: output tokens/s;
- one stream (W0's 32 in / 64 out, one in flight), base and one adapter in turn: TPOT p50;
- four base streams while requests name an adapter one after another: a warm one (held)
  against cold ones, each read from disk on the core's loader thread while the streams go
  on, twice in turn: the streams' inter-token p50, p90 and p99, and the adapter requests' TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.systems import pagedserve_flags
from loadgen.client import BenchConfig, run_items
from loadgen.workloads import BenchItem, w0, w1
from model_runner.config import ModelConfig
from model_runner.loader import load_model_spec
from tests.support.server_process import ServerProcess

WARM = tuple(f"lora{i}" for i in range(4))  # W1's, held
COLD = tuple(f"cold{i}" for i in range(5))  # more than --max-cpu-loras holds: each a read


def projection_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of a dense decoder's config."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def run(url: str, model: str, items: list[BenchItem], concurrency: int) -> dict[str, Any]:
    config = BenchConfig(url=url, model=model, ignore_eos=True, timeout_s=3600)
    summary = asyncio.run(run_items(config, items, concurrency))
    if summary["num_failed"]:
        raise RuntimeError(f"{summary['num_failed']} requests failed: {summary['errors']}")
    return summary


def spread(items: list[BenchItem], names: tuple[str, ...]) -> list[BenchItem]:
    return [dataclasses.replace(item, model=names[i % len(names)]) for i, item in enumerate(items)]


def throughput(url: str, base: str, scale: float, rounds: int) -> dict[str, float]:
    """W1's output tokens/s, base and spread over the warm adapters, parts in turn."""
    workload = w1(scale)
    size = -(-len(workload.requests) // rounds)
    tokens = {"base": 0.0, "loras": 0.0}
    seconds = {"base": 0.0, "loras": 0.0}
    for start in range(0, len(workload.requests), size):
        part = workload.requests[start : start + size]
        for side, items in (("base", part), ("loras", spread(part, WARM))):
            summary = run(url, base, items, workload.concurrency)
            tokens[side] += summary["output_tokens"]
            seconds[side] += summary["duration_s"]
    return {side: tokens[side] / seconds[side] for side in tokens}


def single_stream(url: str, base: str, num_requests: int) -> dict[str, float]:
    """TPOT p50 (ms) of one stream, base and an adapter in turn."""
    tpots: dict[str, list[float]] = {"base": [], "lora": []}
    for item in w0().requests[:num_requests]:
        for side, model in (("base", None), ("lora", WARM[0])):
            summary = run(url, base, [dataclasses.replace(item, model=model)], 1)
            tpots[side].append(summary["all"]["tpot_s"]["p50"] * 1e3)
    return {side: statistics.median(values) for side, values in tpots.items()}


def during_loads(url: str, base: str, names: tuple[str, ...]) -> dict[str, float]:
    """Four base streams while ten requests name `names` in turn, one after another."""
    streams = [dataclasses.replace(item, max_tokens=64) for item in w0(scale=1.0).requests]
    adapter_items = spread([BenchItem(item.prompt, 4) for item in w0(seed=1).requests[:10]],
                           names)
    config = BenchConfig(url=url, model=base, ignore_eos=True, timeout_s=3600)

    async def both() -> list[dict[str, Any]]:
        return list(await asyncio.gather(run_items(config, streams, 4),
                                         run_items(config, adapter_items, 1)))

    stream_summary, adapter_summary = asyncio.run(both())
    itl = stream_summary["all"]["itl_s"]
    ttft = adapter_summary["all"]["ttft_s"]
    return {"itl_p50": itl["p50"] * 1e3, "itl_p90": itl["p90"] * 1e3,
            "itl_p99": itl["p99"] * 1e3, "adapter_ttft_p50": ttft["p50"] * 1e3}


def main(args: argparse.Namespace, write_adapter: Any) -> None:
    spec = load_model_spec(ModelConfig())
    shapes = projection_shapes(spec.hf_config)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for seed, name in enumerate((*WARM, *COLD)):
            write_adapter(folder / name, shapes, spec.hf_config.num_hidden_layers, args.rank,
                          seed)
        modules = [f"{name}={folder / name}" for name in (*WARM, *COLD)]
        flags = pagedserve_flags("pagedserve", "float32", None, [
            "--enable-lora", "--lora-modules", *modules, "--max-loras", str(len(WARM)),
            "--max-cpu-loras", str(len(WARM)), "--max-lora-rank", str(args.rank)])
        server = ServerProcess(flags, log_prefix="lora-http-")
        try:
            server.wait_healthy()
            measure(server.url, spec.served_model_name, args)
        finally:
            server.terminate(timeout_s=30)
            server.remove_log()


def measure(url: str, base: str, args: argparse.Namespace) -> None:
    """Each table row printed as soon as it is measured (a long run cut short keeps them)."""
    for model in (None, *WARM):  # every warm adapter read before it is timed
        run(url, base, [BenchItem(list(range(1000, 1032)), 4, model=model)], 1)
    print(f"| over HTTP | base | {len(WARM)} adapters, rank {args.rank} | adapters / base |")
    print("|---|---|---|---|", flush=True)
    tpot = single_stream(url, base, args.single)
    print(f"| 1 stream TPOT p50 (ms) | {tpot['base']:.1f} | {tpot['lora']:.1f} | "
          f"{tpot['lora'] / tpot['base']:.2f}x |", flush=True)
    tps = throughput(url, base, args.scale, args.rounds)
    print(f"| W1 (x{args.scale}) output tok/s | {tps['base']:.1f} | {tps['loras']:.1f} | "
          f"{tps['loras'] / tps['base']:.2f}x |", flush=True)
    print("\n| 4 base streams, requests naming | ITL p50 (ms) | ITL p90 | ITL p99 | "
          "adapter TTFT p50 |")
    print("|---|---|---|---|---|", flush=True)
    for label, names in 2 * ((f"one held adapter ({WARM[0]})", WARM[:1]),
                             (f"{len(COLD)} cold adapters in turn (each read)", COLD)):
        row = during_loads(url, base, names)
        print(f"| {label} | {row['itl_p50']:.1f} | {row['itl_p90']:.1f} | "
              f"{row['itl_p99']:.1f} | {row['adapter_ttft_p50']:.0f} |", flush=True)
