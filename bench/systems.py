"""The servers a benchmark compares on the same workload (bench/compare.py starts them).

pagedserve's variants are `pagedserve serve` flags: float32 as served by default, float16
or int8 weights, and n-gram speculation (vLLM's `--speculative-config`). llama.cpp's
`llama-server` runs the served GGUF (the default model's, or bench.compare's --model),
with or without its own n-gram speculation (`--spec-type ngram-simple`: the draft that
followed the last earlier match of the last n tokens). `baseline-tree` is pagedserve
float32 served from another checkout.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from loadgen.workloads import Workload

# n-gram prompt lookup as vLLM spells it: 4 draft tokens after a match of 4 down to 2
NGRAM_SPECULATION = {"method": "ngram", "num_speculative_tokens": 4,
                     "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# llama-server's nearest: a match of 3 tokens, 4 drafted
LLAMA_NGRAM_FLAGS = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                     "--spec-ngram-simple-size-m", "4")

PAGEDSERVE_VARIANTS = {
    "pagedserve": [],
    "pagedserve-fp16": ["--weight-dtype", "float16", "--kv-cache-dtype", "float16"],
    "pagedserve-int8": ["--weight-dtype", "int8", "--kv-cache-dtype", "float16"],
    "pagedserve-bf16": ["--weight-dtype", "bfloat16", "--kv-cache-dtype", "bfloat16"],
    "pagedserve-spec": ["--speculative-config", json.dumps(NGRAM_SPECULATION)],
}
LLAMA_SERVERS = ("llama-server", "llama-server-spec")
BASELINE_TREE = "baseline-tree"  # pagedserve float32 from --baseline-tree PATH
SERVERS = (*PAGEDSERVE_VARIANTS, *LLAMA_SERVERS, BASELINE_TREE)
HF_SYSTEMS = ("hf-seq", "hf-static", "hf-cb")  # Hugging Face `generate`, in-process


def parse_systems(
    text: str | None, llama_server: str, baseline_tree: Path | None
) -> list[str]:
    """The systems of `--systems` (None: the default set), checked against what they need;
    ValueError naming the problem."""
    if text is None:
        text = "pagedserve,pagedserve-fp16," + ("llama-server," if llama_server else "")
        text += "hf-static,hf-seq,hf-cb"
    systems = text.split(",")
    unknown = set(systems) - set(SERVERS) - set(HF_SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems: {', '.join(sorted(unknown))}")
    if BASELINE_TREE in systems and baseline_tree is None:
        raise ValueError("baseline-tree needs --baseline-tree PATH")
    needs_binary = sorted(set(systems) & set(LLAMA_SERVERS))
    if needs_binary and not Path(llama_server).is_file():
        raise ValueError(f"{', '.join(needs_binary)} needs --llama-server PATH (or "
                         "$LLAMA_SERVER)")
    return systems


def pagedserve_flags(
    system: str, dtype: str, num_kv_blocks: int | None, extra: Sequence[str] = ()
) -> list[str]:
    """`pagedserve serve` flags of a pagedserve variant (`make serve`'s policy); a variant
    with its own weight dtype is a float32 model whatever `dtype`."""
    variant = PAGEDSERVE_VARIANTS[system]
    if "--weight-dtype" in variant:
        dtype = "float32"
    flags = ["--scheduling-policy", "priority", "--dtype", dtype, "--log-level", "warning"]
    flags += variant
    if num_kv_blocks is not None:
        flags += ["--num-kv-blocks", str(num_kv_blocks)]
    return flags + list(extra)


def llama_server_command(
    system: str, binary: str, gguf: Path, port: int, threads: int, workload: Workload
) -> list[str]:
    """llama-server on `gguf` with a slot for every request the workload has in flight at
    once, each with room for the longest request (a text prompt counted in characters, at
    least its tokens)."""
    longest = max(len(r.prompt) + r.max_tokens for r in workload.requests)
    slots = workload.concurrency + sum(r.send_at_s is not None for r in workload.requests)
    cmd = [binary, "-m", str(gguf), "--port", str(port), "-t", str(threads),
           "-np", str(slots), "-c", str(slots * (longest + 16)), "--no-webui"]
    return cmd + list(LLAMA_NGRAM_FLAGS) if system == "llama-server-spec" else cmd
