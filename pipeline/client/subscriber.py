"""The client side of the model topic: follow it and load verified checkpoints.

:func:`fetch_checkpoint` (read one version's chunks, verify, load) and
:class:`PolicySubscriber` still live in :mod:`pipeline.modeltopic`; this is their client
import path.
"""

from pipeline.modeltopic import LoadedPolicy, PolicySubscriber, fetch_checkpoint

__all__ = ["LoadedPolicy", "PolicySubscriber", "fetch_checkpoint"]
