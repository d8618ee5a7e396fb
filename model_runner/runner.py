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
from model_runner.distributed.tensor_parallel import RanksOutOfStep
from model_runner.draft_model import DraftModel
from model_runner.kv_cache import (
    KVCache,
    allocate_kv_cache,
    bytes_per_block,
    cpu_kv_budget,
    kv_cache_dtype,
    num_blocks_for_memory,
    profile_cuda_num_blocks,
)
from model_runner.loader import LoadedModel
from model_runner.lora_layers import LoRAModel
from model_runner.prompt_logprobs import compute_prompt_logprobs
from model_runner.sampler import Sampler
from model_runner.spec_decode import Verification
from scheduler.output import (
    PLACEHOLDER_TOKEN_ID,
    GrammarBitmask,
    ModelRunnerOutput,
    PromptLogprobs,
    SampleLogprobs,
    ScheduledRequest,
    SchedulerOutput,
)
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# How long a failed collective waits for a worker's death to show (see check_deaths).
_WORKER_DEATH_WAIT_S = 1.0


class Workers(Protocol):
    """Rank 0's handle on the other tensor-parallel ranks
    (model_runner/distributed/tp_workers.py)."""

    def forget(self, request_ids: Sequence[str]) -> None: ...

    def send_step(self, requests: Sequence[ScheduledRequest]) -> None: ...

    def send_loras(self, loras: LoRAModel, loads: Sequence[str]) -> None: ...

    def check_deaths(self, wait_s: float) -> None: ...

    def close(self) -> None: ...


