"""A stand-in for ModelRunner in capacity tests (`pagedserve serve --simulate-step-ms MS`).

Each step sleeps MS milliseconds (wall time without CPU use, as a step on a GPU) and
samples pseudo-random tokens that are never EOS nor another special token, so every
request runs to its max_tokens. The KV pool is sized as the real model's would be (from
--num-kv-blocks or the CPU memory budget) but holds no tensors. A benchmarking aid: the
whole server (HTTP, scheduler, KV accounting, metrics) runs as with a model.
"""

from __future__ import annotations

import random
import time

import torch

from model_runner.config import ModelConfig
from model_runner.kv_cache import bytes_per_block, cpu_kv_budget, num_blocks_for_memory
from model_runner.loader import ModelSpec
from scheduler.output import (
    ModelRunnerOutput,
    PromptLogprobs,
    SampleLogprobs,
    ScheduledRequest,
    SchedulerOutput,
)


class SimulatedRunner:
    """`launch(plan)` puts one step of `step_ms` on a simulated device (after the steps
    already there) and samples one random non-special token per request that samples;
    `result()` sleeps until the device has run it. logprobs, when asked for, are 0 for
    the sampled token, and prompt logprobs 0 (rank 1) for each prompt token, its top-k
    alternatives below it. `host_ms` (benchmarks) is CPU work spent in each launch, as
    the real runner's input preparation is."""

    def __init__(
        self, spec: ModelSpec, config: ModelConfig, step_ms: float, host_ms: float = 0.0
    ) -> None:
        if step_ms < 0:
            raise ValueError("simulate_step_ms must be >= 0")
        if host_ms < 0:
            raise ValueError("host_ms must be >= 0")
        self.step_s = step_ms / 1000
        self.host_s = host_ms / 1000
        self.block_size = config.block_size
        hf = spec.hf_config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        block_bytes = bytes_per_block(
            hf.num_hidden_layers, self.block_size, num_kv_heads, head_dim, torch.float32
        )
        self.num_kv_blocks = config.num_kv_blocks or num_blocks_for_memory(
            cpu_kv_budget(config.kv_cache_memory, config.memory_share, 1), block_bytes
        )
        special = set(spec.tokenizer.all_special_ids) | set(spec.eos_token_ids)
        vocab_size = int(hf.vocab_size)
        self.token_ids = [t for t in range(vocab_size) if t not in special]
        self._rng = random.Random(config.seed)
        self._device_free_at = 0.0  # monotonic time the simulated device is idle again

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for it: `launch(plan).result()`."""
        return self.launch(plan).result()

    def launch(self, plan: SchedulerOutput) -> SimulatedStep:
        if self.host_s:
            _spin(self.host_s)
        start = max(time.monotonic(), self._device_free_at)
        self._device_free_at = start + self.step_s
        out = ModelRunnerOutput()
        choice = self._rng.choice
        for scheduled in plan.scheduled:
            lo, hi = scheduled.prompt_logprob_rows
            if hi > lo:
                out.prompt_logprobs[scheduled.request_id] = self._prompt_logprobs(scheduled)
            if not scheduled.sample:
                continue
            token = choice(self.token_ids)
            out.sampled_token_ids[scheduled.request_id] = token
            if scheduled.sampling_params.logprobs is not None:
                out.logprobs[scheduled.request_id] = SampleLogprobs(0.0, [(token, 0.0)])
        return SimulatedStep(self._device_free_at, out)

    def _prompt_logprobs(self, scheduled: ScheduledRequest) -> PromptLogprobs:
        lo, hi = scheduled.prompt_logprob_rows
        first = scheduled.num_computed_tokens + lo + 1
        targets = scheduled.prompt_token_ids[first : first + hi - lo]
        num_top = scheduled.sampling_params.prompt_logprobs or 0
        top = []
        for token in targets:
            others = [t for t in self.token_ids[:num_top] if t != token][: max(num_top - 1, 0)]
            row = [(token, 0.0), *((t, -1.0 - j) for j, t in enumerate(others))]
            top.append(row[:num_top])
        return PromptLogprobs(first, [0.0] * len(targets), [1] * len(targets), top)


class SimulatedStep:
    """A step on the simulated device: done at `done_at` (time.monotonic)."""

    def __init__(self, done_at: float, output: ModelRunnerOutput) -> None:
        self.done_at = done_at
        self._output = output

    def result(self) -> ModelRunnerOutput:
        wait = self.done_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        return self._output


def _spin(seconds: float) -> None:
    """Busy CPU for `seconds` (host work, unlike the device's sleep)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
