"""`Placement`: who a request is and how it wants to be scheduled, in one record.

The API process builds it once, when admission places a request under its tenant
(server/admission.py); it then travels whole: in the `EngineRequest` (engine/request.py),
in every `NewRequest` message to the core (engine/messages.py), and in the scheduler's
`Request`, which reads it and never copies its fields. A new such field (a latency
target, an adapter) is added here and where admission sets it, nowhere else.
"""

from __future__ import annotations

import msgspec

DEFAULT_TENANT = "default"  # the tenant of a server without a tenants file


class Placement(msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True):
    """Whose a request is and where it stands among the others.

    `priority`: lower is more urgent. `tenant` and `weight` place it in its priority
    level's fair share (tenants served in proportion to their weights);
    `priority_bound` is its tenant's most urgent priority (aging stops there; None:
    none). `deadline` (time.monotonic(), the same clock in both processes), when set,
    finishes it with "deadline" once passed. `cache_salt` keys its prefix-cache blocks
    apart from those of any other salt. Latency targets (under `--scheduling-policy slo`
    the scheduler plans against them; every policy reports them met or missed):
    `ttft_deadline` (time.monotonic()) is when its first token is due, `tpot_s` the most
    seconds between its tokens, and `reject_late` refuses it (503) rather than serve it
    late once its first token can no longer be on time. `lora_name`: the LoRA adapter it
    runs (None: the base model); its prefix-cache blocks are keyed apart from any other
    adapter's.

    NOTE: a msgspec struct, not a dataclass like SamplingParams: it crosses the process
    boundary in every `NewRequest`, and array_like sends its fields by position, not by
    name.
    """

    priority: int = 0
    tenant: str = DEFAULT_TENANT
    weight: float = 1.0
    priority_bound: int | None = None
    deadline: float | None = None
    cache_salt: str | None = None
    ttft_deadline: float | None = None
    tpot_s: float | None = None
    reject_late: bool = False
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ValueError("weight must be > 0")
        if self.tpot_s is not None and not self.tpot_s > 0:
            raise ValueError("tpot_s must be > 0")
