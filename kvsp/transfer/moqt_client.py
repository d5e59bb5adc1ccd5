"""The MOQT consumer of KV blocks: sessions to ``moqt://`` holders and relays, FETCH of
stored tracks and SUBSCRIBE to live ones, every layer verified before it is handed out
(DESIGN.md §4; spec §4.3, §6.1, §6.7).

:class:`MoqtBlockClient` keeps one MOQT session per holder address. ``get_block`` FETCHes
the stored track (named by the replica digest) for the asked layers and checks every object
against the record's ``layer_digests`` (§6.7: a layer that fails is never handed out, and the
transfer stops); ``subscribe_live`` follows a block still being computed, each layer checked
by the digest its object carries in-band or, where a relay stripped it, at completion against
the producer's published record. The session-free parts of one transfer (plan, object
assembly, final checks) are in :mod:`kvsp.transfer.moqt_transfer`; the carrier a session runs on
(QUIC, or QMux over TLS, TCP or a Unix socket where the record offers one) is chosen and opened
by :mod:`kvsp.transfer.moqt_carriers`. Replicas are walked by
:meth:`kvsp.transfer.block_client.BlockClient.fetch`, which hands ``moqt://`` ones to this
client: one walk for both transports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Self

from kvsp.audience import AudienceSigner, canonical_origin
from kvsp.container import Geometry, Layer, mismatch, replica_digest
from kvsp.container_reader import LayerSink
from kvsp.errors import LayersUnavailable, TransportError, UnsupportedHolder
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.moqt_mapping import (
    LayerAssembler,
    kv_namespace,
    layer_range_locations,
    live_track_name,
    stored_track_name,
)
from kvsp.records import ReplicaRecord
from kvsp.registries import Codec
from kvsp.transfer.buffers import BufferPool
from kvsp.transfer.moqt_carriers import (
    CarrierPolicy,
    SessionOptions,
    carrier_candidates,
    open_session,
)
from kvsp.transfer.moqt_publisher import REFUSED_REQUESTS
from kvsp.transfer.moqt_transfer import (
    HASH_BATCH,
    HASH_INLINE_BELOW,
    BlockStream,
    FetchLanding,
    FetchPlan,
    LayerChecks,
    LiveBlock,
    MoqtAddress,
    ObjectFeed,
    RecordSource,
    Watchdog,
    check_live,
    hash_batch,
    parse_moqt_uri,
    plan_fetch,
    rejected_error,
    verified_block,
)
from kvsp.transfer.verify import VerifiedBlock
from moqt.asyncio import (
    FetchResponse,
    MOQTConnection,
    RequestRejected,
    SessionClosedError,
    Subscription,
    TrackReader,
)
from moqt.backend import TransportConfig
from moqt.errors import RequestErrorCode
from moqt.session_events import (
    DataStreamReset,
    FetchReceived,
    MalformedTrackDetected,
    RequestUpdateReceived,
    SubscribeReceived,
)
from moqt.session_state import LocalProtocolError
from moqt.wire import TrackNamespace

_PEER_REQUESTS = (FetchReceived, SubscribeReceived, RequestUpdateReceived, *REFUSED_REQUESTS)
CARRIER_RETRY_S = 30.0  # a QMux carrier that failed is skipped (QUIC used) this long
CANDIDATES_KEPT = 1024  # (holder, carriers) lists remembered (MoqtBlockClient.candidates)
log = logging.getLogger(__name__)


def address_origin(address: MoqtAddress) -> str:
    """The audience (:func:`kvsp.audience.canonical_origin`) of a MOQT address: the URI it
    was read from, reduced to its origin (a ``moqt+unix`` socket keeps its path)."""
    host = f"[{address.host}]" if ":" in address.host else address.host
    if address.carrier == "unix":
        return canonical_origin(f"moqt+unix://{host}{address.socket_path or '/'}")
    scheme = "moqt" if address.carrier == "quic" else f"moqt+{address.carrier}"
    return canonical_origin(f"{scheme}://{host}:{address.port}")


class MoqtBlockClient:
    """Gets blocks from ``moqt://`` holders, verified as §6.7 asks (use ``async with``).

    One MOQT session per holder address is kept and reused. ``cafile`` and ``verify`` are the
    process's one trust setting (``--cafile``/``--insecure``, :mod:`kvsp.web.trust`): CA
    certificates, or a holder's self-signed certificate to pin; ``verify=False`` checks nothing
    (tests). ``timeout`` bounds each request and each pause in the data. ``backend`` is the
    QUIC library (None: the measured default); ``policy`` says which QMux carriers a record may
    offer this client (:mod:`kvsp.transfer.moqt_carriers`). ``buffers`` lends the memory a
    block's layers land in and takes it back when the block is dropped (default: a
    :class:`~kvsp.transfer.buffers.BufferPool` of its own; ``BufferPool(0)`` reuses nothing).
    """

    def __init__(
        self,
        *,
        cafile: str | None = None,
        verify: bool = True,
        server_name: str | None = None,
        backend: str | None = None,
        transport: TransportConfig | None = None,
        auth_token: str | bytes | None = None,
        timeout: float = 30.0,
        policy: CarrierPolicy | None = None,
        buffers: BufferPool | None = None,
    ) -> None:
        self.cafile = cafile
        self.verify = verify
        self.server_name = server_name
        self.backend = backend
        self.transport = transport
        self.policy = policy or CarrierPolicy()
        self._owns_buffers = buffers is None
        self.buffers = BufferPool() if buffers is None else buffers
        token = auth_token.decode("ascii") if isinstance(auth_token, bytes) else auth_token
        # The raw token goes to the control plane only; a holder gets a credential for itself.
        self._signer = AudienceSigner(token)
        self.timeout = timeout
        self.hash_inline_below = HASH_INLINE_BELOW
        """FETCHes of fewer octets are hashed on the event loop; larger ones in batches of half
        the FETCH, at most :attr:`hash_batch` octets, on worker threads (:class:`LayerChecks`,
        :func:`~kvsp.transfer.moqt_transfer.hash_batch`)."""
        self.hash_batch = HASH_BATCH
        self._failed: dict[MoqtAddress, float] = {}  # carrier → monotonic time it failed
        self._candidates: dict[tuple[str, tuple[str, ...] | None], tuple[MoqtAddress, ...]] = {}
        self._sessions: dict[MoqtAddress, tuple[contextlib.AsyncExitStack, MOQTConnection]] = {}
        self._locks: dict[MoqtAddress, asyncio.Lock] = {}
        self._closing: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every pooled session, and the buffer pool if made here (blocks handed out
        stay valid)."""
        sessions, self._sessions = self._sessions, {}
        for stack, _ in sessions.values():
            with contextlib.suppress(Exception):
                await stack.aclose()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        if self._owns_buffers:
            self.buffers.close()

    def sessions(self) -> list[MoqtAddress]:
        """The addresses (carrier included) of the open pooled sessions, oldest first."""
        return [a for a, (_, c) in self._sessions.items() if c.session.closed is None]

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

    async def connection(self, address: MoqtAddress, audience: str | None = None) -> MOQTConnection:
        """The pooled session to ``address`` (connecting when there is none or it ended),
        authenticated with a credential for ``audience`` (default: ``address``'s own origin;
        :mod:`kvsp.audience`).

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
                opening = self._open(stack, address, audience or address_origin(address))
                connection = await asyncio.wait_for(opening, self.timeout)
            except (OSError, TimeoutError, SessionClosedError, ConnectionError, ValueError) as exc:
                await stack.aclose()
                raise TransportError(f"no MOQT session with {address}: {exc!r}") from exc
            self._sessions[address] = (stack, connection)
            return connection

    async def connect_any(
        self, candidates: Sequence[MoqtAddress]
    ) -> tuple[MoqtAddress, MOQTConnection]:
        """The first of ``candidates`` (carriers in preference order, the QUIC address last)
        that gives a session; a carrier that fails is skipped for :data:`CARRIER_RETRY_S`.

        Raises:
            TransportError: the last candidate failed too.
        """
        now = time.monotonic()
        # Every carrier is the holder's (the last candidate): one credential, for its URI.
        audience = address_origin(candidates[-1])
        tried = [a for a in candidates[:-1] if now - self._failed.get(a, -1e9) > CARRIER_RETRY_S]
        for address in tried:
            try:
                return address, await self.connection(address, audience)
            except TransportError as exc:
                log.warning("MOQT carrier %s failed, trying the next one: %s", address, exc)
                self._failed[address] = time.monotonic()
        return candidates[-1], await self.connection(candidates[-1], audience)

    def candidates(self, holder: str, record: ReplicaRecord | None) -> tuple[MoqtAddress, ...]:
        """Where to reach ``holder``: the carriers ``record`` offers for it, then QUIC.

        The list found last for the same holder and carriers is taken again while the pooled
        session to its first address is open and that address is the record's first carrier
        (none could come before it): reading the carriers again would only check, per FETCH,
        that a socket the open session came through still exists.
        """
        carriers = None
        if record is not None and record.holder == holder:
            carriers = record.moqt_carriers
        key = (holder, carriers)
        known = self._candidates.get(key)
        if known is not None:
            entry = self._sessions.get(known[0])
            if entry is not None and entry[1].session.closed is None:
                return known
        found = carrier_candidates(holder, carriers, self.policy)
        if len(self._candidates) >= CANDIDATES_KEPT:
            self._candidates.clear()
        if carriers and len(found) > 1 and _names(carriers[0], found[0]):
            self._candidates[key] = found  # the first carrier listed is usable: kept
        else:
            self._candidates.pop(key, None)
        return found

    async def _open(
        self, stack: contextlib.AsyncExitStack, address: MoqtAddress, audience: str
    ) -> MOQTConnection:
        options = SessionOptions(
            cafile=self.cafile,
            verify=self.verify,
            server_name=self.server_name,
            backend=self.backend,
            transport=self.transport,
            token=self._signer.credential(audience),
            timeout=self.timeout,
            policy=self.policy,
        )
        connection = await open_session(stack, address, options)
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
                lambda: plan_fetch(record, holder, layers, geometry, block_tokens, sink), stream
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
        self, make_plan: Callable[[], FetchPlan], stream: BlockStream[VerifiedBlock]
    ) -> AsyncGenerator[Layer, None]:
        plan = make_plan()  # its errors surface on the first read, like the transfer's
        address, connection = await self.connect_any(self._plan_candidates(plan))
        assembler = LayerAssembler(
            plan.geometry,
            plan.first,
            plan.last,
            token_count=plan.token_count,
            sink=plan.sink,
            hash_below=self.hash_inline_below,
            allocate=self.buffers.take,
        )
        wake = _Wake()
        # With a caller's sink each event is taken in this task, paced by the caller: a
        # layer's buffer is asked for only once the layers before it were handed out (a sink
        # may reuse one staging buffer, kvsp.engine.sink). Otherwise the objects land from
        # the receive path (FetchLanding), from the first one on.
        paced = plan.sink is not None
        # §6.7: each layer against layer_digests, or all against the replica digest
        checks = LayerChecks(
            plan.record.layer_digests,
            plan.record.digest,
            batch=hash_batch(plan.octets, self.hash_batch),
            span=assembler.span,
            on_hashed=None if paced else wake.set,
        )
        landing = None if paced else FetchLanding(assembler, checks, wake.set)
        try:
            response = await self._request_fetch(connection, plan, address, landing)
        except BaseException:
            checks.cancel()
            raise
        reader = response.track

        def stalled() -> None:
            _cancel(connection, response.request_id)
            wake.set()

        if landing is None:
            watchdog = Watchdog(self.timeout, stalled)
            objects = ObjectFeed(assembler, in_band=False)  # the record is authoritative
            landed = _paced(reader, objects, checks, watchdog)
        else:
            watchdog = Watchdog(
                self.timeout, stalled, progress=lambda: landing.progress, armed=False
            )
            landed = _land(reader, landing, watchdog, wake)
        try:
            async for layer in landed:
                yield layer
            async for layer in _last_batches(checks, assembler.complete and not watchdog.fired):
                yield layer
        except SessionClosedError as exc:
            raise TransportError(f"the session with {plan.record.holder} ended: {exc}") from exc
        finally:
            await landed.aclose()  # at once, also when the consumer stopped early
            checks.cancel()
            watchdog.cancel()
            if not reader.ended:
                _cancel(connection, response.request_id)
        if watchdog.fired:
            self._forget(address, connection)
            raise TransportError(f"no data from {plan.record.holder} for {self.timeout} s")
        if not assembler.complete:
            raise LayersUnavailable("the fetch ended before every layer arrived")
        checks.finish()
        for layer in checks.ready():
            yield layer
        stream.result = verified_block(plan, assembler)

    def _plan_candidates(self, plan: FetchPlan) -> tuple[MoqtAddress, ...]:
        """The record's carriers when the plan goes to the record's own holder (not another
        holder the caller named), then the plan's address."""
        holder = plan.record.holder
        if plan.address.carrier == "quic" and parse_moqt_uri(holder) == plan.address:
            return self.candidates(holder, plan.record)
        return (plan.address,)

    async def _request_fetch(
        self,
        connection: MOQTConnection,
        plan: FetchPlan,
        address: MoqtAddress,
        landing: FetchLanding | None,
    ) -> FetchResponse:
        start, end = layer_range_locations(plan.first, plan.last)
        track = stored_track_name(plan.record.digest)
        fetch = connection.fetch(
            plan.namespace,
            track,
            start,
            end,
            payload_sink=None if landing is None else landing.payload,
            object_end=None if landing is None else landing.object_end,
            runs=None if landing is None else landing.run,
        )
        try:  # in this task (no task per request): the FETCH leaves at once
            async with asyncio.timeout(self.timeout):
                return await fetch
        except RequestRejected as exc:
            raise rejected_error(exc) from exc
        except (SessionClosedError, TimeoutError) as exc:
            self._forget(address, connection)
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
                geometry,
                0,
                geometry.layers - 1,
                token_count=block_tokens,
                sink=sink,
                allocate=self.buffers.take,
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
        objects = ObjectFeed(assembler)
        digests: dict[int, bytes] = {}
        pending: list[Layer] = []
        reader = subscription.track
        watchdog = Watchdog(
            self.timeout, lambda: _cancel(connection, subscription.request_id, fetch=False)
        )
        try:
            async for event in reader.events():
                watchdog.progress += 1
                done = objects.on(event)
                if done is None:
                    continue
                layer, computed, in_band = done
                digest = computed if computed is not None else layer.digest()
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
        check_live(published, ordered, bool(pending))
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
            async with asyncio.timeout(self.timeout):
                return await connection.subscribe(namespace, track)
        except RequestRejected as exc:
            raise rejected_error(exc) from exc
        except (SessionClosedError, TimeoutError) as exc:
            self._forget(address, connection)
            raise TransportError(f"SUBSCRIBE at {address} failed: {exc!r}") from exc


