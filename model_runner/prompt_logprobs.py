"""vLLM's `prompt_logprobs`: the logits of a step's flagged prompt positions to each
prompt token's logprob, rank and top-k.

Only the rows a chunk's `prompt_logprob_rows` name go through the LM head, a slice at a
time, so a step without flagged chunks costs nothing and a long prompt never holds more
than [_MAX_ROWS, vocab] logits at once. NOTE: the values come to the host at launch (a
sync that only steps with flagged rows make; an overlapped step waits for it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from scheduler.output import PromptLogprobs, ScheduledRequest

_MAX_ROWS = 256


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    requests: Sequence[ScheduledRequest],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    keep: bool = True,
) -> dict[str, PromptLogprobs]:
    """Prompt logprobs by request id, from the hidden states [T, H] of `requests` laid out
    flat in this order.

    `compute_logits` is the LM head: under tensor parallelism a collective, which every
    rank calls on the same rows in the same order; a rank that does not `keep` (a worker,
    whose logits are a vocab slice) only joins the calls and returns nothing.
    """
    out: dict[str, PromptLogprobs] = {}
    row = 0  # the request's first row in `hidden`
    for request in requests:
        lo, hi = request.prompt_logprob_rows
        for a in range(lo, hi, _MAX_ROWS):
            b = min(a + _MAX_ROWS, hi)
            logits = compute_logits(hidden[row + a : row + b])  # [b - a, vocab]
            if not keep:
                continue
            piece = _logprobs(logits, request, a)
            if request.request_id in out:
                out[request.request_id].extend(piece)
            else:
                out[request.request_id] = piece
        row += request.num_new_tokens
    return out


def _logprobs(logits: torch.Tensor, request: ScheduledRequest, offset: int) -> PromptLogprobs:
    """The rows of `logits` from chunk offset `offset` on: position p's predict prompt
    token p + 1."""
    first = request.num_computed_tokens + offset + 1
    num_top = request.sampling_params.prompt_logprobs or 0
    targets = request.prompt_token_ids[first : first + logits.shape[0]]
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [m, vocab]
    index = torch.tensor(targets, dtype=torch.int64, device=logits.device)[:, None]
    chosen = logprobs.gather(1, index)  # [m, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top: list[list[tuple[int, float]]] = [[] for _ in targets]
    if num_top:
        best = logprobs.topk(num_top, dim=-1)
        top = [
            list(zip(ids, values, strict=True))
            for ids, values in zip(best.indices.tolist(), best.values.tolist(), strict=True)
        ]
    return PromptLogprobs(first, chosen[:, 0].tolist(), ranks.tolist(), top)
