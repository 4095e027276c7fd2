"""Shadow mode: keep serving the incumbent ranking while the policy learns from logged exploration.

A team that adopts the pipeline already has a retriever it trusts (the *incumbent*). In
shadow mode the adapters (docs/byo-retriever.md) serve the incumbent's top k as before,
except for a small budget of requests (``explore_rate``, 5% by default) served in a
uniformly random order over the incumbent's candidates, with the *true* propensity of
that order as the event's ``logprob`` (an ordered draw of k of n: log((n−k)!/n!)). The
learner learns off-policy from those events, and ``causalmem evaluate --shadow``
(:mod:`pipeline.policy_evaluation.shadow`) estimates the policy's gain over the incumbent from
them. Requests served by the incumbent are logged as ``fallback`` events (a different
retriever served them): they carry utility to the metrics, never to the gradient or to the
estimates, whose weights would be biased by a deterministic logging policy.

The cut-over: when the gain's lower bound stays above 0 for the configured period, the
operator side sends a ``cutover`` control event; the learner answers with a checkpoint of
reason ``cutover``. :meth:`ShadowMode.observe` sees that checkpoint (pass it the policies
of ``PolicySubscriber``) and from then on the policy serves. The mode is kept in a small
JSON file when a path is given, so a restarted service does not fall back to shadow.

>>> import numpy as np
>>> mode = ShadowMode(explore_rate=0.0)
>>> mode.mode, mode.decide(np.random.default_rng(0))
('shadow', 'incumbent')
>>> pos, lp = uniform_draw(3, 2, np.random.default_rng(0))
>>> len(set(pos)), round(float(np.exp(lp)), 6)  # 1 / (3·2)
(2, 0.166667)
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Literal

import numpy as np
import orjson

from models.offpolicy.logged import uniform_logprob
from pipeline.client.idmap import write_atomically
from pipeline.client.subscriber import LoadedPolicy
from pipeline.config import AdapterConfig
from topics.internal import CUTOVER_COMMAND

log = logging.getLogger(__name__)

Mode = Literal["shadow", "policy"]
Decision = Literal["incumbent", "explore", "policy"]
MODES: tuple[Mode, ...] = ("shadow", "policy")


def uniform_draw(n: int, k: int, rng: np.random.Generator) -> tuple[list[int], float]:
    """k of n positions in a uniformly random order, and the log-probability of that order."""
    k = min(k, n)
    pos = [int(p) for p in rng.permutation(n)[:k]]
    return pos, float(uniform_logprob(np.array([n]), np.array([k]))[0])


class ShadowMode:
    """Which ranking serves a request: the incumbent (with exploration) until the cut-over, then the policy.

    Parameters
    ----------
    explore_rate
        Share of shadow-mode requests served in a random order (the logged exploration budget).
    mode
        The starting mode (``"shadow"`` or ``"policy"``); a state file, when it exists, wins.
    path
        A JSON file keeping the mode across restarts (None: in memory only).
    """

    def __init__(
        self,
        explore_rate: float = AdapterConfig.shadow_explore_rate,
        mode: Mode = "shadow",
        path: str | os.PathLike[str] | None = None,
    ):
        if not 0.0 <= explore_rate <= 1.0:
            raise ValueError("explore_rate must be in [0, 1]")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.explore_rate = explore_rate
        self.path = Path(path).expanduser() if path is not None else None
        self.mode: Mode = mode
        self.cutover_version: int | None = None
        self.cutover_ts: float | None = None
        if self.path is not None and self.path.exists():
            obj = orjson.loads(self.path.read_bytes())
            if obj.get("mode") in MODES:
                self.mode = obj["mode"]
                self.cutover_version = obj.get("cutover_version")
                self.cutover_ts = obj.get("cutover_ts")

    def decide(self, rng: np.random.Generator) -> Decision:
        """How to serve the next request."""
        if self.mode == "policy":
            return "policy"
        return "explore" if self.explore_rate > 0 and rng.random() < self.explore_rate else "incumbent"

    def observe(self, policy: LoadedPolicy | None) -> bool:
        """Switch to the policy when ``policy`` is the learner's cut-over checkpoint; True when it switched."""
        if policy is None or self.mode == "policy" or policy.manifest.reason != CUTOVER_COMMAND:
            return False
        self.cut_over(policy.version)
        return True

    def cut_over(self, version: int | None = None) -> None:
        """Serve the policy from now on (and remember it)."""
        self.mode = "policy"
        self.cutover_version = version
        self.cutover_ts = time.time()
        log.warning("shadow mode: cut over to the policy (checkpoint v%s)", version)
        self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = orjson.dumps({"mode": self.mode, "cutover_version": self.cutover_version, "cutover_ts": self.cutover_ts})
        write_atomically(self.path, data)
