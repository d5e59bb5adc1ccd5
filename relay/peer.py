"""One MOQT session at the relay, as the dispatcher keeps it (asyncio shell)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from kvsp.web.auth import Principal
from moqt.asyncio import MOQTConnection
from moqt.messages import SubscribeOptions
from moqt.session_state import LocalProtocolError
from moqt.wire import TrackNamespace

from .track import RelayedTrack

NOBODY = Principal(name="upstream", roles=frozenset(), scopes=frozenset())
"""What the upstream relay may do here: nothing (this relay announces nothing upstream)."""


@dataclass(eq=False, slots=True)
class Peer:
    """One session and what it asked for (hashed by identity: a routing source)."""

    connection: MOQTConnection
    principal: Principal
    upstream: bool = False  # our session to the upstream relay: never routed back there
    namespaces: dict[int, TrackNamespace] = field(default_factory=dict)
    ns_subscriptions: dict[int, tuple[Principal, SubscribeOptions]] = field(default_factory=dict)
    subscriptions: dict[int, RelayedTrack] = field(default_factory=dict)
    offers: dict[int, RelayedTrack] = field(default_factory=dict)  # our PUBLISH, awaiting OK
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


def refuse(peer: Peer, request_id: int, code: int, reason: str) -> None:
    """REQUEST_ERROR for one of the peer's requests (nothing when it is already gone)."""
    with contextlib.suppress(LocalProtocolError):
        peer.connection.session.request_error(request_id, code, reason)
        peer.connection.transmit()
