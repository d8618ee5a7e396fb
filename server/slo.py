"""A request's latency targets: the `slo` field, its defaults, and the check at the door.

A request may carry `"slo": {"ttft_ms": 500, "tpot_ms": 80, "on_miss": "reject"}`
(each part optional) beside `priority`; its tenant (the tenants file's `slo`) and the
server (`--default-slo-ttft-ms`, `--default-slo-tpot-ms`) give the parts it leaves out,
in that order. The targets travel in the request's `Placement` (`ttft_deadline` on the
monotonic clock, `tpot_s`, `reject_late`); under `--scheduling-policy slo` the scheduler
plans against them (scheduler/slo.py), and under every policy the metrics count each
target met or missed. A request asking `on_miss: "reject"` whose first token the step-cost
model predicts cannot be on time even if it went next is refused at the door with 503 and
Retry-After (before tokenization, holding nothing), and one that turns late while it
waits is refused the same way by the scheduler.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from server.request_fields import JsonInt

MAX_TARGET_MS = 3_600_000  # an hour: a target beyond it is no latency target


class SloTargets(BaseModel):
    """The `slo` object of a request or a tenant: ttft_ms (arrival to first token),
    tpot_ms (between tokens after it), on_miss ("serve" late, or "reject" with 503)."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: JsonInt | None = Field(default=None, ge=1, le=MAX_TARGET_MS)
    tpot_ms: JsonInt | None = Field(default=None, ge=1, le=MAX_TARGET_MS)
    on_miss: Literal["serve", "reject"] | None = None


@dataclass(frozen=True)
class ResolvedSlo:
    """The targets a request is held to, each part from the first of request, tenant
    and server that gives it."""

    ttft_ms: int | None = None
    tpot_ms: int | None = None
    reject_late: bool = False

    def ttft_deadline(self, arrival: float) -> float | None:
        """When the first token is due, on the clock of `arrival`."""
        return None if self.ttft_ms is None else arrival + self.ttft_ms / 1000.0

    @property
    def tpot_s(self) -> float | None:
        return None if self.tpot_ms is None else self.tpot_ms / 1000.0


def add_slo_arguments(parser: argparse.ArgumentParser) -> None:
    """The latency-target flags of `pagedserve serve`."""
    slo = parser.add_argument_group("latency targets")
    slo.add_argument("--default-slo-ttft-ms", type=int, default=None, metavar="MS",
                     help="time-to-first-token target of requests that give none")
    slo.add_argument("--default-slo-tpot-ms", type=int, default=None, metavar="MS",
                     help="time-per-output-token target of requests that give none")
    slo.add_argument("--calibrate-step-cost", action=argparse.BooleanOptionalAction,
                     default=None, help="time a few steps at start to seed the step-cost "
                     "model (default: with --scheduling-policy slo, which plans with it)")


def resolve_slo(request: SloTargets | None, tenant: SloTargets | None,
                default_ttft_ms: int | None, default_tpot_ms: int | None) -> ResolvedSlo:
    """Each target from the request, else its tenant, else the server's default."""
    layers = [s for s in (request, tenant) if s is not None]
    ttft = next((s.ttft_ms for s in layers if s.ttft_ms is not None), default_ttft_ms)
    tpot = next((s.tpot_ms for s in layers if s.tpot_ms is not None), default_tpot_ms)
    on_miss = next((s.on_miss for s in layers if s.on_miss is not None), "serve")
    return ResolvedSlo(ttft, tpot, on_miss == "reject" and ttft is not None)


def misses_at_the_door(slo: ResolvedSlo, soonest_first_token_s: float) -> bool:
    """Whether a request refused when late cannot have its first token on time even if
    it went next (`soonest_first_token_s`: the engine's predicted step with it)."""
    return slo.reject_late and slo.ttft_ms is not None and (
        soonest_first_token_s * 1000.0 > slo.ttft_ms)
