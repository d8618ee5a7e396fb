"""A mixture-of-experts model through the model runner against Hugging Face `generate`.

`python -m bench.moe_bench [--scale small|full] [--batch-sizes 1,16] [--decode-steps 8]
[--threads N]`

A random Qwen3-MoE scaled down from Qwen3-30B-A3B's shape (`full`: 8 layers, hidden 768,
32 experts of width 256, 4 a token, ~0.65 GB in float32; `small`: a few seconds' run), float32
on the CPU. Per batch size: decode tokens/s (the median step, prompts of ~16 tokens), then one
512-token prefill (the best of a few), both sides in the same run, with runner_bench's loops.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig

from bench.runner_bench import (
    PREFILL_LEN,
    RunnerLoop,
    best_prefill_tps,
    decode_tps,
    hf_generate,
    make_prompts,
)
from model_runner.config import ModelConfig
from model_runner.loader import load_model
from model_runner.runner import ModelRunner
from tests.support.gpu_models import random_model_folder

SHAPES = {
    "full": dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12,
                 num_key_value_heads=4, num_experts=32, num_experts_per_tok=4,
                 moe_intermediate_size=256),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, num_experts=16, num_experts_per_tok=4,
                  moe_intermediate_size=128),
}


def moe_config(scale: str) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        **SHAPES[scale], vocab_size=4096, head_dim=64, intermediate_size=1024,
        max_position_embeddings=1024, norm_topk_prob=True, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )


@torch.inference_mode()
def bench(folder: Path, hf, batch_sizes: list[int], decode_steps: int, repeats: int) -> None:
    config = ModelConfig(model=str(folder), dtype="float32", device="cpu", block_size=16,
                         num_kv_blocks=max(batch_sizes) * 4 + PREFILL_LEN // 16 + 1)
    loaded = load_model(config)
    ours = RunnerLoop(ModelRunner(loaded, config))
    params = sum(p.numel() for p in hf.parameters())
    print(f"Qwen3-MoE random, {params / 1e6:.0f}M parameters ({params * 4 / 1e9:.2f} GB), "
          f"float32, {torch.get_num_threads()} threads")
    print(f"{'':>14} {'pagedserve':>11} {'HF':>9} {'ratio':>6}")
    vocab = int(loaded.hf_config.vocab_size)
    for batch_size in batch_sizes:
        prompts = make_prompts(batch_size, vocab)
        ours_tps = decode_tps(ours.generate(prompts, decode_steps)[0], batch_size)
        hf_tps = decode_tps(hf_generate(hf, prompts, decode_steps), batch_size)
        print(f"decode bs={batch_size:<4} {ours_tps:>11.1f} {hf_tps:>9.1f} "
              f"{ours_tps / hf_tps:>6.2f}")
    (long_prompt,) = make_prompts(1, vocab, seed=2)
    long_prompt = (long_prompt * PREFILL_LEN)[:PREFILL_LEN]
    ours_tps = best_prefill_tps(lambda: ours.generate([long_prompt], 1), repeats)
    hf_tps = best_prefill_tps(lambda: hf_generate(hf, [long_prompt], 1), repeats)
    print(f"prefill {PREFILL_LEN:<6} {ours_tps:>11.1f} {hf_tps:>9.1f} {ours_tps / hf_tps:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=list(SHAPES), default="full")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--prefill-repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        hf = random_model_folder(moe_config(args.scale), Path(tmp), torch.float32, "cpu")
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        bench(Path(tmp), hf, batch_sizes, args.decode_steps, args.prefill_repeats)


if __name__ == "__main__":
    main()
