"""LoRA adapters under tensor parallelism on the CPU: 2 ranks over gloo (this process is
rank 0, one worker process rank 1), a tiny Qwen3 whose 3 KV heads split 2 and 1, float32.

Each rank holds its slice of an adapter (B's rows of q, k, v, gate and up; A's columns of
o and down); greedy tokens are `PeftModel.generate`'s, in one chunked batch with the base
model's rows. The adapters are loaded at run time as the engine core loads them: one read
on rank 0's side while the worker starts its own, then held; one held with no read
announced (as those held from the start), read by the worker then; one dropped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from model_runner.config import LoRAConfig, ModelConfig
from model_runner.distributed.tp_workers import start_tensor_parallel
from model_runner.runner import ModelRunner
from scheduler.output import SchedulerOutput
from tests.support.lora_helpers import ADAPTER_SPECS, TinyAdapter, make_adapter
from tests.support.model_helpers import (
    TINY,
    RunnerLoop,
    Seq,
    greedy_margin,
    make_model_folder,
    prompts,
)


@dataclass
class Ranks:
    hf: torch.nn.Module
    tp: ModelRunner  # rank 0 of two
    adapters: dict[str, TinyAdapter]
    deaths: list[str]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Iterator[Ranks]:
    root: Path = tmp_path_factory.mktemp("tp-lora")
    hf = make_model_folder(root / "model", Qwen3Config(
        **{**TINY, "num_attention_heads": 6, "num_key_value_heads": 3}, head_dim=32,
        tie_word_embeddings=False))
    adapters = {name: make_adapter(root / name, hf, name, seed, **ADAPTER_SPECS[name])
                for seed, name in enumerate(["all", "attn"])}
    config = ModelConfig(model=str(root / "model"), block_size=4, num_kv_blocks=128,
                         tensor_parallel_size=2, lora=LoRAConfig(max_lora_rank=16))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # shared by the two ranks: one thread each
    deaths: list[str] = []
    try:
        _, tp = start_tensor_parallel(config, deaths.append)
        try:
            yield Ranks(hf, tp, adapters, deaths)
            tp.workers.close()
            assert [p.returncode for p in tp.workers.processes] == [0]
        finally:
            tp.model.tp.close()
    finally:
        torch.set_num_threads(threads)
    assert not deaths


def _reference(ranks: Ranks, seq: Seq) -> list[int]:
    model = ranks.hf if seq.lora_name is None else ranks.adapters[seq.lora_name].peft
    return greedy_margin(model, seq.prompt, seq.max_tokens)[0]


@torch.inference_mode()
def test_an_adapter_sliced_over_two_ranks_matches_peft(ranks: Ranks):
    loras, all_path = ranks.tp.loras, ranks.adapters["all"].path
    assert loras is not None
    loras.paths["all"] = all_path
    ranks.tp.execute(SchedulerOutput(lora_loads=["all"]))  # the worker starts its read
    loras.add(loras.read("all", all_path))  # rank 0's read, held between two steps
    seqs = [Seq(f"tp-{name}", p, 6, lora_name=name)
            for name, p in zip(["all", None], prompts([13, 9], seed=21), strict=True)]
    RunnerLoop(ranks.tp, chunk_size=5).run(seqs)
    assert [s.output for s in seqs] == [_reference(ranks, s) for s in seqs]
    # dropped by an eviction; another held with no read announced: the worker reads it then
    ranks.tp.execute(SchedulerOutput(lora_evictions=["all"]))
    loras.add(loras.read("attn", ranks.adapters["attn"].path))
    seqs = [Seq("tp-attn", prompts([11], seed=22)[0], 5, lora_name="attn")]
    RunnerLoop(ranks.tp).run(seqs)
    assert seqs[0].output == _reference(ranks, seqs[0])
    assert set(loras.adapters) == {"attn"} and not ranks.deaths
