"""The MOQT draft-16 relay (DESIGN.md §1 "Relay", §4; moqt.md §2.2 relay rules): asyncio shell.

One UDP socket serves every peer (:func:`moqt.asyncio.serve`). Each session is authenticated
from its CLIENT_SETUP token (:mod:`relay.access`) and then its requests are dispatched:

* PUBLISH_NAMESPACE / PUBLISH_NAMESPACE_DONE: the namespace routes to that session (and is
  announced to the upstream relay, which then routes it here);
  SUBSCRIBE_NAMESPACE sessions hear NAMESPACE / NAMESPACE_DONE, and are offered PUBLISHed
  tracks, for what they may see (:mod:`relay.announce`).
* SUBSCRIBE: attached to the track's one upstream subscription, or a new one to the longest
  announced prefix's publisher, else to the upstream relay (:class:`~relay.track.RelayedTrack`).
* PUBLISH: the publisher's track, fanned out and cached like a subscription.
* FETCH (standalone): from the cache when it holds the whole range, even after the publisher
  left; else passed to the publisher or the upstream relay and cached (:mod:`relay.fetch`);
  concurrent misses of one track and range share one upstream fetch.
  A joining FETCH gets the history the cache holds before the joined subscription's Largest.
* A SUBSCRIBE or FETCH whose source's session closes before answering (a publisher leaving
  as the request reaches it) goes to the next source, as if the leaver had gone before.
* No route: REQUEST_ERROR DOES_NOT_EXIST; not allowed: UNAUTHORIZED; tombstoned:
  MALFORMED_TRACK.

Cached KV replicas are published as Replica Records by :class:`~relay.holder.RelayHolder`;
the maintenance task refreshes records, expires objects, and evicts by LRU under the byte
budget, withdrawing each record before its track goes and never choosing a leased track.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvsp.errors import Unauthorized
from kvsp.web.auth import Principal, Principals
from kvsp.web.background import raise_if_cancelling
from kvsp.web.clock import Clock, SystemClock
from moqt.asyncio import MOQTConnection, MOQTServer, serve
from moqt.backend import DEFAULT_DATAGRAM_SIZE, TransportConfig, get_backend, transport_banner
from moqt.errors import RequestErrorCode, SessionError
from moqt.messages import (
    AuthToken,
    JoiningFetch,
    MessageParameters,
    StandaloneFetch,
)
from moqt.session import SessionConfig
from moqt.session_events import (
    FetchReceived,
    PublishNamespaceDoneReceived,
    PublishNamespaceReceived,
    PublishOkReceived,
    PublishReceived,
    RequestErrorReceived,
    RequestUpdateReceived,
    SubscribeNamespaceEnded,
    SubscribeNamespaceReceived,
    SubscribeReceived,
    TrackStatusReceived,
    UnsubscribeReceived,
)
from moqt.session_state import LocalProtocolError
from moqt.wire import Location, TrackNamespace

from . import access
from .announce import Announcements
from .cache import DEFAULT_TOMBSTONE_MS, FetchPlan, Malformed, ObjectCache, TrackKey
from .downstream import DEFAULT_QUEUE_LIMIT
from .fetch import proxy_fetch, serve_cached
from .holder import HolderConfig, RelayHolder
from .kv import KVReplica
from .peer import NOBODY, Peer, refuse
from .routing import NamespaceRoutes, NamespaceSubscribers
from .track import RelayedTrack, TrackHooks
from .upstream import UpstreamConfig, UpstreamLink

log = logging.getLogger(__name__)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("relay task failed", exc_info=task.exception())


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayConfig:
    """Everything the relay needs; ``principals`` None is open mode (``--open``)."""

    certificate: Path
    private_key: Path
    host: str = "127.0.0.1"
    port: int = 0
    backend: str | None = None
    datagram_size: int | None = DEFAULT_DATAGRAM_SIZE
    """Largest QUIC datagram the relay sends (``--quic-datagram-size``)."""
    cache_bytes: int = 1 << 30
    principals: Principals | None = None
    upstream: UpstreamConfig | None = None
    public_url: str | None = None
    qmux_tls: tuple[str, int] | None = None
    """Where MOQT over QMux over TLS listens (TCP host, port); None: not at all."""
    qmux_tcp: tuple[str, int] | None = None
    """Where MOQT over QMux over plain TCP listens (loopback unless ``trusted_network``)."""
    qmux_unix: Path | None = None
    """The Unix socket MOQT over QMux listens on (mode 0600: the file is the access boundary)."""
    trusted_network: bool = False
    tombstone_ms: int = DEFAULT_TOMBSTONE_MS
    queue_limit: int = DEFAULT_QUEUE_LIMIT
    maintenance_s: float = 0.5
    session: SessionConfig = field(default_factory=SessionConfig)


class Relay(Announcements):
    """A caching MOQT relay that is also a KVSP holder (see the module docstring)."""

    def __init__(
        self,
        config: RelayConfig,
        *,
        holder: RelayHolder | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self.clock = clock or SystemClock()
        self.cache = ObjectCache(config.cache_bytes, tombstone_ms=config.tombstone_ms)
        self.holder = holder or RelayHolder(HolderConfig(capacity=config.cache_bytes), self.clock)
        principals = access.bind_audiences(config.principals, self._own_uris)
        self.config = replace(config, principals=principals)
        self.routes: NamespaceRoutes[Peer] = NamespaceRoutes()
        self.ns_subscribers: NamespaceSubscribers[Peer] = NamespaceSubscribers()
        self.tracks: dict[TrackKey, RelayedTrack] = {}
        self.hooks = TrackHooks(
            cache=self.cache,
            now_ms=self.clock.now_ms,
            on_replica=self._on_replica,
            on_cached=self._on_cached,
            on_ended=self._on_track_ended,
            queue_limit=config.queue_limit,
        )
        self._upstream = (
            None if config.upstream is None else UpstreamLink(config.upstream, self._serve_upstream)
        )
        self._peers: set[Peer] = set()
        self._gone_octets = (0, 0)  # (sent, received) by sessions that ended, for metrics
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: MOQTServer | None = None
        self._qmux_servers: list[Any] = []
        self.carriers: tuple[str, ...] = ()
        self._evicting: asyncio.Task[None] | None = None
        self._fetching: dict[tuple[TrackKey, Location, Location], asyncio.Future[None]] = {}
        self.merged_fetches = 0  # FETCH misses that waited for another one's upstream fetch
        self.url = ""
        self._handlers: dict[type, Callable[[Peer, Any], None]] = {
            SubscribeReceived: self._on_subscribe,
            UnsubscribeReceived: self._on_unsubscribe,
            FetchReceived: self._on_fetch,
            PublishReceived: self._on_publish,
            PublishNamespaceReceived: self._on_publish_namespace,
            PublishNamespaceDoneReceived: self._on_publish_namespace_done,
            SubscribeNamespaceReceived: self._on_subscribe_namespace,
            SubscribeNamespaceEnded: self._on_subscribe_namespace_ended,
            TrackStatusReceived: self._on_track_status,
            RequestUpdateReceived: self._on_request_update,
            PublishOkReceived: self._on_publish_ok,
            RequestErrorReceived: self._on_offer_refused,
        }

    # --- life ----------------------------------------------------------------------------------

    def _own_uris(self) -> list[str | None]:
        """The URIs this relay is known by (the audiences of the credentials it accepts)."""
        holder = self.holder
        return [self.url, *self.carriers, holder.holder_url, holder.lease_base, *holder.carriers]

    async def start(self) -> str:
        """Listen; returns the relay's ``moqt://host:port/`` URL.

        Raises:
            ListenError: a listener cannot bind; the ones already open are closed again.
        """
        try:
            return await self._listen()
        except BaseException:
            self._close_listeners()
            raise

    async def _listen(self) -> str:
        cfg = self.config
        backend = get_backend(cfg.backend)
        transport = TransportConfig(max_datagram_size=cfg.datagram_size)
        configuration = backend.configuration(
            is_client=False,
            transport=transport,
            certificate=str(cfg.certificate),
            private_key=str(cfg.private_key),
        )
        self._server = await serve(
            cfg.host,
            cfg.port,
            configuration=configuration,
            handler=self._serve_peer,
            backend=cfg.backend,
            session_config=cfg.session,
        )
        host, port = self._server.address
        shown = f"[{host}]" if ":" in host else host
        self.url = cfg.public_url or f"moqt://{shown}:{port}/"
        log.info("MOQT over QUIC at %s: %s", self.url, transport_banner(cfg.backend, transport))
        self.carriers = await self._serve_qmux()
        if not self.holder.holder_url:
            self.holder.holder_url = self.url
            self.holder.carriers = self.carriers
        self._spawn(self._maintain())
        return self.url

    async def _serve_qmux(self) -> tuple[str, ...]:
        """Listen on the configured QMux carriers (one cache, one authorization path: every
        session goes to the same handler); their URIs, fastest first, on the host of
        :attr:`url` (records name carriers on the holder's own host)."""
        cfg = self.config
        if cfg.qmux_tls is None and cfg.qmux_tcp is None and cfg.qmux_unix is None:
            return ()
        from moqt.qmux_asyncio import QMuxEndpoint, serve_qmux, server_ssl_context

        public = urlsplit(self.url).hostname or cfg.host
        shown = f"[{public}]" if ":" in public else public
        uris: list[str] = []

        async def listen(endpoint: QMuxEndpoint, ssl_context: Any = None) -> Any:
            server = await serve_qmux(
                endpoint,
                handler=self._serve_peer,
                ssl_context=ssl_context,
                session_config=cfg.session,
                trusted_network=cfg.trusted_network,
            )
            self._qmux_servers.append(server)
            return server

        if cfg.qmux_unix is not None:
            await listen(QMuxEndpoint(carrier="unix", path=str(cfg.qmux_unix)))
            uris.append(f"moqt+unix://localhost{cfg.qmux_unix.resolve()}")
        if cfg.qmux_tcp is not None:
            host, port = cfg.qmux_tcp
            server = await listen(QMuxEndpoint(carrier="tcp", host=host, port=port))
            uris.append(f"moqt+tcp://{shown}:{server.address[1]}/")
        if cfg.qmux_tls is not None:
            host, port = cfg.qmux_tls
            context = server_ssl_context(str(cfg.certificate), str(cfg.private_key))
            server = await listen(QMuxEndpoint(carrier="tls", host=host, port=port), context)
            uris.append(f"moqt+tls://{shown}:{server.address[1]}/")
        return tuple(uris)

    def _close_listeners(self) -> None:
        if self._server is not None:
            self._server.close()
        for server in self._qmux_servers:
            server.close()

    async def close(self) -> None:
        """Stop serving: close every session and withdraw every record."""
        self._close_listeners()
        for track in list(self.tracks.values()):
            track.close()
        if self._upstream is not None:
            await self._upstream.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.holder.close()

    def _spawn(self, coro: Coroutine[Any, Any, Any], peer: Peer | None = None) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)
        if peer is not None:
            peer.tasks.add(task)
            task.add_done_callback(peer.tasks.discard)

    # --- sessions -------------------------------------------------------------------------------

    async def _serve_peer(self, connection: MOQTConnection) -> None:
        setup = await connection.wait_setup()
        tokens = setup.parameters.authorization_tokens
        try:
            principal = access.authenticate(self.config.principals, tokens, self.clock.now_ms())
        except Unauthorized:
            connection.close(SessionError.UNAUTHORIZED, "a valid AUTHORIZATION TOKEN is needed")
            return
        if not access.may_open_session(principal):
            connection.close(SessionError.UNAUTHORIZED, "this principal may not use the relay")
            return
        await self._run_peer(Peer(connection, principal))

    async def _serve_upstream(self, connection: MOQTConnection) -> None:
        await self._run_peer(Peer(connection, NOBODY, upstream=True))

    def _forward_namespace(self, namespace: TrackNamespace, *, done: bool) -> None:
        """Announce (or withdraw) a namespace at the upstream relay, if there is one."""
        if self._upstream is None:
            return
        if done:
            self._upstream.withdraw(namespace)
        else:
            self._upstream.announce(namespace)

    async def _run_peer(self, peer: Peer) -> None:
        self._peers.add(peer)
        try:
            async for event in peer.connection.requests():
                handler = self._handlers.get(type(event))
                if handler is None:
                    continue
                try:
                    handler(peer, event)
                except LocalProtocolError as exc:
                    log.debug("request from a closing session: %s", exc)
        finally:
            self._peer_gone(peer)

    def moqt_octets(self) -> tuple[int, int]:
        """Object payload octets (sent, received) over every session so far (metrics)."""
        sent, received = self._gone_octets
        for peer in self._peers:
            sent += peer.connection.session.payload_octets_sent
            received += peer.connection.session.payload_octets_received
        return sent, received

    def _peer_gone(self, peer: Peer) -> None:
        if peer in self._peers:  # its octets join the totals once
            session = peer.connection.session
            sent, received = self._gone_octets
            self._gone_octets = (
                sent + session.payload_octets_sent,
                received + session.payload_octets_received,
            )
        self._peers.discard(peer)
        for request_id, track in peer.subscriptions.items():
            track.detach(peer.connection, request_id)
        peer.subscriptions.clear()
        for task in list(peer.tasks):
            task.cancel()
        for namespace in self.routes.withdraw_source(peer):
            self._notify(namespace, done=True, origin=peer)
        self.ns_subscribers.remove_session(peer)

    def _principal(self, peer: Peer, tokens: tuple[AuthToken, ...]) -> Principal | None:
        """The principal of one request, or None when its own token is not valid."""
        try:
            return access.request_principal(
                self.config.principals, peer.principal, tokens, self.clock.now_ms()
            )
        except Unauthorized:
            return None

    def _allowed(
        self,
        peer: Peer,
        request_id: int,
        namespace: TrackNamespace,
        tokens: tuple[AuthToken, ...],
        *,
        request: str,
    ) -> Principal | None:
        publish = request in ("PUBLISH", "PUBLISH_NAMESPACE")
        if peer.upstream:  # the upstream relay reads what we announced to it, nothing else
            if publish or self._upstream is None or not self._upstream.covers(namespace):
                refuse(peer, request_id, RequestErrorCode.UNAUTHORIZED, "not authorized")
                return None
            return peer.principal
        principal = self._principal(peer, tokens)
        if principal is None or not access.may_access(principal, namespace, request=request):
            # the same answer whether or not anything of that namespace is cached here
            refuse(peer, request_id, RequestErrorCode.UNAUTHORIZED, "not authorized")
            return None
        return principal

    def _source(
        self, key: TrackKey, exclude: Peer, failed: Collection[Peer | None] = ()
    ) -> Peer | None:
        """Where a request of ``exclude`` for ``key`` goes: the announcing session, passing
        over sessions already closed (their end may not have been handled yet) and those a
        request ``failed`` on."""

        def usable(peer: Peer) -> bool:
            return peer not in failed and peer.connection.session.closed is None

        return self.routes.route(key[0], exclude=exclude, usable=usable)

    # --- subscriptions ----------------------------------------------------------------------

    def _on_subscribe(self, peer: Peer, event: SubscribeReceived) -> None:
        message = event.message
        key = (message.track_namespace, message.track_name)
        tokens = message.parameters.authorization_tokens
        if self._allowed(peer, event.request_id, key[0], tokens, request="SUBSCRIBE") is None:
            return
        if self.cache.is_malformed(key, self.clock.now_ms()):
            refuse(peer, event.request_id, RequestErrorCode.MALFORMED_TRACK, "malformed")
            return
        track = self.tracks.get(key)
        if track is None:
            source = self._source(key, peer)
            if source is None and not self._may_go_upstream(peer):
                refuse(peer, event.request_id, RequestErrorCode.DOES_NOT_EXIST, "no route")
                return
            track = self.tracks[key] = RelayedTrack(key, self.hooks)
            track.attach(peer.connection, message)
            self._spawn(self._subscribe_upstream(track, source, peer, message))
        else:
            track.attach(peer.connection, message)
        peer.subscriptions[event.request_id] = track

    async def _subscribe_upstream(
        self, track: RelayedTrack, source: Peer | None, requester: Peer, first: Any
    ) -> None:
        failed: list[Peer | None] = []  # sources whose session closed before answering
        while True:
            connection = await self._source_connection(source)
            if connection is None:
                track.fail(RequestErrorCode.DOES_NOT_EXIST, "the upstream relay is unreachable")
                return
            if await track.subscribe(connection, first):  # its data events reach pump
                return
            failed.append(source)  # it left as the request reached it: another may serve
            source = self._source(track.key, requester, failed)
            if source is None and not self._may_go_upstream(requester, failed):
                track.fail(RequestErrorCode.DOES_NOT_EXIST, "no route: the publisher left")
                return

    def _may_go_upstream(self, requester: Peer, failed: Collection[Peer | None] = ()) -> bool:
        """Whether a request of ``requester`` no announcer serves goes to the upstream relay:
        there is one, the request did not come from it, and it has not failed the request."""
        return self._upstream is not None and not requester.upstream and None not in failed

    async def _source_connection(self, source: Peer | None) -> MOQTConnection | None:
        if source is not None:
            return source.connection
        if self._upstream is None:
            return None
        try:
            return await self._upstream.connection()
        except ConnectionError as exc:
            log.warning("%s", exc)
            return None

    def _on_unsubscribe(self, peer: Peer, event: UnsubscribeReceived) -> None:
        track = peer.subscriptions.pop(event.request_id, None)
        if track is not None:
            track.detach(peer.connection, event.request_id)

    def _on_publish(self, peer: Peer, event: PublishReceived) -> None:
        message = event.message
        key = (message.track_namespace, message.track_name)
        tokens = message.parameters.authorization_tokens
        if self._allowed(peer, event.request_id, key[0], tokens, request="PUBLISH") is None:
            return
        if self.cache.is_malformed(key, self.clock.now_ms()):
            refuse(peer, event.request_id, RequestErrorCode.MALFORMED_TRACK, "malformed")
            return
        if key in self.tracks:
            reason = "the track is already relayed from another source"
            refuse(peer, event.request_id, RequestErrorCode.NOT_SUPPORTED, reason)
            return
        peer.connection.session.publish_ok(
            event.request_id, parameters=MessageParameters(forward=1)
        )
        peer.connection.transmit()
        track = self.tracks[key] = RelayedTrack(key, self.hooks, published=True)
        track.adopt(peer.connection, event.request_id, message.track_extensions)
        self._spawn(track.pump(peer.connection.track(event.request_id)))  # ends on its own
        for sub, _ in self.ns_subscribers.interested(key[0]):
            self._offer(sub.session, sub.request_id, track)

    def _on_track_ended(self, track: RelayedTrack) -> None:
        if self.tracks.get(track.key) is track:
            del self.tracks[track.key]

    def _on_request_update(self, peer: Peer, event: RequestUpdateReceived) -> None:
        peer.connection.session.request_ok(event.request_id)
        peer.connection.transmit()

    def _on_track_status(self, peer: Peer, event: TrackStatusReceived) -> None:
        message = event.message
        tokens = message.parameters.authorization_tokens
        namespace = message.track_namespace
        if self._allowed(peer, event.request_id, namespace, tokens, request="TRACK_STATUS") is None:
            return
        entry = self.cache.track((message.track_namespace, message.track_name))
        largest = None if entry is None else entry.largest
        if largest is None:
            refuse(peer, event.request_id, RequestErrorCode.DOES_NOT_EXIST, "not cached")
            return
        params = MessageParameters(largest_object=largest)
        peer.connection.session.request_ok(event.request_id, parameters=params)
        peer.connection.transmit()

    # --- FETCH ------------------------------------------------------------------------------

    def _on_fetch(self, peer: Peer, event: FetchReceived) -> None:
        target = event.message.target
        rid = event.request_id
        if isinstance(target, JoiningFetch):
            self._on_joining_fetch(peer, event, target)
            return
        key = (target.track_namespace, target.track_name)
        tokens = event.message.parameters.authorization_tokens
        if self._allowed(peer, rid, key[0], tokens, request="FETCH") is None:
            return
        plan = self.cache.lookup(key, target.start, target.end, self.clock.now_ms())
        if plan is Malformed.TRACK:
            refuse(peer, rid, RequestErrorCode.MALFORMED_TRACK, "malformed track")
        elif plan is not None:
            self._spawn(serve_cached(peer.connection, rid, plan), peer)
        else:
            self._spawn(self._fetch_upstream(peer, rid, target), peer)

    def _on_joining_fetch(self, peer: Peer, event: FetchReceived, target: JoiningFetch) -> None:
        """A joining FETCH (§9.16.2): the history this relay holds before the joined
        subscription's Largest Location, from the cache."""
        rid, joined = event.request_id, event.joined
        track = peer.subscriptions.get(target.joining_request_id)
        joining = (id(peer.connection), target.joining_request_id)
        downstream = None if track is None else track.downstreams.get(joining)
        if track is None or joined is None or downstream is None:
            code = RequestErrorCode.INVALID_JOINING_REQUEST_ID
            refuse(peer, rid, code, "not an accepted subscription")
            return
        tokens = event.message.parameters.authorization_tokens
        if self._allowed(peer, rid, joined.track_namespace, tokens, request="FETCH") is None:
            return
        largest = downstream.joined_at
        start = None
        if largest is not None:
            group = target.joining_start
            start = Location(group if target.absolute else max(0, largest.group - group), 0)
        if largest is None or start is None or start > largest:
            refuse(peer, rid, RequestErrorCode.INVALID_RANGE, "nothing before it")
            return
        found = self.cache.between(track.key, start, largest, self.clock.now_ms())
        plan = FetchPlan(tuple(found), largest, False, track.extensions)
        self._spawn(serve_cached(peer.connection, rid, plan), peer)

    async def _fetch_upstream(self, peer: Peer, request_id: int, target: StandaloneFetch) -> None:
        """A FETCH the cache cannot serve. Concurrent misses of one track and range share one
        upstream fetch: the first goes upstream (objects forwarded as they arrive), the others
        wait for it and are then served from the cache; if it did not bring the whole range
        (failed, cancelled), the next waiter goes upstream itself."""
        key = (target.track_namespace, target.track_name)
        shared = (key, target.start, target.end)
        while (leader := self._fetching.get(shared)) is not None:
            self.merged_fetches += 1
            await asyncio.shield(leader)
            plan = self.cache.lookup(key, target.start, target.end, self.clock.now_ms())
            if plan is Malformed.TRACK:
                refuse(peer, request_id, RequestErrorCode.MALFORMED_TRACK, "malformed track")
                return
            if plan is not None:
                await serve_cached(peer.connection, request_id, plan)
                return
        done = self._fetching[shared] = asyncio.get_running_loop().create_future()
        try:
            await self._fetch_from_source(peer, request_id, target)
        finally:
            del self._fetching[shared]
            done.set_result(None)

    async def _fetch_from_source(
        self, peer: Peer, request_id: int, target: StandaloneFetch
    ) -> None:
        key = (target.track_namespace, target.track_name)
        track = self.tracks.get(key)
        publisher = track.source if track is not None and track.published else None
        if publisher is not None and await proxy_fetch(
            peer.connection, request_id, target, publisher, self.hooks
        ):
            return  # the session that PUBLISHed the track answered
        failed: list[Peer | None] = []  # sources whose session closed before answering
        while True:
            source = self._source(key, peer, failed)
            if source is None and not self._may_go_upstream(peer, failed):
                refuse(peer, request_id, RequestErrorCode.DOES_NOT_EXIST, "not cached")
                return
            connection = await self._source_connection(source)
            if connection is None:
                refuse(peer, request_id, RequestErrorCode.DOES_NOT_EXIST, "not cached")
                return
            if await proxy_fetch(peer.connection, request_id, target, connection, self.hooks):
                return
            failed.append(source)  # it left as the request reached it: another may serve

    # --- cache upkeep and the holder role ---------------------------------------------------

    def _on_replica(self, replica: KVReplica) -> None:
        if self.holder.add(replica):
            self._spawn(self.holder.publish(replica.key))

    def _on_cached(self) -> None:
        if self.cache.over_budget and (self._evicting is None or self._evicting.done()):
            self._evicting = asyncio.get_running_loop().create_task(self._evict())
            self._tasks.add(self._evicting)
            self._evicting.add_done_callback(self._tasks.discard)

    async def _evict(self) -> None:
        """Evict by LRU until the cache fits, withdrawing records first (spec §6.1)."""
        for key in self.cache.victims(self.holder.is_pinned):
            if self.holder.is_pinned(key):  # leased while earlier victims were withdrawn
                self.cache.keep(key)
                continue
            await self.holder.withdraw(key)
            self.cache.evict(key)

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(self.config.maintenance_s)
            raise_if_cancelling()
            try:
                await self._upkeep()
            except Exception:  # noqa: BLE001 - keep the relay running; the next pass retries
                raise_if_cancelling()
                log.exception("cache upkeep failed")

    async def _upkeep(self) -> None:
        for key in self.holder.expired():
            await self.holder.withdraw(key)  # MAX_CACHE_DURATION passed: withdraw, then drop
            self.cache.evict(key)
        for key in self.cache.expire(self.clock.now_ms()):
            await self.holder.withdraw(key)  # no longer complete
        for key in self.holder.due():
            await self.holder.publish(key)
        self._on_cached()
