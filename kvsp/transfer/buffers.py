"""Receive buffers for block bodies, reused once nothing refers to them (spec §6.7 retrieval;
DESIGN.md §7, the bulk path).

A verified block is handed out as views of the one buffer its body landed in (§6.7: the
client verifies every octet before anyone sees them). A fresh 2 MiB buffer per block costs
the kernel a page fault and a zeroed page for every 4 KiB the socket writes into it, and
``free`` gives the pages back when the block is dropped, so the next block faults them in
again (the "fresh buffers" line of ``bench/bench_blocks.py`` shows the cost).

:class:`BufferPool` keeps the memory of dropped blocks and gives it to the next body of the
same size. It never decides by itself that a buffer is free: each one handed out is a NumPy
view of a pooled backing array, and the backing returns to the pool only when that view is
deallocated, i.e. when no memoryview, array, tensor or layer made from it is alive anywhere
(``weakref.finalize``). A buffer is never lent twice at once, whatever the caller keeps.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

DEFAULT_POOL_BYTES = 64 << 20
"""Octets of idle buffers a pool keeps by default: 32 blocks of 2 MiB."""


class BufferPool:
    """Buffers of exact sizes, lent out as writable ``memoryview`` s and taken back when the
    last reference to one (or to anything made from it) is gone.

    ``max_bytes`` bounds the idle buffers kept (0 keeps none: every :meth:`take` allocates).
    Thread-safe: buffers come back on whichever thread drops the last reference.

    Raises:
        ValueError: ``max_bytes`` is negative, or :meth:`take` is asked for a negative size.
    """

    def __init__(self, max_bytes: int = DEFAULT_POOL_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, not {max_bytes}")
        self.max_bytes = max_bytes
        self._idle: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0
        # reentrant: a buffer in a reference cycle comes back from the garbage collector, which
        # may run on this thread at any allocation, also while the lock is held
        self._lock = threading.RLock()
        self.allocated = 0
        """Buffers made by :meth:`take` because none of that size was idle."""
        self.reused = 0
        """Buffers :meth:`take` lent again."""

    @property
    def idle_bytes(self) -> int:
        """Octets of the buffers kept for reuse now."""
        return self._idle_bytes

    def take(self, size: int) -> memoryview:
        """A writable, C-contiguous ``memoryview`` of ``size`` octets (format ``"B"``); its
        contents are whatever they were (the caller writes every octet it reads)."""
        if size < 0:
            raise ValueError(f"size must be >= 0, not {size}")
        backing = None
        with self._lock:
            free = self._idle.get(size)
            if free:
                backing = free.pop()
                self._idle_bytes -= size
                self.reused += 1
            else:
                self.allocated += 1
        if backing is None:
            # np.empty: the caller writes every octet, so zero-filling would be wasted work
            backing = np.empty(size, dtype=np.uint8)
        lent = backing[:]  # a view: it dies with the last thing made from it
        weakref.finalize(lent, self._give_back, backing).atexit = False
        return lent.data.cast("B")

    def _give_back(self, backing: np.ndarray) -> None:
        size = backing.nbytes
        fresh: list[np.ndarray] = []  # made before the lock: nothing under it allocates
        with self._lock:
            if self._idle_bytes + size > self.max_bytes:
                return  # beyond the bound: let it be freed
            self._idle.setdefault(size, fresh).append(backing)
            self._idle_bytes += size

    def clear(self) -> None:
        """Drop every idle buffer (lent ones still come back later)."""
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0

    def close(self) -> None:
        """Drop every idle buffer and keep none from now on (lent ones are freed when
        dropped); :meth:`take` still works, allocating each time."""
        with self._lock:
            self.max_bytes = 0
        self.clear()


__all__ = ["DEFAULT_POOL_BYTES", "BufferPool"]