@dataclass
class ModelInputs:
    """A step laid out flat for the forward pass."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    # [num_sampling] int64: the last row of each sampling request, and the rows of its
    # drafts before it (speculative decoding: 1 + num_draft_tokens rows)
    sample_rows: torch.Tensor


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
    sample_rows = _sample_rows(requests, query_start_loc[1:][sample_mask], sample_mask)
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


def _sample_rows(
    requests: Sequence[ScheduledRequest], ends: np.ndarray, sample_mask: np.ndarray
) -> np.ndarray:
    """The rows whose logits a step samples from: the last of each sampling request (its
    chunk ends at `ends`), and with drafts the 1 + num_draft_tokens last."""
    if not any(r.num_draft_tokens for r in requests):
        return ends - 1
    num_drafts = np.fromiter((r.num_draft_tokens for r in requests), np.int64, len(requests))
    num_rows = 1 + num_drafts[sample_mask]
    starts = np.repeat(ends - num_rows, num_rows)
    first_of = np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
    return starts + np.arange(int(num_rows.sum())) - first_of


# Flat positions of placeholder input ids [P] and the tokens that go there [P], on the device.
Placeholders = tuple[torch.Tensor, torch.Tensor]


class LaunchedStep:
    """A launched step: its sampled ids on the device, in row order of `rows` (request id
    -> row), read on the host by `result()` (on CUDA through a pinned copy started at
    launch, so the read waits only for this step's kernels); the step's prompt
    logprobs, already on the host; and the verification of the requests with drafts.
    The output is read once (the draft model adds its proposals to it)."""

    def __init__(self, rows: dict[str, int], sampled: torch.Tensor | None,
                 logprobs: dict[str, SampleLogprobs],
                 prompt_logprobs: dict[str, PromptLogprobs] | None = None,
                 verification: Verification | None = None) -> None:
        self.rows = rows
        self.sampled = sampled
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs or {}
        self.verification = verification
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self._output: ModelRunnerOutput | None = None
        if sampled is not None and sampled.device.type == "cuda":
            self._host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
            self._host.copy_(sampled, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    @classmethod
    def nothing(cls) -> LaunchedStep:
        """A step that sampled nothing."""
        return cls({}, None, {})

    def result(self) -> ModelRunnerOutput:
        """The sampled tokens (waiting for the device when they are not there yet)."""
        if self._output is None:
            self._output = self._read()
        return self._output

    def _read(self) -> ModelRunnerOutput:
        output = ModelRunnerOutput(logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs)
        if self.verification is not None:
            output.verified_token_ids, output.verified_logprobs = self.verification.result()
        if self.sampled is None:
            return output
        if self._copied is not None and self._host is not None:
            self._copied.synchronize()
            token_ids = self._host.tolist()
        else:
            token_ids = self.sampled.tolist()
        output.sampled_token_ids = dict(zip(self.rows, token_ids, strict=True))
        return output


class ModelRunner:
    """Owns the model, its paged KV cache and the sampler; computes one step at a time.

    `num_kv_blocks` and `block_size` describe the physical cache, which the scheduler's
    block manager must match. `execute` takes a SchedulerOutput and returns the sampled
    tokens of the requests whose chunk reaches the end of their known tokens.

    Tensor parallel (a sharded model): rank 0's runner has the `workers` and sends them
    each step before its own forward; a worker's runner runs `execute_worker`. The number
    of KV blocks is the smallest any rank can hold.

    With a `draft` model (speculative decoding, one process only) every forward is
    followed by the draft's over the same batch, the KV budget pays for both caches, and
    the requests with num_lookahead_tokens get its proposals (model_runner/draft_model.py).
    """

    def __init__(
        self, loaded: LoadedModel, config: ModelConfig, workers: Workers | None = None,
        draft: LoadedModel | None = None,
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
        self._previous: LaunchedStep | None = None  # the last step that sampled
        self.draft = None if draft is None else DraftModel(draft, loaded, config, self.kv_dtype)
        self.loras = None if config.lora is None else LoRAModel(self.model, config.lora)
        # CUDA graphs for decode-only steps (None: every step runs eagerly, as with a draft
        # model, whose forward reads the step's flat inputs)
        self.decode_graphs = None if draft is not None else create_decode_graph_runner(
            self.model, self.attn, config, self.max_model_len, self.device, self.loras
        )
        self.kv_cache = self._allocate_kv_cache(config)
        self.num_kv_blocks = self.kv_cache.num_blocks
        if self.draft is not None:
            self.draft.allocate(self.num_kv_blocks, self.device)
        if self.decode_graphs is not None:
            self.decode_graphs.capture(self.kv_cache.layers)
        logger.info(
            "KV cache: %d blocks of %d tokens, %s attention",
            self.num_kv_blocks,
            self.block_size,
            self.attn.name,
        )

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its tokens: `launch(...).result()`."""
        return self.launch(scheduler_output).result()

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Start one step: forward over every scheduled token, sample where `sample` is
        set. The sampled ids stay on the device (a later step's placeholders read them
        there) until the returned step's `result()`; on CUDA their copy to the host is
        already under way."""
        for request_id in scheduler_output.finished_ids:
            self._generators.pop(request_id, None)
        self.sampler.forget(scheduler_output.finished_ids)
        freed = [*scheduler_output.finished_ids, *scheduler_output.preempted_ids]
        self.block_tables.forget(freed)
        if self.workers is not None:
            self.workers.forget(freed)
        if self.loras is not None:
            for name in scheduler_output.lora_evictions:
                self.loras.remove(name)
            if self.workers is not None:
                self.workers.send_loras(self.loras, scheduler_output.lora_loads)
        if scheduler_output.is_empty:
            return LaunchedStep.nothing()
        # decodes first (stable, so the scheduler's order holds within each group), each
        # group's rows by LoRA adapter (runs of one adapter's rows; the base's first)
        requests = sorted(scheduler_output.scheduled, key=lambda r: (
            r.num_new_tokens != 1, r.lora_name is not None, r.lora_name or ""))
        too_long = [r.request_id for r in requests if r.context_len > self.max_model_len]
        if too_long:
            raise ValueError(f"requests {too_long} exceed max_model_len {self.max_model_len}")
        placeholders = self._placeholders(requests)
        if self.workers is None:
            logits, prompt_logprobs = self._logits(requests, placeholders)
        else:
            if placeholders is not None:
                raise ValueError("overlapped steps do not run with tensor parallelism")
            self.workers.send_step(requests)
            try:
                logits, prompt_logprobs = self._logits(requests, None)
            except Exception as exc:  # the workers wait in a collective rank 0 never joins
                self.workers.check_deaths(_WORKER_DEATH_WAIT_S)  # a dead worker is the cause
                raise RanksOutOfStep(f"rank 0 failed inside a step: {exc!r}") from exc
        if logits is None:
            return LaunchedStep({}, None, {}, prompt_logprobs)
        bitmask = None
        if scheduler_output.grammar_bitmask is not None:
            bitmask = scheduler_output.grammar_bitmask.result()  # filled during the forward
        sampling = [r for r in requests if r.sample]
        verification = None
        if any(r.num_draft_tokens for r in sampling):
            logits, sampling, verification = self._verify(logits, sampling, bitmask)
        sampled, logprobs = None, {}
        if sampling:
            result = self.sampler(logits, sampling, [self._generator(r) for r in sampling],
                                  bitmask)
            sampled = result.sampled
            logprobs = {r.request_id: lp for r, lp in zip(sampling, result.logprobs, strict=True)
                        if lp is not None}
        step = LaunchedStep({r.request_id: i for i, r in enumerate(sampling)}, sampled,
                            logprobs, prompt_logprobs, verification)
        self._previous = step
        if self.draft is not None:
            self._propose(step, requests)
        return step

    def _propose(self, step: LaunchedStep, requests: list[ScheduledRequest]) -> None:
        """The draft model's proposals, into the step's output, for the requests that ask
        for some (their tokens read first: the drafts follow them)."""
        wanting = [r for r in requests if r.num_lookahead_tokens]
        if wanting and self.draft is not None:
            output = step.result()
            output.draft_token_ids = self.draft.propose(
                wanting, output, lambda batch: prepare_inputs(batch, self.block_tables,
                                                               self.device))

    def _verify(
        self, logits: torch.Tensor, sampling: list[ScheduledRequest],
        bitmask: GrammarBitmask | None,
    ) -> tuple[torch.Tensor, list[ScheduledRequest], Verification]:
        """Verify the drafts of the sampling requests that have some (their rows of
        `logits`, 1 + num_draft_tokens each, masked by `bitmask` where constrained); the
        logits and requests left to sample."""
        plain_rows: list[int] = []
        draft_rows: list[int] = []
        row = 0
        for r in sampling:
            num_rows = 1 + r.num_draft_tokens
            (draft_rows if r.num_draft_tokens else plain_rows).extend(range(row, row + num_rows))
            row += num_rows
        drafted = [r for r in sampling if r.num_draft_tokens]
        verification = self.sampler.verify(
            logits[draft_rows], drafted, [self._generator(r) for r in drafted], bitmask
        )
        plain = [r for r in sampling if not r.num_draft_tokens]
        return logits[plain_rows], plain, verification

    def _placeholders(
        self, requests: Sequence[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where the step's flat input ids hold PLACEHOLDER_TOKEN_ID, and the tokens the
        previous step sampled for them there (on the device); None when there are none."""
        positions: list[int] = []
        sources: list[int] = []
        offset = 0
        for r in requests:
            offset += len(r.token_ids)
            if r.token_ids[-1] != PLACEHOLDER_TOKEN_ID:
                continue
            previous = self._previous
            row = None if previous is None else previous.rows.get(r.request_id)
            if previous is None or previous.sampled is None or row is None:
                raise ValueError(f"request {r.request_id}: a placeholder token that the "
                                 "previous step did not sample")
            positions.append(offset - 1)
            sources.append(row)
        if not positions:
            return None
        assert self._previous is not None and self._previous.sampled is not None
        index = torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True)
        rows = torch.tensor(sources, dtype=torch.int64).to(self.device, non_blocking=True)
        return index, self._previous.sampled[rows]

    @torch.inference_mode()
    def execute_worker(self, requests: list[ScheduledRequest], freed_ids: list[str]) -> None:
        """A worker rank's share of the step rank 0 runs on `requests` (same order): the
        same forward and LM head, whose collectives meet rank 0's. Nothing is sampled.
        `freed_ids`: requests whose block tables rank 0's scheduler freed."""
        self.block_tables.forget(freed_ids)
        if requests:  # else a plan of LoRA news alone
            self._logits(requests, None, keep_prompt_logprobs=False)

    def _logits(
        self,
        requests: list[ScheduledRequest],
        placeholders: Placeholders | None,
        keep_prompt_logprobs: bool = True,
    ) -> tuple[torch.Tensor | None, dict[str, PromptLogprobs]]:
        """The forward, then the LM head on the rows that sample: [num_sampling, vocab]
        (whole on rank 0 only), or None when none samples; then on the prompt rows of
        the chunks that want prompt logprobs."""
        hidden, sample_rows = self._forward(requests, placeholders)  # [T, H], [num_sampling]
        logits = None
        if any(r.sample for r in requests):
            logits = self.model.compute_logits(hidden[sample_rows])
        prompt_logprobs = compute_prompt_logprobs(
            hidden, requests, self.model.compute_logits, keep_prompt_logprobs
        )
        return logits, prompt_logprobs

    def _forward(
        self, requests: list[ScheduledRequest], placeholders: Placeholders | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of the step and the rows that sample; decode-only steps go
        through the graph runner when there is one. `placeholders`: flat positions of
        the input ids to overwrite, and their tokens."""
        graphs = self.decode_graphs
        lora_rows = self.loras is not None and self.loras.begin_step(
            [r.lora_name for r in requests], [r.num_new_tokens for r in requests])
        if graphs is not None and graphs.can_run(requests, lora_rows):
            return graphs.forward(requests, self.block_tables, self.kv_cache.layers,
                                  placeholders)
        inputs = prepare_inputs(requests, self.block_tables, self.device)
        if placeholders is not None:
            inputs.input_ids[placeholders[0]] = placeholders[1]
        hidden = self.model(
            inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache.layers, self.attn
        )
        if self.draft is not None:  # NOTE: so that its KV always matches the target's
            self.draft.forward(inputs)
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
        ) + (0 if self.draft is None else self.draft.bytes_per_block)
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
            ranks = 1 if self.model.tp is None else config.tensor_parallel_size
            budget = cpu_kv_budget(config.kv_cache_memory, config.memory_share, ranks)
            num_blocks = num_blocks_for_memory(budget, block_bytes)
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
