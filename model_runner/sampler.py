"""Turn the logits of the sampling rows into tokens (and logprobs).

Per row, in order: the grammar's token mask and allowed_token_ids (what is not allowed
is -inf), logit_bias, min_tokens (stop tokens masked until the output is long enough),
repetition penalty (Hugging Face: over prompt and output), frequency and presence
penalties (OpenAI: over the output), temperature, top_k, top_p, min_p, then a draw.
Everything stays on the device (the sampled ids too, until read; logprobs are read at
once), and nothing per request is rebuilt each step: the parameters are rows kept on the
device (`SamplingBatch`, model_runner/sampling_batch.py), the penalties read per-request
token counts kept there (`TokenCounts`), not the whole history, and allowed_token_ids and
logit_bias are one row per request built once (`TokenMasks`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from model_runner.kernels.cpu_kernels import cpu_kernels_available
from model_runner.sampling_batch import (
    GREEDY,
    LOGPROBS,
    MIN_P,
    MIN_TOKENS,
    PENALTIES,
    REPETITION,
    TOKEN_MASK,
    TOP_K_OR_P,
    Column,
    SamplingBatch,
    StepRows,
    device_index,
)
from model_runner.spec_decode import Verification, rejection_sample, verified_rows
from scheduler.output import GrammarBitmask, SampleLogprobs, ScheduledRequest
from scheduler.sampling_params import SamplingParams


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token, the first of equal maxima (as argmax). On the CPU
    the C++ kernel's (csrc/cpu_sampling.cpp: the same ids, its rows on the threads; 16
    rows of a 262k-token vocabulary 0.7 against torch's 2.0 ms, memory's pace); without
    it `max`'s indices (~1.6x faster than argmax there)."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    if logits.dtype == torch.float32 and logits.dim() == 2 and cpu_kernels_available():
        return torch.ops.pagedserve.greedy_ids(logits if logits.stride(-1) == 1
                                               else logits.contiguous())
    return logits.max(dim=-1).indices


@dataclass
class SamplerOutput:
    """One sampled token per row, on the device (`sampled`, [N] int64) and as a list once
    read (`token_ids`, which waits for the device), and its logprobs where the row asked
    for them."""

    sampled: torch.Tensor
    logprobs: list[SampleLogprobs | None]

    @property
    def token_ids(self) -> list[int]:
        return self.sampled.tolist()


class TokenCounts:
    """Per-request token statistics on the device for the penalties: how often each token
    was generated, and which tokens the prompt holds.

    A request gets a row the first time it samples with penalties (filled from its prompt
    and outputs so far); each later step adds only the tokens sampled since, so the cost
    per step follows the number of rows, not their contexts. A row outlives preemption
    (the outputs are kept) and is freed by `forget` when the request finishes.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._slots: dict[str, int] = {}  # request id -> row
        self._num_counted: dict[str, int] = {}  # request id -> outputs counted in its row
        self._free_slots: list[int] = []
        self._output_counts = torch.zeros(0, 0, device=device)  # [capacity, vocab] float32
        self._prompt_seen = torch.zeros(0, 0, dtype=torch.bool, device=device)

    @property
    def num_rows(self) -> int:
        """Requests holding a row."""
        return len(self._slots)

    def rows(
        self, requests: Sequence[ScheduledRequest], vocab: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output token counts [n, vocab] float32 and prompt tokens seen [n, vocab] bool,
        one row per request in order, brought up to date with its latest outputs."""
        if self._output_counts.shape[1] not in (0, vocab):
            raise ValueError(f"vocab {vocab} != {self._output_counts.shape[1]} of the rows")
        slots: list[int] = []
        fresh: list[tuple[int, ScheduledRequest]] = []  # rows to fill from scratch
        new_slots: list[int] = []
        new_tokens: list[int] = []
        for request in requests:
            request_id, outputs = request.request_id, request.output_token_ids
            slot = self._slots.get(request_id)
            if slot is None or len(outputs) < self._num_counted[request_id]:
                slot = self._slots[request_id] = slot if slot is not None else self._take(vocab)
                self._num_counted[request_id] = 0
                fresh.append((slot, request))
            new = outputs[self._num_counted[request_id] :]
            new_slots += [slot] * len(new)
            new_tokens += new
            self._num_counted[request_id] = len(outputs)
            slots.append(slot)
        if fresh:  # NOTE: a few batched ops, whatever the number of new rows
            self._reset(fresh)
        if new_tokens:
            index = (self._index(new_slots), self._index(new_tokens))
            ones = torch.ones(len(new_tokens), device=self.device)
            self._output_counts.index_put_(index, ones, accumulate=True)
        rows = self._index(slots)
        return self._output_counts[rows], self._prompt_seen[rows]

    def forget(self, request_ids: Sequence[str]) -> None:
        """Free the rows of finished requests (ids without a row are ignored)."""
        for request_id in request_ids:
            slot = self._slots.pop(request_id, None)
            if slot is not None:
                del self._num_counted[request_id]
                self._free_slots.append(slot)

    def _take(self, vocab: int) -> int:
        if not self._free_slots:
            self._grow(vocab)
        return self._free_slots.pop()

    def _reset(self, fresh: list[tuple[int, ScheduledRequest]]) -> None:
        """Zero the rows, then mark each row's prompt tokens as seen."""
        rows = self._index([slot for slot, _ in fresh])
        self._output_counts[rows] = 0.0
        self._prompt_seen[rows] = False
        prompt_slots = [slot for slot, r in fresh for _ in r.prompt_token_ids]
        if prompt_slots:
            prompt_ids = [t for _, r in fresh for t in r.prompt_token_ids]
            self._prompt_seen[self._index(prompt_slots), self._index(prompt_ids)] = True

    def _grow(self, vocab: int) -> None:
        capacity = self._output_counts.shape[0]
        new_capacity = max(8, 2 * capacity)
        counts = torch.zeros(new_capacity, vocab, device=self.device)
        seen = torch.zeros(new_capacity, vocab, dtype=torch.bool, device=self.device)
        if capacity:
            counts[:capacity] = self._output_counts
            seen[:capacity] = self._prompt_seen
        self._output_counts, self._prompt_seen = counts, seen
        self._free_slots += range(new_capacity - 1, capacity - 1, -1)

    def _index(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)


@dataclass
class _MaskRow:
    """One additive row and what it was built from (held, so that their ids stay theirs)."""

    allowed_token_ids: tuple[int, ...] | None
    logit_bias: tuple[tuple[int, float], ...]
    row: torch.Tensor
    num_users: int = 0


class TokenMasks:
    """allowed_token_ids and logit_bias of each request as one additive row [vocab] float32
    on the device: -inf for a token not allowed, else the token's bias (0 without one).

    A row is built the first time a request samples and kept while it runs (a preempted
    request keeps it for its resumption). NOTE: the choices of one HTTP request share their
    params' token lists (the very same tuples: the core receives them once), so a row is
    keyed by the identity of those tuples and serves every choice; the entry holds the
    tuples, so that no other list can take their ids while it lives. Once its last user
    finished (`forget`), a row is kept among the last `max_released` released ones, for a
    choice that starts after its siblings finished (n > seats), then dropped.
    """

    def __init__(self, device: torch.device, max_released: int = 4) -> None:
        self.device = device
        self.max_released = max_released
        self.num_builds = 0  # rows built so far (tests count them)
        self._keys: dict[str, tuple[int, int]] = {}  # request id -> key of its row
        self._rows: dict[tuple[int, int], _MaskRow] = {}
        self._released: OrderedDict[tuple[int, int], None] = OrderedDict()  # no users, LRU

    @property
    def num_rows(self) -> int:
        """Rows held (in use or released)."""
        return len(self._rows)

    def rows(self, requests: Sequence[ScheduledRequest], vocab: int) -> torch.Tensor:
        """The rows of `requests` in order: [n, vocab] float32."""
        rows = []
        for request in requests:
            key = self._keys.get(request.request_id)
            if key is None:
                key = self._keys[request.request_id] = self._add(request.sampling_params, vocab)
            rows.append(self._rows[key].row)
        return torch.stack(rows)

    def forget(self, request_ids: Sequence[str]) -> None:
        """Release the rows of finished requests (ids without one are ignored)."""
        for request_id in request_ids:
            key = self._keys.pop(request_id, None)
            if key is None:
                continue
            entry = self._rows[key]
            entry.num_users -= 1
            if not entry.num_users:
                self._released[key] = None
                if len(self._released) > self.max_released:
                    del self._rows[self._released.popitem(last=False)[0]]

    def _add(self, params: SamplingParams, vocab: int) -> tuple[int, int]:
        key = (id(params.allowed_token_ids), id(params.logit_bias))
        entry = self._rows.get(key)
        if entry is None:
            row = _mask_row(params, vocab).to(self.device, non_blocking=True)
            entry = self._rows[key] = _MaskRow(params.allowed_token_ids, params.logit_bias, row)
            self.num_builds += 1
        self._released.pop(key, None)
        entry.num_users += 1
        return key


def _mask_row(params: SamplingParams, vocab: int) -> torch.Tensor:
    """The additive row of `params` on the host (a token listed twice in logit_bias gets
    both biases)."""
    row = torch.zeros(vocab)
    if params.allowed_token_ids is not None:
        row.fill_(float("-inf"))
        row[torch.tensor(params.allowed_token_ids, dtype=torch.int64)] = 0.0
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64)
        bias = torch.tensor([b for _, b in params.logit_bias])  # NOTE: float32, as the logits
        row.index_add_(0, ids, bias)
    return row


