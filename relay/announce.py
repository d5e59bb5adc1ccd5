"""Namespaces at the relay: PUBLISH_NAMESPACE routes, SUBSCRIBE_NAMESPACE notices, and tracks
offered to namespace subscribers (MOQT draft-16 §9.20–9.25; asyncio shell, mixed into
:class:`~relay.relay.Relay`).

* PUBLISH_NAMESPACE (publishers need ``instance``/``holder``/``admin`` and the scope) makes
  the namespace route to that session; PUBLISH_NAMESPACE_DONE or the session's end withdraws it.
* SUBSCRIBE_NAMESPACE is accepted for any prefix a session may use (a scope prefix of another
  scope is refused; a broader prefix is filtered per namespace); an overlapping prefix of the
  same session is PREFIX_OVERLAP. With options NAMESPACE or BOTH the session hears NAMESPACE
  for announced namespaces under the prefix (now and later) and NAMESPACE_DONE when the last
  announcer withdraws; with PUBLISH or BOTH the relay sends it a PUBLISH for each track
  published to the relay under the prefix, and delivers the objects after its PUBLISH_OK.
  Nobody hears of namespaces or tracks it may not use, nor of its own.
* With an upstream relay, a namespace's first announcement here is announced there too, and
  its last withdrawal withdrawn (:meth:`relay.upstream.UpstreamLink.announce`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvsp.moqt_mapping import Scoped, classify
from kvsp.web.auth import Principal
from kvsp.web.roles import may_request
from moqt.errors import PublishDoneCode, RequestErrorCode
from moqt.messages import AuthToken, SubscribeOptions
from moqt.session_events import (
    PublishNamespaceDoneReceived,
    PublishNamespaceReceived,
    PublishOkReceived,
    RequestErrorReceived,
    SubscribeNamespaceEnded,
    SubscribeNamespaceReceived,
)
from moqt.session_state import LocalProtocolError
from moqt.wire import TrackNamespace

from . import access
from .cache import TrackKey
from .peer import Peer, refuse
from .routing import NamespaceRoutes, NamespaceSubscribers, is_prefix
from .track import RelayedTrack

log = logging.getLogger(__name__)
_NOTICE = "SUBSCRIBE_NAMESPACE"
"""What a namespace subscriber hears of (NAMESPACE, NAMESPACE_DONE, offered PUBLISHes) is
filtered by the rule of its SUBSCRIBE_NAMESPACE."""


class Announcements:
    """Mixin: the namespace handlers of the relay."""

    routes: NamespaceRoutes[Peer]
    ns_subscribers: NamespaceSubscribers[Peer]
    tracks: dict[TrackKey, RelayedTrack]

    if TYPE_CHECKING:  # provided by Relay
        _allowed: Callable[..., Principal | None]

        def _principal(self, peer: Peer, tokens: tuple[AuthToken, ...]) -> Principal | None: ...

        def _forward_namespace(self, namespace: TrackNamespace, *, done: bool) -> None: ...

    def _on_publish_namespace(self, peer: Peer, event: PublishNamespaceReceived) -> None:
        message = event.message
        namespace = message.track_namespace
        tokens = message.parameters.authorization_tokens
        kind = "PUBLISH_NAMESPACE"
        if self._allowed(peer, event.request_id, namespace, tokens, request=kind) is None:
            return
        peer.namespaces[event.request_id] = namespace
        fresh = self.routes.announce(namespace, peer)
        peer.connection.session.request_ok(event.request_id)
        peer.connection.transmit()
        if fresh:
            self._notify(namespace, done=False, origin=peer)

    def _on_publish_namespace_done(self, peer: Peer, event: PublishNamespaceDoneReceived) -> None:
        namespace = peer.namespaces.pop(event.request_id, None)
        if namespace is not None and self.routes.withdraw(namespace, peer):
            self._notify(namespace, done=True, origin=peer)

    def _on_subscribe_namespace(self, peer: Peer, event: SubscribeNamespaceReceived) -> None:
        """Accept a SUBSCRIBE_NAMESPACE; tell it what exists under its prefix now."""
        message = event.message
        prefix, rid = message.track_namespace_prefix, event.request_id
        principal = self._principal(peer, message.parameters.authorization_tokens)
        scoped = isinstance(classify(prefix), Scoped)
        if principal is None or not may_request(principal, "SUBSCRIBE_NAMESPACE"):
            refuse(peer, rid, RequestErrorCode.UNAUTHORIZED, "not authorized")
            return
        if scoped and not access.may_access(principal, prefix, request="SUBSCRIBE_NAMESPACE"):
            refuse(peer, rid, RequestErrorCode.UNAUTHORIZED, "not authorized")
            return
        if self.ns_subscribers.overlaps(peer, prefix):
            refuse(peer, rid, RequestErrorCode.PREFIX_OVERLAP, "overlapping prefix")
            return
        self.ns_subscribers.add(peer, rid, prefix)
        peer.ns_subscriptions[rid] = (principal, message.subscribe_options)
        session = peer.connection.session
        session.request_ok(rid)
        if message.subscribe_options != SubscribeOptions.PUBLISH:
            for namespace in self.routes.under(prefix):
                others = [s for s in self.routes.sources_of(namespace) if s is not peer]
                if others and access.may_access(principal, namespace, request=_NOTICE):
                    session.namespace(rid, namespace[len(prefix) :])
        peer.connection.transmit()
        for track in list(self.tracks.values()):
            if track.published and is_prefix(prefix, track.key[0]):
                self._offer(peer, rid, track)

    def _on_subscribe_namespace_ended(self, peer: Peer, event: SubscribeNamespaceEnded) -> None:
        self.ns_subscribers.remove(peer, event.request_id)
        peer.ns_subscriptions.pop(event.request_id, None)

    def _offer(self, peer: Peer, ns_request_id: int, track: RelayedTrack) -> None:
        """PUBLISH a relayed PUBLISH track to a SUBSCRIBE_NAMESPACE session that asked for
        tracks (options PUBLISH or BOTH) and may see it; objects follow its PUBLISH_OK."""
        known = peer.ns_subscriptions.get(ns_request_id)
        if known is None or known[1] == SubscribeOptions.NAMESPACE:
            return
        if track.source is peer.connection or not access.may_access(
            known[0], track.key[0], request=_NOTICE
        ):
            return
        try:
            request_id = peer.connection.session.publish(
                *track.key, track_extensions=track.extensions
            )
        except LocalProtocolError as exc:  # blocked by its request limit, or closing
            log.debug("cannot offer a track: %s", exc)
            return
        peer.offers[request_id] = track
        peer.connection.transmit()

    def _on_publish_ok(self, peer: Peer, event: PublishOkReceived) -> None:
        track = peer.offers.pop(event.request_id, None)
        if track is None:
            return
        if track.accepted(peer.connection, event.request_id, event.message):
            peer.subscriptions[event.request_id] = track
        else:
            code, reason = PublishDoneCode.TRACK_ENDED, "the track ended"
            peer.connection.session.publish_done(event.request_id, code, reason=reason)
            peer.connection.transmit()

    def _on_offer_refused(self, peer: Peer, event: RequestErrorReceived) -> None:
        peer.offers.pop(event.request_id, None)

    def _notify(self, namespace: TrackNamespace, *, done: bool, origin: Peer) -> None:
        """A namespace got its first source or lost its last: tell the upstream relay, and
        NAMESPACE / NAMESPACE_DONE to every namespace subscriber that may see it."""
        self._forward_namespace(namespace, done=done)
        for sub, suffix in self.ns_subscribers.interested(namespace):
            peer = sub.session
            known = peer.ns_subscriptions.get(sub.request_id)
            if peer is origin or known is None or known[1] == SubscribeOptions.PUBLISH:
                continue
            if not access.may_access(known[0], namespace, request=_NOTICE):
                continue
            with contextlib.suppress(LocalProtocolError):
                if done:
                    peer.connection.session.namespace_done(sub.request_id, suffix)
                else:
                    peer.connection.session.namespace(sub.request_id, suffix)
                peer.connection.transmit()
