"""Who sent a value (contract 1.15): the optional ``principal`` of RetrievalEvent and LLMFeedback.

A principal is a short name for the client (or service) that produced a value: at most
:data:`MAX_PRINCIPAL_LEN` characters of ``[A-Za-z0-9._:@-]``. The pipeline records it in
each experience (which principal produced the event, which the feedback) and the learner
bounds each principal's influence by it (docs/learning.md, "Influence per principal").
A value without one is :data:`ANONYMOUS`'s. The name is the sender's claim: what makes it
more is the broker's ACLs on the input topics (docs/operations.md, "Security").

>>> check_principal("svc-a@tenant.1")
'svc-a@tenant.1'
>>> try:
...     check_principal("two words")
... except Rejected as e:
...     print(e.reason)
out_of_range
>>> principal_of(None), principal_of("svc-a")
('anonymous', 'svc-a')
"""

from __future__ import annotations

import re
from typing import Any

from topics.fields import Rejected

MAX_PRINCIPAL_LEN = 128
ANONYMOUS = "anonymous"  # what a value without a principal (or an older writer's) counts as
PRINCIPAL_RE = re.compile(rf"[A-Za-z0-9._:@-]{{1,{MAX_PRINCIPAL_LEN}}}")


def valid_principal(value: Any) -> bool:
    """Whether ``value`` is a well-formed principal (a string of the allowed characters, 1–128 long)."""
    return type(value) is str and PRINCIPAL_RE.fullmatch(value) is not None


def check_principal(value: Any, where: str = "principal") -> str:
    """``value`` if it is a well-formed principal, else :class:`~topics.fields.Rejected`
    (``wrong_type`` for a non-string, ``oversize`` past 128 characters, ``out_of_range`` for
    an empty name or another character)."""
    if type(value) is not str:
        raise Rejected("wrong_type", f"{where} must be a string")
    if len(value) > MAX_PRINCIPAL_LEN:
        raise Rejected("oversize", f"{where} longer than {MAX_PRINCIPAL_LEN}")
    if PRINCIPAL_RE.fullmatch(value) is None:
        raise Rejected("out_of_range", f"{where} must be 1-{MAX_PRINCIPAL_LEN} characters of A-Z a-z 0-9 . _ : @ -")
    return value


def principal_of(value: str | None) -> str:
    """The name a value counts under: its principal, or :data:`ANONYMOUS`."""
    return value if value is not None else ANONYMOUS
