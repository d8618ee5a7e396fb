"""Side-by-side throughput of pagedserve and its CPU peers on the same workloads, same run.

    python -m bench.compare --workloads W1,WV --systems pagedserve,llama-server,hf-static
    python -m bench.compare --workloads WE,W1,WV,WEP --systems pagedserve,pagedserve-spec
    python -m bench.compare --model gemma-3-270m-q4_k_m.gguf --systems pagedserve,llama-server

Systems (bench/systems.py): `pagedserve` (float32), `pagedserve-fp16` (`--weight-dtype
float16 --kv-cache-dtype float16`: float32 sums on 2-byte weights and KV),
`pagedserve-int8` (`--weight-dtype int8 --kv-cache-dtype float16`: int8 products, see
cpu_linear.py), `pagedserve-bf16` (`--weight-dtype bfloat16 --kv-cache-dtype bfloat16`:
larger batches on bfloat16, AMX tiles where the CPU has them), `pagedserve-spec` (float32
with n-gram speculation, k = 4), `llama-server` and `llama-server-spec` (llama.cpp without
and with its n-gram speculation, built separately: --llama-server PATH) and
`baseline-tree` (pagedserve float32 from another checkout: --baseline-tree PATH) are
started as servers here and driven by loadgen.client over HTTP; `hf-seq`, `hf-static` and
`hf-cb` are Hugging Face `generate` sequential, static batching and continuous batching,
run in this process on the same converted weights (token-id workloads only). Every output
is forced to its requested length. Prints one table per workload with each system's output
tokens/s, its TTFT, ITL (a streamed chunk: a speculating server's carries several tokens)
and TPOT (time per output token after the first) p50, and its ratio to `pagedserve` and
every peer; a workload of two priorities also gets each priority's TPOT and throughput.
--json writes the raw results too. WP also measures the high-priority TTFT on an idle
server and the low-priority throughput without high-priority arrivals, the two references
of its targets.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.systems import (
    BASELINE_TREE,
    LLAMA_SERVERS,
    SERVERS,
    llama_server_command,
    pagedserve_flags,
    parse_systems,
)
from loadgen.client import BenchConfig, run_items
from loadgen.workloads import WORKLOADS, BenchItem, Workload, in_vocabulary
from tests.support.server_process import ServerProcess, free_port, pagedserve_command

# workloads of priorities or text prompts: the servers only
SERVER_ONLY_WORKLOADS = ("WP", "WE", "WEP")


@contextlib.contextmanager
def server_in_tree(cmd: list[str], port: int, log: Path, tree: Path | None = None) -> Iterator[str]:
    """A server from this checkout, or from `tree` (its own PYTHONPATH and cwd, and its own
    C++ kernel cache beside the logs: one cache for two trees' sources rebuilds at each
    switch)."""
    where: dict[str, Any] = {}
    if tree is not None:
        kernels = log.parent / "torch_extensions-baseline"
        where = {"env": {"PYTHONPATH": str(tree), "TORCH_EXTENSIONS_DIR": str(kernels)},
                 "cwd": tree}
    server = ServerProcess(command=cmd, port=port, log_prefix=f"{log.stem}-", **where)
    try:
        server.wait_healthy()
        yield server.url
    finally:
        server.terminate(timeout_s=30)
        log.write_text(server.log_tail(10**9))
        server.remove_log()


def model_file(args: argparse.Namespace) -> Path:
    """The GGUF every system serves: --model, or the default model's."""
    from model_runner.model_source import default_gguf_path

    return args.model or default_gguf_path()


def normal_token_ids(gguf: Path) -> list[int]:
    """The ids of a GGUF's vocabulary that are plain text pieces (no control, byte or
    unused tokens): what --model's token-id prompts are drawn from."""
    from gguf import GGUFReader, TokenType

    types = GGUFReader(gguf).fields["tokenizer.ggml.token_type"].contents()
    return [i for i, kind in enumerate(types) if kind == TokenType.NORMAL]


