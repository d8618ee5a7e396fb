"""Model-runner throughput on the default model, against Hugging Face `generate`.

`python -m bench.runner_bench [--dtypes
float32,float16,float16-weights,int8,bfloat16-weights,bfloat16] [--batch-sizes 1,16,64,128]
[--decode-steps 8] [--threads N]`

Per dtype: decode tokens/s at each batch size (prompts of ~16 tokens, so the context stays
short), and one 512-token prefill. Hugging Face runs the same prompts as static batches,
left-padded, in the same process. Decode time is measured from the first sampled token to
the last, so prefill is left out on both sides, and taken as the median step (prefill as
the best of a few runs): CI machines are often shared. "float16-weights" is float32 with
`--weight-dtype float16`, "float16" that and `--kv-cache-dtype float16` (HF runs float32);
"int8" is `--weight-dtype int8 --kv-cache-dtype float16`, "bfloat16-weights" `--weight-dtype
bfloat16 --kv-cache-dtype bfloat16` (larger batches on AMX where the CPU has it), "bfloat16"
a bfloat16 model (`--dtype bfloat16`; HF runs bfloat16 too). Their greedy token agreement
with float32 is reported on 16 random prompts of 64 new tokens, and their teacher-forced
top-1 agreement and perplexity on a fixed text (tests/support/quality.py).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch
from transformers import LogitsProcessorList

from bench.hf_baseline import StepTimes, left_pad
from model_runner.config import ModelConfig
from model_runner.loader import LoadedModel, load_model
from model_runner.runner import ModelRunner
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.sampling_params import SamplingParams
from tests.support.model_helpers import load_hf_model
from tests.support.quality import compare, reference_token_ids, teacher_forced_logits

GREEDY = SamplingParams(temperature=0.0)
PROMPT_LEN = 16
PREFILL_LEN = 512
BLOCK_SIZE = 16
# the long-context decode row: WV's batch and range of contexts
LONG_BATCH, LONG_CONTEXTS = 64, (32, 768)


def make_prompts(batch_size: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random token prompts of PROMPT_LEN - 3 .. PROMPT_LEN tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(PROMPT_LEN - 3, PROMPT_LEN + 1, (batch_size,), generator=gen)
    return [torch.randint(1000, vocab_size, (int(n),), generator=gen).tolist() for n in lengths]


class RunnerLoop:
    """Greedy generation of fixed length through ModelRunner.execute, one step per token."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def generate(
        self, prompts: list[list[int]], num_new_tokens: int
    ) -> tuple[list[float], list[list[int]]]:
        """Runs prefill then decodes; returns the time at which each step's tokens arrived,
        and the tokens."""
        bs = self.runner.block_size
        max_len = max(len(p) for p in prompts) + num_new_tokens
        blocks_per_seq = -(-max_len // bs)
        outputs: list[list[int]] = [[] for _ in prompts]
        tables = [
            list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(prompts))
        ]
        times = []
        for _ in range(num_new_tokens):
            scheduled = []
            for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
                # prefill on the first step, then the one new token
                computed = len(prompt) + len(output) - 1 if output else 0
                new = [output[-1]] if output else prompt
                scheduled.append(
                    ScheduledRequest(str(i), new, computed, tables[i], True, GREEDY, prompt, output)
                )
            out = self.runner.execute(SchedulerOutput(scheduled=scheduled))
            times.append(time.perf_counter())
            for i, output in enumerate(outputs):
                output.append(out.sampled_token_ids[str(i)])
        self.runner.execute(SchedulerOutput(finished_ids=[str(i) for i in range(len(prompts))]))
        return times, outputs


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], num_new_tokens: int) -> list[float]:
    """Static batch, left-padded; returns the time of each generation step."""
    ids, mask = left_pad(prompts)
    timer = StepTimes()
    model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=num_new_tokens,
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([timer]),
    )
    return timer.times


