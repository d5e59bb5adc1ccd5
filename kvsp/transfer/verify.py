"""Verifying a block while its body arrives (spec §6.7; DESIGN.md §5).

§6.7: a client checks ``Repr-Digest`` over the whole body and, when the body is in the
replica's codec, each returned layer against the Replica Record's ``layer_digests`` and that
list against the replica digest; a block that fails any check is never handed out, the caller
gets an exception instead. Verification runs in :class:`~kvsp.transfer.http11.BodyConsumer` s
that check the octets as they land, so that hashing overlaps the transfer:

* :class:`~kvsp.transfer.verify_slices.SliceBody`, for a body of known length: one buffer,
  its header parsed once, worker threads hashing large slices of it. ``"paired"`` feeds the
  ``Repr-Digest`` stream and the current layer's stream in one ordered native pass
  (:mod:`kvsp.sha256x2`), ``"slices"`` runs the two passes with hashlib, ``"inline"`` does
  that on the event loop.
* :class:`VerifyingBody` (here), for a body of unknown length (chunked), a caller's sink, and
  the ``"thread"`` and ``"split"`` placements: a :class:`~kvsp.container_reader.ContainerReader`.

This module also holds what both share: :func:`plan_block` checks, before any request, what
the record lets a client verify; :class:`VerifiedBlock` is what a client hands out, whichever
transport brought it; bodies land in buffers lent by a
:class:`~kvsp.transfer.buffers.BufferPool` (:func:`receive_buffer`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvsp import sha256x2
from kvsp.container import (
    Container,
    ContainerHeader,
    Geometry,
    Layer,
    check_magic_prefix,
    header_fields,
    header_size,
    replica_digest,
)
from kvsp.container_reader import ContainerReader, LayerSink
from kvsp.errors import ContainerError, DigestMismatch, Incompatible
from kvsp.records import ReplicaRecord
from kvsp.transfer.buffers import BufferPool
from kvsp.transfer.http11 import SCRATCH_SIZE

CODEC_END = 8
"""Octets of a body that name its codec: the field ends at octet 8 (§4.3 figure)."""
Hashing = Literal["inline", "thread", "split", "slices", "paired"]
DEFAULT_HASHING: Hashing = "paired" if sha256x2.ACCELERATED else "slices"
"""``"paired"`` where the native two-stream SHA-256 runs here (:mod:`kvsp.sha256x2`)."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class VerifiedBlock(Container):
    """A container whose octets passed §6.7 verification, with where it came from.

    ``producer_verified`` is true when the layers were checked against the Replica Record
    (the returned codec is the replica's); a transcoded block is protected by ``Repr-Digest``
    only. The layers are views of memory owned by the block (or of the caller's sink).
    """

    record: ReplicaRecord
    source: str
    producer_verified: bool
    body_digest: bytes | None = None
    """The SHA-256 of the HTTP body that carried the block, checked against its Repr-Digest
    (RFC 9530); None where no body was so checked (MOQT). It is the Repr-Digest of the block's
    encoding while the layers lie in that body in place (:func:`~kvsp.stores.blocks.
    container_octets` says so)."""


# -- what one request must return ---------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockPlan:
    """What one GET must return and how to verify it (§6.7)."""

    record: ReplicaRecord
    geometry: Geometry
    first: int
    last: int
    codec: int | None
    """The codec asked for with ``codec=n``; ``None``: none asked, the replica's expected."""

    def producer(self, codec: int) -> bool:
        """Whether a body in ``codec`` is the producer's (checked against the record).

        Raises:
            Incompatible: a codec that was not asked for.
        """
        record = self.record
        if codec != record.codec and codec != self.codec:
            raise Incompatible(f"holder answered codec {codec}, asked {self.codec or record.codec}")
        return codec == record.codec

    def check_layers(self, header: ContainerHeader) -> None:
        """Raises Incompatible: the body holds other layers than asked for."""
        if (header.first_layer, header.first_layer + header.layer_count - 1) != (
            self.first,
            self.last,
        ):
            raise Incompatible(
                f"asked for layers {self.first}-{self.last}, got {header.first_layer}-"
                f"{header.first_layer + header.layer_count - 1}"
            )

    def check_replica_digest(self, producer: bool, digests: Sequence[bytes]) -> None:
        """Check the layers' digests of a producer body against the replica digest when the
        record lists no ``layer_digests`` (then every layer was asked for).

        Raises:
            DigestMismatch: they do not give the replica digest.
        """
        record = self.record
        # §6.7: all layers retrieved (a record without layer_digests allows no range), so their
        # digests must give the replica digest
        computed = producer and record.layer_digests is None
        if computed and replica_digest(digests) != record.digest:
            raise DigestMismatch("the layers' digests do not give the replica digest")

    def reader(self, codec: int, body: memoryview | None, sink: LayerSink | None) -> _Reader:
        """The layer pass for a body whose header names ``codec``.

        Raises:
            Incompatible: a codec that was not asked for.
        """
        record = self.record
        self.producer(codec)
        in_place = _InPlaceSink(body) if sink is None and body is not None else None
        producer = codec == record.codec
        reader = ContainerReader(
            self.geometry,
            layer_digests=record.layer_digests if producer else None,
            sink=sink or in_place,
            compute_digests=producer and record.layer_digests is None,
            hash_container=False,
        )
        return _Reader(reader, producer)


