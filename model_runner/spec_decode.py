"""Verification of draft tokens (speculative decoding), on the logits of every position a
request's drafts occupy.

A request that verifies d drafts has d + 1 rows of logits: at its last known token and at
each draft. Row i decides draft i: a greedy request accepts it when it is the argmax (so
the output is the one it would have had without speculation); a sampling request accepts
it with probability p(draft), p being its processed distribution there (rejection
sampling with the proposer's one-hot distribution), and on a rejection draws from p with
the draft removed, so that every output token follows p exactly. The tokens are the
accepted prefix of the drafts, then the row after it gives one more: the correction at
the first rejection, or a bonus token when every draft was accepted.

A request with a grammar has a mask per row (`verified_rows`): row i's is the grammar's
state after the first i drafts, applied before everything else, so p is the masked
distribution at every position. A draft after which the grammar's mask is missing (it
was late) is not accepted: its own row then gives a token drawn from p whole, as a bonus
row does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from scheduler.output import GrammarBitmask, SampleLogprobs, ScheduledRequest

# A categorical draw per row from unnormalised weights [R, vocab] -> [R] int64.
DrawFn = Callable[[torch.Tensor], torch.Tensor]


def rejection_sample(
    probs: torch.Tensor, drafts: torch.Tensor, uniforms: torch.Tensor, draw: DrawFn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, whether its draft is accepted and the token it gives if it is the row after
    the accepted prefix: probs [R, vocab] (modified in place), drafts [R] (-1: a bonus row,
    without a draft), uniforms [R] in [0, 1). Returns accepted [R] bool, tokens [R] int64."""
    has_draft = drafts >= 0
    index = drafts.clamp_min(0)[:, None]
    p_draft = probs.gather(1, index)[:, 0]
    accepted = has_draft & (uniforms < p_draft)
    # the residual max(p - onehot(draft), 0): p without the draft (unnormalised: `draw` takes
    # weights); a bonus row keeps p whole
    probs.scatter_(1, index, torch.where(has_draft, 0.0, p_draft)[:, None])
    return accepted, draw(probs)


def verified_rows(
    requests: Sequence[ScheduledRequest], bitmask: GrammarBitmask | None
) -> tuple[list[int], list[int], list[int]]:
    """Per verified row (1 + num_draft_tokens per request, in order), the draft it decides
    (-1: none, on the last row of a request and past its grammar's masks); and the rows
    masked by a grammar, with their rows of `bitmask` (each request's consecutive ones)."""
    drafts: list[int] = []
    masked: list[int] = []
    bitmask_rows: list[int] = []
    for request in requests:
        draft_ids = request.draft_token_ids
        first = None if bitmask is None else bitmask.rows.get(request.request_id)
        if bitmask is not None and first is not None:
            num_masked = min(len(draft_ids), bitmask.num_draft_rows.get(request.request_id, 0))
            masked += range(len(drafts), len(drafts) + num_masked + 1)
            bitmask_rows += range(first, first + num_masked + 1)
            draft_ids = draft_ids[:num_masked] + [-1] * (len(draft_ids) - num_masked)
        drafts += [*draft_ids, -1]
    return drafts, masked, bitmask_rows


@dataclass
class Verification:
    """A launched verification: per row, on the device, whether its draft was accepted
    and the token it gives (and, for logprobs, the logprobs of both, and the top ones);
    read on the host by `result()`."""

    requests: Sequence[ScheduledRequest]
    accepted: torch.Tensor  # [R] bool
    tokens: torch.Tensor  # [R] int64
    logprobs: torch.Tensor | None = None  # [R, vocab] float32 when any request wants them
    drafts: torch.Tensor | None = None  # [R] int64, -1 on bonus rows (with logprobs)

    def result(self) -> tuple[dict[str, list[int]], dict[str, list[SampleLogprobs]]]:
        """Each request's tokens (accepted drafts, then one) and their logprobs (only the
        requests that asked for them)."""
        accepted, tokens = self.accepted.tolist(), self.tokens.tolist()
        tables = self._logprob_tables()
        token_ids: dict[str, list[int]] = {}
        logprobs: dict[str, list[SampleLogprobs]] = {}
        row = 0
        for request in self.requests:
            drafts = request.draft_token_ids
            num_accepted = 0
            while num_accepted < len(drafts) and accepted[row + num_accepted]:
                num_accepted += 1
            token_ids[request.request_id] = [*drafts[:num_accepted], tokens[row + num_accepted]]
            num_top = request.sampling_params.logprobs
            if tables is not None and num_top is not None:
                logprobs[request.request_id] = _chosen_logprobs(tables, row, num_accepted,
                                                                num_top)
            row += len(drafts) + 1
        return token_ids, logprobs

    def _logprob_tables(self) -> _LogprobTables | None:
        if self.logprobs is None or self.drafts is None:
            return None
        num_top = max(r.sampling_params.logprobs or 0 for r in self.requests)
        draft_lp = self.logprobs.gather(1, self.drafts.clamp_min(0)[:, None])[:, 0]
        token_lp = self.logprobs.gather(1, self.tokens[:, None])[:, 0]
        top = self.logprobs.topk(num_top, dim=-1)
        return _LogprobTables(draft_lp.tolist(), token_lp.tolist(), top.indices.tolist(),
                              top.values.tolist())


@dataclass
class _LogprobTables:
    draft: list[float]
    token: list[float]
    top_ids: list[list[int]]
    top_values: list[list[float]]


def _chosen_logprobs(
    tables: _LogprobTables, row: int, num_accepted: int, num_top: int
) -> list[SampleLogprobs]:
    """The logprobs of one request's accepted drafts then its last token."""
    out = []
    for i in range(row, row + num_accepted + 1):
        chosen = tables.draft[i] if i < row + num_accepted else tables.token[i]
        top = list(zip(tables.top_ids[i][:num_top], tables.top_values[i][:num_top], strict=True))
        out.append(SampleLogprobs(chosen, top))
    return out
