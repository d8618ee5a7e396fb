"""The model runner: one `execute` per engine step, from a SchedulerOutput to sampled tokens."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from model_runner.attention.selection import select_attention_backend
from model_runner.attention_metadata import AttentionMetadata
from model_runner.block_tables import BlockTables
from model_runner.config import ModelConfig
from model_runner.cuda_graphs import create_decode_graph_runner, host_to_device
from model_runner.kv_cache import (
    KVCache,
    allocate_kv_cache,
    bytes_per_block,
    kv_cache_dtype,
    num_blocks_for_memory,
    profile_cuda_num_blocks,
)
from model_runner.loader import LoadedModel
from model_runner.prompt_logprobs import compute_prompt_logprobs
from model_runner.sampler import Sampler
from model_runner.tensor_parallel import RanksOutOfStep
from scheduler.output import (
    ModelRunnerOutput,
    PromptLogprobs,
    ScheduledRequest,
    SchedulerOutput,
)
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# How long a failed collective waits for a worker's death to show (see check_deaths).
_WORKER_DEATH_WAIT_S = 1.0


class Workers(Protocol):
    """Rank 0's handle on the other tensor-parallel ranks (model_runner/tp_workers.py)."""

    def forget(self, request_ids: Sequence[str]) -> None: ...

    def send_step(self, requests: Sequence[ScheduledRequest]) -> None: ...

    def check_deaths(self, wait_s: float) -> None: ...

    def close(self) -> None: ...