class Sampler:
    """Samples one token per row of a logits batch.

    Requests without a seed draw from one global generator seeded with `seed`; seeded
    requests bring their own generator, so their draws do not depend on batch mates.
    """

    def __init__(self, device: torch.device, eos_token_ids: frozenset[int], seed: int = 0):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.batch = SamplingBatch(device, eos_token_ids)
        self.token_counts = TokenCounts(device)
        self.token_masks = TokenMasks(device)

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop the per-request state of finished requests."""
        self.batch.forget(request_ids)
        self.token_counts.forget(request_ids)
        self.token_masks.forget(request_ids)

    def __call__(
        self,
        logits: torch.Tensor,
        requests: Sequence[ScheduledRequest],
        generators: Sequence[torch.Generator | None],
        bitmask: GrammarBitmask | None = None,
    ) -> SamplerOutput:
        """logits: [N, vocab] float32 (modified in place), one row per request in order;
        generators: the request's own generator, or None for the global one; bitmask:
        the allowed tokens of the rows constrained by a grammar."""
        step = self.batch.select(requests)
        if bitmask is not None:
            apply_bitmask(logits, requests, bitmask)
        if step.any(TOKEN_MASK):
            self._apply_token_masks(logits, requests)
        if step.any(MIN_TOKENS):
            self._mask_stop_tokens(logits, requests, step)
        if step.any(PENALTIES):
            self._apply_penalties(logits, requests, step)
        want_logprobs = step.any(LOGPROBS)
        if step.all(GREEDY) and not want_logprobs:
            return SamplerOutput(greedy(logits), [None] * len(requests))

        if not step.all(GREEDY):  # NOTE: greedy rows divide by 1, which changes nothing
            logits.div_(step.column(Column.TEMPERATURE)[:, None])
        # NOTE: logprobs are of the penalised, temperature-scaled distribution before the
        # top_k / top_p / min_p cut, so that the top-N alternatives are all finite.
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        greedy_ids = greedy(logits)
        if step.all(GREEDY):
            sampled = greedy_ids
        else:
            probs = torch.softmax(self._filter(logits, step), dim=-1)
            sampled = self._draw(probs, generators)
            if step.any(GREEDY):
                sampled = torch.where(step.column(Column.IS_GREEDY) > 0, greedy_ids, sampled)
        if logprobs is None:
            return SamplerOutput(sampled, [None] * len(requests))
        params = [row.params for row in step.rows]
        return SamplerOutput(sampled, self._logprobs(logprobs, sampled, params))

    def verify(
        self,
        logits: torch.Tensor,
        requests: Sequence[ScheduledRequest],
        generators: Sequence[torch.Generator | None],
        bitmask: GrammarBitmask | None = None,
    ) -> Verification:
        """Verify the drafts of `requests` (model_runner/spec_decode.py): logits [R, vocab]
        float32 (modified in place), 1 + num_draft_tokens consecutive rows per request.
        A grammar's rows are masked each with its own state (`bitmask`, a mask per
        position). Their requests have no penalties or min_tokens left to hold (the
        scheduler gives such requests no drafts): their rows differ from a plain step's
        only in the tokens before them."""
        rows = [r for r in requests for _ in range(1 + r.num_draft_tokens)]
        row_generators = [g for r, g in zip(requests, generators, strict=True)
                          for _ in range(1 + r.num_draft_tokens)]
        draft_ids, masked, bitmask_rows = verified_rows(requests, bitmask)
        drafts = device_index(draft_ids, logits.device)
        step = self.batch.select(rows)
        if bitmask is not None:
            mask_rows(logits, masked, bitmask_rows, bitmask.bitmask)
        if step.any(TOKEN_MASK):
            self._apply_token_masks(logits, rows)
        if not step.all(GREEDY):
            logits.div_(step.column(Column.TEMPERATURE)[:, None])
        logprobs = torch.log_softmax(logits, dim=-1) if step.any(LOGPROBS) else None
        greedy_ids = greedy(logits)
        accepted, tokens = greedy_ids == drafts, greedy_ids
        if not step.all(GREEDY):
            probs = torch.softmax(self._filter(logits, step), dim=-1)
            uniforms = self._uniforms(len(rows), row_generators, logits.device)
            sampled_accepted, sampled = rejection_sample(
                probs, drafts, uniforms, lambda weights: self._draw(weights, row_generators)
            )
            is_greedy = step.column(Column.IS_GREEDY) > 0
            accepted = torch.where(is_greedy, accepted, sampled_accepted)
            tokens = torch.where(is_greedy, greedy_ids, sampled)
        return Verification(requests, accepted, tokens, logprobs,
                            drafts if logprobs is not None else None)

    def _uniforms(
        self, n: int, generators: Sequence[torch.Generator | None], device: torch.device
    ) -> torch.Tensor:
        """n draws from U[0, 1), each from its row's generator (None: the global one)."""
        uniforms = torch.empty(n, device=device)
        if any(g is None for g in generators):
            uniforms.uniform_(generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                uniforms[i].uniform_(generator=g)
        return uniforms

    def _apply_token_masks(
        self, logits: torch.Tensor, requests: Sequence[ScheduledRequest]
    ) -> None:
        """allowed_token_ids, then logit_bias (OpenAI: added to the logits), as each masked
        row's additive row of `TokenMasks`."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.has_token_mask]
        masks = self.token_masks.rows([requests[i] for i in rows], logits.shape[1])
        if len(rows) == len(requests):
            logits.add_(masks)
        else:
            logits.index_add_(0, device_index(rows, logits.device), masks)

    def _mask_stop_tokens(
        self, logits: torch.Tensor, requests: Sequence[ScheduledRequest], step: StepRows
    ) -> None:
        """-inf for the stop tokens of the rows whose output is shorter than min_tokens."""
        rows: list[int] = []
        token_ids: list[int] = []
        for i, (request, row) in enumerate(zip(requests, step.rows, strict=True)):
            if row.needs & MIN_TOKENS and len(request.output_token_ids) < row.params.min_tokens:
                rows += [i] * len(row.stop_ids)
                token_ids += row.stop_ids
        if rows:
            device = logits.device
            logits[device_index(rows, device), device_index(token_ids, device)] = float("-inf")

    def _apply_penalties(
        self, logits: torch.Tensor, requests: Sequence[ScheduledRequest], step: StepRows
    ) -> None:
        """Repetition (over prompt and output), then frequency and presence (over the
        output) penalties of the rows that have them."""
        rows = [i for i, row in enumerate(step.rows) if row.needs & PENALTIES]
        counts, prompt_seen = self.token_counts.rows([requests[i] for i in rows],
                                                     logits.shape[1])  # [n, vocab] each
        index = None if len(rows) == len(requests) else device_index(rows, logits.device)
        x = logits if index is None else logits.index_select(0, index)  # [n, vocab]
        values = step.values if index is None else step.values.index_select(0, index)
        if step.any(REPETITION):
            repetition = values[:, Column.REPETITION_PENALTY, None]
            penalised = torch.where(x > 0, x / repetition, x * repetition)
            x = torch.where(prompt_seen | (counts > 0), penalised, x)
        x = (x - values[:, Column.FREQUENCY_PENALTY, None] * counts
             - values[:, Column.PRESENCE_PENALTY, None] * (counts > 0))
        if index is None:
            logits.copy_(x)
        else:
            logits.index_copy_(0, index, x)

    @staticmethod
    def _filter(logits: torch.Tensor, step: StepRows) -> torch.Tensor:
        """Mask to -inf what top_k, then top_p, then min_p exclude."""
        if step.any(TOP_K_OR_P):
            sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [N, vocab]
            ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
            sorted_logits.masked_fill_(ranks >= step.column(Column.TOP_K)[:, None], float("-inf"))
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            # drop a token when the more likely ones already reach top_p (keeps the first)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            sorted_logits.masked_fill_(before > step.column(Column.TOP_P)[:, None], float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)
        if step.any(MIN_P):
            probs = torch.softmax(logits, dim=-1)
            threshold = step.column(Column.MIN_P)[:, None] * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return logits

    def _draw(
        self, probs: torch.Tensor, generators: Sequence[torch.Generator | None]
    ) -> torch.Tensor:
        """One categorical draw per row: [N] int64. On the CPU by the inverse of each row's
        cumulative distribution at one uniform in (0, 1] (a scan of the row: 16 rows of
        a 49k vocabulary in ~1 ms, where drawing a noise per token took ~13 ms); on a
        device as argmax(probs / Exp(1) noise), elementwise with no scan."""
        if probs.device.type == "cpu":
            cdf = probs.cumsum(dim=-1)  # [N, vocab]
            # NOTE: above 0, so a token of probability 0 (an equal cdf) is never the first
            # whose cdf reaches the point
            point = (1 - self._uniforms(probs.shape[0], generators, probs.device)) * cdf[:, -1]
            return torch.searchsorted(cdf, point[:, None]).squeeze(1).clamp_max_(
                probs.shape[1] - 1)
        noise = torch.empty_like(probs)
        if any(g is None for g in generators):
            noise.exponential_(generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)

    @staticmethod
    def _logprobs(
        logprobs: torch.Tensor, sampled: torch.Tensor, params: Sequence[SamplingParams]
    ) -> list[SampleLogprobs | None]:
        num_top = max(p.logprobs or 0 for p in params)
        chosen = logprobs.gather(1, sampled[:, None])[:, 0].tolist()
        top = logprobs.topk(num_top, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
        out: list[SampleLogprobs | None] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                out.append(None)
            else:
                pairs = zip(top_ids[i][: p.logprobs], top_values[i][: p.logprobs], strict=True)
                out.append(SampleLogprobs(chosen[i], list(pairs)))
        return out


def apply_bitmask(
    logits: torch.Tensor, requests: Sequence[ScheduledRequest], bitmask: GrammarBitmask
) -> None:
    """-inf for the tokens a row's grammar forbids (only the rows `bitmask` names)."""
    rows = [i for i, r in enumerate(requests) if r.request_id in bitmask.rows]
    mask_rows(logits, rows, [bitmask.rows[requests[i].request_id] for i in rows],
              bitmask.bitmask)


def mask_rows(
    logits: torch.Tensor, rows: Sequence[int], bitmask_rows: Sequence[int], bitmask: np.ndarray
) -> None:
    """-inf in each of `rows` of `logits` for the tokens its row of `bitmask` (the same
    place in `bitmask_rows`) forbids."""
    if not rows:
        return
    vocab = logits.shape[1]
    # NOTE: unpacked on the host in one numpy pass (bit t of a row is token t)
    words = np.ascontiguousarray(bitmask[list(bitmask_rows)])  # [n, vocab / 32] int32
    allowed = np.unpackbits(words.view(np.uint8), axis=1, count=vocab, bitorder="little")
    forbidden = torch.from_numpy(allowed).to(logits.device, non_blocking=True) == 0
    if len(rows) == logits.shape[0]:  # every row masked (in order): in place, no gather
        logits.masked_fill_(forbidden, float("-inf"))
        return
    index = device_index(rows, logits.device)
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
