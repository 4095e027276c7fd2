"""The policy's query features computed while the index searches (large indices).

A request's masks have a part that depends on the query alone — the network's hidden
layer, :func:`~pipeline.client.serving.policy_features` — and a part that needs the
candidates the search finds. On a large index the search takes milliseconds and leaves
the CPU's caches cold; computing the features *during* the search, on a worker thread,
takes them off the request's latency (faiss and NumPy's matrix product release the GIL while they work).
On a small index the search takes tens of microseconds, less than handing work to a
thread costs, so by default the features overlap only while the searches take at least
:data:`OVERLAP_MIN_SEARCH_S` (a moving average of the measured ones: the index's size,
type, ``nprobe`` and the machine decide it). Same values either way: the same function on
the same inputs.

>>> import numpy as np
>>> from pipeline.client.subscriber import LoadedPolicy
>>> from models.policy.network import init_policy
>>> from topics.manifest import Manifest
>>> policy = LoadedPolicy(Manifest("p", 1, 0.0, "init", {}, 0.5, 0.0, "0" * 64, 1, 1), init_policy(4, 8, 16))
>>> o = FeatureOverlap(overlap=True)
>>> tuple(o.start(policy, np.ones(4, np.float32), 0.0, 0.0)().shape), o.overlapping()
((16,), True)
>>> o.close(); auto = FeatureOverlap(); auto.overlapping()
False
>>> for _ in range(30): auto.observe(0.004)  # 4 ms searches
>>> auto.overlapping()
True
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pipeline.client.serving import policy_features
from pipeline.client.subscriber import LoadedPolicy

# Measured (docs/benchmarks.md, "Scale"): the features take ~0.25–0.35 ms after a search and a
# handoff ~0.1–0.2 ms. An IVF search over 10^6 memories (~2 ms) hides them (a request 3.7 → 3.1
# ms); over 10^5 (~0.3 ms) it cannot (0.97 → 1.19 ms).
OVERLAP_MIN_SEARCH_S = 1e-3
SEARCH_FADING = 0.1  # the moving average's weight of the newest search


class FeatureOverlap:
    """Starts a query's features on one worker thread, or computes them on the caller's.

    ``overlap``: True / False force it; None (default) overlaps while the searches
    (:meth:`observe`) take :data:`OVERLAP_MIN_SEARCH_S` or more on average. One worker
    serves a retriever (started on first use, ended by :meth:`close` or at interpreter
    exit); a request that finds it busy computes its features itself.

    A delta applied in place while a request runs (the subscriber's path for large
    policies) can mix the two versions' weights in that request's masks, as it could
    before; overlapped, the window is the search's duration rather than microseconds.
    """

    def __init__(self, overlap: bool | None = None) -> None:
        self.overlap = overlap
        self.search_s = 0.0  # moving average of the searches' wall time
        self._pool: ThreadPoolExecutor | None = None
        self._starting = threading.Lock()  # guards the worker and its state across requests' threads
        self._busy = False  # the worker holds a request's features

    def observe(self, search_s: float) -> None:
        """One search's wall time, in seconds."""
        self.search_s += SEARCH_FADING * (search_s - self.search_s)

    def overlapping(self) -> bool:
        return self.overlap if self.overlap is not None else self.search_s >= OVERLAP_MIN_SEARCH_S

    def start(
        self, policy: LoadedPolicy | None, q: np.ndarray, loss: float, entropy: float
    ) -> Callable[[], np.ndarray | None]:
        """A call that returns the query's features (None without a policy); started now when overlapping."""
        if policy is None:
            return lambda: None
        if not self.overlapping():
            return lambda: policy_features(policy, q, loss, entropy)
        with self._starting:
            # A request while the worker is busy (requests from several threads) computes its own:
            # queued behind another's features it would wait longer than it saves.
            if self._busy:
                return lambda: policy_features(policy, q, loss, entropy)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="causalmem-features")
            try:
                future = self._pool.submit(policy_features, policy, q, loss, entropy)
            except RuntimeError:  # the interpreter is shutting down: no new threads
                return lambda: policy_features(policy, q, loss, entropy)
            self._busy = True
        future.add_done_callback(self._done)
        return future.result

    def _done(self, _: object) -> None:
        with self._starting:
            self._busy = False

    def close(self) -> None:
        """End the worker thread (a later request starts a new one)."""
        with self._starting:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
