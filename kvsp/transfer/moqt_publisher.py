"""The publisher side of KV blocks over MOQT draft-16 (DESIGN.md §4; spec §4.3, §4.4).

:class:`MoqtBlockPublisher` runs on one MOQT session (an instance's session to its relay, or a
consumer's session to the instance). It PUBLISH_NAMESPACEs the four-field scope prefix, answers
a standalone FETCH of a stored block track (named by the replica digest) with the asked layers
on one fetch stream, answers SUBSCRIBE of a stored track with the whole block on one subgroup
stream (object id = layer, ascending, END_OF_GROUP, FIN), PUBLISHes a stored track to the peer
and sends it the same way (:meth:`MoqtBlockPublisher.push`: how an instance hands a block it
computed to its relay, which caches it), and answers SUBSCRIBE of a live track
(``live-<uri_id(producer)>``, a block still being computed, fed by :class:`LiveWriter`) with each
layer as it is produced. Every object is one layer: its payload K ‖ V is written as two pieces
straight from the block's memory, never joined, and its layer digest travels inside
IMMUTABLE_EXTENSIONS. The replica TTL, when known, is the MAX_CACHE_DURATION track extension.

The consumer side is :mod:`kvsp.transfer.moqt_client`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvsp.container import Buffer, Container, Geometry, Layer, decode_container, replica_digest
from kvsp.errors import Incompatible, InvalidIdentifier, NotFound
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.moqt_mapping import (
    KV_GROUP,
    fetch_layer_range,
    kv_namespace,
    kv_scope_prefix,
    layer_digest_extension,
    live_track_name,
    parse_kv_namespace,
    parse_stored_track_name,
    stored_track_name,
)
from kvsp.registries import Codec
from moqt.asyncio import MOQTConnection, MOQTServer, SessionClosedError, StreamObject, serve
from moqt.backend import TransportConfig
from moqt.errors import PublishDoneCode, RequestErrorCode
from moqt.messages import MessageParameters, StandaloneFetch
from moqt.messages_params import ExtensionType
from moqt.session_events import (
    FetchCancelReceived,
    FetchReceived,
    MOQTEvent,
    PublishNamespaceReceived,
    PublishReceived,
    RequestUpdateReceived,
    SubscribeNamespaceReceived,
    SubscribeReceived,
    TrackStatusReceived,
    UnsubscribeReceived,
)
from moqt.session_state import LocalProtocolError
from moqt.wire import KeyValuePair, Location, TrackNamespace

log = logging.getLogger(__name__)
REFUSED_REQUESTS = (
    PublishReceived,
    PublishNamespaceReceived,
    SubscribeNamespaceReceived,
    TrackStatusReceived,
)
"""Requests a KV block endpoint does not serve: answered REQUEST_ERROR NOT_SUPPORTED."""
_Extensions = tuple[KeyValuePair, ...]
_LayerList = list[tuple[memoryview, memoryview, bytes]]  # K, V and layer digest per layer
_Objects = list[tuple[int, tuple[memoryview, memoryview], _Extensions]]  # index, (K, V), extensions


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class StoredBlock:
    """A replica a publisher serves as a stored track: the layers it holds and the digests
    of the whole replica (its track name is the replica digest)."""

    compat: CompatId
    scope: ScopeId
    key: BlockKey
    container: Container
    layer_digests: tuple[bytes, ...]
    digest: bytes
    ttl_ms: int | None = None
    _extensions: tuple[_Extensions, ...] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @classmethod
    def of(
        cls,
        compat: CompatId,
        scope: ScopeId,
        key: BlockKey,
        data: Buffer | Container,
        *,
        geometry: Geometry | None = None,
        layer_digests: Sequence[bytes] | None = None,
        ttl_ms: int | None = None,
    ) -> StoredBlock:
        """A block from its container (bytes or decoded); the digests are computed unless the
        replica's ``layer_digests`` are given (needed when only some layers are held).

        Raises:
            ContainerError: not a KVB1 container (of ``geometry``).
            Incompatible: a partial container without the replica's layer digests.
        """
        container = data if isinstance(data, Container) else decode_container(data, geometry)
        if layer_digests is None:
            if container.first_layer != 0:
                raise Incompatible("a partial block needs the replica's layer digests")
            layer_digests = container.layer_digests()
        digests = tuple(bytes(d) for d in layer_digests)
        return cls(
            compat=compat,
            scope=scope,
            key=key,
            container=container,
            layer_digests=digests,
            digest=replica_digest(digests),
            ttl_ms=ttl_ms,
        )

    @property
    def namespace(self) -> TrackNamespace:
        """The block's five namespace fields."""
        return kv_namespace(self.compat, self.scope, self.key)

    @property
    def track_name(self) -> bytes:
        """The stored track's name: the replica digest as hex32."""
        return stored_track_name(self.digest)

    def digest_extensions(self) -> tuple[_Extensions, ...]:
        """Each held layer's object extensions (IMMUTABLE_EXTENSIONS with its layer digest),
        by position in the container; encoded once per stored block, then reused."""
        cached = self._extensions
        if cached is None:
            first = self.container.first_layer
            cached = tuple(
                (layer_digest_extension(self.layer_digests[first + i]),)
                for i in range(self.container.layer_count)
            )
            object.__setattr__(self, "_extensions", cached)
        return cached

    def held(self, first: int, last: int) -> tuple[Layer, ...] | None:
        """Layers ``first..last`` when all are held here, else None."""
        start = first - self.container.first_layer
        if start < 0 or last - self.container.first_layer >= self.container.layer_count:
            return None
        return self.container.layers[start : start + last - first + 1]


