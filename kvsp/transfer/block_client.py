"""Block retrieval, storage and leases at holders (spec §6.1 "the index is advisory", §6.6, §6.7).

:class:`BlockClient` gets blocks over the bulk path (:mod:`kvsp.transfer.bulk`) and verifies
them while they arrive, as §6.7 requires: ``Repr-Digest`` over the whole body, and when the
returned codec is the replica's, each returned layer against the Replica Record's
``layer_digests`` and that list against the replica digest. A body of known length lands in
one buffer, its header is parsed once on the event loop, and worker threads hash large slices
of that buffer as they arrive (:class:`SliceBody`), with no second parse of the body. By
default (``"paired"``, where :mod:`kvsp.sha256x2` is built and the CPU has the SHA
extensions) one ordered pass feeds both SHA-256 streams at once, the ``Repr-Digest`` one and
the current layer's, interleaved in native code; ``"slices"`` (the default elsewhere) runs the
two passes with hashlib, the ``Repr-Digest`` pass in order and each layer in one call over its
adjacent K and V sections; ``"inline"`` does that on the event loop. Bodies of unknown length
(chunked), a caller's sink, and the older ``"thread"`` and ``"split"`` placements go through
:class:`VerifyingBody` and the :class:`~kvsp.container_reader.ContainerReader`. Measured side
by side (``bench_blocks.py``, 2 MiB blocks, 4 in flight, 2-core machine shared with other
jobs, the server on the same cores): ``"paired"`` 1.15-1.2 GB/s, 0.39-0.42 of a 2.8-3.0 GB/s
bare-socket HTTP floor over five runs on a quiet machine (median 0.40, on asyncio's loop and
on uvloop alike), ``"slices"`` 0.28-0.33; on a later day with a faster floor (3.3-3.8 GB/s)
``"paired"`` moved 1.3-1.55 GB/s, 0.36-0.45 of it. The two passes cost 1.25-1.7 ms of CPU a
block paired (the two streams keep the core's SHA unit about 95 % busy) against 2.3-3.0 ms
with hashlib. That is the ceiling on two cores: the one hashing thread is busy for the whole
run, a four-stream kernel (tried, not kept) hashed no faster per stream than the two-stream
one, and neither a second hashing thread (at any nice level), nor hashing on the loop when the
worker is busy, nor receiving and hashing each body in a worker thread of its own moved more
(measured side by side; the hand-off back to the event loop per block cost what the cache
saved). A block that fails any check is never handed out: the caller gets an exception, never
the octets. Bodies land in buffers lent by a :class:`~kvsp.transfer.buffers.BufferPool`, used
again once the block and every view of it are dropped.

:meth:`BlockClient.fetch` walks a block's replicas in order and treats a 404, a broken or slow
connection, a malformed body or a digest mismatch as "try the next one" (§6.1), returning
``None`` when all fail (the caller recomputes); :class:`FetchStats` keeps each attempt's
octets and seconds so that an instance can estimate its link rate to each holder (§6.3
``links``). Replicas held behind ``moqt://`` URIs are skipped here: the MOQT path serves them.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import hashlib
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Self

import httpx
import numpy as np

from kvsp import sha256x2
from kvsp.container import (
    DEFAULT_LIMITS,
    KVB1_HEADER,
    Container,
    ContainerHeader,
    Geometry,
    Layer,
    check_digest_list,
    check_magic_prefix,
    header_size,
    mismatch,
    parse_fixed_header,
    parse_header,
    replica_digest,
)
from kvsp.container_reader import ContainerReader, LayerSink
from kvsp.errors import BadRequest, ContainerError, DigestMismatch, Incompatible, KVSPError
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.records import LeaseGrant, LeaseRenewal, LeaseRequest, ReplicaRecord, loads
from kvsp.transfer.buffers import BufferPool
from kvsp.transfer.bulk import (
    DEFAULT_TIMEOUT_S,
    SCRATCH_SIZE,
    Buffer,
    BulkClient,
    BulkResponse,
    BytesBody,
    ResponseHead,
    split_url,
)
from kvsp.web.client import RemoteError, decode_answer, problem_error
from kvsp.web.http import parse_repr_digest, repr_digest
from kvsp.web.problems import KVSP_JSON, PROBLEM_JSON, dumps_json

BLOCK_MEDIA_TYPE = "application/kvsp-block"
MAX_ERROR_BODY = 64 * 1024
MAX_JSON_BODY = 1 << 20
_CODEC_END = 8  # the codec field ends at octet 8 of the KVB1 header (§4.3 figure)
_LEASE_ID = re.compile(r"[A-Za-z0-9._~-]{1,128}")
Hashing = Literal["inline", "thread", "split", "slices", "paired"]
DEFAULT_HASHING: Hashing = "paired" if sha256x2.ACCELERATED else "slices"
"""``"paired"`` where the native two-stream SHA-256 runs here (:mod:`kvsp.sha256x2`)."""
_SLICED = ("slices", "inline", "paired")  # the placements SliceBody serves
SLICE_STEP = 512 * 1024
"""Octets a ``"slices"`` body gathers before it hands them to a hashing job."""


class UnsupportedHolder(Incompatible):
    """A replica this client cannot reach: its holder is not an ``http``/``https`` URI."""


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
        # or glibc frees the 2 MiB buffer from that thread and trims it, and the next block
        # page-faults all its memory again (measured: 180 faults a block, +0.5 ms).
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


@dataclass(frozen=True, slots=True, kw_only=True)
class _Plan:
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


class _Reader:
    """The layer pass: a :class:`ContainerReader` and the layers it has completed."""

    def __init__(self, reader: ContainerReader, producer: bool) -> None:
        self.reader = reader
        self.producer = producer
        self.layers: list[Layer] = []

    def consume(self, piece: memoryview) -> None:
        self.layers.extend(self.reader.feed(piece))


def _receive_buffer(size: int, buffers: BufferPool | None) -> memoryview:
    """The buffer a body lands in: from ``buffers``, or a fresh one."""
    if buffers is not None:
        return buffers.take(size)
    # np.empty: the kernel writes every octet, so zero-filling 2 MiB would be wasted work
    return np.empty(size, dtype=np.uint8).data.cast("B")


class VerifyingBody:
    """A :class:`~kvsp.transfer.bulk.BodyConsumer` that verifies a block as it arrives.

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
        plan: _Plan,
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
        self._first = self._view = _receive_buffer(
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
            if self._total < _CODEC_END:
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
        codec = int.from_bytes(first[6:_CODEC_END], "big")  # §4.3 figure: octets 6-7
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
        # §6.7: clients MUST verify Repr-Digest
        got = self._hash.digest()
        if got != self._expected:
            raise DigestMismatch(f"Repr-Digest {self._expected.hex()} but the body has {got.hex()}")
        return self._container_of(reader), reader.producer

    def _container_of(self, reader: _Reader) -> Container:
        header = reader.reader.header
        if header is None:
            raise RuntimeError("complete container without a header")
        plan = self._plan
        plan.check_layers(header)
        record = plan.record
        # §6.7: all layers retrieved (a record without layer_digests allows no range), so their
        # digests must give the replica digest
        computed = reader.producer and record.layer_digests is None
        if computed and replica_digest(reader.reader.digests) != record.digest:
            raise DigestMismatch("the layers' digests do not give the replica digest")
        return Container(
            version=header.version,
            flags=header.flags,
            codec=header.codec,
            first_layer=header.first_layer,
            layer_count=header.layer_count,
            token_count=header.token_count,
            layers=tuple(reader.layers),
        )


class SliceBody:
    """A :class:`~kvsp.transfer.bulk.BodyConsumer` that verifies a block of known length by
    hashing slices of the one buffer it lands in (§6.7), with no second parse of the body.

    The header is parsed on the event loop as soon as it has arrived; from then on, every
    ``step`` octets (and at the end) a worker job extends the ``Repr-Digest`` hash (one job at
    a time, in order) and another hashes the layers completed meanwhile, each layer in one
    ``update`` over its K and V sections (adjacent in the body), so the workers make a few
    large GIL-free calls per block. The layers handed out are views of the buffer, which comes
    from ``buffers`` when given (:class:`~kvsp.transfer.buffers.BufferPool`).

    With ``paired`` (and :data:`kvsp.sha256x2.ACCELERATED`) a block in the replica's codec is
    hashed in one ordered pass instead: each slice feeds the ``Repr-Digest`` stream and the
    current layer's stream together, the two interleaved on the SHA extensions
    (:func:`kvsp.sha256x2.feed_layers`: one native call, and one GIL release, per slice
    however many layers it spans), and a layer's digest is checked as soon as its last octet
    is hashed.

    Raises: as :class:`VerifyingBody`.
    """

    def __init__(
        self,
        plan: _Plan,
        expected: bytes,
        length: int,
        *,
        executor: Executor | None,
        step: int = SLICE_STEP,
        paired: bool = False,
        buffers: BufferPool | None = None,
    ) -> None:
        self._plan = plan
        self._paired_wanted = paired and sha256x2.ACCELERATED
        self._paired = False  # decided with the codec: only producer layers have digests
        self._layer_hash: sha256x2.Sha256 | None = None  # restarted at each layer's end
        self._layer_at = 0  # the layer the paired pass is in
        self._expected = expected
        self._length = length
        self._executor = executor
        self._step = step
        self._body = _receive_buffer(length, buffers)
        self._fill = 0
        self._header: ContainerHeader | None = None
        self._layer_count = -1  # known once the fixed header has arrived
        self._producer = False
        self._check: Sequence[bytes] | None = None  # the record's digests, when checked
        self._hashing_layers = False
        self._starts: list[int] = []  # offset of each layer, then the end of the body
        self._digests: list[bytes] = []
        self._layers_sent = 0
        self._first_layer = 0
        self._layer_from = 0  # start of the layers not yet handed to a job
        # the Repr-Digest pass
        self._hash: Any = hashlib.sha256()
        self._target = 0  # octets the pass must reach
        self._hashed = 0  # octets it has reached
        self._hash_running = False
        # completion
        self._lock = threading.Lock()
        self._jobs = 0
        self._closed = False
        self.error: BaseException | None = None
        self._loop = asyncio.get_running_loop()
        self._done: asyncio.Future[None] = self._loop.create_future()

    # the consumer

    def buffer(self, size: int) -> memoryview:
        return self._body[self._fill : self._fill + size]

    def written(self, n: int) -> None:
        self._fill = fill = self._fill + n
        if self._header is None and not self._parse_header():
            return
        last = fill == self._length
        if last or fill - self._target >= self._step:
            self._hash_to(fill)
        starts = self._starts
        if self._paired:
            pass  # the Repr-Digest pass hashes the layers too
        elif self._hashing_layers and self._layers_sent < len(starts) - 1:
            done = bisect.bisect_right(starts, fill) - 1  # layers wholly received
            if done > self._layers_sent and (last or starts[done] - self._layer_from >= self._step):
                self._submit(self._hash_layers, self._layers_sent, done)
                self._layers_sent = done
                self._layer_from = starts[done]
        if self.error is not None:
            raise self.error

    def finish(self) -> None:
        if self._header is None:
            raise ContainerError(f"a body of {self._fill} octets is not a KVB1 container")
        self._close()

    def fail(self, exc: BaseException) -> None:
        self._close()

    # the header

    def _parse_header(self) -> bool:
        fill, body = self._fill, self._body
        if self._layer_count < 0:
            if fill < _CODEC_END:
                return False
            check_magic_prefix(body[:4])
            self._producer = self._plan.producer(int.from_bytes(body[6:_CODEC_END], "big"))
            if fill < KVB1_HEADER.size:
                return False
            fixed = parse_fixed_header(
                body[: KVB1_HEADER.size], self._plan.geometry, DEFAULT_LIMITS
            )
            self._layer_count = fixed.layer_count
        size = header_size(self._layer_count)
        if size > self._length:
            raise ContainerError(f"a body of {self._length} octets for a header of {size}")
        if fill < size:
            return False
        header = parse_header(body[:size], self._plan.geometry, DEFAULT_LIMITS)
        if header.total_length != self._length:
            raise ContainerError(
                f"a body of {self._length} octets for a container of {header.total_length}"
            )
        self._plan.check_layers(header)
        record = self._plan.record
        self._first_layer = header.first_layer
        if self._producer:
            self._hashing_layers = True
            if self._paired_wanted and header.layer_count > 0:
                self._paired = True
                self._hash = sha256x2.Sha256()
                self._layer_hash = sha256x2.Sha256()
            if record.layer_digests is not None:
                check_digest_list(
                    record.layer_digests, header.first_layer, header.layer_count, None
                )
                self._check = record.layer_digests
            self._digests = [b""] * header.layer_count
        starts = [size]
        for k_len, v_len in header.lengths:
            starts.append(starts[-1] + k_len + v_len)
        self._starts = starts
        self._layer_from = size
        self._header = header
        return True

    # the jobs

    def _submit(self, job: Callable[[int, int], None], a: int, b: int) -> None:
        with self._lock:
            self._jobs += 1
        if self._executor is None:
            self._run(job, a, b)
        else:
            self._executor.submit(self._run, job, a, b)

    def _run(self, job: Callable[[int, int], None], a: int, b: int) -> None:
        try:
            if self.error is None:
                job(a, b)
        except BaseException as exc:
            self.error = exc
        with self._lock:
            self._jobs -= 1
            settle = self._closed and self._jobs == 0
        if settle:
            self._settle()

    def _hash_to(self, target: int) -> None:
        with self._lock:
            self._target = target
            if self._hash_running:
                return
            self._hash_running = True
        self._submit(self._hash_job, 0, 0)

    def _hash_job(self, a: int, b: int) -> None:
        while True:
            with self._lock:
                start, end = self._hashed, self._target
                if start == end or self.error is not None:
                    self._hash_running = False
                    return
            if self._paired:
                self._hash_paired(start, end)
            else:
                self._hash.update(self._body[start:end])
            self._hashed = end

    def _hash_paired(self, start: int, end: int) -> None:
        """Feed ``[start, end)`` to the Repr-Digest stream and, from the first layer on, to
        the layer streams, checking every layer that completes; one native call (one GIL
        release) for the whole slice, however many layers it spans."""
        body, starts, check = self._body, self._starts, self._check
        layer = self._layer_hash
        assert layer is not None
        if start < starts[0]:  # the header: Repr-Digest only
            cut = min(end, starts[0])
            self._hash.update(body[start:cut])
            start = cut
        first = self._layer_at
        done = bisect.bisect_right(starts, end, first + 1)  # layers first..done-2 complete
        ends = [starts[k] - start for k in range(first + 1, done)]
        digests = sha256x2.feed_layers(self._hash, layer, body[start:end], ends)
        for i, got in enumerate(digests, first):
            index = self._first_layer + i
            if check is not None and got != check[index]:
                raise mismatch(index, got, check[index])
            self._digests[i] = got
        self._layer_at = self._layers_sent = first + len(digests)

    def _hash_layers(self, first: int, stop: int) -> None:
        body, starts, check = self._body, self._starts, self._check
        base = self._first_layer
        for i in range(first, stop):
            got = hashlib.sha256(body[starts[i] : starts[i + 1]]).digest()
            if check is not None and got != check[base + i]:
                raise mismatch(base + i, got, check[base + i])
            self._digests[i] = got

    def _close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            settle = self._jobs == 0
        if settle:
            self._settle()

    def _settle(self) -> None:
        if self._executor is None:
            self._set_done()
        else:
            self._loop.call_soon_threadsafe(self._set_done)

    def _set_done(self) -> None:
        if not self._done.done():
            self._done.set_result(None)

    async def result(self) -> tuple[Container, bool]:
        """The verified container and whether it was checked against the record.

        Raises:
            DigestMismatch, ContainerError, Incompatible: see :class:`VerifyingBody`.
        """
        await self._done
        if self.error is not None:
            raise self.error
        header = self._header
        if header is None or self._fill != self._length or self._hashed != self._length:
            raise ContainerError(f"truncated body: {self._fill} of {self._length} octets")
        # §6.7: clients MUST verify Repr-Digest
        got = self._hash.digest()
        if got != self._expected:
            raise DigestMismatch(f"Repr-Digest {self._expected.hex()} but the body has {got.hex()}")
        plan = self._plan
        plan.check_layers(header)
        if self._producer and self._layers_sent != header.layer_count:
            raise RuntimeError("complete body with layers left unhashed")
        # §6.7: all layers retrieved (a record without layer_digests allows no range), so their
        # digests must give the replica digest
        computed = self._producer and self._check is None
        if computed and replica_digest(self._digests) != plan.record.digest:
            raise DigestMismatch("the layers' digests do not give the replica digest")
        body, starts, first = self._body, self._starts, header.first_layer
        layers = []
        for i, (k_len, _) in enumerate(header.lengths):
            k_end = starts[i] + k_len
            layers.append(Layer(first + i, body[starts[i] : k_end], body[k_end : starts[i + 1]]))
        return (
            Container(
                version=header.version,
                flags=header.flags,
                codec=header.codec,
                first_layer=header.first_layer,
                layer_count=header.layer_count,
                token_count=header.token_count,
                layers=tuple(layers),
            ),
            self._producer,
        )


# -- per-source outcomes -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FetchOutcome:
    """One attempt at one source: what came (octets) in how long, or why not."""

    holder: str
    ok: bool
    octets: int
    seconds: float
    error: str | None = None
    """The error class name when the attempt failed (``NotFound``, ``DigestMismatch``, …)."""


@dataclass(slots=True)
class SourceStats:
    """Totals of the attempts at one holder."""

    attempts: int = 0
    successes: int = 0
    octets: int = 0
    seconds: float = 0.0
    """Wall time of the successful attempts (request sent to block verified)."""
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def mbit_per_s(self) -> float | None:
        """Delivered rate of the successful attempts (§6.3 ``links``), ``None`` before any."""
        if self.seconds <= 0 or self.octets == 0:
            return None
        return 8 * self.octets / self.seconds / 1e6


class FetchStats:
    """Per-holder outcomes of block fetches, and the last ``keep`` attempts in order."""

    def __init__(self, keep: int = 1024) -> None:
        self.sources: dict[str, SourceStats] = {}
        self.recent: deque[FetchOutcome] = deque(maxlen=keep)

    def record(self, outcome: FetchOutcome) -> None:
        """Count one attempt."""
        stats = self.sources.setdefault(outcome.holder, SourceStats())
        stats.attempts += 1
        if outcome.ok:
            stats.successes += 1
            stats.octets += outcome.octets
            stats.seconds += outcome.seconds
        elif outcome.error is not None:
            stats.errors[outcome.error] = stats.errors.get(outcome.error, 0) + 1
        self.recent.append(outcome)

    def mbit_per_s(self, holder: str) -> float | None:
        """The measured rate from ``holder``, ``None`` without a successful attempt."""
        stats = self.sources.get(holder)
        return stats.mbit_per_s if stats is not None else None


# -- the client ----------------------------------------------------------------------------------


def block_base(record: ReplicaRecord) -> str:
    """Where the record's block is served: its ``holder`` (§6.7).

    Raises:
        UnsupportedHolder: not an ``http``/``https`` URI (``moqt://`` replicas use MOQT).
    """
    return _http_base(record.holder)


def source_base(record: ReplicaRecord) -> str:
    """Where the record's block is served, over HTTP or MOQT: its ``holder``, ending in ``/``.

    Raises:
        UnsupportedHolder: neither an ``http``/``https`` nor a ``moqt`` URI.
    """
    if _is_moqt(record.holder):
        return record.holder if record.holder.endswith("/") else record.holder + "/"
    return _http_base(record.holder)


def _is_moqt(uri: str) -> bool:
    return uri[:7].lower() == "moqt://"


def lease_base(record: ReplicaRecord) -> str:
    """Where leases on the record's replica are taken: ``lease_base`` or else ``holder``.

    Raises:
        UnsupportedHolder: neither is an ``http``/``https`` URI.
    """
    return _http_base(record.lease_base or record.holder)


def _http_base(uri: str) -> str:
    try:
        split_url(uri)
    except ValueError:
        raise UnsupportedHolder(f"holder {uri[:120]!r} is not an HTTP(S) URL") from None
    return uri if uri.endswith("/") else uri + "/"


def _plan(
    record: ReplicaRecord, layers: tuple[int, int] | None, geometry: Geometry, codec: int | None
) -> _Plan:
    digests = record.layer_digests
    count = len(digests) if digests is not None else geometry.layers
    first, last = layers if layers is not None else (0, count - 1)
    if not 0 <= first <= last < count:
        raise Incompatible(f"layers {first}-{last} asked of a replica of {count} layers")
    if digests is None and layers is not None and (first, last) != (0, count - 1):
        # §4.4: layer_digests is REQUIRED for replicas served by layer range
        raise Incompatible("a layer range of a replica whose record lists no layer_digests")
    if digests is not None and replica_digest(digests) != record.digest:
        raise DigestMismatch("the record's layer_digests do not give its replica digest")
    return _Plan(record=record, geometry=geometry, first=first, last=last, codec=codec)


def _error_of(response: BulkResponse) -> KVSPError:
    """The error a non-2xx bulk answer stands for (same mapping as every KVSP client)."""
    body = response.body
    content = bytes(body.data) if isinstance(body, BytesBody) else b""
    answer = httpx.Response(response.status, headers=list(response.head.headers), content=content)
    return problem_error(answer)


class MoqtGetter(Protocol):
    """What :class:`BlockClient` hands ``moqt://`` replicas to:
    :class:`~kvsp.transfer.moqt_client.MoqtBlockClient`."""

    async def get_block(
        self,
        record: ReplicaRecord,
        *,
        layers: tuple[int, int] | None = None,
        geometry: Geometry,
        block_tokens: int | None = None,
        sink: LayerSink | None = None,
        holder: str | None = None,
    ) -> VerifiedBlock:
        """The verified block, FETCHed from ``holder`` (DESIGN §4)."""
        ...

    async def aclose(self) -> None:
        """Close its sessions."""
        ...


def default_workers(hashing: Hashing) -> int:
    """Verification threads a :class:`BlockClient` makes for ``hashing``.

    ``"paired"`` runs one pass per block, so its threads need only leave a core to the event
    loop that receives: all cores but one, at least one, at most four. On the 2-core machines
    of ``bench_blocks.py`` one thread moved 1.1-1.2 GB/s at 4 in flight where two moved
    0.9-1.0 (the second competes with the receiving loop and the server for the two cores).
    The hashlib placements keep two, so that ``"split"`` and ``"slices"`` hash their two
    passes of one block at once (``"paired"`` too where it falls back to ``"slices"``).
    """
    if hashing != "paired" or not sha256x2.ACCELERATED:
        return 2
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, (cores or 2) - 1))


