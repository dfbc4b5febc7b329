"""Host memory for a rank's captured rows (``extract``): where they wait between the device and their file.

Where a step's rows wait for their commit (``NNSIGHT_RAY_EXTRACT_STAGING``):

- ``pool`` (the default): a fixed pool of page-locked slabs, each as large as the largest
  step one location can capture (``max_num_batched_tokens`` rows), made at
  the first capture (``NNSIGHT_RAY_EXTRACT_PINNED_MB`` in all, at least two
  steps' worth). A step's rows stay in their slab until every part holding
  them is written, then the slab goes back to the pool: no copy more than
  ``cache``, and pinned memory fixed. When no slab is free the forward waits
  while the writer has files to write (back-pressure), and otherwise (every
  slab holds rows of parts not yet complete) stages that step in a host
  buffer (``host_buffer``, pageable, unmapped once written; counted as an
  overflow). Measured on the H200 (2,048 prompts of 256 tokens a run, 4
  layers, 48 slabs of 64 MiB): 0.87x plain prefill, 5.0 GB/s, the rank's
  RSS 4,974 -> 4,978 MB over 11 runs, pinned 3,289 MB every run, the
  forward waiting ~0.07 s a run for slabs. Before it, ``slab`` (one-size
  blocks from PyTorch's cache, no cap) ratcheted like ``cache``: pinned
  2.3 -> 3.6 GB over 11 runs.
- ``cache``: in pinned blocks from PyTorch's caching host
  allocator. Two copies after the forward: device -> pinned (on a side CUDA
  stream, overlapping the next layers), pinned -> file. The fastest measured
  (0.88x plain prefill, 5.0 GB/s, H200), but that cache keeps every freed
  block for reuse in its power-of-two size class and never gives it back
  while work goes on: the rank's RSS grew with the cache, 3.6 -> 5.7 GB over
  11 runs with every prompt in flight (pinned cache +2,118 MB, RSS +2,120).
- ``ring``: a fixed page-locked ring (``PinnedRing``, allocated once), the
  writer thread copying each step out of it into host buffers mapped for
  them (``host_buffer``, unmapped when written) by a pool of copier threads.
  One copy more, and memory flat by construction: the rank's RSS 2,829-2,831
  MB over the same 11 runs. But 0.60x plain prefill (a 1 GiB ring, 4
  copiers: the forward waited 0.8 s a run for the ring); 3 GiB and 12
  copiers did not wait and still ran 2.0 s against 1.7 (another run:
  faulting fresh pages in and unmapping them competes with the forward).

On the CPU build ``ring`` computes the rows straight into mapped host
buffers; the others as the model's tensors (no pinned memory there).
"""

from __future__ import annotations

import collections
import logging
import math
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Where captured rows wait for their commit: "pool", "cache" or "ring" (the module docstring).
STAGING = os.environ.get("NNSIGHT_RAY_EXTRACT_STAGING", "pool")
STAGINGS = ("pool", "cache", "ring")
if STAGING not in STAGINGS:
    raise ValueError(f"NNSIGHT_RAY_EXTRACT_STAGING={STAGING!r}: expected one of {', '.join(STAGINGS)}")
# The staging ring's size; at least twice the largest step a rank can capture (``ensure_ring``).
RING_MB = int(os.environ.get("NNSIGHT_RAY_EXTRACT_RING_MB", "1024"))
COPIER_THREADS = int(os.environ.get("NNSIGHT_RAY_EXTRACT_COPIERS", "4"))
COPY_CHUNK_BYTES = 8 << 20  # a copier's piece of a step's rows
# The slab pool's page-locked bytes in all (staging "pool"); at least two steps at every asked location.
PINNED_MB = int(os.environ.get("NNSIGHT_RAY_EXTRACT_PINNED_MB", "3072"))


