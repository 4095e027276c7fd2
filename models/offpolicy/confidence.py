"""Anytime-valid confidence sequences for a policy's gain, from logged decisions.

A promotion decision looks at the log again and again as events arrive, and judges many
candidates. A fixed-sample interval (a bootstrap, a t-interval) is valid at one look; looked
at after every batch it is crossed by chance sooner or later. A *confidence sequence* is a
sequence of intervals that hold at every look at once: with probability ≥ 1 − α the true
value is inside all of them, however long the run and whenever one stops.

The gain of a target policy c over a reference a, Δ = V(c) − V(a), is estimated from one
term per logged decision, the importance-weighted difference with a predictable baseline:

    D_i = (w_c,i − w_a,i)·(u_i − b_{i−1}),      w = P_policy(S_i | x_i) / P_logging(S_i | x_i),

where S_i is the set of memories decision i read and b_{i−1} the mean utility of the decisions
before it. The weights are of *sets* (the utility of a prompt does not depend on the order of
its memories), so no reward model enters and none can bias the estimate: E[D_i | past] = Δ for
any reward (query-dependent, not additive over the memories read) and any logging policy,
also one that itself learns, as long as the logging probabilities are those that drew the
set and the logging policy could draw every set c and a read (E[w] = 1). The baseline does not
change the mean (E[w_c − w_a] = 0) and removes the utility's offset from the variance.

The interval is the asymptotic confidence sequence of Waudby-Smith, Arbour, Sinha, Kennedy &
Ramdas ("Time-uniform central limit theory and asymptotic confidence sequences", Annals of
Statistics 2024, Theorem 2.2): the running mean of the D_i plus or minus

    σ̂_t · √( 2(tρ² + 1)/(t²ρ²) · log(√(tρ² + 1)/α) ),

valid at every t at once as t grows, for terms with finite variance (heavy-tailed utilities
and weights included, as long as their variance is finite), with σ̂_t the running standard
deviation and ρ tuned for the sequence to be tightest near :data:`TUNED_FOR` decisions. Before
:data:`MIN_DECISIONS` decisions no bound is given: the guarantee is asymptotic, and a handful of
decisions with large weights says nothing reliable about its spread.

>>> g = GainSequence(alpha=0.05)
>>> rng = np.random.default_rng(0)
>>> g.update(gain_terms(rng.uniform(0, 2, 2000), np.ones(2000), rng.normal(size=2000)))  # E[w] = 1: no gain
>>> g.low <= 0.0 <= g.high
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TUNED_FOR = 2000  # decisions at which the sequence is tightest (ρ)
MIN_DECISIONS = 200  # no bound before this many decisions
MAX_DECISIONS = 2**53  # a recorded count beyond this is not one (floats count exactly up to here)


def radius(n: int, variance: float, alpha: float, tuned_for: int = TUNED_FOR) -> float:
    """The half-width of the two-sided asymptotic confidence sequence after ``n`` terms.

    >>> round(radius(2000, 1.0, 0.05), 4)  # the fixed-sample 1.96/√2000 is 0.0438
    0.0679
    >>> radius(0, 1.0, 0.05)
    inf
    """
    if n <= 0:
        return math.inf
    log_a = math.log(1.0 / alpha)
    rho2 = (2.0 * log_a + math.log(2.0 * log_a + 1.0)) / tuned_for
    t = float(n)
    return math.sqrt(max(variance, 0.0)) * math.sqrt(
        2.0 * (t * rho2 + 1.0) / (t * t * rho2) * math.log(math.sqrt(t * rho2 + 1.0) / alpha)
    )


@dataclass
class GainSequence:
    """The confidence sequence of a gain V(c) − V(a), updated in batches of logged decisions.

    Parameters
    ----------
    alpha
        The error rate: with probability ≥ 1 − alpha (asymptotically), the gain is inside
        [:attr:`low`, :attr:`high`] at every time.
    """

    alpha: float
    n: int = 0
    total: float = 0.0  # Σ D (the lower bound's terms)
    squares: float = 0.0  # Σ D²
    total_high: float = 0.0  # the upper bound's terms, where they differ (see update)
    squares_high: float = 0.0
    low: float = -math.inf
    high: float = math.inf

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), not {self.alpha!r}")

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    def update(self, terms: np.ndarray, terms_high: np.ndarray | None = None) -> None:
        """Take a batch of per-decision gain terms (:func:`gain_terms`), in the order they were
        logged; ``terms_high``, where given, are the upper bound's (terms whose mean is at least
        the gain, where ``terms``' mean is at most it: what the log cannot show of a policy
        valued pessimistically for one bound and optimistically for the other). Non-finite terms
        raise ``ValueError``."""
        d = np.asarray(terms, np.float64).reshape(-1)
        h = d if terms_high is None else np.asarray(terms_high, np.float64).reshape(-1)
        if d.size == 0:
            return
        if h.shape != d.shape:
            raise ValueError("the two bounds' terms differ in length")
        if not (np.isfinite(d).all() and np.isfinite(h).all()):
            raise ValueError("gain terms must be finite")
        self.total += float(d.sum())
        self.squares += float((d * d).sum())
        self.total_high += float(h.sum())
        self.squares_high += float((h * h).sum())
        self.n += int(d.size)
        if self.n >= MIN_DECISIONS:
            low, high = self.total / self.n, self.total_high / self.n
            r_low = radius(self.n, self.squares / self.n - low * low, self.alpha)
            r_high = radius(self.n, self.squares_high / self.n - high * high, self.alpha)
            # The running intersection: each bound only ever tightens (itself a valid sequence).
            self.low, self.high = max(self.low, low - r_low), min(self.high, high + r_high)

    def record(self) -> dict[str, float] | None:
        """The sequence as a JSON object, to go on from where it stands (:meth:`restore`); None
        before it has bounds (nothing worth keeping).

        >>> s = GainSequence(0.01)
        >>> s.update(np.tile([0.1, 0.3], 150))
        >>> GainSequence.restore(s.record()) == s
        True
        """
        if self.n < MIN_DECISIONS or not (math.isfinite(self.low) and math.isfinite(self.high)):
            return None
        return {k: float(v) for k, v in vars(self).items()}

    @classmethod
    def restore(cls, record: object) -> GainSequence | None:
        """A sequence from :meth:`record`'s object, or None where it is not one (a field missing,
        not finite, or bounds that do not hold together). An anytime-valid sequence may be
        continued after any pause: its error rate was spent when it started."""
        if not isinstance(record, dict) or set(record) != {f for f in cls.__dataclass_fields__}:
            return None
        values = record.values()
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            return None
        n = record["n"]
        if n != int(n) or not MIN_DECISIONS <= n <= MAX_DECISIONS or not 0.0 < record["alpha"] < 1.0:
            return None
        if record["low"] > record["high"]:
            return None
        if record["squares"] < 0.0 or record["squares_high"] < 0.0:
            return None
        floats = {k: float(v) for k, v in record.items() if k not in ("alpha", "n")}
        return cls(float(record["alpha"]), int(n), **floats)


def gain_terms(w_target: np.ndarray, w_reference: np.ndarray, utility: np.ndarray) -> np.ndarray:
    """D_i = (w_c − w_a)·(u_i − b_{i−1}), b the mean utility of the decisions before i (0 for the first).

    >>> gain_terms(np.array([2.0, 0.0]), np.array([1.0, 1.0]), np.array([1.0, 3.0])).tolist()
    [1.0, -2.0]
    """
    u = np.asarray(utility, np.float64)
    seen = np.arange(u.size, dtype=np.float64)
    before = np.concatenate([[0.0], np.cumsum(u)[:-1]])
    baseline = np.divide(before, seen, out=np.zeros(u.size), where=seen > 0)
    out: np.ndarray = (np.asarray(w_target) - np.asarray(w_reference)) * (u - baseline)
    return out


def spend(j: int, delta: float) -> float:
    """The error rate of the ``j``-th test of a run (1-based): δ/(j·(j+1)), summing to δ over all tests.

    >>> round(sum(spend(j, 0.05) for j in range(1, 10**5)), 4)
    0.05
    """
    if j < 1:
        raise ValueError("tests are counted from 1")
    return delta / (j * (j + 1))
