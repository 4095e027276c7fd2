"""How clients serve a policy: temperature, exploration and hard drop (docs/learning.md).

The same network served at T = 0.05 and at T = 1.0 are two different policies with two
different values. :class:`ServingParams` is that part of a policy's configuration: the
learner records it in each checkpoint manifest (the optional ``serving`` field,
docs/contract.md §7), ``CausalRetriever`` follows it, and the promotion gate judges
candidates as they will be served: the target policy is the mixture

    π_served = (1 − ε)·π_T + ε·π_{T_explore}

with ε = ``explore_rate``; each logged step's own T and logprob stay the behaviour
policy's propensity.

Each serving default is declared here, once: ``pipeline.config.Settings`` (the ``serve_*``
settings) and the clients (:data:`pipeline.client.serving.UNSERVED`) take theirs from
:class:`ServingParams`.

>>> p = ServingParams()
>>> p.components()
((0.9, 0.05), (0.1, 0.1))
>>> ServingParams.from_wire(p.to_wire()) == p
True
>>> ServingParams.from_wire(None) == ServingParams(drop="dynamic", canary_rate=0.0, explore_temperature=0.25)
True
>>> ServingParams.from_wire(ServingParams(incumbent=True).to_wire()).incumbent
True
>>> ServingParams.from_wire(ServingParams(base=4).to_wire()).base
4
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# The contract's dynamic drop: m_i < 0.01·max m (docs/contract.md §6). Declared here, in a module
# without torch, so that the configuration (pipeline/config.py) and models.serving.rule share it.
# models.serving.rule.DYNAMIC_DROP_RATIO, repeated: that module loads torch, and the
# configuration (pipeline/config.py) builds ServingParams without it.
DYNAMIC_DROP_RATIO = 0.01
DROP_MODES = ("dynamic", "fixed", "none")
# Contract 1.4: a manifest's ``serving`` without ``canary_rate`` (and a manifest without ``serving``)
# means no canary; this is what the wire's absence means, not the learner's default below.
CANARY_RATE_ABSENT = 0.0
# A manifest's ``serving`` without ``drop`` (and one without ``serving``) means the contract's
# dynamic drop (§6); the learner's own default below is no drop, which the promotion rule needs:
# a version that drops reads sets of fewer than k memories that no log shows (docs/promotion.md).
DROP_ABSENT = "dynamic"
# A manifest's ``serving`` without ``explore_temperature`` (and one without ``serving``, and a client
# before any manifest, §6 step 2b) means 0.25, the contract's; the learner's own default below is
# narrower: exploration is served, so its cost is inside the promotion rule's promise, and at 0.25
# the first policy's share cost 0.045 of utility on the real-data world (docs/promotion.md).
EXPLORE_TEMPERATURE_ABSENT = 0.25


@dataclass(frozen=True)
class ServingParams:
    """The serving part of a policy's configuration.

    ``drop``: ``"dynamic"`` (drop m_i < ``drop_ratio``·max m, the contract's rule),
    ``"fixed"`` (drop m_i < ``drop_ratio``, an absolute threshold) or ``"none"`` (never
    drop). Raises ``ValueError`` on values a client could not serve.
    """

    temperature: float = 0.05
    explore_rate: float = 0.1
    explore_temperature: float = 0.1
    drop: str = "none"
    drop_ratio: float = DYNAMIC_DROP_RATIO
    # Contract 1.4: the share of requests on which clients serve the learner's canary (a
    # pending candidate, docs/promotion.md), as its own manifest says it is served. Not part
    # of this policy's served mixture: those requests are the canary's. 0.2 is measured
    # (docs/learning.md, the serve_canary_rate row); a manifest that leaves it out means
    # :data:`CANARY_RATE_ABSENT`.
    canary_rate: float = 0.2
    # Contract 1.5: clients draw the canary's and the serving policy's slates on those requests
    # with the same random numbers and serve the canary's on half of those where they differ
    # (pipeline/client/choice.py); false: the canary serves every such request (1.4's A/B split).
    canary_coupled: bool = False
    # Contract 1.17: the policy is not certified yet (the learner's first policy under the
    # promotion gate): clients serve their own ranking, the first k candidates as found, on
    # every request but the exploration share, which draws under the policy at
    # ``explore_temperature``. The promotion rule values the version as that mixture
    # (models.offpolicy.logged.component_logits). ``temperature`` stays what clients before 1.17
    # draw at.
    incumbent: bool = False
    # Contract 1.23: a probe over a certified version: clients serve this version on every
    # request but the exploration share (at ``temperature``, with this ``drop``), and draw the
    # exploration share under the probe's own weights at ``explore_temperature``. The promotion
    # rule values the probe as that mixture (models.offpolicy.logged.component_logits).
    base: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "explore_temperature"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be finite and > 0, not {v!r}")
        for name in ("explore_rate", "canary_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], not {v!r}")
        if self.drop not in DROP_MODES:
            raise ValueError(f"drop must be one of {DROP_MODES}, not {self.drop!r}")
        if not (math.isfinite(self.drop_ratio) and self.drop_ratio >= 0):
            raise ValueError(f"drop_ratio must be finite and >= 0, not {self.drop_ratio!r}")
        if self.base is not None and (self.incumbent or self.base < 1):
            raise ValueError(f"base must be a version >= 1 on a policy that is not an incumbent, not {self.base!r}")

    def components(self) -> tuple[tuple[float, float], ...]:
        """The served mixture as (weight, temperature) pairs (weights sum to 1; zero weights left out).

        >>> ServingParams(explore_rate=0.0).components()
        ((1.0, 0.05),)
        """
        parts = ((1.0 - self.explore_rate, self.temperature), (self.explore_rate, self.explore_temperature))
        return tuple((round(w, 12), t) for w, t in parts if w > 0)

    @property
    def drop_spec(self) -> str | float:
        """The retriever's ``drop`` argument: ``"dynamic"``, ``"none"`` or the fixed threshold."""
        return self.drop_ratio if self.drop == "fixed" else self.drop

    def to_wire(self) -> dict[str, Any]:
        """The manifest's ``serving`` object (docs/contract.md §7)."""
        return {
            "temperature": self.temperature,
            "explore_rate": self.explore_rate,
            "explore_temperature": self.explore_temperature,
            "drop": self.drop,
            "drop_ratio": self.drop_ratio,
            **({"canary_rate": self.canary_rate} if self.canary_rate > 0 else {}),
            **({"canary_coupled": True} if self.canary_coupled and self.canary_rate > 0 else {}),
            **({"incumbent": True} if self.incumbent else {}),
            **({"base": self.base} if self.base is not None else {}),
        }

    @classmethod
    def from_wire(cls, obj: dict[str, Any] | None) -> ServingParams:
        """From a manifest's ``serving`` object; ``None`` (an older manifest) gives the defaults.

        Missing keys take their defaults, so later additions stay optional; a missing
        ``canary_rate`` means no canary (contract 1.4), a missing ``drop`` and
        ``explore_temperature`` what the contract says (:data:`DROP_ABSENT`,
        :data:`EXPLORE_TEMPERATURE_ABSENT`), not the learner's defaults.

        >>> ServingParams.from_wire({"temperature": 0.2}).canary_rate, ServingParams.from_wire(None).drop
        (0.0, 'dynamic')
        >>> ServingParams.from_wire({"temperature": 0.2}).explore_temperature
        0.25
        """
        absent: dict[str, Any] = {
            "canary_rate": CANARY_RATE_ABSENT,
            "drop": DROP_ABSENT,
            "explore_temperature": EXPLORE_TEMPERATURE_ABSENT,
        }
        if obj is None:
            return cls(**absent)
        names = ("temperature", "explore_rate", "explore_temperature", "drop_ratio", "canary_rate")
        known = {k: obj[k] for k in names if k in obj}
        values = dict(absent)
        values.update({k: float(v) for k, v in known.items()})
        if "drop" in obj:
            values["drop"] = str(obj["drop"])
        if obj.get("canary_coupled") is True:  # contract 1.5
            values["canary_coupled"] = True
        if obj.get("incumbent") is True:  # contract 1.17
            values["incumbent"] = True
        base = obj.get("base")  # contract 1.23
        if isinstance(base, int) and not isinstance(base, bool):
            values["base"] = base
        return cls(**values)