class BlockSource(Protocol):
    """Where a publisher finds the stored blocks it serves."""

    async def lookup(self, compat: CompatId, scope: ScopeId, key: BlockKey) -> StoredBlock | None:
        """The stored block, or None when not held.

        Raises:
            NotFound: the block's stored octets are faulty (answered as a miss).
        """
        ...


class MemoryBlocks:
    """A :class:`BlockSource` over blocks kept in memory."""

    def __init__(self) -> None:
        self._blocks: dict[tuple[bytes, bytes, bytes], StoredBlock] = {}

    def add(self, block: StoredBlock) -> None:
        """Serve ``block`` (replacing what was held under its key)."""
        self._blocks[(block.compat, block.scope, block.key)] = block

    def remove(self, compat: CompatId, scope: ScopeId, key: BlockKey) -> None:
        """Stop serving a block."""
        self._blocks.pop((compat, scope, key), None)

    async def lookup(self, compat: CompatId, scope: ScopeId, key: BlockKey) -> StoredBlock | None:
        """The block held under the key, if any."""
        return self._blocks.get((compat, scope, key))


class LiveTrack:
    """A block being produced: its layers so far, shared by every subscriber's sender."""

    def __init__(
        self, namespace: TrackNamespace, name: bytes, *, token_count: int, codec: int
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.token_count = token_count
        self.codec = codec
        self.layers: list[tuple[memoryview, memoryview, bytes]] = []
        self.done = False
        self.failed: str | None = None
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_beyond(self, count: int) -> None:
        """Until more than ``count`` layers exist or the track has ended."""
        while len(self.layers) <= count and not self.done:
            await self._changed.wait()


class LiveTracks:
    """The live tracks of one producer process, shared by the publishers of its sessions."""

    def __init__(self) -> None:
        self._tracks: dict[tuple[TrackNamespace, bytes], LiveTrack] = {}

    def get(self, namespace: TrackNamespace, name: bytes) -> LiveTrack | None:
        """The live track of that full name, if being produced."""
        return self._tracks.get((namespace, name))

    def publish(
        self,
        producer_uri: str,
        compat: CompatId,
        scope: ScopeId,
        key: BlockKey,
        *,
        token_count: int,
        codec: int = Codec.RAW,
        blocks: MemoryBlocks | None = None,
    ) -> LiveWriter:
        """Start a live track ``live-<uri_id(producer)>`` for a block; see :class:`LiveWriter`.

        Raises:
            ValueError: that track is already being produced.
        """
        namespace = kv_namespace(compat, scope, key)
        name = live_track_name(producer_uri)
        if (namespace, name) in self._tracks:
            raise ValueError("this producer is already producing that block")
        track = LiveTrack(namespace, name, token_count=token_count, codec=codec)
        self._tracks[(namespace, name)] = track
        return LiveWriter(self, track, (compat, scope, key), blocks)

    def retire(self, track: LiveTrack) -> None:
        """Stop offering ``track`` to new subscribers."""
        if self._tracks.get((track.namespace, track.name)) is track:
            del self._tracks[(track.namespace, track.name)]


class LiveWriter:
    """Hands each layer of a block being computed to the live track's subscribers.

    Layers go in ascending order from 0. The K and V buffers are referenced, not copied:
    they must stay unchanged until :meth:`finish` (the engine's pages do).
    """

    def __init__(
        self,
        tracks: LiveTracks,
        track: LiveTrack,
        ref: tuple[CompatId, ScopeId, BlockKey],
        blocks: MemoryBlocks | None,
    ) -> None:
        self._tracks = tracks
        self.track = track
        self._ref = ref
        self._blocks = blocks

    def send_layer(self, index: int, k: Buffer, v: Buffer) -> bytes:
        """Publish layer ``index`` now; returns its layer digest.

        Raises:
            ValueError: not the next layer, or the track has ended.
        """
        track = self.track
        if track.done:
            raise ValueError("the live track has ended")
        if index != len(track.layers):
            raise ValueError(f"layer {index} sent, layer {len(track.layers)} expected")
        kv, vv = memoryview(k).cast("B"), memoryview(v).cast("B")
        digest = hashlib.sha256(kv)
        digest.update(vv)
        track.layers.append((kv, vv, digest.digest()))
        track._notify()
        return track.layers[-1][2]

    def finish(self, *, ttl_ms: int | None = None) -> StoredBlock:
        """The block is complete: end the live track and return it as a stored block (added
        to the publisher's blocks when given), whose record the producer then publishes."""
        track = self.track
        layers = tuple(Layer(i, k, v) for i, (k, v, _) in enumerate(track.layers))
        container = Container(
            version=1,
            flags=0,
            codec=track.codec,
            first_layer=0,
            layer_count=len(layers),
            token_count=track.token_count,
            layers=layers,
        )
        digests = [d for _, _, d in track.layers]
        block = StoredBlock.of(*self._ref, container, layer_digests=digests, ttl_ms=ttl_ms)
        if self._blocks is not None:
            self._blocks.add(block)
        self._end()
        return block

    def abort(self, reason: str = "producer failed") -> None:
        """Give up on the block: subscribers' streams are reset."""
        self.track.failed = reason
        self._end()

    def _end(self) -> None:
        self.track.done = True
        self.track._notify()
        self._tracks.retire(self.track)


# --- the publisher -------------------------------------------------------------------------------


class MoqtBlockPublisher:
    """Serves stored and live block tracks on one MOQT session (see the module docstring).

    Run :meth:`serve` for the session's lifetime; :meth:`announce` each scope whose blocks
    this session should be asked for. ``in_band_digests`` False leaves the layer-digest
    extension off (how a consumer sees a relay that strips it).
    """

    def __init__(
        self,
        connection: MOQTConnection,
        blocks: BlockSource,
        *,
        live: LiveTracks | None = None,
        in_band_digests: bool = True,
    ) -> None:
        self.connection = connection
        self.blocks = blocks
        self.live = live if live is not None else LiveTracks()
        self.in_band_digests = in_band_digests
        self._tasks: dict[int, asyncio.Task[None]] = {}

    async def announce(self, compat: CompatId, scope: ScopeId) -> int:
        """PUBLISH_NAMESPACE the scope prefix; returns its Request ID.

        Raises:
            RequestRejected: the peer refused. SessionClosedError: the session ended.
        """
        ok = await self.connection.publish_namespace(kv_scope_prefix(compat, scope))
        return ok.request_id

    def publish_live(
        self,
        producer_uri: str,
        compat: CompatId,
        scope: ScopeId,
        key: BlockKey,
        *,
        token_count: int,
        codec: int = Codec.RAW,
    ) -> LiveWriter:
        """Start the live track of a block being produced (:meth:`LiveTracks.publish`); a
        :class:`MemoryBlocks` source also serves it as a stored track once finished."""
        blocks = self.blocks if isinstance(self.blocks, MemoryBlocks) else None
        return self.live.publish(
            producer_uri, compat, scope, key, token_count=token_count, codec=codec, blocks=blocks
        )

    async def serve(self) -> None:
        """Answer the peer's requests until the session ends."""
        try:
            async for event in self.connection.requests():
                self._handle(event)
        finally:
            for task in list(self._tasks.values()):
                task.cancel()

    def _handle(self, event: MOQTEvent) -> None:
        if isinstance(event, FetchReceived):
            self._spawn(event.request_id, self._serve_fetch(event))
        elif isinstance(event, SubscribeReceived):
            self._spawn(event.request_id, self._serve_subscribe(event))
        elif isinstance(event, UnsubscribeReceived | FetchCancelReceived):
            task = self._tasks.pop(event.request_id, None)
            if task is not None:
                task.cancel()
        elif isinstance(event, RequestUpdateReceived):
            self._answer(lambda: self.connection.session.request_ok(event.request_id))
        elif isinstance(event, REFUSED_REQUESTS):
            self._refuse(event.request_id, RequestErrorCode.NOT_SUPPORTED, "a KV block publisher")

    def _spawn(self, request_id: int, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(self._guard(request_id, work))
        self._tasks[request_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(request_id, None))

    async def _guard(self, request_id: int, work: Awaitable[None]) -> None:
        try:
            await work
        except (LocalProtocolError, SessionClosedError):
            pass  # the request or session ended while we were sending
        except Exception:
            log.exception("serving request %d failed", request_id)
            self.connection.session.end_subscription_streams(request_id)
            self.connection.transmit()

    def _answer(self, reply: Callable[[], object]) -> None:
        with contextlib.suppress(LocalProtocolError):
            reply()
            self.connection.transmit()

    def _refuse(self, request_id: int, code: int, reason: str) -> None:
        self._answer(lambda: self.connection.session.request_error(request_id, code, reason))

    def _extensions(self, digest: bytes) -> _Extensions:
        return (layer_digest_extension(digest),) if self.in_band_digests else ()

    def _track_extensions(self, ttl_ms: int | None) -> tuple[KeyValuePair, ...]:
        if ttl_ms is None:
            return ()
        return ((ExtensionType.MAX_CACHE_DURATION, ttl_ms),)  # DESIGN §4: replica TTL

    async def _find(self, namespace: TrackNamespace, name: bytes) -> StoredBlock | LiveTrack | None:
        try:
            compat, scope, key = parse_kv_namespace(namespace)
        except InvalidIdentifier:
            return None
        digest = parse_stored_track_name(name)
        if digest is None:
            return self.live.get(tuple(bytes(f) for f in namespace), bytes(name))
        try:
            block = await self.blocks.lookup(compat, scope, key)
        except NotFound:  # a storage fault: the holder retires the block; to the peer, a miss
            return None
        return block if block is not None and block.digest == digest else None

    async def _serve_fetch(self, event: FetchReceived) -> None:
        target = event.message.target
        rid = event.request_id
        if not isinstance(target, StandaloneFetch):
            self._refuse(rid, RequestErrorCode.NOT_SUPPORTED, "only standalone FETCH of blocks")
            return
        found = await self._find(target.track_namespace, target.track_name)
        if found is None:
            self._refuse(rid, RequestErrorCode.DOES_NOT_EXIST, "no such KV block track")
            return
        if isinstance(found, LiveTrack):
            count, ttl = len(found.layers), None
        else:
            count, ttl = len(found.layer_digests), found.ttl_ms
        span = fetch_layer_range(target.start, target.end, count)
        layers = None if span is None else self._layers_of(found, *span)
        if span is None or layers is None:
            self._refuse(rid, RequestErrorCode.INVALID_RANGE, "layers not held")
            return
        first, last = span
        session = self.connection.session
        end_of_track = last == count - 1 and (not isinstance(found, LiveTrack) or found.done)
        session.fetch_ok(
            rid,
            end_location=Location(KV_GROUP, last),
            end_of_track=end_of_track,
            track_extensions=self._track_extensions(ttl),
        )
        stream_id = await self.connection.open_fetch_stream(rid)
        # one run of objects: headers encoded together, K and V never joined
        objects = [StreamObject(i, kv, ext, KV_GROUP) for i, kv, ext in layers]
        await self.connection.send_objects(stream_id, objects, end_stream=True)

    def _layers_of(self, found: StoredBlock | LiveTrack, first: int, last: int) -> _Objects | None:
        """Layers ``first..last`` as (layer index, (K, V), object extensions), or None when
        not all are held."""
        if isinstance(found, LiveTrack):
            if last >= len(found.layers):
                return None
            return self._live_objects(found.layers[first : last + 1], first)
        held = found.held(first, last)
        if held is None:
            return None
        if not self.in_band_digests:
            return [(layer.index, (layer.k, layer.v), ()) for layer in held]
        extensions = found.digest_extensions()
        base = found.container.first_layer
        return [(layer.index, (layer.k, layer.v), extensions[layer.index - base]) for layer in held]

    def _live_objects(self, layers: _LayerList, first: int) -> _Objects:
        return [
            (index, (k, v), self._extensions(digest))
            for index, (k, v, digest) in enumerate(layers, start=first)
        ]

    async def _serve_subscribe(self, event: SubscribeReceived) -> None:
        message, rid = event.message, event.request_id
        found = await self._find(message.track_namespace, message.track_name)
        if found is None:
            self._refuse(rid, RequestErrorCode.DOES_NOT_EXIST, "no such KV block track")
            return
        if isinstance(found, LiveTrack):
            await self._send_live(rid, found)
            return
        last = found.container.first_layer + found.container.layer_count - 1
        self.connection.session.subscribe_ok(
            rid,
            # d16 §9.10: LARGEST_OBJECT MUST be present when objects exist
            parameters=MessageParameters(largest_object=Location(KV_GROUP, last)),
            track_extensions=self._track_extensions(found.ttl_ms),
        )
        await self._send_stored(rid, found)

    async def _send_stored(self, rid: int, block: StoredBlock) -> None:
        """The held layers of ``block`` on one subgroup stream (object = layer, ascending,
        END_OF_GROUP, FIN), then PUBLISH_DONE."""
        first = block.container.first_layer
        last = first + block.container.layer_count - 1
        layers = self._layers_of(block, first, last) or []
        session = self.connection.session
        stream_id = await self.connection.open_subgroup(rid, KV_GROUP, end_of_group=True)
        objects = [StreamObject(i, kv, ext) for i, kv, ext in layers]
        await self.connection.send_objects(stream_id, objects, end_stream=True)
        session.publish_done(rid, PublishDoneCode.TRACK_ENDED)
        self.connection.transmit()

    async def push(self, block: StoredBlock) -> bool:
        """PUBLISH ``block``'s stored track to the peer (a relay, which caches it) and send the
        whole block on it; False when the peer's PUBLISH_OK asked for no objects (FORWARD 0).

        Raises:
            Incompatible: a partial block (a stored track carries layers 0..L-1).
            RequestRejected: the peer refused. SessionClosedError: the session ended.
        """
        if block.container.first_layer != 0 or block.container.layer_count != len(
            block.layer_digests
        ):
            raise Incompatible("only a complete block is published as its stored track")
        publication = await self.connection.publish(
            block.namespace,
            block.track_name,
            track_extensions=self._track_extensions(block.ttl_ms),
        )
        rid = publication.request_id
        if publication.ok.parameters.forward == 0:  # d16 §9.14: the peer wants none now
            self._answer(
                lambda: self.connection.session.publish_done(
                    rid, PublishDoneCode.TRACK_ENDED, stream_count=0
                )
            )
            return False
        await self._send_stored(rid, block)
        return True

    async def _send_live(self, rid: int, track: LiveTrack) -> None:
        session = self.connection.session
        params = MessageParameters()
        if track.layers:
            params = MessageParameters(largest_object=Location(KV_GROUP, len(track.layers) - 1))
        session.subscribe_ok(rid, parameters=params)
        stream_id = await self.connection.open_subgroup(rid, KV_GROUP, end_of_group=True)
        sent = 0
        while True:
            while sent < len(track.layers):
                ready = self._live_objects(track.layers[sent:], sent)
                objects = [StreamObject(i, kv, ext) for i, kv, ext in ready]
                await self.connection.send_objects(stream_id, objects)
                sent += len(objects)
            if track.done:
                break
            await track.wait_beyond(sent)
        if track.failed is not None:
            session.end_subscription_streams(rid)
            session.publish_done(rid, PublishDoneCode.INTERNAL_ERROR, reason=track.failed)
        else:
            session.finish_stream(stream_id)
            session.publish_done(rid, PublishDoneCode.TRACK_ENDED)
        self.connection.transmit()


async def serve_blocks(
    host: str,
    port: int,
    *,
    configuration: Any,
    blocks: BlockSource,
    live: LiveTracks | None = None,
    backend: str | None = None,
    transport: TransportConfig | None = None,
    in_band_digests: bool = True,
) -> MOQTServer:
    """A MOQT server whose every session is a :class:`MoqtBlockPublisher` of ``blocks`` and
    ``live`` (consumers FETCH or SUBSCRIBE straight from the producer)."""
    tracks = live if live is not None else LiveTracks()

    async def handler(connection: MOQTConnection) -> None:
        publisher = MoqtBlockPublisher(
            connection, blocks, live=tracks, in_band_digests=in_band_digests
        )
        await publisher.serve()

    return await serve(
        host,
        port,
        configuration=configuration,
        handler=handler,
        backend=backend,
        transport=transport,
    )
