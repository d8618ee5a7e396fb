"""The step-cost model: predicted seconds of one engine step from the work it carries.

A step costs `fixed + per_decode x decode rows + per_prefill x prefill tokens +
per_prefill_key x prefill keys + per_decode_key x decode keys + per_chunk x prompt chunks
+ per_chunk_context x their contexts`, where decode rows are the tokens of the step's
decodes (their drafts included), a prefill token at context c reads c keys
(`prompt_keys`), and so does a decode row; a prompt chunk costs something of its own
whatever its size (its attention call per layer, its context's KV read once for all its
tokens, the rows it adds past a tile of the batch: 16 decodes of the default model took
43 ms, with a one-token chunk 50 ms at context 0 and 56 ms at 1,024, where its token and
keys alone would be 1 ms). So the fit learns what a long prompt's
late chunks cost on this device, instead of a fixed exchange rate between a token and its
context, and what the decodes cost as their contexts grow (reading their KV cache is most
of a long decode's step on a CPU: 16 decodes of the default model took 55 ms at context
100 and 90 ms at 800). The engine core reports the time
of each step it ran (`observe`); the coefficients are refitted by least squares over the
last `window` steps, held toward the seed (a ridge prior): so a window of decode-only
steps, which says nothing of the prefill coefficients, leaves them at their seed (and
steps of one batch size, which cannot tell the fixed part from the per-row part, split
them as the seed does). A calibration's timed steps stay in every fit beside the window's
(`reseed`'s anchors): a long prompt computed in one-token chunks while the decodes' contexts
grow gives the window no way to tell a prefill key from a decode key, and a split made by
noise, extrapolated to a larger chunk, held the chunks at one token for 98 s.
Plain Python: a step adds to running sums (O(1)); the small system is solved only when
the fit is read (`cost`) after new steps, so a policy that never plans with it pays for
no solve.
"""

from __future__ import annotations

from collections import deque
from dataclasses import astuple, dataclass

# How much the seed weighs in the fit, in steps' worth of evidence per coefficient: a
# tie-breaker for what the window's steps leave undetermined, not a brake on the data.
PRIOR_STEPS = 0.05
# 1, decode rows, prefill tokens, prefill keys, decode keys, prompt chunks, chunk contexts
NUM_FEATURES = 7


def prompt_keys(start: int, num_tokens: int) -> int:
    """The keys the prompt positions [start, start + num_tokens) attend to before their
    own: position c reads c."""
    return num_tokens * start + num_tokens * (num_tokens - 1) // 2


@dataclass(frozen=True)
class StepCost:
    """Coefficients of the model, in seconds: per step, per decode row, per prefill token,
    per key a prefill token attends to, per key a decode row attends to, per prompt chunk
    and per position of context before a chunk."""

    fixed_s: float
    per_decode_s: float
    per_prefill_s: float
    per_prefill_key_s: float = 0.0
    per_decode_key_s: float = 0.0
    per_chunk_s: float = 0.0
    per_chunk_context_s: float = 0.0

    def predict(self, num_decode_rows: int, prefill_tokens: int = 0,
                prefill_keys: int = 0, decode_keys: int = 0, prefill_chunks: int = 0,
                chunk_context: int = 0) -> float:
        """Predicted seconds of a step with that work."""
        return (self.fixed_s + self.per_decode_s * num_decode_rows
                + self.per_prefill_s * prefill_tokens
                + self.per_prefill_key_s * prefill_keys
                + self.per_decode_key_s * decode_keys
                + self.per_chunk_s * prefill_chunks
                + self.per_chunk_context_s * chunk_context)

    def chunk_s(self, start: int) -> float:
        """The seconds a prompt chunk from position `start` costs whatever its size."""
        return self.per_chunk_s + self.per_chunk_context_s * start

    def prefill_exchange(self) -> tuple[int, float]:
        """The prefill work in the units of the step's budget (scheduler/budget.py
        `prefill_cost`: a token at context c counts 1 + c / k): the k at which one unit
        costs at most the seconds returned, so that `room / seconds` units keep a step
        within `room` seconds whatever the context (k: the context that doubles a
        token's cost)."""
        per_token, per_key = self.per_prefill_s, self.per_prefill_key_s
        if per_key <= 0:
            return 1 << 40, per_token
        k = max(1, int(per_token / per_key))
        return k, max(per_token, per_key * k)

    def as_dict(self) -> dict[str, float]:
        return {"fixed_s": self.fixed_s, "per_decode_s": self.per_decode_s,
                "per_prefill_s": self.per_prefill_s,
                "per_prefill_key_s": self.per_prefill_key_s,
                "per_decode_key_s": self.per_decode_key_s, "per_chunk_s": self.per_chunk_s,
                "per_chunk_context_s": self.per_chunk_context_s}


# A seed for a model the engine knows nothing of: a small model on a CPU (tens of ms a
# step, a decode row and a prefill token of the same order, a token or a decode at
# context 2,048 twice one at 0). Calibration at start and the first steps correct it.
DEFAULT_SEED = StepCost(fixed_s=0.02, per_decode_s=0.001, per_prefill_s=0.0005,
                        per_prefill_key_s=0.0005 / 2048, per_decode_key_s=0.001 / 2048)