def layer_range(
    record: ReplicaRecord, layers: tuple[int, int] | None, geometry: Geometry
) -> tuple[int, int]:
    """The inclusive layer range to ask of the record's replica (all when ``layers`` is
    ``None``), once the record is found able to verify it.

    Raises:
        Incompatible: a range outside the replica, or a strict sub-range of a replica whose
            record lists no ``layer_digests``.
        DigestMismatch: the record's ``layer_digests`` do not give its replica digest.
    """
    digests = record.layer_digests
    count = len(digests) if digests is not None else geometry.layers
    first, last = layers if layers is not None else (0, count - 1)
    if not 0 <= first <= last < count:
        raise Incompatible(f"layers {first}-{last} asked of a replica of {count} layers")
    if digests is None and (first, last) != (0, count - 1):
        # §4.4: layer_digests is REQUIRED for replicas served by layer range
        raise Incompatible("a layer range of a replica whose record lists no layer_digests")
    if digests is not None and replica_digest(digests) != record.digest:
        raise DigestMismatch("the record's layer_digests do not give its replica digest")
    return first, last


def plan_block(
    record: ReplicaRecord, layers: tuple[int, int] | None, geometry: Geometry, codec: int | None
) -> BlockPlan:
    """What a GET of the record's block must return (see :func:`layer_range`, whose errors it
    raises); ``codec`` is the one asked for, ``None`` for the replica's."""
    first, last = layer_range(record, layers, geometry)
    return BlockPlan(record=record, geometry=geometry, first=first, last=last, codec=codec)


# -- verification while the body arrives --------------------------------------------------------


def _ignore(piece: memoryview) -> None:
    """What a settled pass does with a piece."""


class _Pass:
    """One verification pass over the body's pieces, in order.

    ``inline`` runs ``consume`` at once; otherwise the pieces queue and one job at a time
    drains them on ``executor``, so hashing overlaps the arrival of further pieces.
    """

    def __init__(self, consume: Callable[[memoryview], None], executor: Executor | None) -> None:
        self._consume = consume
        self._executor = executor
        self._lock = threading.Lock()
        self._pending: list[memoryview] = []
        self._running = False
        self._closed = False
        self.error: BaseException | None = None
        self.done: concurrent.futures.Future[None] = concurrent.futures.Future()

    def push(self, piece: memoryview) -> None:
        """Queue (or consume) the next piece."""
        if self._executor is None:
            if self.error is None:
                try:
                    self._consume(piece)
                except BaseException as exc:
                    self.error = exc
            return
        with self._lock:
            if self.error is not None or self._closed:
                return
            self._pending.append(piece)
            if self._running:
                return
            self._running = True
        self._executor.submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._lock:
                batch, self._pending = self._pending, []
                if not batch or self.error is not None:
                    self._running = False
                    if self._closed:
                        self._settle()
                    return
            self._consume_all(batch)

    def _consume_all(self, batch: list[memoryview]) -> None:
        # a method of its own, so that no local of the worker's frame outlives the batch
        try:
            for piece in batch:
                self._consume(piece)
        except BaseException as exc:
            with self._lock:
                self.error = exc
                self._pending.clear()

    def close(self) -> concurrent.futures.Future[None]:
        """No more pieces; the future resolves when all are consumed (or the pass failed)."""
        with self._lock:
            self._closed = True
            if not self._running:
                self._settle()
        return self.done

    def _settle(self) -> None:
        if self.done.done():
            return
        # Drop the body before waking the caller: the worker must not hold the last reference,
        # or glibc frees the buffer from that thread and trims it, and the next block
        # page-faults all its memory again.
        self._consume = _ignore
        if self.error is not None:
            self.done.set_exception(self.error)
        else:
            self.done.set_result(None)


class _InPlaceSink:
    """Puts each layer where it already lies in the body buffer, so the reader's copy is onto
    itself (glibc's memmove returns at once when source and destination are equal)."""

    def __init__(self, body: memoryview) -> None:
        self._body = body
        self._offset: int | None = None

    def layer_buffer(self, index: int, k_len: int, v_len: int) -> tuple[memoryview, memoryview]:
        start = self._offset
        if start is None:  # the reader has checked the header: the first layer follows it
            start = header_size(int.from_bytes(self._body[12:16], "big"))  # §4.3 Layer Count
        self._offset = start + k_len + v_len
        return self._body[start : start + k_len], self._body[start + k_len : self._offset]