def _load_malloc_trim() -> Any:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim = _load_malloc_trim()
_trim_lock = threading.Lock()


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``), after a part is written.

    A part's rows are freed once its file is written, but glibc raises its mmap threshold
    after freeing large blocks, so later ones come from the heap and its free pages stay
    resident: on the 2-core machine the writing rank's RSS grew 210 MB over 41 runs of
    128 prompts without this, 87 MB with it (docs/performance.md, "Activation datasets").
    """
    if _malloc_trim is not None and _trim_lock.acquire(blocking=False):  # one writer trims; the others go on
        try:
            _malloc_trim(0)
        finally:
            _trim_lock.release()


def release_pinned_cache() -> None:
    """Give PyTorch's cached pinned host blocks back (``torch.accelerator.empty_host_cache``); no-op without CUDA.

    The staging ring (and a step too large for it) comes from PyTorch's
    caching host allocator, which keeps every freed block (sizes rounded up
    to a power of two) for reuse: with rows held there until written, the
    writing rank's RSS grew 7.1 -> 9.5 GB over 4 runs on the H200 with every
    prompt in flight (docs/performance.md). Called once the writer has been
    idle (nothing held, nothing being written) for ``PINNED_IDLE_S``, after it
    drops its ring: returning pinned memory waits for the device, and pinning
    it again costs more (page-locking every page, on the thread that runs the
    forward), so work that goes on keeps its ring.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.accelerator.empty_host_cache()


class _Mapped(mmap.mmap):
    """An anonymous mapping that counts itself in ``_mapped`` while alive (the memory gauge)."""

    def __init__(self, *args: Any) -> None:
        super().__init__()
        with _mapped_lock:
            _mapped[0] += len(self)

    def __del__(self) -> None:
        with _mapped_lock:
            _mapped[0] -= len(self)


_mapped = [0]  # bytes of host buffers alive
_mapped_lock = threading.Lock()


def host_buffer(shape: "tuple[int, ...] | torch.Size", dtype: torch.dtype) -> torch.Tensor:
    """A host tensor in its own anonymous mapping, unmapped (returned to the system) when its last view dies.

    Not from the heap: glibc keeps freed blocks below its (self-raising) mmap threshold, so a
    rank that holds and frees gigabytes of rows a run kept growing (docs/performance.md). Asks
    for transparent huge pages: copying into fresh 4 KiB pages measured 2.5-3.5 GB/s, into
    huge pages 8-11 GB/s (the 2-core dev machine, THP ``madvise``).
    """
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    mapping = _Mapped(-1, nbytes)
    if nbytes >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP off, or not Linux
            pass
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def pinned_rows(shape: "torch.Size", dtype: torch.dtype) -> torch.Tensor:
    """Pinned host memory for rows of ``shape`` (PyTorch's caching host allocator)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return _pinned(nbytes).view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)


class Slab:
    """One slab of a ``SlabPool``, lent to a step's rows at one location until every part holding them is done."""

    __slots__ = ("pool", "tensor", "refs")

    def __init__(self, pool: "SlabPool", tensor: torch.Tensor) -> None:
        self.pool, self.tensor, self.refs = pool, tensor, 0

    def view(self, shape: "torch.Size", dtype: torch.dtype) -> torch.Tensor:
        return self.tensor.narrow(0, 0, math.prod(shape) * dtype.itemsize).view(dtype).view(shape)

    def hold(self, count: int = 1) -> None:
        with self.pool.cond:
            self.refs += count

    def release(self) -> None:
        """One holder done (a part written or dropped); the last one gives the slab back to its pool."""
        with self.pool.cond:
            self.refs -= 1
            if self.refs <= 0:
                self.refs = 0
                self.pool.free.append(self)
                self.pool.cond.notify_all()


class SlabPool:
    """Page-locked slabs of one size, all made at once, lent to captured rows and given back when written.

    ``take`` lends a free slab, waiting while ``busy()`` says a file is being written (whose
    parts will give slabs back); None when none is free and nothing is being written, or the
    rows do not fit a slab: the caller stages those rows elsewhere (``host_buffer``).
    """

    def __init__(self, slab_bytes: int, count: int, pin: bool = True) -> None:
        self.slab_bytes, self.count = slab_bytes, count
        self.free: list[Slab] = [Slab(self, torch.empty(slab_bytes, dtype=torch.uint8, pin_memory=pin))
                                 for _ in range(count)]
        self.cond = threading.Condition()
        self.waited_s = 0.0

    def lent(self) -> int:
        with self.cond:
            return self.count - len(self.free)

    def take(self, nbytes: int, busy: Any = lambda: False, timeout: float = 60.0) -> Slab | None:
        if nbytes > self.slab_bytes:
            return None
        started = time.monotonic()
        with self.cond:
            while not self.free:
                left = timeout - (time.monotonic() - started)
                if left <= 0 or not busy():
                    return None
                self.cond.wait(min(left, 0.05))  # ``busy`` is the writer's state: looked at again
            slab = self.free.pop()
            slab.refs = 1  # the step's capture, until it is filed under its parts
        self.waited_s += time.monotonic() - started
        return slab