def long_context_decode(runner: ModelRunner, steps: int) -> tuple[float, int]:
    """Median decode step of LONG_BATCH sequences at contexts random in LONG_CONTEXTS, and
    their total context. The cache is not filled first: attention moves the same bytes
    whatever the cache holds, and a prefill of that many tokens would take a minute."""
    gen = torch.Generator().manual_seed(0)
    contexts = torch.randint(*LONG_CONTEXTS, (LONG_BATCH,), generator=gen).tolist()
    width = -(-LONG_CONTEXTS[1] // runner.block_size)
    requests = [
        ScheduledRequest(str(i), [7], n - 1, list(range(i * width, (i + 1) * width)), True,
                         GREEDY, [7] * (n - 1), [7])
        for i, n in enumerate(contexts)
    ]
    elapsed = [_timed(lambda: runner.execute(SchedulerOutput(scheduled=requests)))
               for _ in range(steps)]
    runner.execute(SchedulerOutput(finished_ids=[r.request_id for r in requests]))
    return statistics.median(elapsed), sum(contexts)


def decode_tps(times: list[float], batch_size: int) -> float:
    """Tokens/s from the median step time (robust to a machine shared with others)."""
    return batch_size / statistics.median(b - a for a, b in itertools.pairwise(times))


def best_prefill_tps(prefill: Callable[[], object], repeats: int) -> float:
    """PREFILL_LEN tokens over the fastest of `repeats` runs."""
    elapsed = []
    for _ in range(repeats):
        start = time.perf_counter()
        prefill()
        elapsed.append(time.perf_counter() - start)
    return PREFILL_LEN / min(elapsed)


def copy_bandwidth(num_bytes: int = 512 * 1024**2, repeats: int = 5) -> float:
    """Bytes moved per second (read + write) by a large tensor copy: the machine's floor."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * num_bytes / best


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_floor_s(
    runner: ModelRunner, weight_bytes: int, total_context: int, bandwidth: float
) -> float:
    """Weight bytes plus the KV bytes a decode step reads (keys and values of
    `total_context` tokens over all sequences), over bandwidth."""
    model = runner.model
    kv_bytes = (
        total_context * model.num_layers * 2 * model.num_kv_heads
        * model.head_dim * runner.kv_dtype.itemsize
    )
    return (weight_bytes + kv_bytes) / bandwidth


# name -> (model dtype, weight dtype, KV cache dtype)
VARIANTS = {
    "float32": ("float32", "auto", "auto"),
    "float16": ("float32", "float16", "float16"),
    "float16-weights": ("float32", "float16", "auto"),
    "int8": ("float32", "int8", "float16"),
    "bfloat16-weights": ("float32", "bfloat16", "bfloat16"),
    "bfloat16": ("bfloat16", "auto", "auto"),
}
AGREEMENT_PROMPTS, AGREEMENT_TOKENS = 16, 64


def bench_variant(
    variant: str, batch_sizes: list[int], decode_steps: int, prefill_repeats: int
) -> tuple[list[tuple], list[list[int]], tuple[torch.Tensor, torch.Tensor]]:
    """The table rows of one variant, its greedy tokens on the agreement prompts, and
    tests.support.quality's text (token ids) with the variant's teacher-forced logits on it."""
    dtype, weight_dtype, kv_cache_dtype = VARIANTS[variant]
    config = ModelConfig(
        model=None,
        dtype=dtype,
        weight_dtype=weight_dtype,
        kv_cache_dtype=kv_cache_dtype,
        device="cpu",
        block_size=BLOCK_SIZE,
        num_kv_blocks=LONG_BATCH * -(-LONG_CONTEXTS[1] // BLOCK_SIZE),
    )
    loaded: LoadedModel = load_model(config)
    ours = RunnerLoop(ModelRunner(loaded, config))
    hf = load_hf_model(loaded.model_path, loaded.dtype)
    hf.generation_config.eos_token_id = None  # fixed lengths
    # the tied LM head once; float16 weights are 2 bytes, int8 ones 1
    weight_size = {"float16": 2, "bfloat16": 2, "int8": 1}.get(weight_dtype, loaded.dtype.itemsize)
    weight_bytes = sum(p.numel() for p in hf.parameters()) * weight_size
    vocab = int(loaded.hf_config.vocab_size)
    warm = make_prompts(2, vocab, seed=1)
    ours.generate(warm, 3)
    hf_generate(hf, warm, 3)

    bandwidth = copy_bandwidth()
    print(f"  copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)", flush=True)
    rows = []
    for batch_size in batch_sizes:
        prompts = make_prompts(batch_size, vocab)
        ours_tps = decode_tps(ours.generate(prompts, decode_steps + 1)[0], batch_size)
        hf_tps = decode_tps(hf_generate(hf, prompts, decode_steps + 1), batch_size)
        rows.append((variant, f"decode batch {batch_size}", ours_tps, hf_tps))
        total_context = batch_size * (PROMPT_LEN + decode_steps)
        floor_ms = 1000 * decode_floor_s(ours.runner, weight_bytes, total_context, bandwidth)
        print(
            f"  {rows[-1][1]:<22} ours {ours_tps:8.1f} tok/s   hf {hf_tps:8.1f} tok/s   "
            f"step {1000 * batch_size / ours_tps:.1f} ms, bandwidth floor {floor_ms:.1f} ms",
            flush=True,
        )

    step_s, total_context = long_context_decode(ours.runner, decode_steps)
    low, high = LONG_CONTEXTS
    workload = f"decode batch {LONG_BATCH} ctx {low}..{high}"
    rows.append((variant, workload, LONG_BATCH / step_s, None))
    floor_ms = 1000 * decode_floor_s(ours.runner, weight_bytes, total_context, bandwidth)
    print(f"  {rows[-1][1]:<22} ours {rows[-1][2]:8.1f} tok/s   step {1000 * step_s:.1f} ms, "
          f"bandwidth floor {floor_ms:.1f} ms", flush=True)

    (prompt,) = torch.randint(1000, vocab, (1, PREFILL_LEN)).tolist()
    ours_tps = best_prefill_tps(lambda: ours.generate([prompt], 1), prefill_repeats)
    hf_tps = best_prefill_tps(lambda: hf_generate(hf, [prompt], 1), prefill_repeats)
    rows.append((variant, f"prefill {PREFILL_LEN}", ours_tps, hf_tps))
    print(f"  {rows[-1][1]:<22} ours {ours_tps:8.1f} tok/s   hf {hf_tps:8.1f} tok/s", flush=True)
    _, tokens = ours.generate(make_prompts(AGREEMENT_PROMPTS, vocab, seed=2), AGREEMENT_TOKENS)
    text_ids = reference_token_ids(loaded)
    return rows, tokens, (text_ids, teacher_forced_logits(loaded, text_ids))


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> str:
    """Share of positions with the reference's token, and of sequences identical to it."""
    seqs = list(zip(tokens, reference, strict=True))
    pairs = [(a, b) for x, y in seqs for a, b in zip(x, y, strict=True)]
    positions = sum(a == b for a, b in pairs) / len(pairs)
    same = sum(x == y for x, y in seqs)
    return f"{positions:.1%} of tokens, {same}/{len(reference)} sequences identical"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,float16",
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--batch-sizes", default="1,16,64,128")
    parser.add_argument(
        "--bf16-batch-sizes",
        default="1,16",
        help="batch sizes for bfloat16 (slow on CPUs without AMX / AVX512-BF16)",
    )
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--prefill-repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    rows, tokens, teacher_forced = [], {}, {}
    for variant in args.dtypes.split(","):
        if variant not in VARIANTS:
            parser.error(f"unknown dtype {variant!r} (one of {', '.join(VARIANTS)})")
        sizes = args.bf16_batch_sizes if variant == "bfloat16" else args.batch_sizes
        print(f"{variant}:", flush=True)
        batch_sizes = [int(b) for b in sizes.split(",")]
        variant_rows, tokens[variant], teacher_forced[variant] = bench_variant(
            variant, batch_sizes, args.decode_steps, args.prefill_repeats
        )
        rows += variant_rows
    print("\n| dtype | workload | pagedserve runner tok/s | HF generate tok/s | ratio |")
    print("|---|---|---|---|---|")
    for variant, workload, ours, hf in rows:
        if hf is None:  # no HF counterpart
            print(f"| {variant} | {workload} | {ours:.1f} | - | - |")
        else:
            print(f"| {variant} | {workload} | {ours:.1f} | {hf:.1f} | {ours / hf:.2f}x |")
    if "float32" in tokens:
        text_ids, reference = teacher_forced["float32"]
        for variant in tokens.keys() - {"float32"}:
            print(
                f"\ngreedy agreement of {variant} with float32 ({AGREEMENT_PROMPTS} prompts, "
                f"{AGREEMENT_TOKENS} tokens): {agreement(tokens[variant], tokens['float32'])}"
                f"\nteacher-forced on tests.support.quality's text ({text_ids.shape[1]} tokens): "
                f"{compare(teacher_forced[variant][1], reference, text_ids)}"
            )


if __name__ == "__main__":
    main()
