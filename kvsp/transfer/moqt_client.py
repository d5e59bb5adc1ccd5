"""KVSP over MOQT draft-16: the verified consumer, and the one client for both transports
(DESIGN.md §4; spec §4.3, §4.4 ``moqt_namespace``, §6.1, §6.7).

:class:`MoqtBlockClient` gets a replica named by a ``moqt://`` Replica Record. It checks that
the record's ``moqt_namespace`` names the record's own block, FETCHes the stored track (named by
the replica digest) for the asked layers, checks every object against the record's
``layer_digests`` before handing its layer out (§6.7: a layer that fails is never handed out,
and the transfer stops), and rebuilds the container header the objects lack from the record
and the descriptor's geometry. :meth:`MoqtBlockClient.subscribe_live` follows a block still
being computed: each layer is checked by the digest its object carries in-band, or, where a
relay stripped it, at completion against the producer's published record.
:class:`UnifiedBlockClient` walks replicas of either kind in the order given (§6.1: any failure
means "try the next").

The publisher side lives in :mod:`kvsp.transfer.moqt_publisher` and is re-exported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Self, TypeVar
from urllib.parse import urlsplit

from kvsp.container import Container, Geometry, Layer, mismatch, replica_digest
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
)
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.records import ReplicaRecord
from kvsp.registries import Codec
from kvsp.transfer.block_client import (
    BlockClient,
    FetchOutcome,
    FetchStats,
    UnsupportedHolder,
    VerifiedBlock,
)
from kvsp.transfer.moqt_publisher import (
    REFUSED_REQUESTS,
    BlockSource,
    LiveTrack,
    LiveTracks,
    LiveWriter,
    MemoryBlocks,
    MoqtBlockPublisher,
    StoredBlock,
    serve_blocks,
)
from kvsp.web.client import TransportError
from moqt.asyncio import (
    FetchResponse,
    MOQTConnection,
    RequestRejected,
    SessionClosedError,
    Subscription,
    connect,
)
from moqt.backend import TransportConfig, get_backend
from moqt.errors import ObjectStatus, RequestErrorCode
from moqt.namespace import (
    LayerAssembler,
    kv_namespace,
    layer_range_locations,
    live_track_name,
    parse_kv_namespace,
    stored_track_name,
)
from moqt.objects import find_layer_digest
from moqt.session_events import (
    DataStreamReset,
    FetchReceived,
    MalformedTrackDetected,
    MOQTEvent,
    ObjectData,
    ObjectEnd,
    ObjectHeader,
    RequestUpdateReceived,
    SubscribeReceived,
)
from moqt.session_state import LocalProtocolError
from moqt.wire import KeyValuePair, TrackNamespace

__all__ = [
    "BlockSource",
    "BlockStream",
    "LiveBlock",
    "LiveTrack",
    "LiveTracks",
    "LiveWriter",
    "MemoryBlocks",
    "MoqtAddress",
    "MoqtBlockClient",
    "MoqtBlockPublisher",
    "StoredBlock",
    "UnifiedBlockClient",
    "parse_moqt_uri",
    "record_namespace",
    "serve_blocks",
]

MOQT_SCHEME = "moqt"
DEFAULT_MOQT_PORT = 443  # d16 §3.1.2: the moqt URI scheme's default port
T = TypeVar("T")
_PEER_REQUESTS = (FetchReceived, SubscribeReceived, RequestUpdateReceived, *REFUSED_REQUESTS)


@dataclass(frozen=True, slots=True)
class MoqtAddress:
    """Where a ``moqt://host[:port]/path`` URI points (raw QUIC, ALPN ``moqt-16``)."""

    host: str
    port: int
    path: str | None


