"""Weighted fair share among tenants inside one priority level: start-time fair queuing.

Each request gets a tag once, when it arrives: the later of its level's virtual time and
the virtual finish of its tenant's previous request there; that finish then moves on by
the request's cost (prompt plus max_tokens) over the tenant's weight. The waiting queue
orders a level by tag, so a tenant of weight 2 gets twice the tokens of one of weight 1
while both wait, and a tenant arriving at an idle moment starts at the level's virtual
time: behind nobody's backlog. The virtual time is the largest tag admitted so far.
Across levels priority stays strict; tags only order requests of one priority.
O(1) per request; memory is bounded by the (tenant, level) pairs still ahead of the
virtual time.
"""

from __future__ import annotations

from scheduler.request import Request

_PRUNE_AT = 4096


class FairShare:
    """Tags requests on arrival (`tag`) and advances on admission (`admitted`)."""

    def __init__(self) -> None:
        self._virtual_time: dict[int, float] = {}  # priority level -> largest admitted tag
        self._finish: dict[tuple[str, int], float] = {}  # (tenant, level) -> finish
        self._prune_at = _PRUNE_AT

    def tag(self, request: Request) -> None:
        """Set `request.fair_tag` (once: a preempted request keeps its place)."""
        if request.fair_tag is not None:
            return
        placement = request.placement
        level = placement.priority
        key = (placement.tenant, level)
        start = max(self._virtual_time.get(level, 0.0), self._finish.get(key, 0.0))
        cost = request.num_prompt_tokens + request.sampling_params.max_tokens
        self._finish[key] = start + cost / placement.weight
        request.fair_tag = start
        if len(self._finish) >= self._prune_at:
            self._prune()

    def admitted(self, request: Request) -> None:
        """`request` left the waiting queue to run: its level's virtual time reaches it."""
        tag, level = request.fair_tag, request.priority
        if tag is not None and tag > self._virtual_time.get(level, 0.0):
            self._virtual_time[level] = tag

    def _prune(self) -> None:
        """Forget finishes the virtual time has passed (they no longer push a tag)."""
        self._finish = {
            key: finish for key, finish in self._finish.items()
            if finish > self._virtual_time.get(key[1], 0.0)
        }
        self._prune_at = max(_PRUNE_AT, 2 * len(self._finish))
