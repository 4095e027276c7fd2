"""Rows of large arrays: lazily committed zeros, gathers and scatters of random rows, and a
thread that moves rows while the caller computes (docs/learning.md, "Sparse learning").

The output layer [S, H] and Adam's two moments of it are, at S = 10^6, three 2 GB arrays
of which a learner step reads and writes ~1,300 random rows. Those rows are not in any
cache: at 10^6 the moments' gathers and scatters wait for memory ~5× longer than at
S = 1,024, where the whole arrays stay in the CPU's last-level cache.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

HUGE_PAGE_MIN_BYTES = 64 << 20  # below this the TLB covers an array well enough

T = TypeVar("T")


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform has one).

    >>> available_cpus() >= 1
    True
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def lazy_zeros(shape: tuple[int, ...], device: torch.device, huge_pages: bool = False) -> torch.Tensor:
    """float32 zeros whose memory is only committed where written (CPU: calloc via numpy).

    ``torch.zeros`` writes every byte, so 10^6 rows of moments would be resident from the
    start; calloc'ed pages cost nothing until a row is first updated.

    ``huge_pages`` (CPU, Linux, arrays of at least :data:`HUGE_PAGE_MIN_BYTES`): an anonymous
    mapping advised for transparent huge pages, still zero and committed where written, but
    in 2 MB pieces. A step at S = 10^6 reads and writes ~1,300 random rows of each moment;
    with 4 KB pages each of those is also a TLB miss whose page-table entry is itself a
    cache miss (a 2 GB array has 4 MB of them). Where the kernel gives no huge pages
    (``/sys/kernel/mm/transparent_hugepage/enabled`` = never) this is plain zeroed memory.

    >>> t = lazy_zeros((3, 2), torch.device("cpu"), huge_pages=True)
    >>> t.shape, float(t.abs().sum())
    (torch.Size([3, 2]), 0.0)
    """
    nbytes = 4 * math.prod(shape)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=torch.float32, device=device)
    if huge_pages and nbytes >= HUGE_PAGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE)
        return torch.from_numpy(np.frombuffer(buf, np.float32).reshape(shape))
    return torch.from_numpy(np.zeros(shape, np.float32))


def _numpy_rows(rows: torch.Tensor) -> np.ndarray:
    """``rows`` as numpy indices; negative ones are refused as torch refuses them (numpy
    would count them from the end)."""
    idx: np.ndarray = rows.numpy()
    if len(idx) and idx.min() < 0:
        raise IndexError(f"row index {int(idx.min())} is negative")
    return idx


def take_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``t.index_select(0, rows)``; on CPU through numpy, whose row gather is ~25% faster
    on rows spread over a large array (the same values: a copy).

    >>> take_rows(torch.arange(6.0).reshape(3, 2), torch.tensor([2, 0])).tolist()
    [[4.0, 5.0], [0.0, 1.0]]
    """
    if t.device.type == "cpu" and t.is_contiguous() and rows.device.type == "cpu":
        return torch.from_numpy(np.take(t.detach().numpy(), _numpy_rows(rows), axis=0))
    return t.detach().index_select(0, rows)


def put_rows(t: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``t.index_copy_(0, rows, values)`` for distinct ``rows``; on CPU through numpy (as
    :func:`take_rows`).

    >>> t = torch.zeros(3, 2); put_rows(t, torch.tensor([2, 0]), torch.ones(2, 2)); t.tolist()
    [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    """
    if t.device.type == "cpu" and t.is_contiguous() and rows.device.type == "cpu" and values.device.type == "cpu":
        t.detach().numpy()[_numpy_rows(rows)] = values.detach().numpy()
        if not t.is_inference():  # an in-place write, as index_copy_ would count it
            torch.autograd.graph.increment_version(t)
    else:
        t.detach().index_copy_(0, rows, values)


class RowMover:
    """Gathers and scatters rows on one background thread, in the order they were asked for.

    A learner step knows its candidate rows before its forward pass, and nothing but the
    step writes the optimizer's moments: their gathers can start before the forward and
    their scatters finish after the step returns, on this thread, while the caller
    computes (numpy's row copies release the GIL). Jobs run one at a time in submission
    order, so a gather sees every scatter asked for before it; whoever reads or writes
    the arrays otherwise calls :meth:`sync` first. A failed job's error is raised by the
    next :meth:`sync` (and by every later one: the arrays may be half written).

    >>> mover = RowMover()
    >>> a = torch.zeros(4, 2)
    >>> mover.scatter([a], torch.tensor([1, 3]), [torch.ones(2, 2)])
    >>> mover.gather([a], torch.tensor([3, 0])).result()[0].tolist()
    [[1.0, 1.0], [0.0, 0.0]]
    >>> mover.sync(); mover.close()
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="row-mover")
        self._last: Future[Any] | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def _submit(self, job: Callable[[], T]) -> Future[T]:
        def run() -> T:
            try:
                return job()
            except BaseException as exc:
                with self._lock:
                    self._error = self._error or exc
                raise

        fut = self._pool.submit(run)
        self._last = fut
        return fut

    def submit(self, job: Callable[[], T]) -> Future[T]:
        """Run ``job`` on the thread once the jobs before it are done."""
        return self._submit(job)

    def gather(self, tensors: Sequence[torch.Tensor], rows: torch.Tensor) -> Future[list[torch.Tensor]]:
        """``[take_rows(t, rows) for t in tensors]``, once the jobs before it are done."""
        return self._submit(lambda: [take_rows(t, rows) for t in tensors])

    def scatter(self, tensors: Sequence[torch.Tensor], rows: torch.Tensor, values: Sequence[torch.Tensor]) -> None:
        """``put_rows(t, rows, v)`` for each pair, once the jobs before it are done."""

        def job() -> None:
            for t, v in zip(tensors, values, strict=True):
                put_rows(t, rows, v)

        self._submit(job)

    def sync(self) -> None:
        """Wait until every job asked for so far is done; raise the first error of any."""
        last = self._last
        if last is not None:
            try:
                last.result()
            except BaseException:
                pass
        with self._lock:
            if self._error is not None:
                raise RuntimeError("a row copy on the mover's thread failed") from self._error

    def close(self) -> None:
        """Finish the jobs asked for, then end the thread (idempotent)."""
        self._pool.shutdown(wait=True)
