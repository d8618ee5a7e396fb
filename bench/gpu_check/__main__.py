"""The one prepared device check for a CUDA session (an H200): `python -m bench.gpu_check`.

Parts, each recorded as "pass", "fail" or "skipped: <reason>":

1. gpu_tests: pytest on tests/gpu (the Triton kernels at Qwen3-0.6B-like shapes against
   the reference; greedy tokens identical to HF `generate` in fp32, batched, chunked,
   prefix-cached and preempted; the TP code path on one GPU, a 1-rank NCCL group with its
   collectives in the decode CUDA graphs, equal to the plain runner; overlapped steps equal
   to plain ones) and on the runner's Triton and CUDA graph tests, compiled on CUDA.
2. kernel_timing: the Triton write_kv_cache / paged_attention against the torch reference
   (model_runner/attention/torch_backend.py) at Qwen3-0.6B-like attention shapes (16
   heads, 8 kv heads, head_dim 128, bf16, block size 16): time, speedup, KV read
   bandwidth.
3. Measures on random-weight models (nothing downloaded), through the real Scheduler and
   ModelRunner with the Triton backend and decode CUDA graphs:
   - bf16_agreement_hf: greedy tokens' agreement % with HF `generate` in bf16.
   - qwen3_shaped_throughput: output tokens/s of a Qwen3-0.6B-shaped model on nano-vllm's
     workload (256 sequences, 100..1024 tokens in and out), CUDA graphs and eager, against
     HF generate static batching (run in part and extrapolated; the report says so).
   - decode_step_vs_bandwidth: decode step time at batch 1, 64, 256 against (weight bytes
     + KV bytes read) / the device copy bandwidth measured in the same run.
   - async_scheduling_steps: steps/s of overlapped and plain steps (engine/core.py).

Results go to $OUT (else ./gpu_check_out): gpu_check.json and gpu_check.md. The exit status
is 1 when a part failed (skipped parts do not count). The whole check is sized for 8
minutes on one H200; a part that would start after the budget is skipped.

`--dry-run` runs the same code, the GPU tests included, on the CPU under Triton's
interpreter at tiny shapes, to check it before spending device time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from bench.gpu_check.common import TOTAL_BUDGET_S, PartResult, start_budget
from bench.gpu_check.kernels import run_gpu_tests, run_kernel_timing
from bench.gpu_check.overlap import measure_async_scheduling
from bench.gpu_check.parity import measure_bf16_agreement
from bench.gpu_check.throughput import check_decode_step_vs_bandwidth, check_qwen3_shaped_throughput

# --------------------------------------------------------------------------------------
# Driver and report
# --------------------------------------------------------------------------------------

PARTS: list[tuple[str, Callable[[bool], PartResult]]] = [
    ("gpu_tests", run_gpu_tests),
    ("kernel_timing", run_kernel_timing),
    ("bf16_agreement_hf", measure_bf16_agreement),
    ("qwen3_shaped_throughput", check_qwen3_shaped_throughput),
    ("decode_step_vs_bandwidth", check_decode_step_vs_bandwidth),
    ("async_scheduling_steps", measure_async_scheduling),
]


def run_part(name: str, fn: Callable[[bool], PartResult], dry_run: bool,
             deadline: float) -> PartResult:
    if time.monotonic() > deadline:
        return PartResult(name, f"skipped: the {TOTAL_BUDGET_S}s budget ran out")
    start = time.monotonic()
    try:
        result = fn(dry_run)
    except Exception:  # noqa: BLE001 - a crash is a failed part, the others still run
        result = PartResult(name, "fail", detail=traceback.format_exc()[-4000:])
    result.name = name
    result.seconds = time.monotonic() - start
    return result


def environment_info() -> dict:
    info: dict = {"python": sys.version.split()[0]}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
        import triton

        info["triton"] = triton.__version__
    except ImportError as e:
        info["import_error"] = str(e)
    return info


def write_report(out_dir: Path, env: dict, results: list[PartResult]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"environment": env, "parts": [asdict(r) for r in results]}
    (out_dir / "gpu_check.json").write_text(json.dumps(payload, indent=2))
    lines = ["# pagedserve GPU check", "",
             ", ".join(f"{k}: {v}" for k, v in env.items()), "",
             "| part | status | seconds |", "|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.1f} |" for r in results]
    for r in results:
        if r.rows:
            columns = list(dict.fromkeys(k for row in r.rows for k in row))
            lines += ["", f"## {r.name}", "", "| " + " | ".join(columns) + " |",
                      "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |"
                      for row in r.rows]
        if r.detail:
            lines += ["", f"### {r.name}: detail", "", "```", r.detail.strip(), "```"]
    (out_dir / "gpu_check.md").write_text("\n".join(lines) + "\n")


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU + Triton interpreter at tiny shapes: checks this script")
    parser.add_argument("--parts", nargs="*", choices=[n for n, _ in PARTS],
                        help="run only these parts")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    out_dir = Path(os.environ.get("OUT") or "gpu_check_out")
    deadline = start_budget()
    env = environment_info()

    results = []
    for name, fn in PARTS:
        if args.parts and name not in args.parts:
            continue
        if not args.dry_run and not env.get("cuda_available"):
            results.append(PartResult(name, "skipped: no CUDA device (use --dry-run on CPU)"))
            continue
        print(f"[gpu_check] {name} ...", flush=True)
        result = run_part(name, fn, args.dry_run, deadline)
        print(f"[gpu_check] {name}: {result.status} ({result.seconds:.1f}s)", flush=True)
        results.append(result)
        write_report(out_dir, env, results)  # keep what we have if a later part hangs

    write_report(out_dir, env, results)
    print((out_dir / "gpu_check.md").read_text())
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

