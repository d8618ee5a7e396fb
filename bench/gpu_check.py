"""The one prepared device check for a CUDA session (an H200): `python -m bench.gpu_check`.

Parts, each recorded as "pass", "fail" or "skipped: <reason>":

1. kernel_tests: pytest on tests/unit/test_triton_attention.py, test_triton_layers.py and
   test_cuda_graphs.py, compiled on CUDA (no Triton interpreter).
2. kernel_timing: the Triton write_kv_cache / paged_attention against the torch reference
   (model_runner/attention/torch_backend.py) at Qwen3-0.6B-like attention shapes (16
   heads, 8 kv heads, head_dim 128, bf16, block size 16): time, speedup, KV read
   bandwidth, max error.
3. Model-runner checks on random-weight models (nothing downloaded), through the real
   Scheduler and ModelRunner with the Triton backend and decode CUDA graphs:
   - greedy_parity_hf: greedy tokens == HF `generate` on a small Llama, exact in fp32,
     agreement % in bf16; batched, chunked, prefix-cached and preempted requests.
   - qwen3_shaped_throughput: output tokens/s of a Qwen3-0.6B-shaped model on nano-vllm's
     workload (256 sequences, 100..1024 tokens in and out), CUDA graphs and eager, against
     HF generate static batching (run in part and extrapolated; the report says so).
   - decode_step_vs_bandwidth: decode step time at batch 1, 64, 256 against (weight bytes
     + KV bytes read) / the device copy bandwidth measured in the same run.
   - tp_one_rank_nccl: tensor parallelism's code path on the one GPU: a 1-rank NCCL group,
     the sharded model with its all-reduces and logits gather, decode CUDA graphs captured
     with the collectives in them; greedy tokens == the plain runner's, step times of both.

Results go to $OUT (else ./gpu_check_out): gpu_check.json and gpu_check.md. The exit status
is 1 when a part failed (skipped parts do not count). The whole check is sized for 8
minutes on one H200; a part that would start after the budget is skipped.

`--dry-run` runs the same code on the CPU under Triton's interpreter at tiny shapes, to
check the script itself before spending device time.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

TOTAL_BUDGET_S = 8 * 60
KERNEL_TESTS_TIMEOUT_S = 240
H200_HBM_BYTES_PER_S = 4.8e12
TEST_FILES = ["tests/unit/test_triton_attention.py", "tests/unit/test_triton_layers.py",
              "tests/unit/test_cuda_graphs.py"]


@dataclass
class PartResult:
    name: str
    status: str  # "pass", "fail" or "skipped: <reason>"
    seconds: float = 0.0
    detail: str = ""
    rows: list[dict] = field(default_factory=list)  # tables for the markdown report

    @property
    def failed(self) -> bool:
        return self.status == "fail"


class Skip(Exception):
    """Raised by a part that cannot run here; its message is the reason."""


# --------------------------------------------------------------------------------------
# Part 1: the kernel unit tests, compiled on CUDA
# --------------------------------------------------------------------------------------


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
        timer=_cpu_timer if dry_run else _cuda_timer,
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

    from model_runner import triton_attention as ta

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

    from model_runner import triton_attention as ta
    from model_runner.attention_metadata import AttentionMetadata

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


def _cuda_timer(fn: Callable[[], object]) -> float:
    """Median milliseconds per call, L2 flushed between calls (triton's do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _cpu_timer(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


# --------------------------------------------------------------------------------------
# Part 3: model-runner checks on random-weight models (nothing is downloaded)
# --------------------------------------------------------------------------------------
#
# Models are built from a transformers config with random weights, saved to a temporary
# folder (safetensors and a word-level tokenizer) and loaded through
# model_runner.loader.load_model, as a real model would be. Requests go through the real
# Scheduler and ModelRunner.execute, the engine step without the HTTP server. On CUDA the
# runner uses the Triton kernels and captures decode CUDA graphs; in a dry run it uses the
# torch reference (and, in fp32, the Triton kernels under the interpreter) with the
# decode graph runner in eager mode, so the same code paths run except real CUDA.

def _import_runner():
    """model_runner.runner with a ModelRunner, or Skip with the reason."""
    try:
        runner = importlib.import_module("model_runner.runner")
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        raise Skip(f"model_runner.runner does not import: {type(e).__name__}: {e}") from e
    if not hasattr(runner, "ModelRunner"):
        raise Skip("model_runner.runner has no ModelRunner")
    return runner


_deadline = float("inf")  # time.monotonic() at which the whole check's budget ends

# Qwen3-0.6B's sizes (its config.json), for a model with random weights.
QWEN3_0_6B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    bos_token_id=151643, eos_token_id=151645,
)
QWEN3_TINY = dict(QWEN3_0_6B, vocab_size=512, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)


