"""LoRA adapters as the API process sees them: vLLM's flags, and which adapter a request
names in `model`.

`--enable-lora` with `--lora-modules name=path ...` serves each PEFT folder under its
name beside the base model; `--max-loras` adapters may share a step, `--max-lora-rank`
bounds their rank, `--max-cpu-loras` how many stay loaded (model_runner/config.py's
`LoRAConfig`). A request names an adapter in `model`; /v1/models lists each with the
base model as its `parent`.
"""

from __future__ import annotations

import argparse

from model_runner.config import LoRAConfig


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """The LoRA flags of `pagedserve serve` (vLLM's names)."""
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters (PEFT folders) beside the base model")
    lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                      help="adapters served from the start: a request names one in `model`")
    lora.add_argument("--max-loras", type=int, default=1,
                      help="distinct adapters in one step, given to the most urgent "
                      "requests' adapters (default 1)")
    lora.add_argument("--max-lora-rank", type=int, default=16,
                      help="the largest adapter rank accepted (default 16)")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="adapters kept loaded (default: --max-loras); the least recently "
                      "used of the least urgent is evicted first")


def lora_config(args: argparse.Namespace) -> LoRAConfig | None:
    """The LoRA config of parsed flags (None without --enable-lora); ValueError naming a
    bad flag."""
    if not args.enable_lora:
        if args.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    modules = []
    for item in args.lora_modules or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH")
        modules.append((name, path))
    return LoRAConfig(modules=tuple(modules), max_loras=args.max_loras,
                      max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras)
