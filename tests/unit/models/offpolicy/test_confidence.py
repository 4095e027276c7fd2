"""The anytime-valid gain sequences: coverage at every look, on logs like the gate's."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.offpolicy.confidence import MIN_DECISIONS, GainSequence, gain_terms, radius, spend

# A context's sets: near-greedy logging (the serving policy at a low T with some exploration),
# a target that moves mass to other sets, similarity-only's top-k set, heavy-tailed utilities.
LOGGING = np.array([0.9, 0.04, 0.03, 0.02, 0.01])
TARGET = np.array([0.4, 0.3, 0.1, 0.1, 0.1])
TOPK = np.array([1.0, 0.0, 0.0, 0.0, 0.0])
MEANS = np.array([0.2, 0.5, -0.5, 0.1, 0.0])


def _log(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    s = rng.choice(len(LOGGING), size=n, p=LOGGING)
    return s, MEANS[s] + 0.5 * rng.standard_t(3, n) + 3.0  # an offset the baseline must remove


def test_gain_sequences_hold_at_every_look() -> None:
    """Over 200 runs of 25 looks each, the truth leaves the sequence in at most ~α of runs."""
    rng = np.random.default_rng(0)
    truth = float((TARGET - TOPK) @ MEANS)
    crossed = 0
    for _ in range(200):
        g = GainSequence(0.05)
        for _ in range(25):
            s, u = _log(rng, 200)
            g.update(gain_terms(TARGET[s] / LOGGING[s], TOPK[s] / LOGGING[s], u))
            if not g.low <= truth <= g.high:
                crossed += 1
                break
    assert crossed <= 20  # 5% of 200 is 10; a binomial tail of 20 has probability < 0.005


def test_sequences_decide_a_clear_gain_and_stay_around_zero_for_none() -> None:
    rng = np.random.default_rng(1)
    better, same = GainSequence(0.01), GainSequence(0.01)
    for _ in range(10):
        s, u = _log(rng, 500)
        better.update(gain_terms(TARGET[s] / LOGGING[s], np.ones(len(s)), u - 0.4 * (s == 0)))  # truth +0.22
        same.update(gain_terms(np.ones(len(s)), np.ones(len(s)), u))
    assert better.low > 0.0
    assert same.low <= 0.0 <= same.high and same.high - same.low < 1e-9  # identical policies: D = 0


def test_no_bound_before_enough_decisions_and_bounds_only_tighten() -> None:
    g = GainSequence(0.05)
    rng = np.random.default_rng(2)
    g.update(rng.normal(size=MIN_DECISIONS - 1))
    assert (g.low, g.high) == (-math.inf, math.inf)
    widths = []
    for _ in range(10):
        g.update(gain_terms(rng.exponential(1.0, 300), np.ones(300), rng.normal(size=300)))
        widths.append(g.high - g.low)
    assert widths == sorted(widths, reverse=True)


def test_bad_input_is_refused() -> None:
    g = GainSequence(0.05)
    for terms in ([np.inf], [np.nan, 1.0]):
        with pytest.raises(ValueError):
            g.update(np.array(terms))
    assert g.n == 0
    with pytest.raises(ValueError):
        GainSequence(1.0)


def test_radius_shrinks_like_a_confidence_sequence() -> None:
    assert radius(10**6, 1.0, 0.05) < radius(10**4, 1.0, 0.05) < radius(10**2, 1.0, 0.05)
    # Valid at every look costs a log factor over one look, not more.
    assert 1.0 < radius(2000, 1.0, 0.05) / (1.96 / math.sqrt(2000)) < 2.0


def test_spending_sums_to_delta() -> None:
    assert sum(spend(j, 0.1) for j in range(1, 2000)) < 0.1
    assert spend(1, 0.1) == pytest.approx(0.05)
    with pytest.raises(ValueError):
        spend(0, 0.1)


FIELDS = ("alpha", "n", "total", "squares", "total_high", "squares_high", "low", "high")
JSON = st.one_of(st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.floats(allow_nan=True), st.text(max_size=4))


NUMBER = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**64), 2**64)
# Every field, any number, most often in range: a sequence as often as not.
PLAUSIBLE = {
    "alpha": st.floats(0.0, 1.0),
    "n": st.integers(0, 2**60),
    "squares": st.floats(0.0),
    "squares_high": st.floats(0.0),
}
WHOLE = st.fixed_dictionaries({f: PLAUSIBLE.get(f, st.floats()) | NUMBER for f in FIELDS})


@given(WHOLE | st.dictionaries(st.sampled_from(FIELDS), JSON) | JSON | st.lists(JSON, max_size=3))
@settings(max_examples=400, deadline=None)
def test_a_recorded_sequence_read_back_is_a_sequence_or_nothing(record: object) -> None:
    """A record comes from a manifest on the model topic: whatever it holds, reading it back
    gives a sequence that takes further terms and keeps finite bounds that hold together, or
    None; never an error."""
    s = GainSequence.restore(record)
    if s is not None:
        assert 0.0 < s.alpha < 1.0 and s.n >= MIN_DECISIONS and s.low <= s.high
        s.update(np.zeros(3))
        assert math.isfinite(s.low) and math.isfinite(s.high)


def test_a_sequence_goes_on_after_its_record_is_read_back() -> None:
    """Recorded and read back, a sequence takes later terms exactly as the original does."""
    rng = np.random.default_rng(3)
    first, later = rng.normal(0.1, 1.0, 500), rng.normal(0.1, 1.0, 300)
    kept = GainSequence(0.01)
    kept.update(first)
    record = kept.record()
    assert record is not None and GainSequence(0.01).record() is None  # nothing before bounds
    again = GainSequence.restore(record)
    assert again is not None
    assert GainSequence.restore({**record, "n": 1e300}) is None  # its radius would overflow to 0
    kept.update(later)
    again.update(later)
    assert again == kept
