"""Random-weight models and the engine step without HTTP, for the GPU tests (tests/gpu/)
and the GPU bench driver (bench/gpu_check/).

Models are built from a transformers config with random weights, saved to a folder
(safetensors and a word-level tokenizer) and loaded through model_runner.loader.load_model,
as a real model would be; nothing is downloaded. Requests go through the real Scheduler
and ModelRunner.execute (`scheduler_loop`), or the real EngineCore (`serve_core`). On CUDA
the runner uses the Triton kernels and captures decode CUDA graphs; in a dry run (the CPU)
it uses the torch reference (and, in fp32, the Triton kernels under the interpreter) with
the decode graph runner in eager mode, so the same code paths run except real CUDA.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

# `python -m bench.gpu_check --dry-run` sets it (and TRITON_INTERPRET=1): the GPU tests then
# run on the CPU at tiny shapes, to check them before spending device time.
DRY_RUN = os.environ.get("GPU_CHECK_DRY_RUN") == "1"


def attention_shapes(dry_run: bool) -> dict[str, tuple[list[int], list[int], int]]:
    """Steps of Qwen3-0.6B-like attention (tiny in a dry run), by name: (query_lens,
    context_lens, num_decode_seqs)."""
    if dry_run:
        return {"decode 2 x 40": ([1, 1], [40, 40], 2),
                "prefill 1 x 24": ([24], [24], 0),
                "mixed 2 dec + chunk": ([1, 1, 8], [30, 5, 20], 2)}
    return {"decode 1 x 1k": ([1], [1024], 1),
            "decode 32 x 2k": ([1] * 32, [2048] * 32, 32),
            "decode 128 x 1k": ([1] * 128, [1024] * 128, 128),
            "decode 8 x 16k": ([1] * 8, [16384] * 8, 8),
            "prefill 1 x 2k": ([2048], [2048], 0),
            "chunks 4 x 512 after 1.5k": ([512] * 4, [2048] * 4, 0),
            "mixed 64 dec x 1k + 2 x 512": ([1] * 64 + [512, 512], [1024] * 64 + [512, 1024],
                                            64)}


def kv_write_sizes(dry_run: bool) -> tuple[int, int]:
    """Tokens of a decode step's and of a prefill step's KV write."""
    return (4, 32) if dry_run else (256, 4096)


def model_batch(query_lens: list[int], context_lens: list[int], num_decode_seqs: int,
                dry_run: bool):
    """A step's attention inputs at Qwen3-0.6B's head shapes (16 heads, 8 KV heads,
    head_dim 128, bfloat16, block size 16); tiny and float32 in a dry run (the interpreter
    computes bfloat16 dot products wrongly)."""
    import torch

    from tests.support.attention_helpers import Batch

    heads = dict(num_heads=4, num_kv_heads=2, head_dim=64) if dry_run else dict(
        num_heads=16, num_kv_heads=8, head_dim=128)
    return Batch(query_lens, context_lens, **heads, num_decode_seqs=num_decode_seqs,
                 dtype=torch.float32 if dry_run else torch.bfloat16, device=device_for(dry_run))


def device_for(dry_run: bool):
    import torch

    return torch.device("cpu" if dry_run else "cuda")


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


def parity_prompts(vocab_size: int, dry_run: bool) -> tuple[list[list[int]], int, int]:
    """Prompts (every third shares a prefix), max_tokens, block size."""
    num_prompts, max_len, max_tokens = (6, 20, 4) if dry_run else (12, 150, 24)
    block_size, prefix_len = (4, 8) if dry_run else (16, 48)
    import random

    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab_size) for _ in range(prefix_len)]
    prompts = []
    for i in range(num_prompts):
        tail = [rng.randrange(3, vocab_size) for _ in range(rng.randint(3, max_len - prefix_len))]
        prompts.append(prefix + tail if i % 3 == 0 else tail)
    return prompts, max_tokens, block_size


def make_runner(model_config, dry_run: bool, interpret_triton: bool = False):
    """A ModelRunner; in a dry run with the decode graph runner attached in eager mode
    (and the Triton kernels under the interpreter when `interpret_triton`)."""
    from model_runner.attention.backend import AttentionBackend
    from model_runner.loader import load_model
    from model_runner.runner import ModelRunner

    runner = ModelRunner(load_model(model_config), model_config)
    if dry_run:
        if interpret_triton:
            from model_runner.kernels import triton_attention as ta

            runner.attn = AttentionBackend("triton", ta.write_kv_cache, ta.paged_attention)
        attach_eager_decode_graphs(runner, model_config.max_num_seqs)
    return runner


def attach_eager_decode_graphs(runner, max_num_seqs: int) -> None:
    """The decode graph runner in eager mode (the CPU): its code path without CUDA."""
    from model_runner.cuda_graphs import DecodeGraphRunner

    runner.decode_graphs = DecodeGraphRunner(
        runner.model, runner.attn, max_num_seqs=max_num_seqs,
        max_model_len=runner.max_model_len, block_size=runner.block_size,
        use_cuda_graphs=False)


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


def serve_core(runner, requests, num_blocks: int, async_scheduling: bool, block_size: int):
    """Step an EngineCore over `requests` (NewRequest) to the end, plain or overlapped:
    tokens by id, steps, seconds, preemptions."""
    from engine.core import EngineCore
    from engine.messages import AddRequests
    from kvcache.config import CacheConfig
    from scheduler.config import SchedulerConfig
    from scheduler.scheduler import Scheduler

    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024,
                             max_model_len=runner.max_model_len,
                             async_scheduling=async_scheduling)
    core = EngineCore(Scheduler(config, CacheConfig(num_blocks=num_blocks,
                                                    block_size=block_size)),
                      runner, frozenset({2}))
    core.apply(AddRequests(requests))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    steps, start = 0, time.perf_counter()
    while core.has_work:
        for delta in core.step().deltas:
            if delta.error:
                raise RuntimeError(delta.error)
            tokens[delta.request_id] += delta.new_token_ids
        steps += 1
    return tokens, steps, time.perf_counter() - start, core.scheduler.num_preemptions_total


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


def overlap_requests(tag: str, num: int, vocab_size: int, max_tokens: int) -> list:
    """`num` NewRequests, greedy and seeded alternately, of varied prompt and output
    lengths, the same under every `tag` (fresh ids: the runner keeps a finished request's
    seeded generator until a later step names it finished)."""
    import random

    from engine.messages import NewRequest
    from scheduler.sampling_params import SamplingParams

    rng = random.Random(0)
    out = []
    for i in range(num):
        params = SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i,
                                max_tokens=max_tokens - i % 5, ignore_eos=True)
        prompt = [rng.randrange(3, vocab_size) for _ in range(5 + (i * 7) % 40)]
        out.append(NewRequest(request_id=f"{tag}-r{i}", prompt_token_ids=prompt,
                              sampling_params=params))
    return out