class PinnedRing:
    """A fixed page-locked buffer that a rank's captures are copied into from the device, first in, first out.

    The forward's hooks take spans (``take``), the writer thread gives each step's spans back once
    it has copied them out (``give``), in the order taken. A hook waits while the ring is full of
    earlier steps' rows (the forward slows to the writer's pace: back-pressure, not growth); a
    step that does not fit even alone gets a one-off pinned block (``take`` returns None).
    """

    ALIGN = 4096

    def __init__(self, nbytes: int, pin: bool = True) -> None:
        self.size = nbytes
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.spans: collections.deque[tuple[int, int, int]] = collections.deque()  # (start, end, step), taken order
        self.cond = threading.Condition()
        self.waited_s = 0.0

    def used(self) -> int:
        with self.cond:
            return sum(end - start for start, end, _ in self.spans)

    def _place(self, nbytes: int) -> int | None:
        if not self.spans:
            return 0 if nbytes <= self.size else None
        first, last = self.spans[0][0], self.spans[-1][1]
        if self.spans[-1][0] >= first:  # not wrapped: free after the last span, then before the first
            if self.size - last >= nbytes:
                return last
            return 0 if first >= nbytes else None
        return last if first - last >= nbytes else None  # wrapped: free between the last and the first

    def take(self, shape: "torch.Size", dtype: torch.dtype, step: int, timeout: float = 60.0) -> torch.Tensor | None:
        """A view of the ring for ``step``'s rows, waiting while earlier steps fill it; None if it cannot fit."""
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        aligned = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        if aligned > self.size:
            return None
        started = time.monotonic()
        with self.cond:
            while (start := self._place(aligned)) is None:
                earlier = any(s != step for _, _, s in self.spans)
                left = timeout - (time.monotonic() - started)
                if not earlier or left <= 0:
                    return None
                self.cond.wait(left)
            self.spans.append((start, start + aligned, step))
        self.waited_s += time.monotonic() - started
        return self.buffer.narrow(0, start, nbytes).view(dtype).view(shape)

    def give(self, step: int) -> None:
        """Free ``step``'s spans (the oldest ones; step numbers grow)."""
        with self.cond:
            while self.spans and self.spans[0][2] <= step:  # and any older step's that was never filed
                self.spans.popleft()
            self.cond.notify_all()


