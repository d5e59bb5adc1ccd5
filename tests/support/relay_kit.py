"""Helpers for the relay tests: relays in-process, MOQT clients, a scripted publisher, KV blocks.

Everything runs over real UDP on 127.0.0.1 with :mod:`moqt.asyncio`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.moqt_mapping import kv_namespace, layer_digest_extension
from moqt.asyncio import MOQTConnection, ReceivedObject, connect
from moqt.backend import get_backend
from moqt.errors import PublishDoneCode, RequestErrorCode
from moqt.messages import StandaloneFetch
from moqt.messages_params import ExtensionType
from moqt.session_events import FetchReceived, SubscribeReceived, UnsubscribeReceived
from moqt.wire import KeyValuePair, Location, TrackNamespace
from relay.relay import Relay, RelayConfig

COMPAT = CompatId(hashlib.sha256(b"relay-test-compat").digest())
SCOPE_A = ScopeId(b"\x0a" * 16)
SCOPE_B = ScopeId(b"\x0b" * 16)
Certs = tuple[Path, Path]


@dataclass(frozen=True, slots=True)
class Block:
    """A KV block as a stored replica track: namespace, name (replica digest hex), layers."""

    namespace: TrackNamespace
    name: bytes
    layers: tuple[bytes, ...]
    scope: bytes
    key: bytes

    @property
    def track(self) -> tuple[TrackNamespace, bytes]:
        return self.namespace, self.name

    @property
    def digests(self) -> tuple[bytes, ...]:
        return tuple(hashlib.sha256(layer).digest() for layer in self.layers)

    def objects(self) -> list[tuple[bytes, tuple[KeyValuePair, ...]]]:
        return [
            (layer, (layer_digest_extension(d),))
            for layer, d in zip(self.layers, self.digests, strict=True)
        ]


def make_block(seed: int, *, scope: bytes = SCOPE_A, layers: int = 4, size: int = 1024) -> Block:
    """A block of ``layers`` layers of ``size`` octets, deterministic in ``seed``."""
    payloads = tuple(
        (hashlib.sha256(b"%d/%d" % (seed, i)).digest() * (size // 32 + 1))[:size]
        for i in range(layers)
    )
    key = BlockKey(hashlib.sha256(b"key%d" % seed).digest())
    namespace = kv_namespace(COMPAT, ScopeId(scope), key)
    digest = hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in payloads)).digest()
    return Block(namespace, digest.hex().encode(), payloads, scope, key)


def max_cache(ms: int) -> tuple[KeyValuePair, ...]:
    """Track extensions with MAX_CACHE_DURATION."""
    return ((ExtensionType.MAX_CACHE_DURATION, ms),)


@dataclass
class Track:
    """What the scripted publisher serves for one track."""

    objects: list[tuple[bytes, tuple[KeyValuePair, ...]]]
    extensions: tuple[KeyValuePair, ...] = ()


@dataclass
class Publisher:
    """A client that announces namespaces and answers the relay's SUBSCRIBE and FETCH.

    Subscription objects are sent once ``release`` is set, FETCH answers once ``answer_fetches``
    is (set from the start); ``versions`` lets a track's payloads change between subscriptions
    (a buggy publisher, for the malformed-track test).
    """

    connection: MOQTConnection
    tracks: dict[tuple[TrackNamespace, bytes], Track]
    release: asyncio.Event = field(default_factory=asyncio.Event)
    subscribes: int = 0
    fetches: int = 0
    unsubscribes: int = 0
    versions: list[Track] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    answer_fetches: asyncio.Event = field(default_factory=lambda: _set(asyncio.Event()))

    async def announce(self, namespace: TrackNamespace) -> None:
        await self.connection.publish_namespace(namespace)

    async def run(self) -> None:
        async for event in self.connection.requests():
            if isinstance(event, SubscribeReceived):
                task = asyncio.create_task(self._subscribe(event))
            elif isinstance(event, FetchReceived):
                task = asyncio.create_task(self._fetch(event))
            else:
                self.unsubscribes += isinstance(event, UnsubscribeReceived)
                continue
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _track(self, namespace: TrackNamespace, name: bytes) -> Track | None:
        return self.tracks.get((namespace, name))

    async def _subscribe(self, event: SubscribeReceived) -> None:
        session = self.connection.session
        track = self._track(event.message.track_namespace, event.message.track_name)
        if track is None:
            session.request_error(event.request_id, RequestErrorCode.DOES_NOT_EXIST, "no")
            self.connection.transmit()
            return
        if self.versions:
            track = self.versions[min(self.subscribes, len(self.versions) - 1)]
        self.subscribes += 1
        session.subscribe_ok(event.request_id, track_extensions=track.extensions)
        self.connection.transmit()
        await self.release.wait()
        stream = await self.connection.open_subgroup(event.request_id, 0, end_of_group=True)
        last = len(track.objects) - 1
        for index, (payload, extensions) in enumerate(track.objects):
            await self.connection.send_object(
                stream, index, payload, extensions=extensions, end_stream=index == last
            )
        session.publish_done(event.request_id, PublishDoneCode.TRACK_ENDED)
        self.connection.transmit()

    async def _fetch(self, event: FetchReceived) -> None:
        session = self.connection.session
        target = event.message.target
        assert isinstance(target, StandaloneFetch)
        track = self._track(target.track_namespace, target.track_name)
        if track is None:
            session.request_error(event.request_id, RequestErrorCode.DOES_NOT_EXIST, "no")
            self.connection.transmit()
            return
        self.fetches += 1
        await self.answer_fetches.wait()
        if event.request_id not in session.requests:
            return  # cancelled (FETCH_CANCEL) while held back
        first = target.start.object
        last = len(track.objects) - 1 if target.end.object == 0 else target.end.object - 1
        last = min(last, len(track.objects) - 1)
        session.fetch_ok(
            event.request_id,
            end_location=Location(0, last),
            end_of_track=last == len(track.objects) - 1,
            track_extensions=track.extensions,
        )
        stream = await self.connection.open_fetch_stream(event.request_id)
        for index in range(first, last + 1):
            payload, extensions = track.objects[index]
            await self.connection.send_fetch_object(
                stream,
                group_id=0,
                object_id=index,
                payload=payload,
                extensions=extensions,
                end_stream=index == last,
            )


def _set(event: asyncio.Event) -> asyncio.Event:
    event.set()
    return event


def relay_config(certs: Certs, **overrides: Any) -> RelayConfig:
    """An open relay on an ephemeral port (tests override principals, budget, upstream...)."""
    cert, key = certs
    return replace(RelayConfig(certificate=cert, private_key=key), **overrides)


@contextlib.asynccontextmanager
async def running_relay(config: RelayConfig, **kwargs: Any) -> AsyncIterator[Relay]:
    """A started relay, closed on exit."""
    relay = Relay(config, **kwargs)
    await relay.start()
    try:
        yield relay
    finally:
        await relay.close()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].strip("/"))


@contextlib.asynccontextmanager
async def client(
    url: str, certs: Certs, *, backend: str = "aioquic", token: str | None = None
) -> AsyncIterator[MOQTConnection]:
    """A MOQT session to the relay at ``url`` (pinning the test certificate)."""
    quic = get_backend(backend)
    configuration = quic.configuration(
        is_client=True, cafile=str(certs[0]), server_name="localhost"
    )
    auth = None if token is None else token.encode()
    async with connect(
        "127.0.0.1", port_of(url), configuration=configuration, backend=backend, auth_token=auth
    ) as connection:
        yield connection


@contextlib.asynccontextmanager
async def publishing(
    url: str,
    certs: Certs,
    tracks: dict[tuple[TrackNamespace, bytes], Track],
    namespaces: list[TrackNamespace],
    *,
    backend: str = "aioquic",
    token: str | None = None,
) -> AsyncIterator[Publisher]:
    """A connected :class:`Publisher` that has announced ``namespaces``."""
    async with client(url, certs, backend=backend, token=token) as connection:
        publisher = Publisher(connection, tracks)
        runner = asyncio.create_task(publisher.run())
        try:
            for namespace in namespaces:
                await publisher.announce(namespace)
            yield publisher
        finally:
            runner.cancel()
            for task in list(publisher.tasks):
                task.cancel()


async def fetch_all(
    connection: MOQTConnection, track: tuple[TrackNamespace, bytes], count: int
) -> list[ReceivedObject]:
    """FETCH objects 0..count-1 of group 0 and read them."""
    response = await connection.fetch(*track, Location(0, 0), Location(0, count))
    return [obj async for obj in response.track.objects()]


def block_track(block: Block) -> dict[tuple[TrackNamespace, bytes], Track]:
    """The publisher's tracks for one block (digest extensions on every object)."""
    return {block.track: Track(block.objects())}


def run(coro: Any, timeout: float = 30.0) -> Any:
    """Run a test coroutine with a deadline."""
    return asyncio.run(asyncio.wait_for(coro, timeout))
