"""Hugging Face baselines on a bench workload, measured in the same run as pagedserve.

- `generate` sequential (one request at a time),
- `generate` static batching: left-padded batches of `concurrency` requests, each batch
  running until its longest request is done,
- `generate_batch`: transformers' own continuous batching with paged attention.
Outputs are forced to their requested length (min_new_tokens = max_new_tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor

from loadgen.workloads import Workload


@dataclass
class BaselineResult:
    system: str
    output_tokens: int
    elapsed_s: float

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.elapsed_s


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A static batch: input ids and attention mask [batch, longest], prompts right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask


class StepTimes(LogitsProcessor):
    """Records when each generation step's logits are ready (a no-op on the scores)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


@torch.inference_mode()
def run_static(model: torch.nn.Module, workload: Workload, batch_size: int) -> BaselineResult:
    """Left-padded static batches of `batch_size`, in workload order."""
    pad_id = 0
    reqs = workload.requests
    useful = 0
    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        ids, mask = left_pad([list(r.prompt) for r in batch], pad_id)
        new = max(r.max_tokens for r in batch)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=pad_id,
        )
        useful += sum(r.max_tokens for r in batch)
    name = f"hf generate (static, bs {batch_size})"
    if batch_size == 1:
        name = "hf generate (sequential)"
    return BaselineResult(name, useful, time.perf_counter() - start)


@torch.inference_mode()
def run_continuous(model: torch.nn.Module, workload: Workload) -> BaselineResult:
    """transformers' continuous batching manager (paged attention), all requests queued."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=16)
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=config, timeout=5) as manager:
        for i, r in enumerate(workload.requests):
            manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.max_tokens)
        pending = len(workload.requests)
        while pending:
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError("transformers continuous batching stopped before finishing")
            if result.is_finished():
                pending -= 1
    useful = sum(r.max_tokens for r in workload.requests)
    return BaselineResult("hf continuous batching", useful, time.perf_counter() - start)
