"""Memory health score (seed 000 §6.1): one number an operator can act on.

Four signals, each mapped to [0, 1]:

- correlation s_c = clip(ρ / 0.8, 0, 1): U_query agrees with human judgement (the seed
  reports ρ ≈ 0.8 on a healthy system); 0.5 while too few pairs are known;
- utility s_u = share of recent steps whose memories did not hurt (u ≥ 0);
- intervention s_i = 1 − clip((r_i − 0.5) / 0.5, 0, 1): dropping most candidates means
  the memory bank rarely has what queries need;
- fallback s_f = 1 − clip(r_f / 0.05, 0, 1): more than 5% fallbacks is a failing policy.

``score = 100 · (0.35 s_c + 0.35 s_u + 0.15 s_i + 0.15 s_f)``, banded as in the seed:
≥ 90 efficient, 70–90 healthy, 50–70 warning, < 50 critical.

>>> health_score(correlation=0.8, pairs=100, min_pairs=50, nonnegative_share=1.0,
...              intervention_rate=0.2, fallback_rate=0.0)
(100.0, 'efficient')
"""

from __future__ import annotations


def _clip(x: float) -> float:
    return max(0.0, min(1.0, x))


def band(score: float) -> str:
    if score >= 90:
        return "efficient"
    if score >= 70:
        return "healthy"
    if score >= 50:
        return "warning"
    return "critical"


def health_score(
    correlation: float,
    pairs: int,
    min_pairs: int,
    nonnegative_share: float,
    intervention_rate: float,
    fallback_rate: float,
) -> tuple[float, str]:
    s_c = _clip(correlation / 0.8) if pairs >= min_pairs else 0.5
    s_u = _clip(nonnegative_share)
    s_i = 1.0 - _clip((intervention_rate - 0.5) / 0.5)
    s_f = 1.0 - _clip(fallback_rate / 0.05)
    score = round(100.0 * (0.35 * s_c + 0.35 * s_u + 0.15 * s_i + 0.15 * s_f), 2)
    return score, band(score)
