"""One KV block transfer over MOQT draft-16: where it goes, what it must deliver, and how
objects become verified layers (DESIGN.md §4; spec §4.4 ``moqt_namespace``, §6.7).

:func:`plan_fetch` checks a ``moqt://`` Replica Record before any request: its URI
(:func:`parse_moqt_uri`), its ``moqt_namespace`` naming its own block
(:func:`record_namespace`), codec raw, and the layers it lets a client verify.
:class:`ObjectFeed` turns a track's data events into layers through a
:class:`~kvsp.moqt_mapping.LayerAssembler`; :class:`LayerChecks` checks a FETCH's layers against
the record (§6.7), those of a large block in batches on worker threads, so that hashing one
batch overlaps receiving the next (hashlib releases the GIL on large inputs; one job a batch,
since a job a layer costs more to dispatch than it saves), and hands them out in order, each
only once it matched. :func:`verified_block` and :func:`check_live` rebuild and check the whole
block once every object has arrived, since the objects carry no container header.
:class:`BlockStream` hands the layers out one by one as each is verified.
These are the parts of a transfer that hold no session; the sessions, and the FETCH and
SUBSCRIBE that drive these parts, are :class:`~kvsp.transfer.moqt_client.MoqtBlockClient`'s.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import threading
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar
from urllib.parse import urlsplit

from kvsp import sha256x2
from kvsp.container import Container, Geometry, Layer, layer_digest, mismatch, replica_digest
from kvsp.container_reader import LayerSink
from kvsp.errors import (
    ContainerError,
    DigestMismatch,
    Forbidden,
    Incompatible,
    InvalidIdentifier,
    KVSPError,
    LayersUnavailable,
    NotFound,
    RecordError,
    TransportError,
    UnsupportedHolder,
)
from kvsp.moqt_mapping import LayerAssembler, find_layer_digest, parse_kv_namespace
from kvsp.records import ReplicaRecord
from kvsp.registries import Codec
from kvsp.transfer.verify import VerifiedBlock, layer_range
from moqt.asyncio import RequestRejected
from moqt.errors import ObjectStatus, RequestErrorCode
from moqt.objects import ObjectRun
from moqt.session_events import (
    DataStreamReset,
    MalformedTrackDetected,
    MOQTEvent,
    ObjectData,
    ObjectEnd,
    ObjectHeader,
)
from moqt.wire import KeyValuePair, TrackNamespace

MOQT_SCHEME = "moqt"
CARRIERS = {"moqt": "quic", "moqt+tls": "tls", "moqt+tcp": "tcp", "moqt+unix": "unix"}
"""URI scheme → the carrier under the MOQT session (DESIGN §4 Carriers)."""
DEFAULT_MOQT_PORT = 443  # d16 §3.1.2: the moqt URI scheme's default port
HASH_INLINE_BELOW = 256 * 1024
"""A FETCH of fewer payload octets is hashed on the event loop as it arrives (the HTTP client's
rule, :data:`kvsp.transfer.block_client.INLINE_BELOW`): a worker thread costs more than it saves."""
HASH_BATCH = 1024 * 1024
"""The most octets of queued layers one worker-thread job hashes (:func:`hash_batch`)."""
HASH_THREADS = 2
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class MoqtAddress:
    """Where a MOQT URI points: ``moqt://host[:port]/path`` is raw QUIC (ALPN ``moqt-16``);
    ``moqt+tls``, ``moqt+tcp`` and ``moqt+unix`` are MOQT over QMux over TLS, plain TCP or the
    Unix socket ``socket_path`` (:mod:`kvsp.transfer.moqt_carriers`)."""

    host: str
    port: int
    path: str | None
    carrier: str = "quic"
    socket_path: str | None = None

    def __str__(self) -> str:
        if self.carrier == "unix":
            return f"unix:{self.socket_path}"
        where = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.carrier}:{where}:{self.port}"


@functools.lru_cache(maxsize=1024)
def parse_moqt_uri(uri: str) -> MoqtAddress:
    """The address of a ``moqt``, ``moqt+tls``, ``moqt+tcp`` or ``moqt+unix`` URI; a ``moqt``
    port defaults to 443, the others need one (a ``moqt+unix`` URI has none: its path is the
    socket's). Every FETCH reads its record's holder and carriers again, so the (immutable)
    addresses of recent URIs are kept; a URI that fails is not, it raises each time.

    Raises:
        UnsupportedHolder: not such a URI with a host and a valid port.
    """
    parts = urlsplit(uri)
    try:
        port = parts.port
    except ValueError:
        port = -1
    carrier = CARRIERS.get(parts.scheme.lower())
    if carrier is None or not parts.hostname or port == -1:
        raise UnsupportedHolder(
            f"{uri[:120]!r} is not a moqt, moqt+tls, moqt+tcp or moqt+unix URI with a host"
        )
    if carrier == "unix":
        if port is not None or not parts.path.startswith("/") or parts.query:
            raise UnsupportedHolder(f"{uri[:120]!r}: moqt+unix://HOST/absolute/socket/path")
        return MoqtAddress(parts.hostname, 0, None, carrier, parts.path)
    if carrier != "quic" and not port:
        raise UnsupportedHolder(f"{uri[:120]!r} names no port")
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    return MoqtAddress(parts.hostname, port or DEFAULT_MOQT_PORT, path or None, carrier)


def record_namespace(record: ReplicaRecord) -> TrackNamespace:
    """The record's ``moqt_namespace`` fields, checked to name the record's own block.

    Raises:
        RecordError: no ``moqt_namespace``, or one that is not a KV block namespace or names
            another compat_id, scope_id or block_key than the record.
    """
    path = "$.moqt_namespace"
    fields = record.namespace_fields
    if fields is None:
        raise RecordError("a replica served over MOQT needs moqt_namespace", path=path)
    try:
        named = parse_kv_namespace(fields)
    except InvalidIdentifier as exc:
        raise RecordError(f"not a KV block namespace: {exc}", path=path) from None
    if named != (record.compat_id, record.scope_id, record.block_key):
        raise RecordError("names another block than the record", path=path)
    return fields


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class LiveBlock(Container):
    """A block received from a live track: its layers, where from, and how it was checked.

    ``in_band_verified``: every layer matched the digest its object carried; ``record``: the
    published Replica Record the layers were also (or only) checked against.
    """

    source: str
    block_digest: bytes
    record: ReplicaRecord | None
    in_band_verified: bool


class BlockStream(Generic[T]):
    """Verified layers as they arrive (``async for``), then the whole block (:meth:`block`).

    A layer is yielded only once verified; an error ends the iteration and nothing more is
    handed out.
    """

    def __init__(self, run: Callable[[BlockStream[T]], AsyncGenerator[Layer, None]]) -> None:
        self._iterator = run(self)
        self.result: T | None = None
        self._error: BaseException | None = None

    def __aiter__(self) -> BlockStream[T]:
        return self

    async def __anext__(self) -> Layer:
        if self._error is not None:
            raise self._error
        try:
            return await self._iterator.__anext__()
        except StopAsyncIteration:
            raise
        except BaseException as exc:
            self._error = exc
            raise

    async def block(self) -> T:
        """Read what is left; the verified block.

        Raises:
            DigestMismatch, ContainerError, NotFound, TransportError: as the transfer failed
                (again, when iteration already failed).
        """
        if self._error is not None:
            raise self._error
        try:  # the generator itself, not __anext__ a layer at a time: nothing is handed out
            async for _ in self._iterator:
                pass
        except BaseException as exc:
            self._error = exc
            raise
        if self.result is None:
            raise RuntimeError("the block stream ended without a block")
        return self.result

    async def aclose(self) -> None:
        """Stop early (the request is cancelled)."""
        await self._iterator.aclose()


class Watchdog:
    """Calls ``on_stall`` when ``progress`` (the attribute, or what the callable given as
    ``progress`` returns) has not moved for ``idle`` seconds; from now, or with ``armed``
    False from the first :meth:`arm` (a consumer that never has to wait needs no timer)."""

    def __init__(
        self,
        idle: float,
        on_stall: Callable[[], None],
        progress: Callable[[], int] | None = None,
        *,
        armed: bool = True,
    ) -> None:
        self.progress = 0
        self.fired = False
        self._seen = -1
        self._idle = idle
        self._on_stall = on_stall
        self._measure = progress
        self._handle: asyncio.TimerHandle | None = None
        if armed:
            self.arm()

    def arm(self) -> None:
        """Start watching, if not yet started."""
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(self._idle, self._check)

    def _check(self) -> None:
        progress = self.progress if self._measure is None else self._measure()
        if progress == self._seen:
            self.fired = True
            self._on_stall()
            return
        self._seen = progress
        self._handle = asyncio.get_running_loop().call_later(self._idle, self._check)

    def cancel(self) -> None:
        """Stop watching."""
        if self._handle is not None:
            self._handle.cancel()


class ObjectFeed:
    """Feeds a track's data events to a :class:`LayerAssembler`, skipping status objects
    (relays append an empty END_OF_GROUP object). With ``in_band`` False the objects' in-band
    layer digests are not read (a FETCH checks against the record alone)."""

    def __init__(self, assembler: LayerAssembler, *, in_band: bool = True) -> None:
        self.assembler = assembler
        self._skip: set[int] = set()
        self._read_in_band = in_band  # False: the caller checks against the record only
        self._in_band: bytes | None = None

    def on(self, event: MOQTEvent) -> tuple[Layer, bytes | None, bytes | None] | None:
        """The layer (its computed digest, None where the assembler does not hash, and its
        in-band digest) an event completes, if any.

        Raises:
            ContainerError: an object that is not a layer of the block.
            TransportError: the data stream was reset.
        """
        if isinstance(event, ObjectData):  # most events: payload pieces
            if not self._skip or event.stream_id not in self._skip:
                self.assembler.feed(event.data)
        elif isinstance(event, ObjectHeader):
            start = event.object
            if start.status != ObjectStatus.NORMAL:
                self._skip.add(event.stream_id)
                return None
            if self._read_in_band:
                self._in_band = in_band_digest(start.extensions)
            self.assembler.begin(start.group_id, start.object_id, start.payload_length)
        elif isinstance(event, ObjectEnd):
            if event.stream_id in self._skip:
                self._skip.discard(event.stream_id)
                return None
            layer, digest = self.assembler.end()
            return layer, digest, self._in_band
        elif isinstance(event, DataStreamReset | MalformedTrackDetected):
            raise TransportError(f"the block's data stream broke off: {event}")
        return None


class FetchLanding:
    """The payload sink of a FETCH (:meth:`moqt.transport.TrackReader.set_payload_sink` with
    ``object_end`` and ``runs``): pieces go into the :class:`LayerAssembler` and each ended
    layer into the :class:`LayerChecks` from the session's receive path, so a block of many
    objects costs no event and no wake-up of the consumer per piece, header or end; the whole
    objects a received piece holds (a small block's) come as one run, landed in one call each.
    Status objects (a relay's END_OF_GROUP) are skipped, and in-band digests are not read (the
    record is authoritative).

    A callback never raises into the carrier's receive path: the first error (an object that
    is not a layer of the block, a mismatch found inline) is kept in :attr:`error`, everything
    after it is ignored, and ``wake`` tells the consumer, which raises it. ``wake`` is also
    called when a layer was checked at once (hashed as it arrived); batched layers wake the
    consumer when their job ends (:class:`LayerChecks` ``on_hashed``).
    """

    def __init__(
        self, assembler: LayerAssembler, checks: LayerChecks, wake: Callable[[], None]
    ) -> None:
        self.assembler = assembler
        self.checks = checks
        self.progress = 0
        """Pieces and ends taken so far (the watchdog's measure)."""
        self.error: Exception | None = None
        self._wake = wake
        self._open: ObjectHeader | None = None  # the object the assembler has begun
        self._skipping: ObjectHeader | None = None  # a status object in progress

    def payload(self, header: ObjectHeader, data: memoryview, offset: int) -> None:
        """A piece of ``header``'s payload (the sink)."""
        self.progress += 1
        if self.error is not None or header is self._skipping:
            return
        try:
            if header is not self._open:
                self._begin(header)
            if header is self._open:
                self.assembler.feed(data)
        except Exception as exc:  # noqa: BLE001 - raised by the consumer (see the class)
            self._fail(exc)

    def object_end(self, header: ObjectHeader) -> None:
        """``header``'s object is complete (the object-end sink)."""
        self.progress += 1
        if self.error is not None:
            return
        if header is self._skipping:
            self._skipping = None
            return
        try:
            if header is not self._open:  # an object without payload octets
                self._begin(header)
                if header is not self._open:
                    self._skipping = None
                    return
            self._open = None
            layer, digest = self.assembler.end()
            self.checks.add(layer, digest)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            return
        if digest is not None:
            self._wake()

    def run(self, run: ObjectRun) -> None:
        """Whole objects, each a layer (the run sink): landed one after another, then hashed
        together where the assembler hashes (:meth:`LayerAssembler.digests`) and checked, the
        consumer woken once for the run. Nothing after the first object that is not a layer
        or the first layer that fails its check is handed out."""
        self.progress += 1
        if self.error is not None:
            return
        assembler = self.assembler
        landed: list[Layer] = []
        error: Exception | None = None
        try:
            assembler.land(run, landed)
        except Exception as exc:  # noqa: BLE001 - raised by the consumer (see the class)
            error = exc
        try:
            self.checks.add_run(landed, assembler.digests(landed) if assembler.hashing else None)
        except Exception as exc:  # noqa: BLE001
            error = exc  # a layer before the one that stopped the landing
        if error is not None:
            self._fail(error)
        elif assembler.hashing and landed:
            self._wake()

    def _begin(self, header: ObjectHeader) -> None:
        start = header.object
        if start.status != ObjectStatus.NORMAL:
            self._skipping = header
            return
        self.assembler.begin(start.group_id, start.object_id, start.payload_length)
        self._open = header

    def _fail(self, exc: Exception) -> None:
        self.error = exc
        self._wake()


def in_band_digest(extensions: tuple[KeyValuePair, ...]) -> bytes | None:
    """The layer digest an object carries in its extensions (DESIGN.md §4), if any.

    Raises:
        ContainerError: a malformed extension block (the object cannot be trusted).
    """
    try:
        return find_layer_digest(extensions)
    except Exception as exc:
        raise ContainerError(f"malformed layer-digest extension: {exc}") from None


_hashers: ThreadPoolExecutor | None = None
_hashers_lock = threading.Lock()


def hash_executor() -> Executor:
    """The worker threads that hash large FETCHes' layers (made at first use, shared)."""
    global _hashers
    with _hashers_lock:
        if _hashers is None:
            _hashers = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="kvsp-moqt-hash")
        return _hashers


def hash_batch(octets: int, most: int = HASH_BATCH) -> int:
    """The batch of a FETCH of about ``octets`` payload octets hashed on worker threads: half
    of it, at most ``most``. The first half is hashed while the second arrives; more, smaller
    jobs would overlap more but each costs the event loop a hand-off (a job, a future, a
    wake-up), which on two cores costs more than the overlap saves
    (``bench/bench_hash_batch.py``; bench/NOTES.md)."""
    return max(1, min(most, octets // 2))


def digest_layers(layers: Sequence[Layer]) -> list[bytes]:
    """Each layer's digest (§4.3), in order: one worker-thread job."""
    return [layer_digest(layer.k, layer.v) for layer in layers]


def digest_span(data: memoryview, size: int) -> list[bytes]:
    """The digests of the ``size``-octet layers that ``data`` holds one after another: one
    worker-thread job. With :mod:`kvsp.sha256x2`, one native call that takes the GIL back once
    (hashlib would take it back after every layer, each time waiting for the event loop) and
    hashes two layers at a time on its interleaved lanes."""
    if not sha256x2.ACCELERATED:
        return [hashlib.sha256(data[at : at + size]).digest() for at in range(0, len(data), size)]
    return sha256x2.digests(data, size)


class LayerChecks:
    """The layers of one FETCH checked against the record (§6.7) and handed out in order.

    :meth:`add` takes each layer as its object ends, with its digest when the assembler hashed
    it as it arrived (checked at once), or without: then it is queued, and once the queue holds
    ``batch`` octets (or at :meth:`flush`) the queued layers are hashed in one worker-thread
    job (``span``, where given, views consecutive layers as one buffer, hashed in one call);
    ``on_hashed`` is called on the event loop as each job finishes.
    :meth:`ready` hands out the layers that matched, in order, up to the first that did
    not, which raises :class:`~kvsp.errors.DigestMismatch` naming it: no later layer is handed
    out. With ``expected`` None (no ``layer_digests``) nothing is handed out until
    :meth:`finish` has found the digests of all layers to give the ``replica`` digest.
    """

    def __init__(
        self,
        expected: Sequence[bytes] | None,
        replica: bytes,
        *,
        batch: int = HASH_BATCH,
        executor: Executor | None = None,
        span: Callable[[int, int], memoryview | None] | None = None,
        on_hashed: Callable[[], None] | None = None,
    ) -> None:
        self._expected = expected
        self._on_hashed = on_hashed
        self._span = span
        self._replica = replica
        self._batch = batch
        self._executor = executor
        self._queued: list[Layer] = []
        self._octets = 0
        self._jobs: deque[tuple[list[Layer], asyncio.Future[list[bytes]]]] = deque()
        self._matched: deque[Layer] = deque()  # checked, not yet handed out
        self._held: list[Layer] = []  # no layer_digests: wait for the replica digest
        self._tail: list[tuple[Layer, bytes]] = []  # hashed at the end, after the jobs
        self._digests: dict[int, bytes] = {}

    @property
    def pending(self) -> bool:
        """Whether layers are queued or being hashed."""
        return bool(self._jobs or self._queued or self._tail)

    def add(self, layer: Layer, digest: bytes | None) -> None:
        """A layer whose object ended, with its digest if already computed.

        Raises:
            DigestMismatch: ``digest`` differs from the record's.
        """
        if digest is not None:
            self._check(layer, digest)
            return
        self._queued.append(layer)
        self._octets += len(layer.k) + len(layer.v)
        if self._octets >= self._batch:
            self.flush()

    def add_run(self, layers: Sequence[Layer], digests: Sequence[bytes] | None) -> None:
        """Layers whose objects ended together, in order, with their digests (as many) if
        computed: what :meth:`add` does with each.

        Raises:
            DigestMismatch: the first layer whose digest differs from the record's (the layers
                before it are taken, none after it).
        """
        expected = self._expected
        if digests is None:
            for layer in layers:
                self.add(layer, None)
        elif expected is not None and digests == [expected[layer.index] for layer in layers]:
            self._matched.extend(layers)  # all of them match: §6.7 for each
        else:
            for layer, digest in zip(layers, digests, strict=True):
                self._check(layer, digest)

    def flush(self) -> None:
        """Hash the queued layers now (one worker-thread job), however few."""
        if not self._queued:
            return
        batch, self._queued, self._octets = self._queued, [], 0
        executor = self._executor or hash_executor()
        loop = asyncio.get_running_loop()
        first, last = batch[0].index, batch[-1].index
        whole = self._span(first, last) if self._span and last - first + 1 == len(batch) else None
        if whole is not None:  # consecutive layers in one buffer: one native call
            job = loop.run_in_executor(executor, digest_span, whole, len(whole) // len(batch))
        else:
            job = loop.run_in_executor(executor, digest_layers, batch)
        if self._on_hashed is not None:
            on_hashed = self._on_hashed
            job.add_done_callback(lambda _: on_hashed())
        self._jobs.append((batch, job))

    def _check(self, layer: Layer, digest: bytes) -> None:
        expected = self._expected
        if expected is None:
            self._digests[layer.index] = digest
            self._held.append(layer)
        elif digest != expected[layer.index]:
            # §6.7: clients MUST verify the layer digests against the record
            raise mismatch(layer.index, digest, expected[layer.index])
        else:
            self._matched.append(layer)

    def ready(self) -> Iterator[Layer]:
        """The layers that matched so far, in order (from the finished jobs at the head).

        Raises:
            DigestMismatch: the next layer differs from the record (after the ones before it).
        """
        matched, jobs = self._matched, self._jobs
        while True:
            while matched:
                yield matched.popleft()
            if jobs and jobs[0][1].done():
                batch, job = jobs.popleft()
                hashed: Sequence[tuple[Layer, bytes]] = list(zip(batch, job.result(), strict=True))
            elif not jobs and self._tail:
                hashed, self._tail = self._tail, []
            else:
                return
            for layer, digest in hashed:
                self._check(layer, digest)
                while matched:
                    yield matched.popleft()

    async def wait(self) -> None:
        """The transfer has ended: hash what is queued here, on the event loop thread, which
        has nothing else to do while the worker finishes the batches before it (the last
        batch then costs no hand-over); then wait for the oldest job (none: return at once)."""
        if self._queued:
            batch, self._queued, self._octets = self._queued, [], 0
            self._tail.extend(zip(batch, digest_layers(batch), strict=True))
        if self._jobs:
            await asyncio.wait([self._jobs[0][1]])

    def finish(self) -> None:
        """Every layer has been hashed: without ``layer_digests``, check that their digests
        give the replica digest, then let :meth:`ready` hand them out.

        Raises:
            DigestMismatch: they do not.
        """
        if self.pending:
            raise RuntimeError("layers are still being hashed")
        if self._held:
            # §6.7: all layers retrieved, so their digests must give the replica digest
            digests = [self._digests[index] for index in sorted(self._digests)]
            if replica_digest(digests) != self._replica:
                raise DigestMismatch("the layers' digests do not give the replica digest")
            self._held.sort(key=lambda layer: layer.index)
            self._matched.extend(self._held)
            self._held.clear()

    def cancel(self) -> None:
        """Drop what is queued and cancel the jobs not yet started (the transfer stopped)."""
        self._queued.clear()
        self._tail.clear()
        for _, job in self._jobs:
            job.cancel()
        self._jobs.clear()


def rejected_error(exc: RequestRejected) -> KVSPError:
    """The KVSP error a refused FETCH or SUBSCRIBE stands for (its REQUEST_ERROR code)."""
    code = exc.error_code
    if code == RequestErrorCode.DOES_NOT_EXIST:
        return NotFound(f"the holder has no such block track: {exc.reason}")
    if code == RequestErrorCode.INVALID_RANGE:
        return LayersUnavailable(f"the holder does not hold those layers: {exc.reason}")
    if code in (
        RequestErrorCode.UNAUTHORIZED,
        RequestErrorCode.MALFORMED_AUTH_TOKEN,
        RequestErrorCode.EXPIRED_AUTH_TOKEN,
    ):
        return Forbidden(f"the holder refused: {exc.reason}")
    return TransportError(f"the holder refused with {code:#x}: {exc.reason}")


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchPlan:
    """One FETCH of a stored track and how to verify it (§6.7)."""

    record: ReplicaRecord
    address: MoqtAddress
    namespace: TrackNamespace
    first: int
    last: int
    geometry: Geometry
    token_count: int | None
    sink: LayerSink | None

    @property
    def octets(self) -> int:
        """About how many octets the FETCH carries: the record's size, in proportion to the
        layers asked for (what its hashing batches are sized by, :func:`hash_batch`)."""
        return self.record.size * (self.last - self.first + 1) // max(1, self.geometry.layers)


def plan_fetch(
    record: ReplicaRecord,
    holder: str | None,
    layers: tuple[int, int] | None,
    geometry: Geometry,
    token_count: int | None,
    sink: LayerSink | None,
) -> FetchPlan:
    """The FETCH of the record's stored track at ``holder`` (default: the record's) for
    ``layers`` (default: all), checked against what the record lets a client verify.

    Raises:
        UnsupportedHolder: not a ``moqt`` URI. RecordError: the record's ``moqt_namespace``
            does not name its block. Incompatible: codec not raw, a layer count other than
            the geometry's, or a range the record cannot verify. DigestMismatch: the record's
            ``layer_digests`` do not give its replica digest.
    """
    address = parse_moqt_uri(holder or record.holder)
    if record.codec != Codec.RAW:
        # DESIGN §4: objects reproduce the layer digests for codec raw only
        raise Incompatible(f"codec {record.codec} is not carried over MOQT")
    namespace = record_namespace(record)
    digests = record.layer_digests
    if digests is not None and len(digests) != geometry.layers:
        raise Incompatible(
            f"record lists {len(digests)} layers, the geometry has {geometry.layers}"
        )
    first, last = layer_range(record, layers, geometry)
    return FetchPlan(
        record=record,
        address=address,
        namespace=namespace,
        first=first,
        last=last,
        geometry=geometry,
        token_count=token_count,
        sink=sink,
    )


RecordSource = ReplicaRecord | Callable[[], Awaitable[ReplicaRecord | None]] | None
"""The record a live block is checked against at completion: the record, a callable that
fetches the producer's published record, or ``None`` (in-band digests only)."""


def check_live(record: ReplicaRecord | None, digests: list[bytes], unchecked: bool) -> None:
    """Verify a completed live block's layer digests against the published record.

    Raises:
        DigestMismatch: they differ, or some layers had no in-band digest and there is no
            record to check them against.
    """
    if record is None:
        if unchecked:
            raise DigestMismatch("layers without in-band digests and no record to verify them")
        return
    if record.layer_digests is not None:
        for index, (got, want) in enumerate(zip(digests, record.layer_digests, strict=False)):
            if got != want:
                raise mismatch(index, got, want)
    if replica_digest(digests) != record.digest:
        raise DigestMismatch("the live block's layers do not give the record's replica digest")


def verified_block(plan: FetchPlan, assembler: LayerAssembler) -> VerifiedBlock:
    """The container the objects carried, its header rebuilt from the record and geometry."""
    return VerifiedBlock(
        version=1,
        flags=0,
        codec=plan.record.codec,
        first_layer=plan.first,
        layer_count=assembler.count,
        token_count=assembler.token_count or 0,
        layers=assembler.layers(),
        record=plan.record,
        source=plan.record.holder,
        producer_verified=True,
    )
