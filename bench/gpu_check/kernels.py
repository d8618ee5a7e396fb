"""GPU check parts 1 and 2: the kernel unit tests compiled on CUDA, and the Triton
kernels timed against the torch reference."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

# --------------------------------------------------------------------------------------
# Part 1: the kernel unit tests, compiled on CUDA
# --------------------------------------------------------------------------------------
from bench.gpu_check.common import (
    H200_HBM_BYTES_PER_S,
    KERNEL_TESTS_TIMEOUT_S,
    TEST_FILES,
    PartResult,
)


def run_kernel_tests(dry_run: bool) -> PartResult:
    """pytest on the Triton attention and CUDA graph tests, without the interpreter (unless
    dry run)."""
    env = dict(os.environ)
    if not dry_run:
        env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *TEST_FILES]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=KERNEL_TESTS_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode()
        return PartResult("kernel_tests", "fail",
                          detail=f"timed out after {KERNEL_TESTS_TIMEOUT_S}s\n{out[-4000:]}")
    output = proc.stdout + proc.stderr
    summary = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$", output, re.MULTILINE)
    detail = (summary[-1] if summary else "no pytest summary") + "\n" + output[-4000:]
    return PartResult("kernel_tests", "pass" if proc.returncode == 0 else "fail",
                      detail=detail)


# --------------------------------------------------------------------------------------
# Part 2: kernel timing against the torch reference
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttnShape:
    name: str
    query_lens: list[int]
    context_lens: list[int]
    num_decode_seqs: int


def attention_shapes(dry_run: bool) -> list[AttnShape]:
    if dry_run:
        return [
            AttnShape("decode 2 x 40", [1, 1], [40, 40], 2),
            AttnShape("prefill 1 x 24", [24], [24], 0),
            AttnShape("mixed 2 dec + chunk", [1, 1, 8], [30, 5, 20], 2),
        ]
    return [
        AttnShape("decode 1 x 1k", [1], [1024], 1),
        AttnShape("decode 32 x 2k", [1] * 32, [2048] * 32, 32),
        AttnShape("decode 128 x 1k", [1] * 128, [1024] * 128, 128),
        AttnShape("decode 8 x 16k", [1] * 8, [16384] * 8, 8),
        AttnShape("prefill 1 x 2k", [2048], [2048], 0),
        AttnShape("chunks 4 x 512 after 1.5k", [512] * 4, [2048] * 4, 0),
        AttnShape("mixed 64 dec x 1k + 2 x 512", [1] * 64 + [512, 512], [1024] * 64 + [512, 1024],
                  64),
    ]


@dataclass
class _TimingSetup:
    """What every timed case shares."""

    device: object  # torch.device
    dtype: object  # torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    gen: object  # torch.Generator
    timer: Callable[[Callable[[], object]], float]
    torch_ref: object  # model_runner.attention.torch_backend, or None
    atol: float


def run_kernel_timing(dry_run: bool) -> PartResult:
    """Time the Triton kernels and the torch reference; check outputs agree."""
    import torch

    try:
        from model_runner.attention import torch_backend as torch_ref
    except ImportError as e:  # the comparison is then skipped, the timing still runs
        torch_ref = None
        ref_missing = f"torch reference unavailable: {e}"
    else:
        ref_missing = ""

    device = torch.device("cpu" if dry_run else "cuda")
    dtype = torch.float32 if dry_run else torch.bfloat16
    num_heads, num_kv_heads, head_dim = (4, 2, 64) if dry_run else (16, 8, 128)
    setup = _TimingSetup(
        device=device, dtype=dtype, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=16,
        gen=torch.Generator(device=device).manual_seed(0),
        timer=cpu_timer if dry_run else cuda_timer,
        torch_ref=torch_ref,
        atol=1e-4 if dtype == torch.float32 else 2e-2,
    )
    rows: list[dict] = []
    failures: list[str] = []
    # write_kv_cache: a decode step's and a prefill step's worth of tokens
    for num_tokens in (4, 32) if dry_run else (256, 4096):
        rows.append(_time_write_kv_cache(setup, num_tokens, failures))
    for shape in attention_shapes(dry_run):
        rows.append(_time_paged_attention(setup, shape, failures, hbm_peak=not dry_run))
    status = "fail" if failures else "pass"
    detail = "; ".join(failures) or ref_missing or "all outputs match the torch reference"
    return PartResult("kernel_timing", status, detail=detail, rows=rows)


def _time_write_kv_cache(s: _TimingSetup, num_tokens: int, failures: list[str]) -> dict:
    import torch

    from model_runner.kernels import triton_attention as ta

    num_blocks = num_tokens // s.block_size + 8
    shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
    k_cache = torch.zeros(shape, dtype=s.dtype, device=s.device)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(num_tokens, s.num_kv_heads, s.head_dim, generator=s.gen,
                      device=s.device, dtype=s.dtype)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * s.block_size, generator=s.gen, device=s.device)
    slots = slots[:num_tokens]
    ta.write_kv_cache(key, value, k_cache, v_cache, slots)
    flat = (-1, s.num_kv_heads, s.head_dim)
    ok = torch.equal(k_cache.view(flat)[slots], key) and \
        torch.equal(v_cache.view(flat)[slots], value)
    if not ok:
        failures.append(f"write_kv_cache {num_tokens} tokens: wrong cache contents")
    triton_ms = s.timer(lambda: ta.write_kv_cache(key, value, k_cache, v_cache, slots))
    row = {"kernel": "write_kv_cache", "shape": f"{num_tokens} tokens",
           "triton_ms": triton_ms, "correct": ok}
    if s.torch_ref is not None:
        ref = s.torch_ref
        row["torch_ms"] = s.timer(lambda: ref.write_kv_cache(key, value, k_cache, v_cache,
                                                             slots))
        row["speedup"] = row["torch_ms"] / triton_ms
    return row


def _time_paged_attention(s: _TimingSetup, shape: AttnShape, failures: list[str],
                          hbm_peak: bool) -> dict:
    import torch

    from model_runner.attention_metadata import AttentionMetadata
    from model_runner.kernels import triton_attention as ta

    blocks_per_seq = [-(-c // s.block_size) for c in shape.context_lens]
    num_blocks = sum(blocks_per_seq) + 1
    cache_shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
    k_cache = torch.randn(cache_shape, generator=s.gen, device=s.device, dtype=s.dtype)
    v_cache = torch.randn(cache_shape, generator=s.gen, device=s.device, dtype=s.dtype)
    # Shuffled blocks, as a long-running server's block pool hands them out.
    pool = torch.randperm(num_blocks, generator=s.gen, device=s.device).to(torch.int32)
    block_tables = torch.zeros(len(blocks_per_seq), max(blocks_per_seq), dtype=torch.int32,
                               device=s.device)
    taken = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = pool[taken: taken + n]
        taken += n
    query_start_loc = torch.zeros(len(shape.query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(shape.query_lens).cumsum(0)
    num_tokens = sum(shape.query_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=s.device),  # unused
        query_start_loc=query_start_loc.to(s.device),
        context_lens=torch.tensor(shape.context_lens, dtype=torch.int32, device=s.device),
        block_tables=block_tables,
        max_query_len=max(shape.query_lens),
        max_context_len=max(shape.context_lens),
        num_decode_seqs=shape.num_decode_seqs,
    )
    query = torch.randn(num_tokens, s.num_heads, s.head_dim, generator=s.gen,
                        device=s.device, dtype=s.dtype)
    scale = s.head_dim**-0.5

    out = ta.paged_attention(query, k_cache, v_cache, meta, scale)
    triton_ms = s.timer(lambda: ta.paged_attention(query, k_cache, v_cache, meta, scale))
    kv_bytes = 2 * sum(shape.context_lens) * s.num_kv_heads * s.head_dim
    kv_bytes *= k_cache.element_size()
    row = {"kernel": "paged_attention", "shape": shape.name, "triton_ms": triton_ms,
           "kv_read_GBps": kv_bytes / (triton_ms * 1e-3) / 1e9}
    if hbm_peak:
        row["pct_of_hbm_peak"] = 100 * kv_bytes / (triton_ms * 1e-3) / H200_HBM_BYTES_PER_S
    if s.torch_ref is not None:
        ref_mod = s.torch_ref
        row["torch_ms"] = s.timer(lambda: ref_mod.paged_attention(query, k_cache, v_cache,
                                                                  meta, scale))
        row["speedup"] = row["torch_ms"] / triton_ms
        # Reference in fp32 on the same (rounded) inputs.
        ref = ref_mod.paged_attention(query.float(), k_cache.float(), v_cache.float(), meta,
                                      scale)
        err = (out.float() - ref).abs().max().item()
        row["max_abs_err"] = err
        row["correct"] = bool(err <= s.atol)
        if not row["correct"]:
            failures.append(f"paged_attention {shape.name}: max abs err {err:.3g} > {s.atol}")
    return row


def cuda_timer(fn: Callable[[], object]) -> float:
    """Median milliseconds per call, L2 flushed between calls (triton's do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def cpu_timer(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