@dataclass
class ModelInputs:
    """A step laid out flat for the forward pass."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampling] int64: last row of each sampling request


def prepare_inputs(
    requests: Sequence[ScheduledRequest], block_tables: BlockTables, device: torch.device
) -> ModelInputs:
    """Lay `requests` out flat, in the given order, their block tables from `block_tables`
    (brought up to date with what the requests' tables gained).

    The leading requests with one new token are the decode sequences of the metadata;
    callers put all of them first. Raises ValueError when a block table is too short for
    the request's context.
    """
    block_size = block_tables.block_size
    num_seqs = len(requests)
    query_lens = np.fromiter((len(r.token_ids) for r in requests), np.int64, num_seqs)
    num_computed = np.fromiter((r.num_computed_tokens for r in requests), np.int64, num_seqs)
    context_lens = num_computed + query_lens
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    token_ids = np.fromiter(
        itertools.chain.from_iterable(r.token_ids for r in requests), np.int64, num_tokens
    )
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)  # [T]
    positions = np.arange(num_tokens) - query_start_loc[seq_of_token] + num_computed[seq_of_token]

    rows = block_tables.rows(requests, context_lens)
    width = int((-(-context_lens // block_size)).max())  # blocks the longest context covers
    tables = block_tables.gather(rows, width)
    slot_mapping = (
        tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    )

    sample_mask = np.fromiter((r.sample for r in requests), bool, num_seqs)
    sample_rows = query_start_loc[1:][sample_mask] - 1
    num_decode_seqs = int(np.argmin(query_lens == 1)) if (query_lens != 1).any() else num_seqs

    def to_device(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return host_to_device(a, dtype, device)  # pinned + non_blocking on CUDA

    meta = AttentionMetadata(
        slot_mapping=to_device(slot_mapping, torch.int64),
        query_start_loc=to_device(query_start_loc, torch.int32),
        context_lens=to_device(context_lens, torch.int32),
        block_tables=to_device(tables, torch.int32),
        max_query_len=int(query_lens.max()),
        max_context_len=int(context_lens.max()),
        num_decode_seqs=num_decode_seqs,
    )
    return ModelInputs(
        input_ids=to_device(token_ids, torch.int64),
        positions=to_device(positions, torch.int64),
        meta=meta,
        sample_rows=to_device(sample_rows, torch.int64),
    )


class ModelRunner:
    """Owns the model, its paged KV cache and the sampler; computes one step at a time.

    `num_kv_blocks` and `block_size` describe the physical cache, which the scheduler's
    block manager must match. `execute` takes a SchedulerOutput and returns the sampled
    tokens of the requests whose chunk reaches the end of their known tokens.

    Tensor parallel (a sharded model): rank 0's runner has the `workers` and sends them
    each step before its own forward; a worker's runner runs `execute_worker`. The number
    of KV blocks is the smallest any rank can hold.
    """

    def __init__(
        self, loaded: LoadedModel, config: ModelConfig, workers: Workers | None = None
    ) -> None:
        self.model = loaded.model
        self.workers = workers
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.max_model_len = loaded.max_model_len
        self.block_size = config.block_size
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.attn = select_attention_backend(
            config.attention_backend, self.device, self.model.head_dim
        )
        self.sampler = Sampler(self.device, loaded.eos_token_ids, config.seed)
        self.block_tables = BlockTables(
            self.block_size, config.max_num_seqs, -(-self.max_model_len // self.block_size)
        )
        self._generators: dict[str, torch.Generator] = {}
        # CUDA graphs for decode-only steps (None: every step runs eagerly)
        self.decode_graphs = create_decode_graph_runner(
            self.model, self.attn, config, self.max_model_len, self.device
        )
        self.kv_cache = self._allocate_kv_cache(config)
        self.num_kv_blocks = self.kv_cache.num_blocks
        if self.decode_graphs is not None:
            self.decode_graphs.capture(self.kv_cache.layers)
        logger.info(
            "KV cache: %d blocks of %d tokens, %s attention",
            self.num_kv_blocks,
            self.block_size,
            self.attn.name,
        )

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: forward over every scheduled token, sample where `sample` is set."""
        for request_id in scheduler_output.finished_ids:
            self._generators.pop(request_id, None)
        self.sampler.forget(scheduler_output.finished_ids)
        freed = [*scheduler_output.finished_ids, *scheduler_output.preempted_ids]
        self.block_tables.forget(freed)
        if self.workers is not None:
            self.workers.forget(freed)
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        # decodes first (stable, so the scheduler's order holds within each group)
        requests = sorted(scheduler_output.scheduled, key=lambda r: r.num_new_tokens != 1)
        too_long = [r.request_id for r in requests if r.context_len > self.max_model_len]
        if too_long:
            raise ValueError(f"requests {too_long} exceed max_model_len {self.max_model_len}")
        if self.workers is None:
            logits, prompt_logprobs = self._logits(requests)
        else:
            self.workers.send_step(requests)
            try:
                logits, prompt_logprobs = self._logits(requests)
            except Exception as exc:  # the workers wait in a collective rank 0 never joins
                self.workers.check_deaths(_WORKER_DEATH_WAIT_S)  # a dead worker is the cause
                raise RanksOutOfStep(f"rank 0 failed inside a step: {exc!r}") from exc
        sampling = [r for r in requests if r.sample]
        output = ModelRunnerOutput(prompt_logprobs=prompt_logprobs)
        if logits is None:
            return output
        bitmask = None
        if scheduler_output.grammar_bitmask is not None:
            bitmask = scheduler_output.grammar_bitmask.result()  # filled during the forward
        result = self.sampler(logits, sampling, [self._generator(r) for r in sampling], bitmask)
        for r, token_id, logprobs in zip(sampling, result.token_ids, result.logprobs, strict=True):
            output.sampled_token_ids[r.request_id] = token_id
            if logprobs is not None:
                output.logprobs[r.request_id] = logprobs
        return output

    @torch.inference_mode()
    def execute_worker(self, requests: list[ScheduledRequest], freed_ids: list[str]) -> None:
        """A worker rank's share of the step rank 0 runs on `requests` (same order): the
        same forward and LM head, whose collectives meet rank 0's. Nothing is sampled.
        `freed_ids`: requests whose block tables rank 0's scheduler freed."""
        self.block_tables.forget(freed_ids)
        self._logits(requests, keep_prompt_logprobs=False)

    def _logits(
        self, requests: list[ScheduledRequest], keep_prompt_logprobs: bool = True
    ) -> tuple[torch.Tensor | None, dict[str, PromptLogprobs]]:
        """The forward, then the LM head on the rows that sample: [num_sampling, vocab]
        (whole on rank 0 only), or None when none samples; then on the prompt rows of
        the chunks that want prompt logprobs."""
        hidden, sample_rows = self._forward(requests)  # [T, H], [num_sampling]
        logits = None
        if any(r.sample for r in requests):
            logits = self.model.compute_logits(hidden[sample_rows])
        prompt_logprobs = compute_prompt_logprobs(
            hidden, requests, self.model.compute_logits, keep_prompt_logprobs
        )
        return logits, prompt_logprobs

    def _forward(self, requests: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of the step and the rows that sample; decode-only steps go
        through the graph runner when there is one."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(requests):
            return graphs.forward(requests, self.block_tables, self.kv_cache.layers)
        inputs = prepare_inputs(requests, self.block_tables, self.device)
        hidden = self.model(
            inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache.layers, self.attn
        )
        return hidden, inputs.sample_rows

    def _generator(self, request: ScheduledRequest) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._generators[request.request_id] = generator
        return generator

    def _allocate_kv_cache(self, config: ModelConfig) -> KVCache:
        model = self.model
        block_bytes = bytes_per_block(
            model.num_layers, self.block_size, model.num_kv_heads, model.head_dim, self.kv_dtype
        )
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif self.device.type == "cuda":
            num_blocks = profile_cuda_num_blocks(
                lambda: self._profile_forward(config),
                block_bytes,
                config.gpu_memory_utilization,
                self.device,
            )
        else:
            num_blocks = num_blocks_for_memory(config.kv_cache_memory, block_bytes)
        if self.model.tp is not None:
            num_blocks = self.model.tp.min(num_blocks)
        return self._new_kv_cache(num_blocks)

    def _new_kv_cache(self, num_blocks: int) -> KVCache:
        model = self.model
        return allocate_kv_cache(
            model.num_layers,
            num_blocks,
            self.block_size,
            model.num_kv_heads,
            model.head_dim,
            self.kv_dtype,
            self.device,
        )

    @torch.inference_mode()
    def _profile_forward(self, config: ModelConfig) -> None:
        """The largest step: max_num_batched_tokens of prefill in max_model_len pieces, then
        sampling-sized work on max_num_seqs rows of logits, over a throwaway cache."""
        num_tokens = config.max_num_batched_tokens
        requests, next_block = [], 0
        for i, start in enumerate(range(0, num_tokens, self.max_model_len)):
            n = min(self.max_model_len, num_tokens - start)
            blocks = list(range(next_block, next_block + -(-n // self.block_size)))
            next_block += len(blocks)
            requests.append(
                ScheduledRequest(f"profile-{i}", [0] * n, 0, blocks, True, SamplingParams(), [], [])
            )
        cache = self._new_kv_cache(next_block)
        inputs = prepare_inputs(requests, BlockTables(self.block_size), self.device)
        hidden = self.model(
            inputs.input_ids, inputs.positions, inputs.meta, cache.layers, self.attn
        )
        rows = hidden[:1].expand(min(config.max_num_seqs, num_tokens), -1)
        self.model.compute_logits(rows).sort(dim=-1)
        if self.decode_graphs is not None:
            self.decode_graphs.profile(cache.layers)  # the largest decode bucket
