"""The learner pins glibc's malloc thresholds: a step's large temporaries are reused, not faulted in anew."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.allocator import pin_malloc

PROBE = """
import resource, sys
import numpy as np
from pipeline.allocator import pin_malloc
if sys.argv[1] == "pinned":
    assert pin_malloc()
np.ones(8 << 20).sum()  # 64 MB: above glibc's largest self-tuned mmap threshold (32 MB)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    np.ones(8 << 20).sum()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_pinned_a_large_temporary_is_reused_unpinned_it_is_faulted_in_every_time() -> None:
    assert pin_malloc()
    pinned, unpinned = _faults("pinned"), _faults("default")
    # Unpinned, each 64 MB array is mapped and faulted in again (huge pages where the kernel
    # gives them: ~550 faults an array here); pinned, the first one's memory is reused.
    assert unpinned >= 10 * 32
    assert pinned < unpinned // 20
