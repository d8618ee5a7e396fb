"""Planning against latency targets (`--scheduling-policy slo`): the scheduler's share.

`SloPlanner` holds the step-cost model (scheduler/step_cost.py) and answers, from it,
the questions the slo policy asks of a step (docs/scheduling.md gives the reasons):

  - a waiting request's latest start: its TTFT deadline less the predicted step of its
    whole prompt (the waiting queue orders a level by it, least slack first, and serves
    those past it after the others: scheduler/request_queue.py `SloRequestQueue`); the
    step's prefill work (running chunks and admissions) goes in the same order;
  - the decodes that sit the step out: worse ones without a `tpot_s`, while a better
    prompt can still have its first token on time;
  - the prefill room beside the step's decodes: the prefill cost that keeps the
    predicted step, plus its margin, within the tightest `tpot_s` among them, at the
    fitted exchange between a token and its context (`num_steps_over_tpot` counts the
    steps where no size can: the decodes alone are over, or leave no room for a token
    beside them). The margin is a high quantile (PLAN_QUANTILE) of how far recent steps
    of the same kind (with prefill or decode-only) strayed from their prediction, as a
    decode saw them (the engine's time between steps included), and at least
    1 - PLAN_SHARE of the target: the fit gives the mean step, the target binds its tail;
  - the draft room of a decode: drafts of a worse priority only while the predicted
    step, plus its margin, stays within the tightest `tpot_s` among the better ones'
    decodes;
  - the victim among equals: the request with the most slack.

Every policy observes the steps' times (`observe`, from the engine core) and shows the
fit at /scheduler/state; only the slo policy plans with it, so only it solves the fit
every step (the others when the state or the stats are read) and keeps the residuals of
the steps it planned. The engine core may seed it from a calibration at start
(`calibrated`: engine/calibration.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from scheduler.budget import StepBudget
from scheduler.request import Request
from scheduler.step_cost import Residuals, StepCost, StepCostModel, prompt_keys

# The most of the tightest TPOT target a step is planned to, whatever its residuals say:
# a step planned to the target exactly overruns it half the time, and the steps of the
# default model on two CPU cores stray by 10-15% of a 100 ms target (planned to 90%, the
# gap p99 of bench/slo.py --real was 100-112 ms; to 85%, 90-94 ms).
PLAN_SHARE = 0.85
# How a step's prefill work may grow past the last one whose decodes were on time, and
# shrink after one that was not, staying below that for PREFILL_CEILING_STEPS such steps: the
# fit is linear and the device is not (beside 16 decodes of the default model, a chunk of
# 48 tokens took 84 ms and one of 49 took 106: oneDNN runs 65 rows as 96), so the planner
# feels its way up to the target as TCP does a link's capacity, and does not probe the
# cliff it found again each step.
PREFILL_GROWTH = 1.25
PREFILL_SHRINK = 0.75
PREFILL_CEILING_STEPS = 128
# The quantile of the residuals a step is planned to: the inter-token p99 is the figure
# a tpot target is held to, and the window's 2nd largest of 128 is about its 99th.
PLAN_QUANTILE = 0.99


@dataclass
class StepWork:
    """The work of one scheduled step, as the cost model counts it."""

    num_decode_rows: int = 0
    prefill_tokens: int = 0
    prefill_keys: int = 0  # the keys its prefill tokens attend to (step_cost.prompt_keys)
    decode_keys: int = 0  # the keys its decode rows attend to: their contexts
    prefill_chunks: int = 0  # the prompts it computes positions of
    chunk_context: int = 0  # the positions before each one's first in this step

    def add_prefill(self, start: int, num_tokens: int) -> None:
        """Prompt positions [start, start + num_tokens) computed in this step."""
        self.prefill_tokens += num_tokens
        self.prefill_keys += prompt_keys(start, num_tokens)
        self.prefill_chunks += 1
        self.chunk_context += start

    def seconds(self, cost: StepCost) -> float:
        """The step's predicted time under `cost`."""
        return cost.predict(self.num_decode_rows, self.prefill_tokens, self.prefill_keys,
                            self.decode_keys, self.prefill_chunks, self.chunk_context)

    def observed(self, model: StepCostModel, seconds: float) -> None:
        """A step of this work took `seconds`: one more sample for `model`'s fit."""
        model.observe(self.num_decode_rows, self.prefill_tokens, self.prefill_keys, seconds,
                      self.decode_keys, self.prefill_chunks, self.chunk_context)


def work_of(step: StepBudget, requests: dict[str, Request]) -> StepWork:
    """A scheduled step's work as the cost model counts it (before the requests'
    progress advances by it)."""
    work = StepWork()
    for request_id, num_new in step.num_scheduled_tokens.items():
        if request_id in step.decode_ids:
            work.num_decode_rows += num_new
            work.decode_keys += requests[request_id].num_computed_tokens + num_new
        else:
            work.add_prefill(requests[request_id].num_computed_tokens, num_new)
    return work