def _time_left() -> float:
    return _deadline - time.monotonic()


def _device(dry_run: bool):
    import torch

    return torch.device("cpu" if dry_run else "cuda")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _save_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer "t<id>" for every id (the loader needs one; nothing here
    decodes text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)


def _random_model_folder(hf_config, folder: Path, dtype, device):
    """Random weights from `hf_config` (built on `device`), saved to `folder`; returns the
    Hugging Face model, in eval mode, with EOS off so that generate runs to length."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.eval()
    model.save_pretrained(folder)
    _save_tokenizer(folder, min(int(hf_config.vocab_size), 4096))
    model.generation_config.eos_token_id = None
    return model


_qwen3_cache: dict[bool, tuple[Path, object]] = {}


def _qwen3_model(dry_run: bool) -> tuple[Path, object]:
    """The Qwen3-0.6B-shaped random model (a tiny one in a dry run): its folder and the
    Hugging Face model (bf16 on the device), built once per process."""
    if dry_run not in _qwen3_cache:
        import atexit
        import shutil
        import tempfile

        import torch
        from transformers import Qwen3Config

        folder = Path(tempfile.mkdtemp(prefix="gpu_check_qwen3_"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        config = Qwen3Config(**(QWEN3_TINY if dry_run else QWEN3_0_6B))
        hf = _random_model_folder(config, folder, torch.bfloat16, _device(dry_run))
        _qwen3_cache[dry_run] = (folder, hf)
    return _qwen3_cache[dry_run]


def _make_runner(model_config, dry_run: bool, interpret_triton: bool = False):
    """A ModelRunner; in a dry run with the decode graph runner attached in eager mode
    (and the Triton kernels under the interpreter when `interpret_triton`)."""
    from model_runner.attention.backend import AttentionBackend
    from model_runner.cuda_graphs import DecodeGraphRunner
    from model_runner.loader import load_model
    from model_runner.runner import ModelRunner

    runner = ModelRunner(load_model(model_config), model_config)
    if dry_run:
        if interpret_triton:
            from model_runner import triton_attention as ta

            runner.attn = AttentionBackend("triton", ta.write_kv_cache, ta.paged_attention)
        runner.decode_graphs = DecodeGraphRunner(
            runner.model, runner.attn, max_num_seqs=model_config.max_num_seqs,
            max_model_len=runner.max_model_len, block_size=runner.block_size,
            use_cuda_graphs=False)
    return runner


@dataclass
class LoopStats:
    outputs: list[list[int]]
    elapsed_s: float
    num_steps: int
    num_decode_steps: int  # decode-only steps (graphed on CUDA)
    num_preemptions: int
    phase_s: dict[str, float]  # seconds in Scheduler.schedule, ModelRunner.execute, update

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def _scheduler_loop(runner, prompts: list[list[int]], params: list, *, max_num_seqs: int,
                    max_num_batched_tokens: int, num_blocks: int | None = None) -> LoopStats:
    """Serve `prompts` to the end through the real Scheduler and `runner` (the engine
    step: schedule, execute, update); `num_blocks` shrinks the scheduler's KV pool."""
    from kvcache.config import CacheConfig
    from scheduler.config import SchedulerConfig
    from scheduler.output import SchedulerOutput
    from scheduler.request import Request
    from scheduler.scheduler import Scheduler

    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=runner.max_model_len),
        CacheConfig(num_blocks=num_blocks or runner.num_kv_blocks, block_size=runner.block_size),
    )
    requests = [Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params,
                                                                        strict=True))]
    for request in requests:
        scheduler.add_request(request)
    num_steps = num_decode_steps = idle = 0
    phase_s = dict.fromkeys(("schedule", "execute", "update"), 0.0)
    start = time.perf_counter()
    while scheduler.has_unfinished_requests():
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        if plan.is_empty:
            idle += 1
            if idle > 3:
                raise RuntimeError("the scheduler stalled with unfinished requests")
        t1 = time.perf_counter()
        out = runner.execute(plan)  # ends in a host sync: the sampled tokens
        t2 = time.perf_counter()
        scheduler.update(plan, out)
        phase_s["schedule"] += t1 - t0
        phase_s["execute"] += t2 - t1
        phase_s["update"] += time.perf_counter() - t2
        num_steps += 1
        num_decode_steps += bool(plan.scheduled) and all(
            r.num_new_tokens == 1 for r in plan.scheduled)
    elapsed = time.perf_counter() - start
    runner.execute(SchedulerOutput(finished_ids=[r.request_id for r in requests]))
    return LoopStats([list(r.output_token_ids) for r in requests], elapsed, num_steps,
                     num_decode_steps, scheduler.num_preemptions_total, phase_s)


