"""The messages between the API process and the engine core, as msgspec structs.

In (API -> core): `AddRequests`, `FinishRequests` (aborts, and stop strings the API
process matched), `SnapshotQuery`, `Shutdown`. Out (core -> API): `Ready` or
`LoadFailed` once, then per step a `StepScheduled` and a `StepOutputs`, and a
`SnapshotReply` per query. The same structs travel in-process (the unit tests' engine)
and, msgpack-encoded, over the pyzmq sockets between the two processes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgspec

from kvcache.config import CacheConfig
from scheduler.introspection import SchedulerStats
from scheduler.output import PromptLogprobs, SampleLogprobs
from scheduler.placement import Placement
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams


class NewRequest(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    """One scheduler request (one choice of an HTTP request), built with keywords."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float | None = None  # time.monotonic(), the same clock in both processes
    placement: Placement = msgspec.field(default_factory=Placement)  # whose it is, whole
    # Its place among the choices of its HTTP request: the choice that computes the prompt
    # it shares (n > 1), and whether its allowed_token_ids and logit_bias are left out of
    # `sampling_params`: they are then those of the first request of its AddRequests (the
    # lists travel once per HTTP request).
    prompt_leader_id: str | None = None
    shares_token_lists: bool = False


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    requests: list[NewRequest]

    def scheduler_requests(self, eos_token_ids: frozenset[int]) -> list[Request]:
        """The scheduler's `Request` of each message: the one place the core makes them
        (vLLM's `Request.from_engine_core_request`), each holding its placement whole."""
        return [
            Request(new.request_id, new.prompt_token_ids, params, eos_token_ids,
                    new.placement, new.arrival_time, new.prompt_leader_id)
            for new, params in zip(self.requests, self.sampling_params(), strict=True)
        ]

    def sampling_params(self) -> list[SamplingParams]:
        """Each request's params, with the first request's token lists where it shares
        them: the very same tuples, so that the runner builds one mask for them all."""
        first = self.requests[0].sampling_params if self.requests else None
        return [
            replace(new.sampling_params, allowed_token_ids=first.allowed_token_ids,
                    logit_bias=first.logit_bias)
            if new.shares_token_lists and first is not None else new.sampling_params
            for new in self.requests
        ]


class FinishRequests(msgspec.Struct, tag=True, array_like=True):
    """Finish requests in the core: aborted (client gone, shutdown) or stopped (the API
    process matched a stop string). Unknown or finished ids are ignored."""

    request_ids: list[str]
    stopped: bool = False


class SnapshotQuery(msgspec.Struct, tag=True, array_like=True):
    query_id: int
    check_integrity: bool = False


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class UpdateLoRA(msgspec.Struct, tag=True, array_like=True):
    """Serve the LoRA adapter in the PEFT folder `path` under `name` from now on (checked
    against the model), or stop serving it (`path` None): answered by a `SnapshotReply`
    whose state is {"error": why not, or None}."""

    query_id: int
    name: str
    path: str | None = None


Command = AddRequests | FinishRequests | SnapshotQuery | Shutdown | UpdateLoRA


class CoreInfo(msgspec.Struct, array_like=True):
    """What the core tells the API process once its model is loaded."""

    model_name: str
    max_model_len: int
    vocab_size: int
    policy: str
    eos_token_ids: list[int]
    cache_config: CacheConfig  # the KV pool the runner allocated
    structured_outputs: bool = False  # grammars can be compiled (structured/)
    loras: dict[str, str] | None = None  # LoRA adapters served, name -> path (None: off)


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: CoreInfo


class LoadFailed(msgspec.Struct, tag=True, array_like=True):
    """The core could not load the model; `kind` is the exception's class name."""

    kind: str
    message: str


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step did to one request: its new tokens, and its end."""

    request_id: str
    new_token_ids: list[int]
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    logprobs: list[SampleLogprobs] | None = None
    finish_reason: str | None = None  # "stop" or "length" (EOS, stop ids, max_tokens)
    error: str | None = None  # the step failed; the core aborted the request
    # 400: the request's own fault (its grammar failed or ran late, the scheduler refused
    # it); 500: the step failed.
    error_status: int = 500
    prompt_logprobs: PromptLogprobs | None = None  # whole, with the first new tokens
    # Instead of `prompt_logprobs`: they are those an earlier delta of another choice of
    # the same prompt carried (n > 1: sent once per prompt).
    shares_prompt_logprobs: bool = False


class StepScheduled(msgspec.Struct, tag=True, array_like=True):
    """Sent once a step is scheduled, before it runs: `first_scheduled` names the requests
    scheduled for the first time (at `step_start`, monotonic); `num_waiting` is the
    scheduler's count after scheduling; `num_added` counts the requests the core took in
    since its previous message; `num_scheduled_tokens` is the step's size."""

    step_start: float
    first_scheduled: list[str]
    num_waiting: int
    num_added: int
    num_scheduled_tokens: int = 0


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    """What a step did (or, between steps, what commands did: rejected adds, stats);
    `stats` is the scheduler's, None when they are those of the last message."""

    deltas: list[RequestDelta]
    stats: SchedulerStats | None
    num_added: int = 0


class SnapshotReply(msgspec.Struct, tag=True, array_like=True):
    query_id: int
    state: dict[str, Any]


CoreMessage = Ready | LoadFailed | StepScheduled | StepOutputs | SnapshotReply

command_encoder = msgspec.msgpack.Encoder()
command_decoder = msgspec.msgpack.Decoder(Command)
output_encoder = msgspec.msgpack.Encoder()
output_decoder = msgspec.msgpack.Decoder(CoreMessage)