class StepCostModel:
    """`cost`: the fit of the steps observed so far (solved when read after new steps).
    `observe(rows, tokens, keys, seconds, decode_keys, chunks, chunk_context)` adds a step
    run."""

    def __init__(self, seed: StepCost = DEFAULT_SEED, window: int = 256) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.seed = seed
        self._cost = seed
        self._stale = False  # steps observed since the last fit
        self.window = window
        self.num_observed = 0
        self._samples: deque[tuple[tuple[float, ...], float]] = deque()
        self._anchors: tuple[tuple[tuple[float, ...], float], ...] = ()
        self._xtx = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        self._xty = [0.0] * NUM_FEATURES

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

    @property
    def steps(self) -> tuple[tuple[tuple[float, ...], float], ...]:
        """The window's steps: each one's features (1, decode rows, prefill tokens,
        prefill keys, decode keys, prompt chunks, chunk contexts) and seconds."""
        return tuple(self._samples)

    def reseed(self, seed: StepCost,
               anchors: tuple[tuple[tuple[float, ...], float], ...] = ()) -> None:
        """Hold the fit toward `seed` from now on and keep `anchors` (a calibration's
        `steps`, whose fit `seed` is) in every fit; `seed` itself while no step was
        observed."""
        self.seed = seed
        self._anchors = anchors
        self._resum()
        if self._samples:
            self._stale = True
        else:
            self.cost = seed

    def observe(self, num_decode_rows: int, prefill_tokens: int, prefill_keys: int,
                seconds: float, decode_keys: int = 0, prefill_chunks: int = 0,
                chunk_context: int = 0) -> None:
        """Add the time of one step with that work (the oldest beyond the window goes); the
        fit follows when next read."""
        if seconds < 0 or not seconds < float("inf"):
            return
        x = (1.0, float(num_decode_rows), float(prefill_tokens), float(prefill_keys),
             float(decode_keys), float(prefill_chunks), float(chunk_context))
        self._accumulate(x, seconds, +1.0)
        self._samples.append((x, seconds))
        if len(self._samples) > self.window:
            old_x, old_y = self._samples.popleft()
            self._accumulate(old_x, old_y, -1.0)
        self.num_observed += 1
        self._stale = True
        if self.num_observed % self.window == 0:
            self._resum()

    def _resum(self) -> None:
        """The sums again from the window's steps (O(window), once a window: O(1) a step).
        NOTE: subtracting the steps that leave leaves rounding behind, on the scale of the
        largest key counts seen (~1e12 squared); a window of decode-only steps after long
        prompts would otherwise fit its prefill coefficients to that residue."""
        self._xtx = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        self._xty = [0.0] * NUM_FEATURES
        for x, y in (*self._anchors, *self._samples):
            self._accumulate(x, y, +1.0)

    def _accumulate(self, x: tuple[float, ...], y: float, sign: float) -> None:
        for i in range(NUM_FEATURES):
            self._xty[i] += sign * x[i] * y
            for j in range(NUM_FEATURES):
                self._xtx[i][j] += sign * x[i] * x[j]

    def _fit(self) -> StepCost:
        """Ridge least squares toward the seed, each coefficient's prior scaled to its
        feature's spread so that the prior counts as PRIOR_STEPS steps of evidence."""
        seed = astuple(self.seed)
        n = len(self._samples) + len(self._anchors)
        a = [row[:] for row in self._xtx]
        b = self._xty[:]
        for i in range(NUM_FEATURES):
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
    free = list(range(len(b)))
    while free:
        sub = _solve([[a[i][j] for j in free] for i in free], [b[i] for i in free])
        if sub is None:
            return None
        theta = [0.0] * len(b)
        for i, value in zip(free, sub, strict=True):
            theta[i] = value
        negative = [i for i in free if theta[i] < 0]
        if not negative:
            return theta
        free = [i for i in free if i not in negative]
    return [0.0] * len(b)


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


class Residuals:
    """The last `window` residuals of one kind of step: the seconds a decode waited for
    it (its time and the engine's between it and the one before) less the model's
    prediction of it when it was planned. `quantile(q)`: their q-quantile, None while
    fewer than `min_count` (too few to say how far the steps stray), and never the
    largest alone: one stall of the machine (a page fault, another process) says nothing
    of how long the next step takes, and shrinking every chunk of the window for it
    cost the long prompt of bench/slo.py --real a minute of TTFT; a second one that
    large within the window sets it."""

    def __init__(self, window: int = 128, min_count: int = 8) -> None:
        if min_count < 2:
            raise ValueError("min_count must be >= 2")
        self._values: deque[float] = deque(maxlen=window)
        self._sorted: list[float] | None = None
        self.min_count = min_count

    def add(self, seconds: float) -> None:
        self._values.append(seconds)
        self._sorted = None

    def quantile(self, q: float) -> float | None:
        if len(self._values) < self.min_count:
            return None
        if self._sorted is None:
            self._sorted = sorted(self._values)
        return self._sorted[min(len(self._sorted) - 2, int(q * len(self._sorted)))]