def _names(uri: str, address: MoqtAddress) -> bool:
    """Whether ``uri`` is a MOQT URI of ``address``."""
    try:
        return parse_moqt_uri(uri) == address
    except UnsupportedHolder:
        return False


async def _land(
    reader: TrackReader, landing: FetchLanding, watchdog: Watchdog, wake: _Wake
) -> AsyncGenerator[Layer, None]:
    """The layers of a FETCH, as they pass their checks, while its objects land through the
    payload sink the request was made with (:class:`~kvsp.transfer.moqt_transfer.FetchLanding`),
    until the track ends or the watchdog (armed at the first wait) fires; then the stream's own
    events, raising on a reset or malformed one.

    Raises:
        TransportError: the data stream was reset or found malformed. SessionClosedError.
        ContainerError, DigestMismatch: from the landing.
    """
    ending: asyncio.Future[None] | None = None
    try:
        while True:
            for layer in landing.checks.ready():
                yield layer
            if landing.error is not None:
                raise landing.error
            if reader.ended or watchdog.fired:
                break
            if ending is None:  # the first wait (none when the track ended at once)
                ending = asyncio.ensure_future(reader.finished())
                ending.add_done_callback(wake.settle)
                watchdog.arm()
            await wake.wait()
    finally:
        reader.set_payload_sink(None)  # the reader may outlive the fetch: not the block
        if ending is not None:
            ending.cancel()
    if reader.ended:
        async for event in reader.events():  # the stream's own events, queued
            if isinstance(event, DataStreamReset | MalformedTrackDetected):
                raise TransportError(f"the block's data stream broke off: {event}")