class Staging:
    """Where a rank's captured rows wait for their file (``mode``: the module docstring), and the ring or
    slab pool it keeps for that: made at the first capture that needs it, dropped when the writer idles."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.ring: PinnedRing | None = None  # mode "ring" (``ensure_ring``)
        self.slabs: SlabPool | None = None  # mode "pool" (``ensure_slabs``)
        self.lock = threading.Lock()
        self.overflows = 0  # rows staged outside the ring or the pool (too large for it, or it stayed full)
        self.copier = ThreadPoolExecutor(COPIER_THREADS, thread_name_prefix="nnsight-ray-extract-copy")

    def ensure_ring(self, nbytes: int) -> PinnedRing:
        """The ring, made (or, while empty, remade) at least ``nbytes`` large."""
        with self.lock:
            ring = self.ring
            if ring is None or (ring.size < nbytes and not ring.used()):
                self.ring = ring = None  # the old buffer goes back to PyTorch's cache first
                self.ring = ring = PinnedRing(nbytes)
                logger.info("extraction: a %d MB page-locked staging ring", nbytes >> 20)
            return ring

    def ensure_slabs(self, slab_bytes: int, locations: int) -> SlabPool:
        """The slab pool, made (or, while nothing is lent, remade) with slabs of at least ``slab_bytes``:
        ``PINNED_MB`` in all, and at least two steps at ``locations`` locations."""
        with self.lock:
            slabs = self.slabs
            count = max(2 * max(locations, 1), (PINNED_MB << 20) // max(slab_bytes, 1))
            if slabs is None or ((slabs.slab_bytes < slab_bytes or slabs.count < 2 * locations) and not slabs.lent()):
                self.slabs = slabs = None  # the old slabs go back to PyTorch's cache first
                started = time.monotonic()
                self.slabs = slabs = SlabPool(slab_bytes, count, pin=torch.cuda.is_available())
                logger.info("extraction: %d page-locked slabs of %d MB in %.2f s", count, slab_bytes >> 20,
                            time.monotonic() - started)
            return slabs

    def drop(self) -> bool:
        """Drop an unused ring and slab pool (an idle writer's); False if rows are in some of them."""
        with self.lock:
            if (self.ring is not None and self.ring.used()) or (self.slabs is not None and self.slabs.lent()):
                return False
            self.ring = self.slabs = None
            return True

    def to_host(self, taken: torch.Tensor, step: int, lent: list, busy: Any) -> torch.Tensor:
        """Start the copy of device rows ``taken`` to the host (current stream: the caller's side stream), as
        ``mode`` says: into the ring (a one-off pinned block when they do not fit), a slab of the pool (appended
        to ``lent``; a host buffer when none is free and not ``busy()``: that copy waits), or a pinned block of
        their own size."""
        ring = self.ring if self.mode == "ring" else None
        slabs = self.slabs if self.mode == "pool" else None
        host = None
        if ring is not None:
            host = ring.take(taken.shape, taken.dtype, step)
            if host is None:
                self._overflow(f"a step's rows did not fit the {ring.size >> 20} MB staging ring; a one-off pinned "
                               "block (NNSIGHT_RAY_EXTRACT_RING_MB sets its size)")
        elif slabs is not None:
            slab = slabs.take(taken.numel() * taken.dtype.itemsize, busy)
            if slab is None:
                self._overflow(f"no free slab in the {slabs.count} x {slabs.slab_bytes >> 20} MB pool and nothing "
                               "being written (every slab holds rows of parts not yet complete); the step's rows "
                               "go through pageable memory (NNSIGHT_RAY_EXTRACT_PINNED_MB sets the pool's size)")
                host = host_buffer(taken.shape, taken.dtype)
            else:
                lent.append(slab)
                host = slab.view(taken.shape, taken.dtype)
        if host is None:
            host = pinned_rows(taken.shape, taken.dtype)
        host.copy_(taken, non_blocking=True)
        return host

    def _overflow(self, why: str) -> None:
        self.overflows += 1
        if self.overflows == 1 or self.overflows % 100 == 0:
            logger.warning("extraction (%d so far): %s", self.overflows, why)

    def unstage(self, values: dict[str, torch.Tensor], step: int) -> None:
        """Copy ``step``'s ring views in ``values`` into host buffers (``host_buffer``, by the copier pool) and
        free its spans (also when copying failed: the ring must not stay full)."""
        ring = self.ring
        if ring is None:
            return
        try:
            base = ring.buffer.data_ptr()
            jobs = []
            for location, staged in list(values.items()):
                if not base <= staged.data_ptr() < base + ring.size:
                    continue  # a one-off block: stays as it is
                host = host_buffer(staged.shape, staged.dtype)
                flat_from, flat_to = staged.view(-1), host.view(-1)
                chunk = max(1, COPY_CHUNK_BYTES // staged.element_size())
                for start in range(0, flat_from.numel(), chunk):
                    jobs.append(self.copier.submit(flat_to[start:start + chunk].copy_, flat_from[start:start + chunk]))
                values[location] = host
            for job in jobs:
                job.result()
        finally:
            ring.give(step)

    def gauge(self) -> dict[str, Any]:
        """The memory gauge's part (``extract.capture.memory``): the mode when not the default, the ring, the pool."""
        found: dict[str, Any] = {} if self.mode == STAGINGS[0] else {"staging": self.mode}
        ring, slabs = self.ring, self.slabs
        if ring is not None:
            found.update(ring_mb=ring.size / 1e6, ring_used_mb=ring.used() / 1e6, ring_wait_s=round(ring.waited_s, 3),
                         ring_overflows=self.overflows)
        if slabs is not None:
            found.update(pool_mb=slabs.count * slabs.slab_bytes / 1e6, pool_lent=slabs.lent(), pool_slabs=slabs.count,
                         pool_wait_s=round(slabs.waited_s, 3), pool_overflows=self.overflows)
        return found
