"""The draft model of speculative decoding (`"method": "draft_model"`): a second checkpoint
on the target's tokenizer, its own paged KV cache indexed by the target's block ids, and
its greedy proposals.

The draft's KV tensors have the target's number of blocks and block size, and a request's
blocks hold both models' keys and values for the same positions. Invariant: every target
forward is followed by a draft forward over the same flat batch (input ids, positions,
slot mapping, attention metadata), so a block's draft KV is always that of the tokens its
target KV holds: prefill chunks, prefix-cache hits, recompute after a preemption and the
prompt blocks n > 1 choices share need nothing of their own.

After a step is sampled and verified, each request with `num_lookahead_tokens` L gets L
batched greedy draft decodes: its newest token at its position, then each draft token
after it, their KV written into the lookahead slots the scheduler allocated. The next
step verifies those drafts (its target and draft forwards write those positions again
with the tokens it computes); rejected positions are overwritten later, as the target's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

import torch

from model_runner.attention.selection import select_attention_backend
from model_runner.attention_metadata import AttentionMetadata
from model_runner.config import ModelConfig
from model_runner.kv_cache import KVCache, allocate_kv_cache, bytes_per_block
from model_runner.loader import LoadedModel
from model_runner.models.sliding_windows import model_window
from model_runner.sampler import greedy
from scheduler.output import ModelRunnerOutput, ScheduledRequest


class FlatBatch(Protocol):
    """A step laid out flat (the runner's ModelInputs)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


# Lays a batch out flat on the target's block tables (the runner's prepare_inputs).
PrepareFn = Callable[[Sequence[ScheduledRequest]], FlatBatch]


def check_draft_fits(target: LoadedModel, draft: LoadedModel) -> None:
    """ValueError unless `draft` can propose for `target`: the same vocabulary size and EOS
    ids (one tokenizer), a context at least the target's, and, under a target windowed in
    every layer (whose blocks behind the window are freed), a window no wider."""
    name = draft.model_path
    vocab, draft_vocab = int(target.hf_config.vocab_size), int(draft.hf_config.vocab_size)
    if vocab != draft_vocab:
        raise ValueError(f"draft model {name} has a vocabulary of {draft_vocab} ids, the "
                         f"target {vocab}: a draft model must share the target's tokenizer")
    if draft.eos_token_ids != target.eos_token_ids:
        raise ValueError(f"draft model {name}'s EOS ids {sorted(draft.eos_token_ids)} are not "
                         f"the target's {sorted(target.eos_token_ids)}: a draft model must "
                         "share the target's tokenizer")
    if draft.max_model_len < target.max_model_len:
        raise ValueError(f"draft model {name} holds {draft.max_model_len} positions, fewer than "
                         f"the target's {target.max_model_len}: lower --max-model-len")
    window, draft_window = model_window(target.hf_config), model_window(draft.hf_config)
    if window is not None and (draft_window is None or draft_window > window):
        raise ValueError(f"the target attends to a window of {window} tokens in every layer: "
                         f"draft model {name} must too (its window: {draft_window})")


class DraftModel:
    """The draft model, its KV cache (after `allocate`), its forward over a step's flat
    batch and its proposals."""

    def __init__(self, draft: LoadedModel, target: LoadedModel, config: ModelConfig,
                 kv_dtype: torch.dtype) -> None:
        check_draft_fits(target, draft)
        self.model = draft.model
        self.kv_dtype = kv_dtype
        self.block_size = config.block_size
        self.attn = select_attention_backend(config.attention_backend, draft.device,
                                             self.model.head_dim)
        self.kv_cache: KVCache | None = None

    @property
    def bytes_per_block(self) -> int:
        """What a block of the draft's KV takes: paid from the same budget as the target's."""
        model = self.model
        return bytes_per_block(model.num_layers, self.block_size, model.num_kv_heads,
                               model.head_dim, self.kv_dtype)

    def allocate(self, num_blocks: int, device: torch.device) -> None:
        """The draft's KV tensors: `num_blocks` blocks, the target's number."""
        model = self.model
        self.kv_cache = allocate_kv_cache(model.num_layers, num_blocks, self.block_size,
                                          model.num_kv_heads, model.head_dim, self.kv_dtype,
                                          device)

    def forward(self, inputs: FlatBatch) -> torch.Tensor:
        """The draft's forward over a step's flat batch (the target's inputs): its KV written
        at the same slots; its hidden states [T, H]."""
        assert self.kv_cache is not None
        inputs.meta.scratch.clear()  # NOTE: what the target's backend derived is its own
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache.layers,
                          self.attn)

    def propose(self, requests: Sequence[ScheduledRequest], output: ModelRunnerOutput,
                prepare: PrepareFn) -> dict[str, list[int]]:
        """The greedy draft tokens after each request's newest token in `output` (its
        accepted drafts and one more, or its sampled token): num_lookahead_tokens each, by
        as many batched decodes as the most any asks, each request leaving the batch when
        it has its own. One read of the device, at the end."""
        order = sorted(requests, key=lambda r: -r.num_lookahead_tokens)
        batch = [_newest(r, output) for r in order]  # each decode's batch: a prefix of it
        steps: list[torch.Tensor] = []
        for i in range(order[0].num_lookahead_tokens):
            batch = [r for r in batch if r.num_lookahead_tokens > i]
            inputs = prepare(batch)
            if steps:
                inputs.input_ids = steps[-1][:len(batch)]  # the drafts just proposed
            hidden = self.forward(inputs)
            steps.append(greedy(self.model.compute_logits(hidden)))
            batch = [replace(r, num_computed_tokens=r.num_computed_tokens + 1) for r in batch]
        flat = iter(torch.cat(steps).tolist())
        proposals: dict[str, list[int]] = {r.request_id: [] for r in order}
        for step in steps:
            for r in order[:len(step)]:
                proposals[r.request_id].append(next(flat))
        return proposals


def _newest(request: ScheduledRequest, output: ModelRunnerOutput) -> ScheduledRequest:
    """A one-token request of `request`'s newest token at its position (after the drafts
    it accepted), asking for its num_lookahead_tokens."""
    verified = output.verified_token_ids.get(request.request_id)
    if verified is None:
        newest, num_accepted = output.sampled_token_ids[request.request_id], 0
    else:
        newest, num_accepted = verified[-1], len(verified) - 1
    position = request.context_len - request.num_draft_tokens + num_accepted
    return replace(request, token_ids=[newest], num_computed_tokens=position,
                   num_draft_tokens=0, prompt_logprob_rows=(0, 0))
