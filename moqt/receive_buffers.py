"""Where a QMux carrier's bytes land (draft-ietf-quic-qmux-01 §3.1 carriers, read by
:mod:`moqt.qmux_asyncio` and :mod:`moqt.qmux_tls`): large buffers handed out, once filled, as
read-only slices that stay valid, and the process's pool of prefaulted buffers.

A relay caches the slices it forwards, so every buffer it fills lives until the cache lets go
of what it holds. Fresh memory costs the kernel a mapping and a zeroed page per 4 KiB, and an
unmapping later: 0.3 ms a MiB here, about as much as the rest of a relay's work on those bytes.
A relay in service has a full cache, evicting as it admits, so the buffers it gives up come
free at the rate it fills new ones: :class:`BufferPool` takes them back once their last slice
is gone and hands them out again, their pages still mapped.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref
from typing import TypeAlias

RECEIVE_BUFFER = 1 << 20  # bytes one read may take (the size of each receive buffer)
RECEIVE_MIN_READ = 64 << 10  # a shorter free tail starts a fresh buffer
POOL_KEEP = 32
"""Free buffers the pool holds at most (32 MiB of receive buffers); more are unmapped."""

Buffer: TypeAlias = "bytearray | mmap.mmap | ctypes.Array[ctypes.c_char]"
"""A receive buffer: a ``bytearray``, a prefaulted mapping, or a window onto a pooled one."""


class BufferPool:
    """Prefaulted buffers of ``size`` octets, each handed out again once nothing views it.

    :meth:`take` hands out a *window*, a ``ctypes`` array over a pooled mapping: every
    memoryview made of it (and every slice of those) holds the window, so the window dies with
    the last of them, and its finalizer gives the mapping back. Nothing polls, and a mapping
    is never written while any slice of it is alive. At most ``keep`` free mappings are held;
    the rest are unmapped (a relay whose cache emptied returns the memory).
    """

    def __init__(self, size: int = RECEIVE_BUFFER, keep: int = POOL_KEEP) -> None:
        self.size = size
        self.keep = keep
        self.taken = 0
        """Windows handed out."""
        self.reused = 0
        """Of those, the ones on a mapping given back (the rest were fresh memory)."""
        self._free: list[mmap.mmap] = []

    @property
    def free(self) -> int:
        """Mappings given back and not yet handed out again."""
        return len(self._free)

    def take(self) -> Buffer:
        """A buffer of :attr:`size` octets that nothing else views: a window onto a mapping
        given back, else onto a fresh one; a ``bytearray`` where no mapping can be made."""
        try:
            mapping = self._free.pop()  # the last given back: its pages are the warmest
            self.reused += 1
        except IndexError:
            fresh = prefaulted(self.size)
            if type(fresh) is bytearray:
                return fresh
            mapping = fresh  # type: ignore[assignment]
        self.taken += 1
        window = (ctypes.c_char * self.size).from_buffer(mapping)
        weakref.finalize(window, self._give_back, mapping).atexit = False
        return window

    def _give_back(self, mapping: mmap.mmap) -> None:
        """The window onto ``mapping`` is gone, and with it every view of it."""
        if len(self._free) < self.keep:
            self._free.append(mapping)
        # else dropped: unmapped once the window's own export of it is released


RECEIVE_POOL = BufferPool()
"""The process's pool of bulk receive buffers (:data:`RECEIVE_BUFFER` octets each)."""


