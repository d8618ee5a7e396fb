"""LoRA adapters on the default model: decode throughput and TPOT against the base model,
in the same run, and what loading an adapter costs the step.

`python -m bench.lora_bench [--batch 16] [--adapters 4] [--rank 16] [--steps 32]
[--threads N]`; with `--http`, the same over HTTP against a server (bench/lora_http.py).

Four random adapters of rank 16 on all seven projections (PEFT folders written to a
temporary directory, read through the runner's own checks) beside SmolLM2-135M. The model
runner alone (tests/support's `RunnerLoop`: no scheduler, no HTTP), float32 on the CPU:
- a batch of `--batch` streams (32-token prompts) decoding, the base model's against the
  same streams spread over the adapters (W1's shape: many streams, one step each token);
- one stream, base against one adapter (TPOT);
- an adapter's load: the folder read and checked (off the step, on the core's loader
  thread) and its hand-over to the runner between two steps (on the step's thread).
Steps alternate between the two sides so that a shared machine disturbs both alike; the
table gives each side's median step and their ratio. Decode steps of up to eight rows
take the C++ decode stack, adapters' rows among them (docs/models.md); the third column
is the base model through the Python layers, for what the stack saves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench import lora_http
from model_runner.config import LoRAConfig, ModelConfig
from model_runner.loader import load_model
from model_runner.runner import ModelRunner
from tests.support.model_helpers import RunnerLoop, Seq, prompts

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, shapes: dict[str, tuple[int, int]], layers: int, rank: int,
                  seed: int) -> None:
    """A random PEFT folder of `rank` on every projection."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for name, (out_size, in_size) in shapes.items():
            owner = "self_attn" if name in PROJECTIONS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{owner}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_size, generator=generator)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_size, rank,
                                                          generator=generator) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": list(PROJECTIONS)}))


def paired(runner: ModelRunner, sides: dict[str, list[str | None]], num_streams: int,
           steps: int, python_layers: str | None = None) -> dict[str, float]:
    """Median decode step (ms) of each side: its streams' adapters (None: base), one step
    of each side in turn, after the prompts and two warm-up steps."""
    loops = {}
    for n, (side, loras) in enumerate(sides.items()):
        seqs = [Seq(f"{side}-{i}", p, steps + 4, lora_name=loras[i % len(loras)])
                for i, p in enumerate(prompts([32] * num_streams, seed=n))]
        loop = RunnerLoop(runner)
        loop.next_block = iter(range(n * 1000, (n + 1) * 1000))
        loops[side] = (loop, seqs)
    times: dict[str, list[float]] = {side: [] for side in sides}
    stack = runner.model.decode_stack
    for step in range(steps + 3):
        for side, (loop, seqs) in loops.items():
            runner.model.decode_stack = None if side == python_layers else stack
            start = time.perf_counter()
            loop.step(seqs)
            if step >= 3:
                times[side].append((time.perf_counter() - start) * 1e3)
    runner.model.decode_stack = stack
    return {side: statistics.median(ms) for side, ms in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--http", action="store_true",
                        help="a server over HTTP (bench/lora_http.py) instead of the runner")
    parser.add_argument("--scale", type=float, default=1.0, help="--http: W1's size")
    parser.add_argument("--rounds", type=int, default=2, help="--http: W1's parts in turn")
    parser.add_argument("--single", type=int, default=4,
                        help="--http: the single stream's requests on each side")
    args = parser.parse_args()
    if args.http:
        lora_http.main(args, write_adapter)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(ModelConfig(num_kv_blocks=1))
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"lora{i}" for i in range(args.adapters)]
        lora = LoRAConfig(modules=tuple((n, f"{tmp}/{n}") for n in names),
                          max_loras=args.adapters, max_lora_rank=args.rank)
        runner = ModelRunner(loaded, ModelConfig(block_size=16, num_kv_blocks=4096,
                                                 model=loaded.model_path, lora=lora))
        assert runner.loras is not None
        for seed, name in enumerate(names):
            write_adapter(Path(tmp) / name, runner.loras.shapes, len(loaded.model.layers),
                          args.rank, seed)
        start = time.perf_counter()
        adapters = [runner.loras.read(name, f"{tmp}/{name}") for name in names]
        read_ms = (time.perf_counter() - start) * 1e3 / len(names)
        start = time.perf_counter()
        for adapter in adapters:
            runner.loras.add(adapter)
        add_ms = (time.perf_counter() - start) * 1e3 / len(names)
        with torch.inference_mode():
            batch = paired(runner, {"base": [None], "loras": names, "python": [None]},
                           args.batch, args.steps, python_layers="python")
            single = paired(runner, {"base": [None], "loras": names[:1], "python": [None]},
                            1, args.steps, python_layers="python")
    print(f"| rows | base (ms/step) | {args.adapters} adapters, rank {args.rank} | base, "
          "Python layers | throughput vs base |")
    print("|---|---|---|---|---|")
    for label, ms in ((f"{args.batch} streams", batch), ("1 stream", single)):
        print(f"| {label} | {ms['base']:.1f} | {ms['loras']:.1f} | {ms['python']:.1f} | "
              f"{ms['base'] / ms['loras']:.2f}x |")
    print(f"adapter load: {read_ms:.0f} ms read and checked (loader thread), "
          f"{add_ms:.1f} ms handed to the runner (between steps)")


if __name__ == "__main__":
    main()