def server_cmd(system: str, port: int, workload: Workload, args: argparse.Namespace
               ) -> list[str]:
    if system in LLAMA_SERVERS:
        return llama_server_command(system, args.llama_server, model_file(args), port,
                                    args.threads, workload)
    num_kv_blocks = args.wp_kv_blocks if workload.name == "WP" else None
    variant = "pagedserve" if system == BASELINE_TREE else system
    extra = args.pagedserve_args.split() + (["--model", str(args.model)] if args.model else [])
    return pagedserve_command(port, pagedserve_flags(variant, args.dtype, num_kv_blocks, extra))


def run_client(
    url: str, items: list[BenchItem], concurrency: int, logprobs: int | None = None
) -> dict[str, Any]:
    """Send `items` to `url` (EOS ignored) and summarize (`logprobs`: BenchConfig's)."""
    config = BenchConfig(url=url, ignore_eos=True, timeout_s=3600, logprobs=logprobs)
    return asyncio.run(run_items(config, items, concurrency))


def warm_up(url: str, workload: Workload) -> None:
    first = workload.requests[0].prompt  # its ids are the served model's
    run_client(url, [BenchItem(first[:32] if isinstance(first, list) else first, 8)], 1)


def _server_result(system: str, summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "system": system,
        "output_tps": summary["output_token_throughput"],
        "duration_s": summary["duration_s"],
        "failed": summary["num_failed"],
        "errors": summary["errors"],  # the first few distinct ones
        "ttft_p50_ms": _ms(summary["all"]["ttft_s"]["p50"]),
        "itl_p50_ms": _ms(summary["all"]["itl_s"]["p50"]),
        "tpot_p50_ms": _ms(summary["all"]["tpot_s"]["p50"]),
        "by_priority": summary["by_priority"],
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def run_server(system: str, workload: Workload, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start the server once, run the workload (and WP's references) against it."""
    port = free_port()
    log = Path(args.log_dir) / f"{system}-{workload.name}.log"
    tree = args.baseline_tree.resolve() if system == BASELINE_TREE else None
    results = []
    with server_in_tree(server_cmd(system, port, workload, args), port, log, tree) as url:
        warm_up(url, workload)
        if workload.name == "WP":
            low = [r for r in workload.requests if r.send_at_s is None]
            high = [r for r in workload.requests if r.send_at_s is not None]
            idle = [
                run_client(url, [dataclasses.replace(h, send_at_s=None)], 1) for h in high[:3]
            ]
            low_only = run_client(url, low, workload.concurrency)
            alone = _server_result(f"{system} (low only)", low_only)
            ttft_idle = statistics.median(s["all"]["ttft_s"]["p50"] for s in idle)
            alone["high_ttft_idle_ms"] = ttft_idle * 1000
            results.append(alone)
        summary = run_client(url, workload.requests, workload.concurrency)
        results.append(_server_result(system, summary))
    return results


def run_hf(system: str, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from bench import hf_baseline
    from tests.support.model_helpers import load_hf_model

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, "float32" if args.dtype == "auto" else args.dtype)
    model = load_hf_model(str(model_file(args)), dtype)
    if system == "hf-seq":
        result = hf_baseline.run_static(model, workload, 1)
    elif system == "hf-static":
        result = hf_baseline.run_static(model, workload, workload.concurrency)
    else:
        result = hf_baseline.run_continuous(model, workload)
    return {"system": result.system, "output_tps": result.output_tps,
            "duration_s": result.elapsed_s, "failed": 0}


def format_table(workload: Workload, results: list[dict[str, Any]]) -> str:
    baselines = [r for r in results if r["system"] == "pagedserve"]
    baselines += [r for r in results if not r["system"].startswith("pagedserve")]
    head = "| system | output tok/s | TTFT p50 ms | ITL p50 ms | TPOT p50 ms |" + "".join(
        f" x {b['system']} |" for b in baselines)
    lines = [f"### {workload.name}: {workload.description}", "", head,
             "|---" * (5 + len(baselines)) + "|"]
    for r in results:
        cells = [r["system"], f"{r['output_tps']:.1f}", _fmt(r.get("ttft_p50_ms")),
                 _fmt(r.get("itl_p50_ms")), _fmt(r.get("tpot_p50_ms"))]
        cells += [f"{r['output_tps'] / b['output_tps']:.2f}" for b in baselines]
        lines.append("| " + " | ".join(cells) + " |")
    if len({item.priority for item in workload.requests}) > 1:
        lines += ["", *priority_table(results)]
    for r in results:
        if "high_ttft_idle_ms" in r:
            lines.append(f"\nhigh-priority TTFT on an idle server: {r['high_ttft_idle_ms']:.0f} ms")
        if r["failed"]:
            lines.append(f"\n{r['system']}: {r['failed']} requests FAILED: "
                         + "; ".join(r.get("errors", [])))
    return "\n".join(lines)


def priority_table(results: list[dict[str, Any]]) -> list[str]:
    """Per priority: TTFT, TPOT and output tok/s, and the TPOT and tok/s ratios to
    `pagedserve`'s requests of the same priority in the same run."""
    plain = next((_by_priority(r) for r in results if r["system"] == "pagedserve"), {})
    lines = ["| system | priority | TTFT p50 ms | TPOT p50 ms | tok/s | TPOT x pagedserve | "
             "tok/s x pagedserve |", "|---" * 7 + "|"]
    for r in results:
        for priority, (ttft, tpot, tps) in _by_priority(r).items():
            ratios = ["-", "-"]
            if priority in plain and tpot is not None and plain[priority][1]:
                ratios = [f"{tpot / plain[priority][1]:.2f}", f"{tps / plain[priority][2]:.2f}"]
            lines.append(f"| {r['system']} | {priority} | {_fmt(_ms(ttft))} | "
                         f"{_fmt(_ms(tpot))} | {tps:.1f} | {ratios[0]} | {ratios[1]} |")
    return lines


def _by_priority(result: dict[str, Any]) -> dict[str, tuple[float | None, float | None, float]]:
    """priority -> (TTFT p50 s, TPOT p50 s, output tok/s) of a server's result."""
    return {
        priority: (stats["ttft_s"]["p50"], stats["tpot_s"]["p50"],
                   stats["output_tokens"] / result["duration_s"])
        for priority, stats in result.get("by_priority", {}).items()
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="W0,W1,WV,WP")
    parser.add_argument("--systems", default=None,
                        help="default: pagedserve,pagedserve-fp16,hf-static,hf-seq,hf-cb, and "
                        "llama-server when --llama-server is given; also pagedserve-int8, "
                        "pagedserve-bf16, pagedserve-spec, llama-server-spec, baseline-tree")
    parser.add_argument("--scale", type=float, default=1.0, help="scale every request count")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="pagedserve's and Hugging Face's model dtype (the -fp16, -int8 "
                        "and -bf16 variants stay float32 models with those weights)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", ""),
                        help="path to llama.cpp's llama-server binary")
    parser.add_argument("--wp-kv-blocks", type=int, default=384,
                        help="KV blocks for WP: about half the low-priority working set")
    parser.add_argument("--model", type=Path, default=None,
                        help="a GGUF file every system serves instead of the default model; "
                        "token-id prompts drawn from its vocabulary")
    parser.add_argument("--pagedserve-args", default="", help="extra `pagedserve serve` flags")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="another checkout, served as system baseline-tree (float32)")
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--json", default=None, help="also write all results to this file")
    args = parser.parse_args(argv)
    try:
        systems = parse_systems(args.systems, args.llama_server, args.baseline_tree)
    except ValueError as exc:
        parser.error(str(exc))
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    everything = {}
    for name in args.workloads.split(","):
        workload = WORKLOADS[name](args.scale)
        if args.model:
            workload = in_vocabulary(workload, normal_token_ids(args.model))
        results: list[dict[str, Any]] = []
        for system in systems:
            if system in SERVERS:
                results += run_server(system, workload, args)
            elif name in SERVER_ONLY_WORKLOADS:
                continue
            else:
                try:
                    results.append(run_hf(system, workload, args))
                except RuntimeError as exc:  # a peer that breaks must not lose the others
                    print(f"{name} {system} FAILED: {exc}", file=sys.stderr)
                    continue
            print(f"{name} {system}: {results[-1]['output_tps']:.1f} tok/s", file=sys.stderr)
        print(format_table(workload, results) + "\n", flush=True)
        everything[name] = results
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