class ReceiveBuffers:
    """Where the carrier's bytes land: the unfilled tail of a large buffer, handed out, once
    filled, as read-only slices that stay valid.

    Nothing that was filled is ever written again while any view of it is alive: when the
    tail is short the next read starts another buffer, and the old one lives as long as a
    slice of it does (payload queued for a reader, or forwarded by a relay without a copy).
    So bytes are copied once, from the kernel (or the TLS layer) straight into the buffer,
    and one read takes up to ``size`` bytes.

    Fresh memory is zero-filled twice when it is a ``bytearray`` (by the kernel as each 4 KiB
    page faults in on first touch, then by Python), one fault per page. So once a connection
    has filled a whole buffer (it carries bulk data, not just control messages), its later
    buffers of the pool's size come from ``pool`` (:class:`BufferPool`: mappings made with
    ``MAP_POPULATE``, which maps and zeroes all their pages in one call, and taken again once
    their last slice is gone), others are prefaulted mappings of their own. A consumer that
    copies what it reads (a FETCH landing in its block buffer) thus turns over two buffers whose
    pages stay mapped; a relay that caches slices gets back the buffers its cache let go of.

    Before that first whole buffer, the ``bytearray`` given up last is kept and taken again
    once no view of it is left (it refuses to be resized while anything views it), so a
    connection that carries control messages alone holds at most two small buffers. Where
    ``MAP_POPULATE`` does not exist every buffer is a ``bytearray``.
    """

    __slots__ = (
        "size",
        "min_read",
        "prefault",
        "pool",
        "_buffer",
        "_writable",
        "_readonly",
        "_filled",
        "_spare",
        "_bulk",
    )

    def __init__(
        self,
        size: int = RECEIVE_BUFFER,
        min_read: int = RECEIVE_MIN_READ,
        *,
        prefault: bool = True,
        pool: BufferPool | None = None,
    ) -> None:
        self.size = size
        self.min_read = min_read
        self.prefault = prefault and hasattr(mmap, "MAP_POPULATE")
        if pool is None:  # the process's, or one of this connection's own (two buffers)
            pool = RECEIVE_POOL if size == RECEIVE_POOL.size else BufferPool(size, keep=2)
        self.pool = pool
        self._buffer: Buffer = bytearray()
        self._writable = memoryview(self._buffer)
        self._readonly = self._writable.toreadonly()
        self._filled = 0
        self._spare: bytearray | None = None  # the bytearray given up last
        self._bulk = False  # a whole buffer was filled: later ones are prefaulted

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """The free tail to read into; another buffer when the tail is under ``min_read``
        bytes and does not hold ``sizehint`` (what the carrier has ready, where it knows)."""
        free = len(self._buffer) - self._filled
        if free < self.min_read and not 0 < sizehint <= free:
            self._replace(max(self.size, sizehint))
        return self._writable[self._filled :]

    def _replace(self, size: int) -> None:
        old = self._buffer
        if len(old) >= self.size:
            self._bulk = self.prefault
        spare = self._spare
        if self._bulk:
            self._spare = None  # no bytearray is taken again from now on
        elif type(old) is bytearray and len(old) == self.size:
            self._spare = old
        # our own views of the old buffer go first: only the slices handed out hold it, and a
        # pooled one that nothing holds is back in its pool before the next is taken
        del old
        self._buffer = self._writable = self._readonly = None  # type: ignore[assignment]
        buffer: Buffer
        if self._bulk and size == self.pool.size:
            buffer = self.pool.take()
        elif self._bulk:
            buffer = prefaulted(size)
        elif spare is not None and len(spare) == size and unviewed(spare):
            buffer = spare
        else:
            buffer = bytearray(size)
        self._buffer = buffer
        writable = memoryview(buffer)
        self._writable = writable if writable.format == "B" else writable.cast("B")
        self._readonly = self._writable.toreadonly()
        self._filled = 0

    def filled(self, nbytes: int) -> memoryview:
        """``nbytes`` were written at the start of the last :meth:`get_buffer`: those bytes,
        read-only."""
        start = self._filled
        self._filled = end = start + nbytes
        return self._readonly[start:end]


def prefaulted(size: int) -> mmap.mmap | bytearray:
    """``size`` bytes of fresh anonymous memory, every page mapped (and zeroed) by the kernel
    in this one call; a ``bytearray`` where the kernel refuses another mapping (a process may
    hold ``vm.max_map_count`` of them, 65,530 by default: 64 GiB of 1 MiB buffers)."""
    try:
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    except OSError:
        return bytearray(size)


def unviewed(buffer: bytearray) -> bool:
    """Whether no view of ``buffer`` is alive (it may then be written again): a bytearray that
    anything views cannot be resized. Its length and octets are left as they were."""
    try:
        buffer.append(0)
        del buffer[-1]
    except BufferError:
        return False
    return True
