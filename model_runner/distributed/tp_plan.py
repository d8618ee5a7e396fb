"""What rank 0 tells the tensor-parallel workers each step, and their copy of the block tables.

Only rank 0 runs the scheduler and samples; the workers run the same forward on their
shards. Per step rank 0 sends them a `StepPlan`: for each scheduled request (in the
runner's order) its new tokens (a decode's one, a prefill chunk's), its computed count,
whether it samples (the LM head's gather runs then, on its drafts' rows too), the rows
whose prompt logprobs it wants (the LM head runs on them too), its LoRA adapter and the
blocks added to its table since the workers last saw it; the requests to forget (finished
or preempted, whose tables were freed); and what changed of rank 0's LoRA adapters
(model_runner/distributed/tp_lora.py), alone in a plan of no requests when no step runs.
Never a whole history: a table reaches the workers once, then grows by its new blocks,
which is how the scheduler grows it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from model_runner.distributed.tp_lora import LoRANews
from scheduler.output import ScheduledRequest
from scheduler.sampling_params import SamplingParams


class PlannedRequest(msgspec.Struct, array_like=True):
    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    new_block_ids: list[int]
    sample: bool
    prompt_logprob_rows: tuple[int, int] = (0, 0)  # the LM head runs on these rows too
    num_draft_tokens: int = 0  # speculative decoding: the LM head runs on their rows too
    lora_name: str | None = None


class StepPlan(msgspec.Struct, array_like=True):
    forget_ids: list[str]
    requests: list[PlannedRequest]
    loras: LoRANews | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StepPlan)
_NOT_SAMPLED = SamplingParams()  # the workers never sample


class PlanWriter:
    """Rank 0's side: what the workers know of each request's block table."""

    def __init__(self) -> None:
        self._num_known: dict[str, int] = {}  # request id -> blocks the workers hold of it
        self._forget: list[str] = []

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests whose tables were freed; the workers drop theirs with the next plan."""
        for request_id in request_ids:
            if self._num_known.pop(request_id, None) is not None:
                self._forget.append(request_id)

    def plan(self, requests: Sequence[ScheduledRequest], loras: LoRANews | None = None) -> bytes:
        """The encoded plan of a step that runs `requests` in this order, with the news
        of rank 0's adapters."""
        planned = []
        for r in requests:
            num_known = self._num_known.get(r.request_id, 0)
            planned.append(PlannedRequest(r.request_id, r.token_ids, r.num_computed_tokens,
                                          r.block_table[num_known:], r.sample,
                                          r.prompt_logprob_rows, r.num_draft_tokens,
                                          r.lora_name))
            self._num_known[r.request_id] = len(r.block_table)
        plan, self._forget = StepPlan(self._forget, planned, loras), []
        return _encoder.encode(plan)


class BlockTables:
    """A worker's side: every live request's block table, as rank 0's scheduler has it."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}

    def apply(
        self, data: bytes
    ) -> tuple[list[ScheduledRequest], list[str], LoRANews | None]:
        """Apply an encoded plan: the step's requests and the ids it forgets, for
        `ModelRunner.execute_worker`, and the news of rank 0's adapters."""
        plan = _decoder.decode(data)
        for request_id in plan.forget_ids:
            self._tables.pop(request_id, None)
        requests = []
        for r in plan.requests:
            table = self._tables.setdefault(r.request_id, [])
            table.extend(r.new_block_ids)
            requests.append(ScheduledRequest(r.request_id, r.token_ids, r.num_computed_tokens,
                                             table, r.sample, _NOT_SAMPLED, [], [],
                                             r.prompt_logprob_rows, r.num_draft_tokens,
                                             lora_name=r.lora_name))
        return requests, plan.forget_ids, plan.loras

    def __len__(self) -> int:
        return len(self._tables)