async def _last_batches(checks: LayerChecks, complete: bool) -> AsyncGenerator[Layer, None]:
    """The transfer has ended: hash the last batches and hand their layers out (none when it
    did not ``complete``: what is queued is dropped).

    Raises:
        DigestMismatch: a layer differs from the record.
    """
    if not complete:
        checks.cancel()
    while checks.pending:
        await checks.wait()
        for layer in checks.ready():
            yield layer


async def _paced(
    reader: TrackReader, objects: ObjectFeed, checks: LayerChecks, watchdog: Watchdog
) -> AsyncGenerator[Layer, None]:
    """The layers of a FETCH into a caller's sink, each event taken in the consumer's task
    (see :meth:`MoqtBlockClient._fetch`), handed out as they pass their checks.

    Raises:
        TransportError: the data stream was reset or found malformed. SessionClosedError.
        ContainerError, DigestMismatch: an object that is not a layer, a layer that differs.
    """
    async for event in reader.events():
        watchdog.progress += 1
        done = objects.on(event)
        if done is None:
            continue
        checks.add(done[0], done[1])
        for layer in checks.ready():
            yield layer


class _Wake:
    """What a FETCH's consumer waits for: a flag that the payload sink, the hash jobs, the
    watchdog and the track's end set (one future a wait, none while the flag is up)."""

    __slots__ = ("_up", "_waiter")

    def __init__(self) -> None:
        self._up = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        self._up = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def settle(self, ended: asyncio.Future[None]) -> None:
        """The track ended (its error, if any, is raised by the reader's iterator)."""
        if not ended.cancelled():
            ended.exception()
        self.set()

    async def wait(self) -> None:
        if not self._up:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self._up = False


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


async def _refuse_requests(connection: MOQTConnection) -> None:
    """A consumer's session publishes nothing: refuse whatever the peer asks of it."""
    session = connection.session
    async for event in connection.requests():
        if isinstance(event, _PEER_REQUESTS):
            with contextlib.suppress(LocalProtocolError):
                session.request_error(event.request_id, RequestErrorCode.NOT_SUPPORTED, "consumer")
                connection.transmit()
