"""What the GPU check's parts share: the result record, the budget, the device, the
random-weight models and the scheduler loop that drives the real Scheduler and
ModelRunner."""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
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

def import_runner():
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


def start_budget() -> float:
    """Start the whole check's budget of TOTAL_BUDGET_S; returns its deadline."""
    global _deadline
    _deadline = time.monotonic() + TOTAL_BUDGET_S
    return _deadline


def time_left() -> float:
    return _deadline - time.monotonic()


def device_for(dry_run: bool):
    import torch

    return torch.device("cpu" if dry_run else "cuda")


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def save_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer "t<id>" for every id (the loader needs one; nothing here
    decodes text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)


def random_model_folder(hf_config, folder: Path, dtype, device):
    """Random weights from `hf_config` (built on `device`), saved to `folder`; returns the
    Hugging Face model, in eval mode, with EOS off so that generate runs to length."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.eval()
    model.save_pretrained(folder)
    save_tokenizer(folder, min(int(hf_config.vocab_size), 4096))
    model.generation_config.eos_token_id = None
    return model


_qwen3_cache: dict[bool, tuple[Path, object]] = {}


def qwen3_model(dry_run: bool) -> tuple[Path, object]:
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
        hf = random_model_folder(config, folder, torch.bfloat16, device_for(dry_run))
        _qwen3_cache[dry_run] = (folder, hf)
    return _qwen3_cache[dry_run]


def small_llama_config(dry_run: bool, vocab_size: int | None = None, tie: bool = False):
    """The random small Llama of the parity checks (tiny in a dry run). NOTE: a wide init
    makes the logits peaked, so that greedy never rests on a near tie."""
    from transformers import LlamaConfig

    sizes = (dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
             if dry_run else
             dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024))
    if vocab_size is not None:
        sizes["vocab_size"] = vocab_size
    return LlamaConfig(**sizes, initializer_range=0.2, tie_word_embeddings=tie,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_runner(model_config, dry_run: bool, interpret_triton: bool = False):
    """A ModelRunner; in a dry run with the decode graph runner attached in eager mode
    (and the Triton kernels under the interpreter when `interpret_triton`)."""
    from model_runner.attention.backend import AttentionBackend
    from model_runner.cuda_graphs import DecodeGraphRunner
    from model_runner.loader import load_model
    from model_runner.runner import ModelRunner

    runner = ModelRunner(load_model(model_config), model_config)
    if dry_run:
        if interpret_triton:
            from model_runner.kernels import triton_attention as ta

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


def scheduler_loop(runner, prompts: list[list[int]], params: list, *, max_num_seqs: int,
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


def hf_greedy(hf, prompts: list[list[int]], max_tokens: int, device) -> list[list[int]]:
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


def agreement(outputs: list[list[int]], expected: list[list[int]]) -> tuple[int, float, str]:
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


