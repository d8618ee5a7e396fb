"""`EngineRequest`: one HTTP request as the engine takes it, built once by the API
process (server/serving.py) and read by everything after: its choices' scheduler
requests, their detokenizers and the metrics' labels."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from engine.messages import NewRequest
from scheduler.placement import Placement
from scheduler.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """n choices for each of `prompts`, each its own scheduler request.

    Choice `p * n + i` (prompt p, sample i) has the scheduler id `<request_id>-<p*n+i>`.
    `stop`, `skip_special_tokens` and `include_stop_str_in_output` shape its text (the
    API process detokenizes). Whose it is and how it wants to be scheduled (priority,
    tenant, deadline, ...: scheduler/placement.py) is its `placement`, which every choice
    carries whole."""

    request_id: str
    prompts: Sequence[list[int]]
    sampling_params: SamplingParams
    n: int = 1
    stop: Sequence[str] = ()
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    placement: Placement = field(default_factory=Placement)
    arrival_time: float = field(default_factory=time.monotonic)  # when the request arrived

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def choice_id(self, index: int) -> str:
        """The scheduler id of choice `index`."""
        return f"{self.request_id}-{index}"

    def new_requests(self) -> list[NewRequest]:
        """Its choices as the core takes them: with a seed, sample i uses seed + i so that
        the n samples differ; choices i > 0 name choice p * n as their prompt leader; the
        token lists (allowed ids, logit bias) travel with the first choice only."""
        new_requests: list[NewRequest] = []
        for p, prompt in enumerate(self.prompts):
            for i in range(self.n):
                params = self.sampling_params
                if i > 0 and params.seed is not None:
                    params = replace(params, seed=params.seed + i)
                shares_token_lists = bool(new_requests) and params.has_token_mask
                if shares_token_lists:
                    params = replace(params, allowed_token_ids=None, logit_bias=())
                new_requests.append(NewRequest(
                    request_id=self.choice_id(p * self.n + i),
                    prompt_token_ids=list(prompt),
                    sampling_params=params,
                    arrival_time=self.arrival_time,
                    placement=self.placement,
                    prompt_leader_id=self.choice_id(p * self.n) if i > 0 else None,
                    shares_token_lists=shares_token_lists,
                ))
        return new_requests
