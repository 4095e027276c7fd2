"""glibc's malloc thresholds, pinned for processes that allocate large temporaries each step.

By default glibc adjusts its mmap threshold as a process frees large blocks and gives memory
above its trim threshold back to the kernel, so a step's multi-MB temporaries can be mapped,
faulted in and unmapped again at every learner step: measured by ``causalmem bench scale``,
~1,800 minor page faults per step (~3 ms) at S = 1,024, depending on the process's history.
Pinned, freed blocks are reused. The learner pins them at start; the scale bench starts its
measuring processes with the same values in the environment (glibc reads them at start).

>>> sorted(PINNED_MALLOC)
['MALLOC_MMAP_THRESHOLD_', 'MALLOC_TRIM_THRESHOLD_']
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 256 << 20  # blocks below this come from the heap, and are reused when freed
TRIM_THRESHOLD = 512 << 20  # free heap memory kept before any is given back to the kernel
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def pin_malloc() -> bool:
    """Pin this process's thresholds now (glibc's ``mallopt``); False where that is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        ok = libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
        ok = ok and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))  # type: ignore[union-attr]
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.debug("malloc thresholds not pinned (no glibc mallopt)")
    return ok
