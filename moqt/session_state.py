"""MOQT draft-16 request state (§3.3, §5, §8, §9): request IDs and the request lifecycle table.

Every request (SUBSCRIBE, PUBLISH, FETCH, TRACK_STATUS, REQUEST_UPDATE, PUBLISH_NAMESPACE,
SUBSCRIBE_NAMESPACE) lives in one :class:`RequestTable` while it is open. Its transitions are a
table keyed by (kind, state, signal, party); anything not in the table is a PROTOCOL_VIOLATION
when the peer caused it and a :class:`LocalProtocolError` when our own API did. Messages for a
request that is already closed (a reply crossing our cancel) are ignored; messages for a Request
ID that was never used close the session.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

from .errors import ProtocolViolation, SessionError
from .messages import ControlMessage


class LocalProtocolError(Exception):
    """Our own caller used the session in a way the draft forbids (h11's LocalProtocolError)."""


class RequestsBlockedError(LocalProtocolError):
    """The peer's MAX_REQUEST_ID does not allow another request yet (§9.6).

    The session has sent REQUESTS_BLOCKED; retry after a ``MaxRequestIdReceived`` event.
    """

    def __init__(self, maximum_request_id: int) -> None:
        self.maximum_request_id = maximum_request_id
        super().__init__(f"blocked at the peer's Maximum Request ID {maximum_request_id}")


class StreamsBlockedError(LocalProtocolError):
    """The peer's QUIC stream-count limit does not allow another stream yet."""


class StreamClosedError(LocalProtocolError):
    """The data stream was closed: finished, reset by us, or stopped by the peer."""


class RequestKind(Enum):
    """What a request is (§9)."""

    SUBSCRIBE = auto()
    PUBLISH = auto()
    FETCH = auto()
    TRACK_STATUS = auto()
    REQUEST_UPDATE = auto()
    PUBLISH_NAMESPACE = auto()
    SUBSCRIBE_NAMESPACE = auto()


class RequestState(Enum):
    """A request's lifecycle: waiting for its reply, established, closed."""

    PENDING = auto()
    ESTABLISHED = auto()
    CLOSED = auto()


class Signal(Enum):
    """What happens to a request: a reply, an end, a cancel."""

    OK = auto()  # SUBSCRIBE_OK, PUBLISH_OK, FETCH_OK, REQUEST_OK
    ERROR = auto()  # REQUEST_ERROR
    PUBLISH_DONE = auto()
    UNSUBSCRIBE = auto()
    FETCH_CANCEL = auto()
    FETCH_COMPLETE = auto()  # the fetch stream ended
    NAMESPACE_DONE = auto()  # PUBLISH_NAMESPACE_DONE
    NAMESPACE_CANCEL = auto()  # PUBLISH_NAMESPACE_CANCEL
    NAMESPACE = auto()  # NAMESPACE / NAMESPACE_DONE on a SUBSCRIBE_NAMESPACE stream
    STREAM_CLOSED = auto()  # the SUBSCRIBE_NAMESPACE stream ended
    UPDATE = auto()  # a REQUEST_UPDATE names this request


class Party(Enum):
    """Who acts on a request: the endpoint that sent it, or the one answering it."""

    REQUESTER = auto()
    RESPONDER = auto()


TRANSITIONS: dict[RequestKind, dict[tuple[RequestState, Signal, Party], RequestState]] = {
    # SUBSCRIBE: the requester subscribes, the responder publishes (§5.1, §9.9-9.15)
    RequestKind.SUBSCRIBE: {
        (RequestState.PENDING, Signal.OK, Party.RESPONDER): RequestState.ESTABLISHED,
        (RequestState.PENDING, Signal.ERROR, Party.RESPONDER): RequestState.CLOSED,
        (RequestState.ESTABLISHED, Signal.PUBLISH_DONE, Party.RESPONDER): RequestState.CLOSED,
        (RequestState.PENDING, Signal.UNSUBSCRIBE, Party.REQUESTER): RequestState.CLOSED,
        (RequestState.ESTABLISHED, Signal.UNSUBSCRIBE, Party.REQUESTER): RequestState.CLOSED,
        (RequestState.PENDING, Signal.UPDATE, Party.REQUESTER): RequestState.PENDING,
        (RequestState.ESTABLISHED, Signal.UPDATE, Party.REQUESTER): RequestState.ESTABLISHED,
    },
    # PUBLISH: the requester publishes, the responder subscribes (§9.13-9.15)
    RequestKind.PUBLISH: {
        (RequestState.PENDING, Signal.OK, Party.RESPONDER): RequestState.ESTABLISHED,
        (RequestState.PENDING, Signal.ERROR, Party.RESPONDER): RequestState.CLOSED,
        (RequestState.PENDING, Signal.PUBLISH_DONE, Party.REQUESTER): RequestState.CLOSED,
        (RequestState.ESTABLISHED, Signal.PUBLISH_DONE, Party.REQUESTER): RequestState.CLOSED,
        (RequestState.ESTABLISHED, Signal.UNSUBSCRIBE, Party.RESPONDER): RequestState.CLOSED,
        (RequestState.ESTABLISHED, Signal.UPDATE, Party.RESPONDER): RequestState.ESTABLISHED,
    },
    # FETCH (§9.16-9.18); the fetch stream may finish before FETCH_OK arrives
    RequestKind.FETCH: {
        (RequestState.PENDING, Signal.OK, Party.RESPONDER): RequestState.ESTABLISHED,
        (RequestState.PENDING, Signal.ERROR, Party.RESPONDER): RequestState.CLOSED,
        (RequestState.PENDING, Signal.FETCH_CANCEL, Party.REQUESTER): RequestState.CLOSED,
        (RequestState.ESTABLISHED, Signal.FETCH_CANCEL, Party.REQUESTER): RequestState.CLOSED,
        (RequestState.PENDING, Signal.FETCH_COMPLETE, Party.RESPONDER): RequestState.PENDING,
        (RequestState.ESTABLISHED, Signal.FETCH_COMPLETE, Party.RESPONDER): RequestState.CLOSED,
    },
    # one reply and done (§9.11, §9.19)
    RequestKind.TRACK_STATUS: {
        (RequestState.PENDING, Signal.OK, Party.RESPONDER): RequestState.CLOSED,
        (RequestState.PENDING, Signal.ERROR, Party.RESPONDER): RequestState.CLOSED,
    },
    RequestKind.REQUEST_UPDATE: {
        (RequestState.PENDING, Signal.OK, Party.RESPONDER): RequestState.CLOSED,
        (RequestState.PENDING, Signal.ERROR, Party.RESPONDER): RequestState.CLOSED,
    },
    # PUBLISH_NAMESPACE (§9.20-9.24)
    RequestKind.PUBLISH_NAMESPACE: {
        (RequestState.PENDING, Signal.OK, Party.RESPONDER): RequestState.ESTABLISHED,
        (RequestState.PENDING, Signal.ERROR, Party.RESPONDER): RequestState.CLOSED,
        (RequestState.PENDING, Signal.NAMESPACE_DONE, Party.REQUESTER): RequestState.CLOSED,
        (RequestState.ESTABLISHED, Signal.NAMESPACE_DONE, Party.REQUESTER): RequestState.CLOSED,
        (RequestState.ESTABLISHED, Signal.NAMESPACE_CANCEL, Party.RESPONDER): RequestState.CLOSED,
    },
    # SUBSCRIBE_NAMESPACE on its own bidi stream (§9.25)
    RequestKind.SUBSCRIBE_NAMESPACE: {
        (RequestState.PENDING, Signal.OK, Party.RESPONDER): RequestState.ESTABLISHED,
        (RequestState.PENDING, Signal.ERROR, Party.RESPONDER): RequestState.CLOSED,
        (RequestState.ESTABLISHED, Signal.NAMESPACE, Party.RESPONDER): RequestState.ESTABLISHED,
        (RequestState.PENDING, Signal.STREAM_CLOSED, Party.REQUESTER): RequestState.CLOSED,
        (RequestState.ESTABLISHED, Signal.STREAM_CLOSED, Party.REQUESTER): RequestState.CLOSED,
        (RequestState.ESTABLISHED, Signal.STREAM_CLOSED, Party.RESPONDER): RequestState.CLOSED,
    },
}
"""Kind → (state, signal, party) → the state after it; a signal not listed is illegal."""


@dataclass(slots=True)
class Request:
    """One open request. ``local`` is True when we sent it (we are the requester)."""

    request_id: int
    kind: RequestKind
    local: bool
    message: ControlMessage
    state: RequestState = RequestState.PENDING
    track_alias: int | None = None
    stream_id: int | None = None  # the SUBSCRIBE_NAMESPACE stream
    streams_opened: int = 0  # data streams we opened for it (PUBLISH_DONE's Stream Count)


class RequestIds:
    """Request ID allocation and checks (§9.1): client even from 0, server odd from 1, +2.

    ``peer_limit`` is the peer's Maximum Request ID (exclusive: IDs below it may be sent);
    ``granted`` is ours for the peer. With ``window`` > 0 the grant is kept ``window`` requests
    ahead of the peer's next Request ID.
    """

    __slots__ = ("next_local", "peer_limit", "next_peer", "granted", "window", "_blocked_at")

    def __init__(self, *, is_client: bool, max_requests: int, window: int) -> None:
        self.next_local = 0 if is_client else 1
        self.next_peer = 1 if is_client else 0
        self.peer_limit = 0  # §9.3.1.3: absent MAX_REQUEST_ID means 0
        self.granted = self.limit_for(self.next_peer, max_requests)
        self.window = window
        self._blocked_at: int | None = None

    @staticmethod
    def limit_for(next_id: int, count: int) -> int:
        """The exclusive limit that allows ``count`` more requests from ``next_id`` on."""
        return 0 if count <= 0 else next_id + 2 * count - (next_id & 1)

    def peek(self) -> int:
        """The next local Request ID, not yet used (see :meth:`commit`).

        Raises:
            RequestsBlockedError: the peer's limit is reached (see :meth:`blocked`).
        """
        if self.next_local >= self.peer_limit:
            raise RequestsBlockedError(self.peer_limit)
        return self.next_local

    def commit(self, request_id: int) -> None:
        """Mark ``request_id`` (from :meth:`peek`) as sent.

        Raises:
            ValueError: it is not the ID :meth:`peek` gives.
        """
        if request_id != self.next_local:
            raise ValueError(f"request id {request_id} is not the next ({self.next_local})")
        self.next_local += 2

    def allocate(self) -> int:
        """:meth:`peek` and :meth:`commit` in one.

        Raises:
            RequestsBlockedError: the peer's limit is reached (see :meth:`blocked`).
        """
        request_id = self.peek()
        self.commit(request_id)
        return request_id

    def blocked(self) -> int | None:
        """The limit to report in REQUESTS_BLOCKED, once per limit value (§9.6)."""
        if self._blocked_at == self.peer_limit:
            return None
        self._blocked_at = self.peer_limit
        return self.peer_limit

    def raise_peer_limit(self, value: int) -> None:
        """Apply the peer's MAX_REQUEST_ID.

        Raises:
            ProtocolViolation: the value does not increase (§9.5).
        """
        if value <= self.peer_limit:
            raise ProtocolViolation(f"MAX_REQUEST_ID {value} does not exceed {self.peer_limit}")
        self.peer_limit = value

    def accept_peer(self, request_id: int) -> None:
        """Check a new request's ID from the peer and advance.

        Raises:
            ProtocolViolation: wrong parity or out of sequence (INVALID_REQUEST_ID), or at or
                above our grant (TOO_MANY_REQUESTS) (§9.1, §9.5).
        """
        if request_id & 1 != self.next_peer & 1:
            raise ProtocolViolation(
                f"request id {request_id} has the wrong parity for the peer",
                error_code=SessionError.INVALID_REQUEST_ID,
            )
        if request_id >= self.granted:
            raise ProtocolViolation(
                f"request id {request_id} at or above our MAX_REQUEST_ID {self.granted}",
                error_code=SessionError.TOO_MANY_REQUESTS,
            )
        if request_id != self.next_peer:
            raise ProtocolViolation(
                f"request id {request_id} out of sequence (expected {self.next_peer})",
                error_code=SessionError.INVALID_REQUEST_ID,
            )
        self.next_peer += 2

    def next_grant(self, *, force: bool = False) -> int | None:
        """A new MAX_REQUEST_ID to send when the peer has used half its window, else None."""
        if self.window <= 0:
            return None
        remaining = (self.granted - self.next_peer + 1) // 2
        if not force and remaining > self.window // 2:
            return None
        new = self.limit_for(self.next_peer, self.window)
        if new <= self.granted:
            return None
        self.granted = new
        return new

    def is_past_local(self, request_id: int) -> bool:
        """True for one of our Request IDs that was used."""
        return request_id & 1 == self.next_local & 1 and request_id < self.next_local

    def is_past_peer(self, request_id: int) -> bool:
        """True for one of the peer's Request IDs that was used."""
        return request_id & 1 == self.next_peer & 1 and request_id < self.next_peer


class RequestTable:
    """The open requests, and the one place their states change."""

    __slots__ = ("_open", "ids")

    def __init__(self, ids: RequestIds) -> None:
        self._open: dict[int, Request] = {}
        self.ids = ids

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._open

    def add(self, request: Request) -> None:
        """Open ``request``."""
        self._open[request.request_id] = request

    def get(self, request_id: int) -> Request | None:
        """The open request with that ID, or None."""
        return self._open.get(request_id)

    def values(self) -> list[Request]:
        """Every open request."""
        return list(self._open.values())

    def apply(
        self,
        request_id: int,
        signal: Signal,
        *,
        by_local: bool,
        kinds: frozenset[RequestKind] | None = None,
    ) -> Request | None:
        """Move a request by ``signal``; None means "already closed: ignore the message".

        ``kinds`` limits the request kinds the message may name (SUBSCRIBE_OK only answers a
        SUBSCRIBE, ...).

        Raises:
            ProtocolViolation: the peer named a Request ID never used, a request of another
                kind, or a transition the table lacks.
            LocalProtocolError: our own API asked for a transition the table lacks, or named a
                request that is not open.
        """
        request = self._open.get(request_id)
        if request is None:
            self._check_closed(request_id, by_local=by_local)
            return None
        if kinds is not None and request.kind not in kinds:
            what = f"{signal.name} names {request.kind.name} request {request_id}"
            if by_local:
                raise LocalProtocolError(what)
            raise ProtocolViolation(what)
        party = Party.REQUESTER if request.local == by_local else Party.RESPONDER
        new_state = TRANSITIONS[request.kind].get((request.state, signal, party))
        if new_state is None:
            what = f"{signal.name} by the {party.name.lower()} of {request.kind.name} "
            what += f"{request_id} in state {request.state.name}"
            if by_local:
                raise LocalProtocolError(what)
            raise ProtocolViolation(what)
        request.state = new_state
        if new_state == RequestState.CLOSED:
            del self._open[request_id]
        return request

    def _check_closed(self, request_id: int, *, by_local: bool) -> None:
        """Accept a peer message for a request that was open once (it crossed our close)."""
        if by_local:
            raise LocalProtocolError(f"request {request_id} is not open")
        if self.ids.is_past_local(request_id) or self.ids.is_past_peer(request_id):
            return
        raise ProtocolViolation(f"message names request id {request_id}, never used")