class _Reader:
    """The layer pass: a :class:`ContainerReader` and the layers it has completed."""

    def __init__(self, reader: ContainerReader, producer: bool) -> None:
        self.reader = reader
        self.producer = producer
        self.layers: list[Layer] = []

    def consume(self, piece: memoryview) -> None:
        self.layers.extend(self.reader.feed(piece))


def check_repr_digest(got: bytes, expected: bytes) -> None:
    """Raises DigestMismatch: the body's SHA-256 differs from its ``Repr-Digest``."""
    # §6.7: clients MUST verify Repr-Digest
    if got != expected:
        raise DigestMismatch(f"Repr-Digest {expected.hex()} but the body has {got.hex()}")


def receive_buffer(size: int, buffers: BufferPool | None) -> memoryview:
    """The buffer a body lands in: from ``buffers``, or a fresh one."""
    if buffers is not None:
        return buffers.take(size)
    # np.empty: the kernel writes every octet, so zero-filling 2 MiB would be wasted work
    return np.empty(size, dtype=np.uint8).data.cast("B")


class VerifyingBody:
    """A :class:`~kvsp.transfer.http11.BodyConsumer` that verifies a block as it arrives.

    With a known length the body lands in one buffer and the layers stay there; otherwise it
    lands in segments and the reader copies each layer out (or into ``sink``). ``hashing``
    says where the two passes run: ``"inline"`` on the event loop, ``"thread"`` both in one
    worker job, ``"split"`` each in its own (two cores hash at once). The first buffer comes
    from ``buffers`` when given (:class:`~kvsp.transfer.buffers.BufferPool`).

    Raises (from :meth:`written`, aborting the transfer early, or from :meth:`result`):
        DigestMismatch: ``Repr-Digest`` or a layer digest differs, or the layers do not give
            the replica digest.
        ContainerError: the body is not a KVB1 container of the geometry.
        Incompatible: a codec that was not asked for, or other layers than asked for.
    """

    def __init__(
        self,
        plan: BlockPlan,
        expected: bytes,
        length: int | None,
        *,
        executor: Executor | None,
        hashing: Hashing,
        sink: LayerSink | None = None,
        buffers: BufferPool | None = None,
    ) -> None:
        self._plan = plan
        self._expected = expected
        self._sink = sink
        self._executor = executor if hashing != "inline" else None
        self._split = hashing == "split"
        self._contiguous = length is not None
        self._first = self._view = receive_buffer(
            length if length is not None else 4 * SCRATCH_SIZE, buffers
        )
        self._fill = 0
        self._total = 0
        self._hash = hashlib.sha256()
        self._reader: _Reader | None = None
        self._passes: list[_Pass] = []

    def buffer(self, size: int) -> memoryview:
        if self._fill == len(self._view):  # segment full (only without a known length)
            self._view = memoryview(bytearray(max(len(self._view), SCRATCH_SIZE)))
            self._fill = 0
        return self._view[self._fill : self._fill + size]

    def written(self, n: int) -> None:
        start = self._fill
        self._fill += n
        self._total += n
        if not self._passes:
            if self._total < CODEC_END:
                return
            self._start()
            start = 0  # nothing was pushed yet; all of it lies in the first segment
        piece = self._view[start : self._fill]
        for p in self._passes:
            p.push(piece)
            if p.error is not None:
                raise p.error

    def _start(self) -> None:
        first = self._first
        check_magic_prefix(first[:4])
        codec = int.from_bytes(first[6:CODEC_END], "big")  # §4.3 figure: octets 6-7
        reader = self._plan.reader(codec, self._view if self._contiguous else None, self._sink)
        self._reader = reader
        if self._split:
            self._passes = [
                _Pass(self._hash.update, self._executor),
                _Pass(reader.consume, self._executor),
            ]
            return
        update = self._hash.update

        def both(piece: memoryview) -> None:
            update(piece)
            reader.consume(piece)

        self._passes = [_Pass(both, self._executor)]

    def finish(self) -> None:
        if not self._passes:
            raise ContainerError(f"a body of {self._total} octets is not a KVB1 container")

    def fail(self, exc: BaseException) -> None:
        for p in self._passes:
            p.close()

    async def result(self) -> tuple[Container, bool]:
        """The verified container and whether it was checked against the record.

        Raises:
            DigestMismatch, ContainerError, Incompatible: see the class.
        """
        waits = (asyncio.wrap_future(p.close()) for p in self._passes)
        for outcome in await asyncio.gather(*waits, return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome
        reader = self._reader
        if reader is None:
            raise RuntimeError("result() before finish()")
        reader.reader.close()
        check_repr_digest(self._hash.digest(), self._expected)
        return self._container_of(reader), reader.producer

    def _container_of(self, reader: _Reader) -> Container:
        header = reader.reader.header
        if header is None:
            raise RuntimeError("complete container without a header")
        self._plan.check_layers(header)
        self._plan.check_replica_digest(reader.producer, reader.reader.digests)
        return Container(**header_fields(header), layers=tuple(reader.layers))