# --- 3a: greedy parity with Hugging Face generate ---------------------------------------------


def _hf_greedy(hf, prompts: list[list[int]], max_tokens: int, device) -> list[list[int]]:
    """Hugging Face greedy generate, one prompt at a time (no padding)."""
    import torch

    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            tokens = hf.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
            out.append(tokens[0, len(prompt):].tolist())
    return out


def _agreement(outputs: list[list[int]], expected: list[list[int]]) -> tuple[int, float, str]:
    """(identical sequences, % of tokens before each sequence's first divergence, the
    first mismatch described)."""
    identical, agreeing, total, first = 0, 0, 0, ""
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        pairs = enumerate(zip(got, want, strict=False))
        n = next((j for j, (a, b) in pairs if a != b), min(len(got), len(want)))
        identical += got == want
        agreeing += n
        total += len(want)
        if got != want and not first:
            first = f"request {i} token {n}: got {got[n:n + 4]}, HF {want[n:n + 4]}"
    return identical, 100.0 * agreeing / max(total, 1), first


def check_greedy_parity_hf(dry_run: bool) -> PartResult:
    """Greedy tokens of the runner == HF `generate` on the same random small Llama: exact
    in fp32, agreement % in bf16. Requests are batched, chunked, prefix-cached, and in a
    second run preempted (a small KV pool), through the real Scheduler; decodes go
    through the decode graph runner (CUDA graphs on a GPU)."""
    _import_runner()
    import copy
    import random
    import tempfile

    import torch
    from transformers import LlamaConfig

    from model_runner.config import ModelConfig
    from scheduler.sampling_params import SamplingParams

    device = _device(dry_run)
    sizes = (dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
             if dry_run else
             dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024))
    # NOTE: a wide init makes the logits peaked, so that greedy never rests on a near tie.
    hf_config = LlamaConfig(**sizes, initializer_range=0.2, tie_word_embeddings=False,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)
    num_prompts, max_len, max_tokens = (6, 20, 4) if dry_run else (12, 150, 24)
    block_size, prefix_len = (4, 8) if dry_run else (16, 48)
    rng = random.Random(0)
    vocab = sizes["vocab_size"]
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    prompts = []
    for i in range(num_prompts):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randint(3, max_len - prefix_len))]
        prompts.append(prefix + tail if i % 3 == 0 else tail)  # every third shares a prefix
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * len(
        prompts)
    longest = max(len(p) for p in prompts) + max_tokens
    tight_pool = -(-longest // block_size) + 2  # one long request and a little more

    rows, failures = [], []
    with tempfile.TemporaryDirectory(prefix="gpu_check_llama_") as tmp:
        hf32 = _random_model_folder(hf_config, Path(tmp), torch.float32, device)
        for dtype in (torch.float32, torch.bfloat16):
            dtype_name = str(dtype).removeprefix("torch.")
            hf = hf32 if dtype == torch.float32 else copy.deepcopy(hf32).to(dtype)
            expected = _hf_greedy(hf, prompts, max_tokens, device)
            if dtype == torch.float32:
                expected_fp32 = expected
            # bf16 noise alone: how far HF's own bf16 tokens stray from its fp32 ones
            hf_vs_fp32 = _agreement(expected, expected_fp32)[1]
            config = ModelConfig(
                model=tmp, device=device.type, dtype=dtype_name, block_size=block_size,
                num_kv_blocks=4 * num_prompts * -(-longest // block_size),
                max_num_seqs=8, max_num_batched_tokens=16 if dry_run else 64,
                attention_backend="torch" if dry_run else "triton")
            # NOTE: the interpreter computes bf16 dot products wrongly: fp32 only there.
            runner = _make_runner(config, dry_run, interpret_triton=dtype == torch.float32)
            for scenario, num_blocks in (("batched, chunked, prefix-cached", None),
                                         ("preempted (small KV pool)", tight_pool)):
                stats = _scheduler_loop(runner, prompts, params, max_num_seqs=8,
                                        max_num_batched_tokens=config.max_num_batched_tokens,
                                        num_blocks=num_blocks)
                identical, pct, first = _agreement(stats.outputs, expected)
                rows.append({"dtype": dtype_name, "scenario": scenario,
                             "backend": runner.attn.name,
                             "identical_seqs": f"{identical}/{len(prompts)}",
                             "token_agreement_pct": pct, "steps": stats.num_steps,
                             "decode_steps": stats.num_decode_steps,
                             "preemptions": stats.num_preemptions,
                             "vs_hf_fp32_pct": _agreement(stats.outputs, expected_fp32)[1],
                             "hf_vs_hf_fp32_pct": hf_vs_fp32, "first_mismatch": first})
                if dtype == torch.float32 and identical != len(prompts):
                    failures.append(f"fp32 {scenario}: {first}")
            del runner, hf
            _free_device_memory()
    detail = "; ".join(failures) or (
        "fp32 identical to HF generate; bf16 agreement in the table (token_agreement_pct: "
        "with HF generate in the same dtype; vs_hf_fp32_pct: with HF fp32; hf_vs_hf_fp32_pct: "
        "HF's own tokens in this dtype against its fp32 ones)")
    return PartResult("greedy_parity_hf", "fail" if failures else "pass", detail=detail,
                      rows=rows)


# --- 3b: throughput on a Qwen3-0.6B-shaped model -------------------------------------------


def nano_vllm_workload(dry_run: bool) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py: 256 sequences, prompts of 100..1024 random ids below 10000,
    100..1024 output tokens each (ignore_eos); 8 short ones in a dry run."""
    import random

    rng = random.Random(0)
    n, low, high, top = (8, 4, 24, 500) if dry_run else (256, 100, 1024, 10000)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(low, high))] for _ in range(n)]
    max_tokens = [rng.randint(low, high) for _ in range(n)]
    return prompts, max_tokens


def _hf_static_tps(hf, prompts: list[list[int]], max_tokens: list[int], num_steps: int,
                   temperature: float, device) -> dict:
    """HF generate with static batching: all requests in one left-padded batch, run
    until the longest is done. Only the prefill and `num_steps` decode steps run; the
    rest is extrapolated at the median step time (steps only get slower as the cache
    grows, so this flatters HF)."""
    import statistics

    import torch
    from transformers import LogitsProcessorList

    from bench.hf_baseline import StepTimes, left_pad

    ids, mask = left_pad(prompts)
    ids, mask = ids.to(device), mask.to(device)
    steps = min(num_steps, max(max_tokens))
    timer = StepTimes()
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                    temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=steps,
                    min_new_tokens=steps, pad_token_id=0,
                    logits_processor=LogitsProcessorList([timer]))
    _sync(device)
    end = time.perf_counter()
    prefill_s = timer.times[0] - start
    step_s = statistics.median(b - a for a, b in zip(timer.times, timer.times[1:],
                                                     strict=False)) if steps > 1 else 0.0
    total_s = prefill_s + step_s * (max(max_tokens) - 1)
    return {"system": f"HF generate, static batch of {len(prompts)}",
            "output_tokens": sum(max_tokens), "seconds": total_s,
            "output_tok_per_s": sum(max_tokens) / total_s,
            "note": f"ran prefill + {steps} of {max(max_tokens)} steps "
                    f"({end - start:.1f}s), the rest extrapolated at the median step "
                    f"{step_s * 1e3:.1f} ms"}


def check_qwen3_shaped_throughput(dry_run: bool) -> PartResult:
    """Output tokens/s on nano-vllm's workload (256 sequences, 100..1024 tokens in and
    out, ignore_eos, temperature 0.6) of a Qwen3-0.6B-shaped model with random weights,
    through the real Scheduler + ModelRunner (CUDA graphs; eager too if time allows),
    against HF generate with static batching in the same run."""
    _import_runner()
    import torch

    from model_runner.config import ModelConfig
    from scheduler.sampling_params import SamplingParams

    device = _device(dry_run)
    folder, hf = _qwen3_model(dry_run)
    prompts, max_tokens = nano_vllm_workload(dry_run)
    temperature = 0.6
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True)
              for m in max_tokens]
    max_num_seqs, max_num_batched_tokens = (8, 64) if dry_run else (256, 16384)
    config = ModelConfig(
        model=str(folder), device=device.type, dtype="bfloat16", block_size=16,
        max_model_len=256 if dry_run else 4096, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, gpu_memory_utilization=0.9,
        kv_cache_memory=64 * 2**20,
        attention_backend="torch" if dry_run else "auto")
    rows = []

    def run(label: str, runner) -> LoopStats:
        # Warm-up, as nano-vllm does before timing: Triton compiles its kernel variants,
        # mixed steps included (a small token budget chunks the prompts).
        _scheduler_loop(runner, prompts[:4], [SamplingParams(max_tokens=8, ignore_eos=True)] * 4,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=16 if dry_run else 256)
        _sync(device)
        stats = _scheduler_loop(runner, prompts, params, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens)
        rows.append({"system": label, "output_tokens": stats.num_output_tokens,
                     "seconds": stats.elapsed_s,
                     "output_tok_per_s": stats.num_output_tokens / stats.elapsed_s,
                     "note": f"{stats.num_steps} steps, {stats.num_decode_steps} decode-only, "
                             f"{stats.num_preemptions} preemptions, "
                             f"{runner.num_kv_blocks} KV blocks; ms per step: " + ", ".join(
                                 f"{k} {v / stats.num_steps * 1e3:.2f}"
                                 for k, v in stats.phase_s.items())})
        print(f"[gpu_check]   {label}: {rows[-1]['output_tok_per_s']:.0f} tok/s "
              f"({stats.elapsed_s:.1f}s)", flush=True)
        return stats

    runner = _make_runner(config, dry_run)
    graphs = "CUDA graphs" if runner.decode_graphs and runner.decode_graphs.use_cuda_graphs \
        else "decode graph runner, eager"
    first = run(f"pagedserve ({runner.attn.name}, {graphs})", runner)
    if first.num_output_tokens != sum(max_tokens):
        raise RuntimeError(f"{first.num_output_tokens} tokens out, expected {sum(max_tokens)}")
    # The eager rerun only when the rest of the check keeps enough time after it.
    if _time_left() > 2.5 * first.elapsed_s + 150:
        runner.decode_graphs = None
        run(f"pagedserve ({runner.attn.name}, eager)", runner)
    else:
        rows.append({"system": "pagedserve (eager)", "note": "skipped: budget"})
    del runner
    _free_device_memory()
    rows.append(_hf_static_tps(hf, prompts, max_tokens, 4 if dry_run else 64, temperature,
                               device))
    print(f"[gpu_check]   HF static: {rows[-1]['output_tok_per_s']:.0f} tok/s (extrapolated)",
          flush=True)
    ours = rows[0]["output_tok_per_s"]
    detail = (f"{len(prompts)} requests, {sum(len(p) for p in prompts)} prompt tokens, "
              f"{sum(max_tokens)} output tokens; pagedserve {ours:.0f} tok/s = "
              f"{ours / rows[-1]['output_tok_per_s']:.2f}x HF static batching (HF time "
              f"extrapolated, see its note); random weights, {torch.bfloat16}")
    return PartResult("qwen3_shaped_throughput", "pass", detail=detail, rows=rows)


# --- 3c: decode step time against the memory-bandwidth floor ------------------------------------


def _copy_bandwidth(device, dry_run: bool) -> float:
    """Bytes moved per second (read + written) by a large device-to-device tensor copy."""
    import torch

    num_bytes = (64 if dry_run else 4096) * 2**20
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    repeats = 3 if dry_run else 20
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    return 2 * num_bytes * repeats / (time.perf_counter() - start)


def check_decode_step_vs_bandwidth(dry_run: bool) -> PartResult:
    """Decode step time (ModelRunner.execute, greedy) of the Qwen3-0.6B-shaped model at
    batch 1, 64 and 256 with ~1k-token contexts, CUDA graphs and eager, against its floor:
    (weight bytes + KV bytes read) / the copy bandwidth measured here. Also the bare
    graph replay (the forward alone, no host work)."""
    _import_runner()
    import statistics

    import torch

    from model_runner.config import ModelConfig
    from scheduler.output import ScheduledRequest, SchedulerOutput
    from scheduler.sampling_params import SamplingParams

    device = _device(dry_run)
    bandwidth = _copy_bandwidth(device, dry_run)
    folder, _ = _qwen3_model(dry_run)
    batch_sizes, context, num_steps = ((1, 4, 8), 32, 3) if dry_run else ((1, 64, 256), 1024, 20)
    max_batch, block_size = max(batch_sizes), 16
    # Request 0 decodes in every timed step: up to 3 modes x (warm-up + num_steps) per
    # batch size.
    decode_tokens = len(batch_sizes) * 3 * (num_steps + 1)
    blocks_per_seq = -(-(context + decode_tokens + 8) // block_size)
    max_num_batched_tokens = 64 if dry_run else 16384
    config = ModelConfig(
        model=str(folder), device=device.type, dtype="bfloat16", block_size=block_size,
        max_model_len=256 if dry_run else 4096, max_num_seqs=max_batch,
        max_num_batched_tokens=max_num_batched_tokens,
        num_kv_blocks=max_batch * blocks_per_seq + 1,
        attention_backend="torch" if dry_run else "auto")
    runner = _make_runner(config, dry_run)
    model, graphs = runner.model, runner.decode_graphs
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    k_cache = runner.kv_cache.layers[0][0]
    kv_bytes_per_token = (2 * len(runner.kv_cache.layers) * k_cache.shape[2] * k_cache.shape[3]
                          * k_cache.element_size())

    greedy = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    prompts = [torch.randint(3, vocab, (context,), generator=gen).tolist()
               for _ in range(max_batch)]
    outputs: list[list[int]] = [[] for _ in range(max_batch)]
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
              for i in range(max_batch)]

    def request(i: int, prefill: bool) -> ScheduledRequest:
        tokens = prompts[i] + outputs[i]
        new = prompts[i] if prefill else tokens[-1:]
        return ScheduledRequest(str(i), new, len(tokens) - len(new), tables[i], True, greedy,
                                prompts[i], outputs[i])

    def step(batch: list[ScheduledRequest]) -> None:
        out = runner.execute(SchedulerOutput(scheduled=batch))
        for r in batch:
            outputs[int(r.request_id)].append(out.sampled_token_ids[r.request_id])

    per_step = max(1, max_num_batched_tokens // context)
    for start in range(0, max_batch, per_step):
        step([request(i, prefill=True) for i in range(start, min(start + per_step, max_batch))])

    # (label, graph runner or None for eager): the runner's own graphs, and (on CUDA, for
    # the fused layer kernels' share) graphs of the same model with the torch layer code
    modes: list[tuple[str, object]] = [("eager", None)]
    if graphs is not None:
        modes.insert(0, ("CUDA graphs" if graphs.use_cuda_graphs else "graph runner, eager",
                         graphs))
        if graphs.use_cuda_graphs and runner.attn.layer_ops is not None:
            from model_runner.cuda_graphs import create_decode_graph_runner

            torch_layers = create_decode_graph_runner(
                model, dataclasses.replace(runner.attn, layer_ops=None), config,
                runner.max_model_len, device)
            torch_layers.capture(runner.kv_cache.layers)
            modes.insert(1, ("CUDA graphs, torch layer code", torch_layers))
    rows = []
    for batch_size in batch_sizes:
        for label, mode_graphs in modes:
            runner.decode_graphs = mode_graphs
            step([request(i, prefill=False) for i in range(batch_size)])  # warm-up
            times = []
            for _ in range(num_steps):
                batch = [request(i, prefill=False) for i in range(batch_size)]
                begin = time.perf_counter()
                step(batch)
                times.append(time.perf_counter() - begin)
            step_s = statistics.median(times)
            contexts = sum(len(prompts[i]) + len(outputs[i]) for i in range(batch_size))
            floor_s = (weight_bytes + contexts * kv_bytes_per_token) / bandwidth
            row = {"batch": batch_size, "mode": label,
                   "step_ms": step_s * 1e3, "floor_ms": floor_s * 1e3,
                   "floor_pct": 100 * floor_s / step_s, "tok_per_s": batch_size / step_s,
                   "mean_context": contexts / batch_size}
            if mode_graphs is not None:
                row["forward_only_ms"] = _time_graph_forward(mode_graphs, batch_size, runner,
                                                             num_steps) * 1e3
                row["forward_floor_pct"] = 100 * floor_s * 1e3 / row["forward_only_ms"]
            rows.append(row)
            print(f"[gpu_check]   batch {batch_size} {row['mode']}: {row['step_ms']:.2f} ms "
                  f"(floor {row['floor_ms']:.2f} ms)", flush=True)
    runner.decode_graphs = graphs
    detail = (f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write, device tensor copy); "
              f"weights {weight_bytes / 2**20:.0f} MiB; KV {kv_bytes_per_token} B/token; "
              f"step = ModelRunner.execute (inputs, forward, greedy sampling), median of "
              f"{num_steps}; forward_only = the graph replayed alone")
    return PartResult("decode_step_vs_bandwidth", "pass", detail=detail, rows=rows)


def _time_graph_forward(graphs, batch_size: int, runner, repeats: int) -> float:
    """Seconds per forward of the bucket's graph replayed back to back on the inputs
    staged last (same tokens at the same slots: the cache is rewritten unchanged)."""
    import torch

    bucket = graphs.bucket(batch_size)
    device = graphs.device

    def forward() -> None:
        if graphs.use_cuda_graphs:
            graphs._graphs[bucket].replay()
        else:
            with torch.inference_mode():
                graphs._run(bucket, runner.kv_cache.layers)

    forward()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        forward()
    _sync(device)
    return (time.perf_counter() - start) / repeats


# --------------------------------------------------------------------------------------
# Driver and report
# --------------------------------------------------------------------------------------

# --- 3d: tensor parallelism on one rank --------------------------------------------------


def check_tp_one_rank_nccl(dry_run: bool) -> PartResult:
    """The TP runner (`start_tensor_parallel` with one rank: NCCL on CUDA, gloo in a dry
    run) against the plain one on the same random Llama, through the real Scheduler:
    identical greedy tokens in fp32, and the execute time per step of each."""
    _import_runner()
    import random
    import tempfile

    import torch
    from transformers import LlamaConfig

    from model_runner.config import ModelConfig
    from model_runner.cuda_graphs import DecodeGraphRunner
    from model_runner.tp_workers import start_tensor_parallel
    from scheduler.sampling_params import SamplingParams

    device = _device(dry_run)
    sizes = (dict(vocab_size=255, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
             if dry_run else
             dict(vocab_size=2047, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024))
    hf_config = LlamaConfig(**sizes, initializer_range=0.2, tie_word_embeddings=True,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)
    rng = random.Random(1)
    num_prompts, max_tokens = (4, 4) if dry_run else (16, 32)
    prompts = [[rng.randrange(3, sizes["vocab_size"]) for _ in range(rng.randint(3, 60))]
               for _ in range(num_prompts)]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * len(
        prompts)
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_tp_") as tmp:
        _random_model_folder(hf_config, Path(tmp), torch.float32, device)
        config = ModelConfig(model=tmp, device=device.type, dtype="float32", block_size=16,
                             num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=256,
                             attention_backend="torch" if dry_run else "triton")
        for name in ("plain", "tp=1"):
            if name == "plain":
                runner = _make_runner(config, dry_run)
            else:
                _, runner = start_tensor_parallel(
                    dataclasses.replace(config, tensor_parallel_size=1))
                if dry_run:
                    runner.decode_graphs = DecodeGraphRunner(
                        runner.model, runner.attn, max_num_seqs=config.max_num_seqs,
                        max_model_len=runner.max_model_len, block_size=runner.block_size,
                        use_cuda_graphs=False)
            try:
                stats = _scheduler_loop(runner, prompts, params, max_num_seqs=16,
                                        max_num_batched_tokens=256)
            finally:
                if runner.workers is not None:
                    runner.workers.close()
                    runner.model.tp.close()
            graphs = runner.decode_graphs
            results[name] = stats.outputs
            rows.append({"runner": name, "backend": runner.attn.name,
                         "process_group": "none" if runner.model.tp is None else (
                             "nccl" if device.type == "cuda" else "gloo"),
                         "cuda_graphs": 0 if graphs is None else len(graphs._graphs),
                         "steps": stats.num_steps, "decode_steps": stats.num_decode_steps,
                         "execute_ms_per_step": 1000 * stats.phase_s["execute"]
                         / max(stats.num_steps, 1)})
            del runner
            _free_device_memory()
    identical, pct, first = _agreement(results["tp=1"], results["plain"])
    ok = identical == len(prompts)
    return PartResult("tp_one_rank_nccl", "pass" if ok else "fail", rows=rows,
                      detail="identical greedy tokens" if ok else f"{pct:.1f}% agree; {first}")


PARTS: list[tuple[str, Callable[[bool], PartResult]]] = [
    ("kernel_tests", run_kernel_tests),
    ("kernel_timing", run_kernel_timing),
    ("greedy_parity_hf", check_greedy_parity_hf),
    ("qwen3_shaped_throughput", check_qwen3_shaped_throughput),
    ("decode_step_vs_bandwidth", check_decode_step_vs_bandwidth),
    ("tp_one_rank_nccl", check_tp_one_rank_nccl),
]


def run_part(name: str, fn: Callable[[bool], PartResult], dry_run: bool,
             deadline: float) -> PartResult:
    if time.monotonic() > deadline:
        return PartResult(name, f"skipped: the {TOTAL_BUDGET_S}s budget ran out")
    start = time.monotonic()
    try:
        result = fn(dry_run)
    except Skip as e:
        result = PartResult(name, f"skipped: {e}")
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
    global _deadline
    deadline = _deadline = time.monotonic() + TOTAL_BUDGET_S
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