class BlockClient:
    """Gets, stores and leases blocks at holders over the bulk path (use ``async with``).

    ``bulk`` shares a :class:`~kvsp.transfer.bulk.BulkClient` (not closed here);
    ``executor`` the verification threads (default: a pool of ``workers`` made here; by
    default :func:`default_workers`).
    ``hashing`` places the verification passes (see :class:`VerifyingBody`). ``buffers``
    lends the memory bodies land in and takes it back when a block is dropped (default: a
    :class:`~kvsp.transfer.buffers.BufferPool` of its own; ``BufferPool(0)`` reuses
    nothing). With ``moqt`` (closed with this client) :meth:`get_block` and :meth:`fetch`
    also serve ``moqt://`` replicas (a relay's) through it; leases stay HTTP (a relay's
    ``lease_base``).
    """

    def __init__(
        self,
        token: str | None,
        *,
        bulk: BulkClient | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        executor: Executor | None = None,
        workers: int | None = None,
        hashing: Hashing = DEFAULT_HASHING,
        slice_step: int = SLICE_STEP,
        stats: FetchStats | None = None,
        moqt: MoqtGetter | None = None,
        buffers: BufferPool | None = None,
    ) -> None:
        self._auth = {} if token is None else {"authorization": f"Bearer {token}"}
        self.moqt = moqt
        self._owns_bulk = bulk is None
        self.bulk = bulk or BulkClient(timeout=timeout)
        self._owns_executor = executor is None and hashing != "inline"
        self._executor = executor
        if self._owns_executor:
            count = default_workers(hashing) if workers is None else workers
            self._executor = ThreadPoolExecutor(count, thread_name_prefix="kvsp-verify")
        self.hashing: Hashing = hashing
        self.slice_step = slice_step
        self.stats = stats or FetchStats()
        self._owns_buffers = buffers is None
        self.buffers = BufferPool() if buffers is None else buffers

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the MOQT client, and the bulk client, the worker pool and the buffer pool if
        made here (blocks handed out stay valid)."""
        if self.moqt is not None:
            await self.moqt.aclose()
        if self._owns_bulk:
            await self.bulk.aclose()
        if self._owns_executor and self._executor is not None:
            self._executor.shutdown(wait=False)
        if self._owns_buffers:
            self.buffers.close()

    async def get_block(
        self,
        holder_base: str,
        record: ReplicaRecord,
        *,
        layers: tuple[int, int] | None = None,
        geometry: Geometry,
        codec: int | None = None,
        sink: LayerSink | None = None,
    ) -> VerifiedBlock:
        """GET the record's block (layers ``a..b`` inclusive, or all) and verify it (§6.7).

        ``codec`` asks the holder for that codec (``codec=n``); a block in another codec
        than the replica's is protected by ``Repr-Digest`` only. With ``sink`` the layers
        are written into caller memory as they arrive; after an error it holds garbage.

        Raises:
            NotFound: the holder does not hold the block (LayersUnavailable: those layers).
            DigestMismatch: ``Repr-Digest`` missing or different, a layer digest differs, or
                the record's digests disagree; no block is returned.
            ContainerError: the body is not a KVB1 container of ``geometry``.
            Incompatible: other layers or codec than asked, or layers the record cannot
                verify (no ``layer_digests``).
            UnsupportedHolder: ``holder_base`` is not an HTTP URI (nor a ``moqt`` one with
                ``moqt`` set).
            TransportError: connection failed, broke off or timed out; malformed HTTP.
            KVSPError: any other problem the holder answered.
        """
        if self.moqt is not None and _is_moqt(holder_base):
            if codec is not None and codec != record.codec:
                raise Incompatible("a MOQT holder serves the replica's codec only")
            return await self.moqt.get_block(
                record, layers=layers, geometry=geometry, sink=sink, holder=holder_base
            )
        base = _http_base(holder_base)
        plan = _plan(record, layers, geometry, codec)
        query = f"?layers={plan.first}-{plan.last}" if layers is not None else ""
        if codec is not None:
            query += ("&" if query else "?") + f"codec={codec}"
        url = f"{base}blocks/{record.compat_id.hex()}/{record.scope_id.hex()}/"
        url += record.block_key.hex() + query

        def consumer(
            head: ResponseHead, length: int | None
        ) -> VerifyingBody | SliceBody | BytesBody:
            if head.status != 200:
                return BytesBody(length, MAX_ERROR_BODY)
            try:
                expected = parse_repr_digest(head.get("repr-digest"))
            except BadRequest as exc:  # the holder's fault, not ours
                raise DigestMismatch(f"holder sent a malformed Repr-Digest: {exc}") from exc
            if expected is None:  # §6.7: holders MUST send it, clients MUST verify it
                raise DigestMismatch("holder sent no Repr-Digest (sha-256)")
            if self.hashing in _SLICED and length is not None and sink is None:
                executor = None if self.hashing == "inline" else self._executor
                paired = self.hashing == "paired"
                return SliceBody(
                    plan,
                    expected,
                    length,
                    executor=executor,
                    step=self.slice_step,
                    paired=paired,
                    buffers=self.buffers,
                )
            return VerifyingBody(
                plan,
                expected,
                length,
                executor=self._executor,
                hashing=self.hashing,
                sink=sink,
                buffers=self.buffers,
            )

        headers = {**self._auth, "accept": f"{BLOCK_MEDIA_TYPE}, {PROBLEM_JSON}"}
        response = await self.bulk.request("GET", url, headers=headers, consumer=consumer)
        body = response.body
        if not isinstance(body, VerifyingBody | SliceBody):
            raise _error_of(response)
        container, producer = await body.result()
        return VerifiedBlock(
            version=container.version,
            flags=container.flags,
            codec=container.codec,
            first_layer=container.first_layer,
            layer_count=container.layer_count,
            token_count=container.token_count,
            layers=container.layers,
            record=record,
            source=base,
            producer_verified=producer,
        )

    async def fetch(
        self,
        replicas: Sequence[ReplicaRecord],
        *,
        layers: tuple[int, int] | None = None,
        geometry: Geometry,
        sink: LayerSink | None = None,
    ) -> VerifiedBlock | None:
        """The block from the first replica that delivers it verified; ``None`` when none does.

        A 404, a broken, refused or slow connection, malformed HTTP, a digest mismatch or any
        other KVSP error at one replica means "try the next" (§6.1: the index is advisory);
        ``moqt://`` replicas are skipped unless ``moqt`` is set. Each attempt is recorded in
        :attr:`stats`.
        """
        for record in replicas:
            try:
                base = block_base(record) if self.moqt is None else source_base(record)
            except UnsupportedHolder:
                continue
            started = time.perf_counter()
            try:
                block = await self.get_block(
                    base, record, layers=layers, geometry=geometry, sink=sink
                )
            except KVSPError as exc:
                elapsed = time.perf_counter() - started
                self.stats.record(FetchOutcome(base, False, 0, elapsed, type(exc).__name__))
                continue
            octets = sum(layer.k.nbytes + layer.v.nbytes for layer in block.layers)
            elapsed = time.perf_counter() - started
            self.stats.record(FetchOutcome(base, True, octets, elapsed))
            return block
        return None

    async def put_block(
        self,
        holder_base: str,
        compat: CompatId,
        scope: ScopeId,
        key: BlockKey,
        data: Buffer | Sequence[Buffer],
    ) -> bool:
        """Store a container at a holder with ``If-None-Match: *`` (§6.7): ``True`` when
        stored, ``False`` when the holder already has the block (412) and kept its copy.

        Raises:
            KVSPError: the holder refused (e.g. Unauthorized, Forbidden, BadRequest).
            TransportError: the connection failed.
        """
        parts = [data] if isinstance(data, bytes | bytearray | memoryview) else list(data)
        digest = await asyncio.to_thread(_sha256_parts, parts)
        url = f"{_http_base(holder_base)}blocks/{compat.hex()}/{scope.hex()}/{key.hex()}"
        headers = {
            **self._auth,
            "content-type": BLOCK_MEDIA_TYPE,
            "if-none-match": "*",
            "repr-digest": repr_digest(digest),
            "accept": PROBLEM_JSON,
        }
        consumer = BytesBody.factory(MAX_ERROR_BODY)
        response = await self.bulk.request(
            "PUT", url, headers=headers, body=parts, consumer=consumer
        )
        if 200 <= response.status < 300:
            return True
        if response.status == 412:
            return False
        raise _error_of(response)

    async def acquire_lease(self, holder_base: str, request: LeaseRequest) -> LeaseGrant:
        """POST leases (§6.6): protect the request's blocks at the holder for ``ttl_ms``.

        Raises:
            LeaseQuota: beyond the client's quota (429 ``kvsp-lease-quota``).
            RemoteError: an answer that is not a lease grant.
            KVSPError: any other refusal; TransportError when unreachable.
        """
        answer = await self._json("POST", f"{_http_base(holder_base)}leases", request.to_json())
        return decode_answer(LeaseGrant.from_json, answer)

    async def renew_lease(self, holder_base: str, lease: str, ttl_ms: int) -> LeaseGrant:
        """PUT leases/{id} (§6.6): extend the lease to ``ttl_ms`` from now.

        Raises:
            LeaseQuota: beyond the client's quota. NotFound: no such lease (expired).
            KVSPError: any other refusal; TransportError when unreachable.
        """
        url = _lease_url(holder_base, lease)
        answer = await self._json("PUT", url, LeaseRenewal(ttl_ms=ttl_ms).to_json())
        return decode_answer(LeaseGrant.from_json, answer)

    async def release_lease(self, holder_base: str, lease: str) -> None:
        """DELETE leases/{id} (§6.6).

        Raises:
            NotFound: no such lease. KVSPError: any other refusal; TransportError.
        """
        await self._json("DELETE", _lease_url(holder_base, lease), None)

    async def _json(self, method: str, url: str, body: Any) -> Any:
        headers = {**self._auth, "accept": f"{KVSP_JSON}, {PROBLEM_JSON}"}
        content = None
        if body is not None:
            headers["content-type"] = KVSP_JSON
            content = dumps_json(body)
        consumer = BytesBody.factory(MAX_JSON_BODY)
        response = await self.bulk.request(
            method, url, headers=headers, body=content, consumer=consumer
        )
        if not 200 <= response.status < 300:
            raise _error_of(response)
        data = response.body.data if isinstance(response.body, BytesBody) else b""
        if not data:
            return None
        try:
            return loads(data)
        except KVSPError as exc:
            raise RemoteError(
                f"peer answered {response.status} with a body that is not JSON: {exc}",
                remote_status=response.status,
                body=bytes(data),
            ) from exc


def _lease_url(holder_base: str, lease: str) -> str:
    if _LEASE_ID.fullmatch(lease) is None:
        raise ValueError(f"not a lease identifier: {lease[:40]!r}")
    return f"{_http_base(holder_base)}leases/{lease}"


def _sha256_parts(parts: Sequence[Buffer]) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.digest()