def prompt_left(request: Request) -> StepWork:
    """The prefill work of what is left of `request`'s prompt, as one step."""
    work = StepWork()
    start = request.num_computed_tokens
    work.add_prefill(start, max(request.num_prompt_tokens - start, 0))
    return work


class SloPlanner:
    """The cost model and the slo policy's per-step rules."""

    def __init__(self, seed: StepCost) -> None:
        self.model = StepCostModel(seed)
        self.num_steps_over_tpot = 0
        self.num_rejected_late = 0
        self.calibration_s: float | None = None  # the calibration at start took (None: none)
        # observed less predicted seconds of the steps planned, by whether they had prefill
        self.residuals = {False: Residuals(), True: Residuals()}
        self._planned: StepCost | None = None  # the fit this step was planned with
        # the most prefill seconds (predicted) a step beside decodes may carry, from the
        # last such step's (None: none seen yet), and below the last late one's, for
        # PREFILL_CEILING_STEPS steps with prefill after it (the steps left)
        self._prefill_allowed_s: float | None = None
        self._prefill_ceiling_s = math.inf
        self._ceiling_steps_left = 0
        # This step's decodes' tightest tpot_s, in all and of each better priority.
        self._tightest: float | None = None
        self._bounds: list[tuple[int, float]] = []  # (priority, tightest of those before)

    @property
    def cost(self) -> StepCost:
        return self.model.cost

    def calibrated(self, calibration: StepCostModel, seconds: float) -> None:
        """The engine core timed `calibration`'s steps at start, in `seconds`: plan from
        its fit, and keep its steps in every fit."""
        self.model.reseed(calibration.cost, calibration.steps)
        self.calibration_s = seconds

    def observe(self, work: StepWork, seconds: float, gap_s: float | None = None) -> None:
        """A step with `work` ran in `seconds` and ended `gap_s` after the step before it
        (None: not straight after one): refit; a step sized against a target adds its
        residual, the gap (its time when unknown) less what it was planned to take."""
        if self._planned is not None:
            waited = seconds if gap_s is None else gap_s
            planned_s = work.seconds(self._planned)
            self.residuals[work.prefill_tokens > 0].add(waited - planned_s)
            if work.prefill_tokens and self._tightest is not None:
                decodes = StepWork(work.num_decode_rows, decode_keys=work.decode_keys)
                self._feel_prefill(planned_s - decodes.seconds(self._planned),
                                   waited <= self._tightest)
            self._planned = None
        work.observed(self.model, seconds)

    def _feel_prefill(self, prefill_s: float, on_time: bool) -> None:
        """A step beside decodes carried `prefill_s` of prefill (as planned): let the next
        one carry PREFILL_GROWTH times that if its decodes were on time (no more than the
        ceiling), else PREFILL_SHRINK times it, the ceiling for the next
        PREFILL_CEILING_STEPS on time."""
        if not on_time:
            self._prefill_allowed_s = self._prefill_ceiling_s = PREFILL_SHRINK * prefill_s
            self._ceiling_steps_left = PREFILL_CEILING_STEPS
            return
        self._ceiling_steps_left -= 1
        if self._ceiling_steps_left <= 0:
            self._prefill_ceiling_s = math.inf
        grown = min(PREFILL_GROWTH * prefill_s, self._prefill_ceiling_s)
        if self._prefill_allowed_s is None or self._prefill_allowed_s < grown:
            self._prefill_allowed_s = grown

    def margin(self, target: float, with_prefill: bool) -> float:
        """The seconds of `target` a step (`with_prefill` or not) is planned to leave for
        its error: the PLAN_QUANTILE of its kind's residuals (a step with prefill: the
        decode-only steps' while too few with prefill were seen), at least
        1 - PLAN_SHARE of the target."""
        floor = (1 - PLAN_SHARE) * target
        quantile = self.residuals[True].quantile(PLAN_QUANTILE) if with_prefill else None
        if quantile is None:
            quantile = self.residuals[False].quantile(PLAN_QUANTILE)
        return floor if quantile is None else max(floor, quantile)

    def latest_start(self, request: Request) -> float:
        """When `request` must start its prompt to have its first token on time
        (+inf without a TTFT target)."""
        deadline = request.placement.ttft_deadline
        if deadline is None:
            return math.inf
        work = StepWork()
        work.add_prefill(0, request.num_prompt_tokens)
        return deadline - work.seconds(self.cost)

    def begin_step(self, decodes: Sequence[Request]) -> None:
        """Note this step's decodes (in priority order) for the rooms below."""
        self._tightest = None
        self._bounds = []
        self._planned = None
        last_priority: int | None = None
        for request in decodes:
            tpot = request.placement.tpot_s
            if request.priority != last_priority:
                if self._tightest is not None:
                    self._bounds.append((request.priority, self._tightest))
                last_priority = request.priority
            if tpot is not None and (self._tightest is None or tpot < self._tightest):
                self._tightest = tpot

    def size_prefills(self, step: StepBudget, decodes: StepWork, cap: int | None
                      ) -> int | None:
        """The prefill cost `step` may carry beside its decodes (their work: `decodes`,
        drafts included): what keeps the predicted
        step plus its `margin` within the tightest tpot_s among them, in place of `cap`
        (the fixed factor of the batch other policies use, kept when no decode has a
        target), counted at the fitted exchange between a token and its context
        (`step.attention_cost_context`), each chunk charged its own cost besides
        (`step.chunk_units`). When no size can, the step is counted over: if
        the decodes alone are predicted over the target it takes `cap` (one token without
        one), so that prompts still progress at the rate other policies give them; if
        only the margin leaves no room, the smallest chunk (one token)."""
        if self._tightest is None:
            return cap
        cost = self._planned = self.cost
        decodes_s = decodes.seconds(cost)
        spare = self._tightest - self.margin(self._tightest, True) - decodes_s
        context, unit_s = cost.prefill_exchange()
        if unit_s > 0:
            allowed_s = self._prefill_allowed_s
            if allowed_s is None:  # no step with prefill seen: no more than other policies
                allowed_s = math.inf if cap is None else cap * unit_s
            room = min(spare, allowed_s) / unit_s
            # NOTE: a unit more a chunk: prefill_cost rounds each chunk's context part down
            chunk_units = cost.per_chunk_s / unit_s + 1
        else:
            room, chunk_units = (math.inf if spare >= 0 else -1.0), 0.0
        if room < 1 + chunk_units:
            self.num_steps_over_tpot += 1
            if decodes_s > self._tightest:
                return 1 if cap is None else cap
        step.attention_cost_context = context
        if unit_s > 0:
            step.chunk_units, step.chunk_context_units = (
                chunk_units, cost.per_chunk_context_s / unit_s)
        step.whole_prompt_slack = 1.0  # NOTE: the room is a target, not a rule of thumb
        return max(1, int(min(room, 1 << 40)))

    def draft_room(self, request: Request, work: StepWork) -> int:
        """The draft tokens `request`'s decode may add to a step with `work` while the
        predicted step plus its margin stays within the tightest tpot_s of better
        priorities' decodes."""
        bound = self._bound_for(request.priority)
        if bound is None:
            return 1 << 30
        spare = bound - self.margin(bound, work.prefill_tokens > 0) - work.seconds(self.cost)
        per_row = self.cost.per_decode_s
        if spare <= 0:
            return 0
        return 1 << 30 if per_row <= 0 else int(spare / per_row)

    def _bound_for(self, priority: int) -> float | None:
        bound = None
        for level, tightest in self._bounds:
            if level > priority:
                break
            bound = tightest
        return bound

    def prefill_key(self, request: Request, now: float) -> tuple[int, int, float, float]:
        """The order of prefill work (a running prompt's next chunk, a waiting request's
        admission) within the step: priority, then those whose first token can still be
        on time by their TTFT deadline, then the late ones by arrival."""
        deadline = request.placement.ttft_deadline
        if deadline is None or request.first_token_time is not None:
            return (request.priority, 0, math.inf, request.arrival_time)
        if not self._can_be_on_time(request, now):
            return (request.priority, 1, request.arrival_time, request.arrival_time)
        return (request.priority, 0, deadline, request.arrival_time)

    def sits_out(self, prompts: Iterable[Request], now: float) -> Callable[[Request], bool]:
        """Whether a decode sits this step out: one without a tpot target, of a worse
        priority than one of `prompts` (the running chunks, the waiting head) whose first
        token can still be on time. Its row is prefill room for that prompt within the
        step's tpot budget (as a worse draft's is); it keeps its blocks and decodes again
        once no such prompt waits (NOTE: measured on bench/slo.py at 1x-2x capacity:
        interactive TTFT attainment +5-20 points, goodput +5-10%)."""
        urgent = min((r.priority for r in prompts if self._can_be_on_time(r, now)),
                     default=None)
        if urgent is None:
            return lambda request: False
        return lambda request: request.priority > urgent and request.placement.tpot_s is None

    def _can_be_on_time(self, request: Request, now: float) -> bool:
        """Whether `request`'s first token is still to come and can be by its deadline."""
        deadline = request.placement.ttft_deadline
        return (deadline is not None and request.first_token_time is None
                and now + prompt_left(request).seconds(self.cost) <= deadline)

    def pick_victim(self, requests: Iterable[Request], now: float) -> Request:
        """The victim: the worst priority, and among equals the one with the most slack."""
        return max(requests, key=lambda r: (r.priority, slack(r, now), r.arrival_time))


def slack(request: Request, now: float) -> float:
    """Seconds `request` may lose and still meet its targets: to its TTFT deadline before
    its first token, then to the time its tokens so far are due at tpot_s each (+inf
    without the target concerned)."""
    placement = request.placement
    if request.first_token_time is None:
        deadline = placement.ttft_deadline
        return math.inf if deadline is None else deadline - now
    if placement.tpot_s is None:
        return math.inf
    due = request.first_token_time + placement.tpot_s * request.num_output_tokens
    return due - now
