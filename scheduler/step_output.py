"""The plan of a scheduled step: `build_output` turns a `Step` into the `SchedulerOutput`
the model runner reads, and advances each scheduled request's progress by what it
computes (an output placeholder for a token it samples)."""

from __future__ import annotations

from kvcache.kv_cache_manager import KVCacheManager
from scheduler.admission import Step
from scheduler.output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from scheduler.request import Request

_NO_DRAFTS: list[int] = []  # read only


def build_output(step: Step, requests: dict[str, Request], kv_cache: KVCacheManager,
                 finished_ids: list[str], lora_loads: list[str], lora_evictions: list[str]
                 ) -> SchedulerOutput:
    """The step's plan: every scheduled request's tokens (placeholders for tokens still
    being sampled, then its drafts), block table, sampling and LoRA adapter, in scheduling
    order, and the adapters the runner loads and evicts first."""
    scheduled = []
    for request_id, num_new in step.num_scheduled_tokens.items():
        request = requests[request_id]
        start = request.num_computed_tokens
        end = start + num_new
        drafts = step.draft_token_ids.get(request_id, _NO_DRAFTS)
        known_end = end - len(drafts)  # the drafts (speculation) come after the known
        token_ids = request.all_token_ids[start:known_end]
        if known_end > request.num_tokens:  # the token of an unfinished step
            token_ids += [PLACEHOLDER_TOKEN_ID] * (known_end - request.num_tokens)
        sample = known_end == request.num_tokens + request.num_output_placeholders
        token_ids += drafts
        scheduled.append(
            ScheduledRequest(
                request_id=request_id,
                token_ids=token_ids,
                num_computed_tokens=start,
                block_table=kv_cache.get_block_ids(request_id),
                sample=sample,
                sampling_params=request.sampling_params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                prompt_logprob_rows=_prompt_logprob_rows(request, start, end),
                num_draft_tokens=len(drafts),
                num_lookahead_tokens=step.num_lookahead_tokens.get(request_id, 0),
                lora_name=request.lora_name,
            )
        )
        request.num_computed_tokens = end
        if sample:
            request.num_output_placeholders += 1
    return SchedulerOutput(
        scheduled=scheduled,
        preempted_ids=[r.request_id for r in step.preempted],
        finished_ids=finished_ids,
        lora_loads=lora_loads,
        lora_evictions=lora_evictions,
    )


def _prompt_logprob_rows(request: Request, start: int, end: int) -> tuple[int, int]:
    """Offsets into the chunk of positions [start, end) whose logits give the prompt
    logprobs `request` still misses (position p's give prompt token p + 1's)."""
    logprobs = request.prompt_logprobs
    if logprobs is None or logprobs.end >= request.num_prompt_tokens:
        return (0, 0)
    lo, hi = max(start, logprobs.end - 1), min(end, request.num_prompt_tokens - 1)
    return (lo - start, hi - start) if lo < hi else (0, 0)