def parse_moqt_uri(uri: str) -> MoqtAddress:
    """The address of a ``moqt`` URI; the port defaults to 443.

    Raises:
        UnsupportedHolder: not a ``moqt`` URI with a host and a valid port.
    """
    parts = urlsplit(uri)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme.lower() != MOQT_SCHEME or not parts.hostname or port == -1:
        raise UnsupportedHolder(f"holder {uri[:120]!r} is not a moqt URI")
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    return MoqtAddress(parts.hostname, port or DEFAULT_MOQT_PORT, path or None)


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
        async for _ in self:
            pass
        if self.result is None:
            raise RuntimeError("the block stream ended without a block")
        return self.result

    async def aclose(self) -> None:
        """Stop early (the request is cancelled)."""
        await self._iterator.aclose()


class _Watchdog:
    """Calls ``on_stall`` when ``progress`` has not moved for ``idle`` seconds."""

    def __init__(self, idle: float, on_stall: Callable[[], None]) -> None:
        self.progress = 0
        self.fired = False
        self._seen = -1
        self._idle = idle
        self._on_stall = on_stall
        self._handle = asyncio.get_running_loop().call_later(idle, self._check)

    def _check(self) -> None:
        if self.progress == self._seen:
            self.fired = True
            self._on_stall()
            return
        self._seen = self.progress
        self._handle = asyncio.get_running_loop().call_later(self._idle, self._check)

    def cancel(self) -> None:
        self._handle.cancel()


class _Objects:
    """Feeds a track's data events to a :class:`LayerAssembler`, skipping status objects
    (relays append an empty END_OF_GROUP object)."""

    def __init__(self, assembler: LayerAssembler) -> None:
        self.assembler = assembler
        self._skip: set[int] = set()
        self._in_band: bytes | None = None

    def on(self, event: MOQTEvent) -> tuple[Layer, bytes, bytes | None] | None:
        """The layer (its computed digest and in-band digest) an event completes, if any.

        Raises:
            ContainerError: an object that is not a layer of the block.
            TransportError: the data stream was reset.
        """
        if isinstance(event, ObjectHeader):
            if event.object.status != ObjectStatus.NORMAL:
                self._skip.add(event.stream_id)
                return None
            self._in_band = _in_band_digest(event.object.extensions)
            self.assembler.begin(event.group_id, event.object_id, event.payload_length)
        elif isinstance(event, ObjectData):
            if event.stream_id not in self._skip:
                self.assembler.feed(event.data)
        elif isinstance(event, ObjectEnd):
            if event.stream_id in self._skip:
                self._skip.discard(event.stream_id)
                return None
            layer, digest = self.assembler.end()
            return layer, digest, self._in_band
        elif isinstance(event, DataStreamReset | MalformedTrackDetected):
            raise TransportError(f"the block's data stream broke off: {event}")
        return None


def _in_band_digest(extensions: tuple[KeyValuePair, ...]) -> bytes | None:
    try:
        return find_layer_digest(extensions)
    except Exception as exc:  # a malformed extension block: the object cannot be trusted
        raise ContainerError(f"malformed layer-digest extension: {exc}") from None


def _rejected(exc: RequestRejected) -> KVSPError:
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
class _Plan:
    """One FETCH of a stored track and how to verify it (§6.7)."""

    record: ReplicaRecord
    address: MoqtAddress
    namespace: TrackNamespace
    first: int
    last: int
    geometry: Geometry
    token_count: int | None
    sink: LayerSink | None


