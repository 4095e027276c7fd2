"""A client written from docs/contract.md alone: the events it sends, and nothing more.

The benches' simulated agents serve with :class:`~pipeline.client.retriever.CausalRetriever`,
which fills every optional field of contract §3. A client that follows only the required
fields (the served slate's ``logprob``, ``temperature``, candidates and scores) sends much
less, and the learner must still learn from it: :func:`required_only` turns a full event into
what such a client sends, for the in-process loop (:mod:`causalmem_lab.offline`) and the
pipeline runs (:mod:`causalmem_lab.simrun`) alike. Such a client also serves no canary
(§7.2 is optional), which the two callers arrange by not giving it one.
"""

from __future__ import annotations

from dataclasses import replace

from topics.events import RetrievalEvent


def required_only(event: RetrievalEvent) -> RetrievalEvent:
    """``event`` as a client written from docs/contract.md's required fields sends it (§3):
    ``policy`` and ``policy_version`` kept (the contract asks for them), every other optional
    field left out — no ``candidate_probs``, ``candidate_masks``, ``dropped``, ``mask_max``,
    texts or canary fields. ``incumbent`` stays (contract 1.17): a client that serves its own
    ranking because the manifest says so must say it did, or its ``logprob`` 0 would be false.
    So does ``base`` (contract 1.23): a client that draws under the certified version a probe's
    manifest names must say so, or its ``logprob`` would claim a draw under the probe's weights."""
    return replace(
        event,
        mask_max=None,
        query_text=None,
        memory_texts=None,
        dropped=None,
        candidate_masks=None,
        candidate_probs=None,
        answer_text=None,
        candidate_ids=None,
        canary=None,
        canary_arm=None,
        canary_version=None,
        canary_other=None,
    )
