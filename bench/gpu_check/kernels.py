"""GPU check parts: the GPU tests (pytest, kernels compiled on CUDA), and the Triton
kernels timed against the torch reference."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial

from bench.gpu_check.common import (
    GPU_TESTS_TIMEOUT_S,
    H200_HBM_BYTES_PER_S,
    TEST_PATHS,
    PartResult,
)
from tests.support.gpu_models import attention_shapes, kv_write_sizes, model_batch


def run_gpu_tests(dry_run: bool) -> PartResult:
    """pytest on tests/gpu and the runner's kernel and CUDA-graph tests, compiled (in a dry
    run on the CPU at tiny shapes, Triton under its interpreter)."""
    env = dict(os.environ)
    if dry_run:
        env["GPU_CHECK_DRY_RUN"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *TEST_PATHS]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=GPU_TESTS_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode()
        return PartResult("gpu_tests", "fail",
                          detail=f"timed out after {GPU_TESTS_TIMEOUT_S}s\n{out[-4000:]}")
    output = proc.stdout + proc.stderr
    summary = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$", output, re.MULTILINE)
    detail = (summary[-1] if summary else "no pytest summary") + "\n" + output[-4000:]
    return PartResult("gpu_tests", "pass" if proc.returncode == 0 else "fail", detail=detail)


def run_kernel_timing(dry_run: bool) -> PartResult:
    """The Triton KV write and paged attention against the torch reference at the model's
    shapes: milliseconds, speedup, KV read bandwidth (their agreement with the reference is
    tests/gpu/test_kernels.py's)."""
    from model_runner.attention import torch_backend
    from model_runner.kernels import triton_attention

    timer = cpu_timer if dry_run else cuda_timer
    rows = []
    for num_tokens in kv_write_sizes(dry_run):
        b = model_batch([num_tokens], [num_tokens], 0, dry_run)
        args = (b.new_k, b.new_v, b.k_cache, b.v_cache, b.meta.slot_mapping)
        triton_ms = timer(partial(triton_attention.write_kv_cache, *args))
        torch_ms = timer(partial(torch_backend.write_kv_cache, *args))
        rows.append({"kernel": "write_kv_cache", "shape": f"{num_tokens} tokens",
                     "triton_ms": triton_ms, "torch_ms": torch_ms,
                     "speedup": torch_ms / triton_ms})
    for name, shape in attention_shapes(dry_run).items():
        rows.append(_time_paged_attention(name, model_batch(*shape, dry_run), timer,
                                          hbm_peak=not dry_run))
    return PartResult("kernel_timing", "pass", rows=rows)


def _time_paged_attention(name: str, b, timer: Callable[[Callable[[], object]], float],
                          hbm_peak: bool) -> dict:
    from model_runner.attention import torch_backend
    from model_runner.kernels import triton_attention

    b.write_new_kv_with_torch()
    args = (b.query, b.k_cache, b.v_cache, b.meta, b.scale)
    triton_ms = timer(partial(triton_attention.paged_attention, *args))
    torch_ms = timer(partial(torch_backend.paged_attention, *args))
    kv_bytes = 2 * int(b.meta.context_lens.sum()) * b.k_cache[0, 0].numel()
    kv_bytes *= b.k_cache.element_size()
    row = {"kernel": "paged_attention", "shape": name, "triton_ms": triton_ms,
           "torch_ms": torch_ms, "speedup": torch_ms / triton_ms,
           "kv_read_GBps": kv_bytes / (triton_ms * 1e-3) / 1e9}
    if hbm_peak:
        row["pct_of_hbm_peak"] = 100 * kv_bytes / (triton_ms * 1e-3) / H200_HBM_BYTES_PER_S
    return row


def cuda_timer(fn: Callable[[], object]) -> float:
    """Median milliseconds per call, L2 flushed between calls (triton's do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def cpu_timer(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