def _plan(
    record: ReplicaRecord,
    holder: str | None,
    layers: tuple[int, int] | None,
    geometry: Geometry,
    token_count: int | None,
    sink: LayerSink | None,
) -> _Plan:
    address = parse_moqt_uri(holder or record.holder)
    if record.codec != Codec.RAW:
        # DESIGN §4: objects reproduce the layer digests for codec raw only
        raise Incompatible(f"codec {record.codec} is not carried over MOQT")
    namespace = record_namespace(record)
    digests = record.layer_digests
    count = len(digests) if digests is not None else geometry.layers
    if count != geometry.layers:
        raise Incompatible(f"record lists {count} layers, the geometry has {geometry.layers}")
    first, last = layers if layers is not None else (0, count - 1)
    if not 0 <= first <= last < count:
        raise Incompatible(f"layers {first}-{last} asked of a replica of {count} layers")
    if digests is None and (first, last) != (0, count - 1):
        # §4.4: layer_digests is REQUIRED for replicas served by layer range
        raise Incompatible("a layer range of a replica whose record lists no layer_digests")
    if digests is not None and replica_digest(digests) != record.digest:
        raise DigestMismatch("the record's layer_digests do not give its replica digest")
    return _Plan(
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


class MoqtBlockClient:
    """Gets blocks from ``moqt://`` holders, verified as §6.7 asks (use ``async with``).

    One MOQT session per holder address is kept and reused. ``cafile`` pins the holder's
    (self-signed) certificate; ``verify=False`` disables the check (tests, ``--tls-disable-
    verify``). ``timeout`` bounds each request and each pause in the data.
    """

    def __init__(
        self,
        *,
        cafile: str | None = None,
        verify: bool = True,
        server_name: str | None = None,
        backend: str = "aioquic",
        transport: TransportConfig | None = None,
        auth_token: str | bytes | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.cafile = cafile
        self.verify = verify
        self.server_name = server_name
        self.backend = backend
        self.transport = transport or TransportConfig()
        self._token = auth_token.encode() if isinstance(auth_token, str) else auth_token
        self.timeout = timeout
        self._sessions: dict[MoqtAddress, tuple[contextlib.AsyncExitStack, MOQTConnection]] = {}
        self._locks: dict[MoqtAddress, asyncio.Lock] = {}
        self._closing: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every pooled session."""
        sessions, self._sessions = self._sessions, {}
        for stack, _ in sessions.values():
            with contextlib.suppress(Exception):
                await stack.aclose()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def _forget(self, address: MoqtAddress, connection: MOQTConnection) -> None:
        """Drop a pooled session that stopped answering (its peer died, or restarted and no
        longer knows it), so that the next request connects anew instead of waiting on it
        until QUIC's idle timeout; it is closed in the background."""
        entry = self._sessions.get(address)
        if entry is None or entry[1] is not connection:
            return
        del self._sessions[address]
        task = asyncio.ensure_future(_close_quietly(entry[0]))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def connection(self, address: MoqtAddress) -> MOQTConnection:
        """The pooled session to ``address`` (connecting when there is none or it ended).

        Raises:
            TransportError: the handshake or the MOQT setup failed or timed out.
        """
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            entry = self._sessions.get(address)
            if entry is not None and entry[1].session.closed is None:
                return entry[1]
            if entry is not None:
                del self._sessions[address]
                with contextlib.suppress(Exception):
                    await entry[0].aclose()
            stack = contextlib.AsyncExitStack()
            try:
                connection = await asyncio.wait_for(self._open(stack, address), self.timeout)
            except (OSError, TimeoutError, SessionClosedError, ConnectionError) as exc:
                await stack.aclose()
                where = f"{address.host}:{address.port}"
                raise TransportError(f"no MOQT session with {where}: {exc!r}") from exc
            self._sessions[address] = (stack, connection)
            return connection

    async def _open(self, stack: contextlib.AsyncExitStack, address: MoqtAddress) -> MOQTConnection:
        quic = get_backend(self.backend)
        configuration = quic.configuration(
            is_client=True,
            transport=self.transport,
            cafile=self.cafile,
            verify=self.verify,
            server_name=self.server_name or address.host,
        )
        connection = await stack.enter_async_context(
            connect(
                address.host,
                address.port,
                configuration=configuration,
                backend=self.backend,
                path=address.path,
                auth_token=self._token,
                transport=self.transport,
                setup_timeout=self.timeout,
            )
        )
        task = asyncio.ensure_future(_refuse_requests(connection))
        stack.callback(task.cancel)
        return connection

    def stream_block(
        self,
        record: ReplicaRecord,
        *,
        layers: tuple[int, int] | None = None,
        geometry: Geometry,
        block_tokens: int | None = None,
        sink: LayerSink | None = None,
        holder: str | None = None,
    ) -> BlockStream[VerifiedBlock]:
        """FETCH the record's stored track (layers ``a..b``, or all) from ``holder`` (default:
        the record's); iterate the verified layers, then ``await stream.block()``.

        ``block_tokens`` (the descriptor's) fixes the token count; without it the count is
        read off the objects' length. With ``sink`` the layers land in caller memory.

        Raises (when iterated):
            RecordError: the record's ``moqt_namespace`` does not name its block.
            UnsupportedHolder: not a ``moqt`` URI. Incompatible: codec not raw, or a range
                the record cannot verify. DigestMismatch: a layer differs from the record.
            NotFound / LayersUnavailable: the holder lacks the block / the layers.
            ContainerError: objects that are not the block's layers. TransportError.
        """

        def run(stream: BlockStream[VerifiedBlock]) -> AsyncGenerator[Layer, None]:
            return self._fetch(
                lambda: _plan(record, holder, layers, geometry, block_tokens, sink), stream
            )

        return BlockStream(run)

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
        """The verified block (see :meth:`stream_block`, whose errors it raises)."""
        return await self.stream_block(
            record,
            layers=layers,
            geometry=geometry,
            block_tokens=block_tokens,
            sink=sink,
            holder=holder,
        ).block()

    async def _fetch(
        self, make_plan: Callable[[], _Plan], stream: BlockStream[VerifiedBlock]
    ) -> AsyncGenerator[Layer, None]:
        plan = make_plan()  # its errors surface on the first read, like the transfer's
        connection = await self.connection(plan.address)
        response = await self._request_fetch(connection, plan)
        assembler = LayerAssembler(
            plan.geometry, plan.first, plan.last, token_count=plan.token_count, sink=plan.sink
        )
        objects = _Objects(assembler)
        expected = plan.record.layer_digests
        unchecked: list[tuple[Layer, bytes]] = []  # no layer_digests: checked as a whole
        reader = response.track
        watchdog = _Watchdog(self.timeout, lambda: _cancel(connection, response.request_id))
        try:
            async for event in reader.events():
                watchdog.progress += 1
                done = objects.on(event)
                if done is None:
                    continue
                layer, digest, _ = done  # the record, not the in-band copy, is authoritative
                if expected is None:
                    unchecked.append((layer, digest))
                elif digest != expected[layer.index]:
                    # §6.7: clients MUST verify the layer digests against the record
                    raise mismatch(layer.index, digest, expected[layer.index])
                else:
                    yield layer
        except SessionClosedError as exc:
            raise TransportError(f"the session with {plan.record.holder} ended: {exc}") from exc
        finally:
            watchdog.cancel()
            if not reader.ended:
                _cancel(connection, response.request_id)
        if watchdog.fired:
            self._forget(plan.address, connection)
            raise TransportError(f"no data from {plan.record.holder} for {self.timeout} s")
        if not assembler.complete:
            raise LayersUnavailable("the fetch ended before every layer arrived")
        if unchecked:
            # §6.7: all layers retrieved, so their digests must give the replica digest
            if replica_digest([d for _, d in unchecked]) != plan.record.digest:
                raise DigestMismatch("the layers' digests do not give the replica digest")
            for layer, _ in unchecked:
                yield layer
        stream.result = _verified(plan, assembler)

    async def _request_fetch(self, connection: MOQTConnection, plan: _Plan) -> FetchResponse:
        start, end = layer_range_locations(plan.first, plan.last)
        track = stored_track_name(plan.record.digest)
        try:
            return await asyncio.wait_for(
                connection.fetch(plan.namespace, track, start, end), self.timeout
            )
        except RequestRejected as exc:
            raise _rejected(exc) from exc
        except (SessionClosedError, TimeoutError) as exc:
            self._forget(plan.address, connection)
            raise TransportError(f"FETCH of {plan.record.holder} failed: {exc!r}") from exc

    def subscribe_live(
        self,
        holder: str,
        *,
        producer: str,
        compat: CompatId,
        scope: ScopeId,
        key: BlockKey,
        geometry: Geometry,
        block_tokens: int | None = None,
        record: RecordSource = None,
        sink: LayerSink | None = None,
    ) -> BlockStream[LiveBlock]:
        """SUBSCRIBE to ``producer``'s live track of a block at ``holder`` (a relay or the
        producer itself); iterate the layers as they are computed, then ``await block()``.

        A layer whose object carries its in-band digest is handed out once it matches; one
        without (a relay may strip unknown extensions) is held until the block completes and
        is checked against ``record`` (or what the callable returns: the producer's published
        Replica Record). When a record is at hand every layer is checked against it too.

        Raises (when iterated):
            DigestMismatch: a layer differs from its in-band digest or the record, or layers
                lack in-band digests and no record is available.
            NotFound: no such live track (finished or never started: FETCH the stored track).
            ContainerError, TransportError: as for :meth:`stream_block`.
        """
        namespace = kv_namespace(compat, scope, key)

        def assembler() -> LayerAssembler:
            return LayerAssembler(
                geometry, 0, geometry.layers - 1, token_count=block_tokens, sink=sink
            )

        def run(stream: BlockStream[LiveBlock]) -> AsyncGenerator[Layer, None]:
            track = live_track_name(producer)
            return self._live(holder, namespace, track, assembler, record, stream)

        return BlockStream(run)

    async def _live(
        self,
        holder: str,
        namespace: TrackNamespace,
        track: bytes,
        make_assembler: Callable[[], LayerAssembler],
        record: RecordSource,
        stream: BlockStream[LiveBlock],
    ) -> AsyncGenerator[Layer, None]:
        assembler = make_assembler()
        address = parse_moqt_uri(holder)
        connection = await self.connection(address)
        subscription = await self._request_subscribe(connection, address, namespace, track)
        objects = _Objects(assembler)
        digests: dict[int, bytes] = {}
        pending: list[Layer] = []
        reader = subscription.track
        watchdog = _Watchdog(
            self.timeout, lambda: _cancel(connection, subscription.request_id, fetch=False)
        )
        try:
            async for event in reader.events():
                watchdog.progress += 1
                done = objects.on(event)
                if done is None:
                    continue
                layer, digest, in_band = done
                digests[layer.index] = digest
                if in_band is None:
                    pending.append(layer)
                elif in_band != digest:
                    raise mismatch(layer.index, digest, in_band)
                else:
                    yield layer
                if assembler.complete:
                    break
        except SessionClosedError as exc:
            raise TransportError(f"the session with {holder} ended: {exc}") from exc
        finally:
            watchdog.cancel()
            if not reader.ended:
                _cancel(connection, subscription.request_id, fetch=False)
        if not assembler.complete:
            if watchdog.fired:
                self._forget(address, connection)
            why = "stalled" if watchdog.fired else "ended"
            raise TransportError(f"the live track {why} before every layer arrived")
        ordered = [digests[i] for i in range(assembler.count)]
        published = await _resolve(record)
        _check_live(published, ordered, bool(pending))
        for layer in pending:
            yield layer
        stream.result = LiveBlock(
            version=1,
            flags=0,
            codec=Codec.RAW,
            first_layer=0,
            layer_count=assembler.count,
            token_count=assembler.token_count or 0,
            layers=assembler.layers(),
            source=holder,
            block_digest=replica_digest(ordered),
            record=published,
            in_band_verified=not pending,
        )

    async def _request_subscribe(
        self,
        connection: MOQTConnection,
        address: MoqtAddress,
        namespace: TrackNamespace,
        track: bytes,
    ) -> Subscription:
        try:
            return await asyncio.wait_for(connection.subscribe(namespace, track), self.timeout)
        except RequestRejected as exc:
            raise _rejected(exc) from exc
        except (SessionClosedError, TimeoutError) as exc:
            self._forget(address, connection)
            where = f"{address.host}:{address.port}"
            raise TransportError(f"SUBSCRIBE at {where} failed: {exc!r}") from exc


def _cancel(connection: MOQTConnection, request_id: int, *, fetch: bool = True) -> None:
    """FETCH_CANCEL or UNSUBSCRIBE, unless the request or session has already ended."""
    with contextlib.suppress(LocalProtocolError, SessionClosedError):
        if fetch:
            connection.fetch_cancel(request_id)
        else:
            connection.unsubscribe(request_id)


async def _close_quietly(stack: contextlib.AsyncExitStack) -> None:
    with contextlib.suppress(Exception):
        await stack.aclose()


async def _resolve(record: RecordSource) -> ReplicaRecord | None:
    if record is None or isinstance(record, ReplicaRecord):
        return record
    return await record()


def _check_live(record: ReplicaRecord | None, digests: list[bytes], unchecked: bool) -> None:
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


def _verified(plan: _Plan, assembler: LayerAssembler) -> VerifiedBlock:
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


async def _refuse_requests(connection: MOQTConnection) -> None:
    """A consumer's session publishes nothing: refuse whatever the peer asks of it."""
    session = connection.session
    async for event in connection.requests():
        if isinstance(
            event, FetchReceived | SubscribeReceived | RequestUpdateReceived | REFUSED_REQUESTS
        ):
            with contextlib.suppress(LocalProtocolError):
                session.request_error(event.request_id, RequestErrorCode.NOT_SUPPORTED, "consumer")
                connection.transmit()


# --- one client for both kinds of holder ---------------------------------------------------------


class UnifiedBlockClient:
    """Gets a block from ``http(s)://`` holders with :class:`BlockClient` and from ``moqt://``
    holders with :class:`MoqtBlockClient`, so a caller need not care which a replica names.

    Attempts are counted in the HTTP client's :class:`FetchStats` whatever the transport.
    """

    def __init__(self, http: BlockClient, moqt: MoqtBlockClient) -> None:
        self.http = http
        self.moqt = moqt

    @property
    def stats(self) -> FetchStats:
        """Per-holder outcomes of :meth:`fetch_block`."""
        return self.http.stats

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close both clients."""
        await self.moqt.aclose()
        await self.http.aclose()

    async def get_block(
        self,
        holder_base: str,
        record: ReplicaRecord,
        *,
        layers: tuple[int, int] | None = None,
        geometry: Geometry,
        codec: int | None = None,
        sink: LayerSink | None = None,
        block_tokens: int | None = None,
    ) -> VerifiedBlock:
        """:meth:`BlockClient.get_block` for HTTP holders, :meth:`MoqtBlockClient.get_block`
        for ``moqt://`` ones (which carry the replica's codec only).

        Raises:
            as the chosen client; Incompatible: another codec asked of a MOQT holder.
        """
        if holder_base.partition(":")[0].lower() != MOQT_SCHEME:
            return await self.http.get_block(
                holder_base, record, layers=layers, geometry=geometry, codec=codec, sink=sink
            )
        if codec is not None and codec != record.codec:
            raise Incompatible("a MOQT holder serves the replica's codec only")
        return await self.moqt.get_block(
            record,
            layers=layers,
            geometry=geometry,
            block_tokens=block_tokens,
            sink=sink,
            holder=holder_base,
        )

    async def fetch_block(
        self,
        replicas: Sequence[ReplicaRecord],
        *,
        layers: tuple[int, int] | None = None,
        geometry: Geometry,
        sink: LayerSink | None = None,
        block_tokens: int | None = None,
    ) -> VerifiedBlock | None:
        """The block from the first replica, in the order given, that delivers it verified;
        None when none does (§6.1: the index is advisory, so any failure means "next")."""
        for record in replicas:
            started = time.perf_counter()
            try:
                block = await self.get_block(
                    record.holder,
                    record,
                    layers=layers,
                    geometry=geometry,
                    sink=sink,
                    block_tokens=block_tokens,
                )
            except KVSPError as exc:
                elapsed = time.perf_counter() - started
                outcome = FetchOutcome(record.holder, False, 0, elapsed, type(exc).__name__)
                self.stats.record(outcome)
                continue
            octets = sum(layer.k.nbytes + layer.v.nbytes for layer in block.layers)
            elapsed = time.perf_counter() - started
            self.stats.record(FetchOutcome(record.holder, True, octets, elapsed))
            return block
        return None

    fetch = fetch_block
