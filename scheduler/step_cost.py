"""The step-cost model: predicted seconds of one engine step from the work it carries.

A step costs `fixed + per_decode x decode rows + per_prefill x prefill cost`, where
decode rows are the tokens of the step's decodes (their drafts included) and prefill
cost is the weighted prefill tokens of scheduler/budget.py (`prefill_cost`: a position
at context c counts 1 + c / attention_cost_context). The engine core reports the time
of each step it ran (`observe`); the coefficients are refitted by least squares over the
last `window` steps, held toward the seed (a ridge prior): so a window of decode-only
steps, which says nothing of the prefill coefficient, leaves that one at its seed (and
steps of one batch size, which cannot tell the fixed part from the per-row part, split
them as the seed does). Plain Python: a step adds to running sums (O(1)); the small
system is solved only when the fit is read (`cost`) after new steps, so a policy that
never plans with it pays for no solve.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# How much the seed weighs in the fit, in steps' worth of evidence per coefficient: a
# tie-breaker for what the window's steps leave undetermined, not a brake on the data.
PRIOR_STEPS = 0.05


@dataclass(frozen=True)
class StepCost:
    """Coefficients of the model, in seconds: per step, per decode row, per unit of
    prefill cost."""

    fixed_s: float
    per_decode_s: float
    per_prefill_s: float

    def predict(self, num_decode_rows: int, prefill_cost: float) -> float:
        """Predicted seconds of a step with that work."""
        return (self.fixed_s + self.per_decode_s * num_decode_rows
                + self.per_prefill_s * prefill_cost)

    def prefill_room(self, target_s: float, num_decode_rows: int) -> float:
        """The most prefill cost a step with `num_decode_rows` may carry and still take at
        most `target_s` (negative: not even the decodes fit)."""
        spare = target_s - self.fixed_s - self.per_decode_s * num_decode_rows
        if self.per_prefill_s <= 0:
            return float("inf") if spare >= 0 else -1.0
        return spare / self.per_prefill_s

    def as_dict(self) -> dict[str, float]:
        return {"fixed_s": self.fixed_s, "per_decode_s": self.per_decode_s,
                "per_prefill_s": self.per_prefill_s}


# A seed for a model the engine knows nothing of: a small model on a CPU (tens of ms a
# step, a decode row and a prefill token of the same order). The first steps correct it.
DEFAULT_SEED = StepCost(fixed_s=0.02, per_decode_s=0.001, per_prefill_s=0.0005)


class StepCostModel:
    """`cost`: the fit of the steps observed so far (solved when read after new steps).
    `observe(rows, prefill, seconds)` adds a step run."""

    def __init__(self, seed: StepCost = DEFAULT_SEED, window: int = 256) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.seed = seed
        self._cost = seed
        self._stale = False  # steps observed since the last fit
        self.window = window
        self.num_observed = 0
        self._samples: deque[tuple[tuple[float, float, float], float]] = deque()
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3

    @property
    def cost(self) -> StepCost:
        """The coefficients fitted to the window's steps (the seed before any)."""
        if self._stale:
            self._cost = self._fit()
            self._stale = False
        return self._cost

    @cost.setter
    def cost(self, cost: StepCost) -> None:
        """Coefficients to plan with until the next step observed (tests, calibration)."""
        self._cost = cost
        self._stale = False

    def observe(self, num_decode_rows: int, prefill_cost: float, seconds: float) -> None:
        """Add the time of one step with that work (the oldest beyond the window goes); the
        fit follows when next read."""
        if seconds < 0 or not seconds < float("inf"):
            return
        x = (1.0, float(num_decode_rows), float(prefill_cost))
        self._accumulate(x, seconds, +1.0)
        self._samples.append((x, seconds))
        if len(self._samples) > self.window:
            old_x, old_y = self._samples.popleft()
            self._accumulate(old_x, old_y, -1.0)
        self.num_observed += 1
        self._stale = True

    def _accumulate(self, x: tuple[float, float, float], y: float, sign: float) -> None:
        for i in range(3):
            self._xty[i] += sign * x[i] * y
            for j in range(3):
                self._xtx[i][j] += sign * x[i] * x[j]

    def _fit(self) -> StepCost:
        """Ridge least squares toward the seed, each coefficient's prior scaled to its
        feature's spread so that the prior counts as PRIOR_STEPS steps of evidence."""
        seed = (self.seed.fixed_s, self.seed.per_decode_s, self.seed.per_prefill_s)
        n = len(self._samples)
        a = [row[:] for row in self._xtx]
        b = self._xty[:]
        for i in range(3):
            # NOTE: the feature's variance, not its mean square: a row count is never far
            # from its mean, and a prior on its scale would outweigh the data's spread.
            variance = a[i][i] / n - (a[0][i] / n) ** 2
            lam = PRIOR_STEPS * (1.0 if i == 0 else max(variance, 1.0))
            a[i][i] += lam
            b[i] += lam * seed[i]
        theta = _nonnegative(a, b)
        if theta is None:
            return self._cost
        return StepCost(*theta)


def _nonnegative(a: list[list[float]], b: list[float]) -> list[float] | None:
    """The least-squares coefficients of the normal equations `a x = b` with none below 0:
    a coefficient that comes out negative is held at 0 and the others refitted without it
    (NOTE: clipping it alone would leave the others fitted around the negative value: a
    window of one batch size, whose fixed part and per-row part trade off freely, then
    predicted its own steps 5x too long)."""
    free = [0, 1, 2]
    while free:
        sub = _solve([[a[i][j] for j in free] for i in free], [b[i] for i in free])
        if sub is None:
            return None
        theta = [0.0, 0.0, 0.0]
        for i, value in zip(free, sub, strict=True):
            theta[i] = value
        negative = [i for i in free if theta[i] < 0]
        if not negative:
            return theta
        free = [i for i in free if i not in negative]
    return [0.0, 0.0, 0.0]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """The solution of a small linear system by Gaussian elimination with partial
    pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
