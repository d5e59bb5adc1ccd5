"""The request API of :class:`~moqt.session.MOQTSession`: requests we send and our answers (§9).

Every method writes control messages through the QUIC connection and moves the request table;
the caller then transmits. A method the draft does not allow in the request's state raises
:class:`~moqt.session_state.LocalProtocolError` and sends nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .backend import QuicConnectionLike, SessionBackend
from .errors import RequestErrorCode, StreamResetCode
from .messages import (
    ControlMessage,
    Fetch,
    FetchCancel,
    FetchOk,
    Goaway,
    JoiningFetch,
    MaxRequestId,
    MessageParameters,
    Namespace,
    NamespaceDone,
    Publish,
    PublishDone,
    PublishNamespace,
    PublishNamespaceCancel,
    PublishNamespaceDone,
    PublishOk,
    RequestError,
    RequestOk,
    RequestsBlocked,
    RequestUpdate,
    StandaloneFetch,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    SubscribeOptions,
    TrackStatus,
    Unsubscribe,
)
from .messages_track import STREAM_COUNT_UNKNOWN
from .session_state import (
    LocalProtocolError,
    Request,
    RequestKind,
    RequestsBlockedError,
    RequestTable,
    Signal,
    StreamsBlockedError,
)
from .wire import KeyValuePair, Location, TrackNamespace

_NO_PARAMS = MessageParameters()
_SUBSCRIPTIONS = frozenset({RequestKind.SUBSCRIBE, RequestKind.PUBLISH})
_REQUEST_OK_KINDS = frozenset(
    {
        RequestKind.TRACK_STATUS,
        RequestKind.REQUEST_UPDATE,
        RequestKind.PUBLISH_NAMESPACE,
        RequestKind.SUBSCRIBE_NAMESPACE,
    }
)


class RequestAPI:
    """Mixin: requests and replies. :class:`~moqt.session.MOQTSession` provides the attributes
    declared here."""

    _quic: QuicConnectionLike
    _backend: SessionBackend
    requests: RequestTable
    is_client: bool
    _setup_done: bool
    _goaway_received: bool
    _goaway_sent: bool
    _next_alias: int

    if TYPE_CHECKING:  # provided by MOQTSession and DataPlane

        def _send_control(self, message: ControlMessage) -> None: ...
        def _send_control_data(self, data: bytes) -> None: ...
        def _alias_in_use(self, alias: int) -> bool: ...
        def _reset_streams_of(self, request_id: int, error_code: int) -> None: ...
        def _new_namespace_stream(self, stream_id: int, request_id: int) -> None: ...
        def _close_namespace_stream(self, stream_id: int) -> None: ...

        @property
        def closed(self) -> object: ...

    # --- sending requests ----------------------------------------------------------------------

    def _next_request_id(self) -> int:
        if not self._setup_done:
            raise LocalProtocolError("the setup has not completed")
        if self.closed is not None:
            raise LocalProtocolError("the session is closed")
        if self._goaway_received:
            raise LocalProtocolError("the peer sent GOAWAY: no new requests")
        try:
            return self.requests.ids.peek()  # used only once the message encodes
        except RequestsBlockedError:
            limit = self.requests.ids.blocked()
            if limit is not None:
                self._send_control(RequestsBlocked(maximum_request_id=limit))
            raise

    def _open(self, kind: RequestKind, message: ControlMessage, request_id: int) -> int:
        data = message.encode()  # a ValueError here leaves the Request ID unused
        self.requests.ids.commit(request_id)
        self.requests.add(Request(request_id, kind, local=True, message=message))
        self._send_control_data(data)
        return request_id

    def subscribe(
        self,
        track_namespace: TrackNamespace,
        track_name: bytes,
        *,
        parameters: MessageParameters = _NO_PARAMS,
    ) -> int:
        """Send SUBSCRIBE (§9.9); returns its Request ID.

        Raises:
            RequestsBlockedError: the peer's MAX_REQUEST_ID is reached (REQUESTS_BLOCKED sent).
            LocalProtocolError: before the setup, after GOAWAY, or on a closed session.
            ValueError: an invalid name or parameter.
        """
        rid = self._next_request_id()
        message = Subscribe(
            request_id=rid,
            track_namespace=track_namespace,
            track_name=track_name,
            parameters=parameters,
        )
        return self._open(RequestKind.SUBSCRIBE, message, rid)

    def fetch(
        self,
        track_namespace: TrackNamespace,
        track_name: bytes,
        start: Location,
        end: Location,
        *,
        parameters: MessageParameters = _NO_PARAMS,
    ) -> int:
        """Send a standalone FETCH (§9.16.1); ``end`` is the last Location plus one.

        Raises:
            see :meth:`subscribe`.
        """
        rid = self._next_request_id()
        target = StandaloneFetch(
            track_namespace=track_namespace, track_name=track_name, start=start, end=end
        )
        return self._open(
            RequestKind.FETCH, Fetch(request_id=rid, target=target, parameters=parameters), rid
        )

    def joining_fetch(
        self,
        subscribe_request_id: int,
        joining_start: int,
        *,
        absolute: bool = False,
        parameters: MessageParameters = _NO_PARAMS,
    ) -> int:
        """Send a joining FETCH (§9.16.2) for one of our subscriptions.

        Raises:
            LocalProtocolError: ``subscribe_request_id`` is not an open SUBSCRIBE of ours.
            see :meth:`subscribe`.
        """
        subscription = self.requests.get(subscribe_request_id)
        if (
            subscription is None
            or subscription.kind != RequestKind.SUBSCRIBE
            or not subscription.local
        ):
            raise LocalProtocolError(f"{subscribe_request_id} is not an open SUBSCRIBE of ours")
        rid = self._next_request_id()
        target = JoiningFetch(
            joining_request_id=subscribe_request_id, joining_start=joining_start, absolute=absolute
        )
        return self._open(
            RequestKind.FETCH, Fetch(request_id=rid, target=target, parameters=parameters), rid
        )

    def publish(
        self,
        track_namespace: TrackNamespace,
        track_name: bytes,
        *,
        track_alias: int | None = None,
        parameters: MessageParameters = _NO_PARAMS,
        track_extensions: tuple[KeyValuePair, ...] = (),
    ) -> int:
        """Send PUBLISH (§9.13); objects may follow on streams from :meth:`open_subgroup`.

        Raises:
            see :meth:`subscribe`.
        """
        rid = self._next_request_id()
        alias = self._allocate_alias(track_alias)
        message = Publish(
            request_id=rid,
            track_namespace=track_namespace,
            track_name=track_name,
            track_alias=alias,
            parameters=parameters,
            track_extensions=track_extensions,
        )
        self._open(RequestKind.PUBLISH, message, rid)
        request = self.requests.get(rid)
        if request is not None:
            request.track_alias = alias
        return rid

    def track_status(
        self,
        track_namespace: TrackNamespace,
        track_name: bytes,
        *,
        parameters: MessageParameters = _NO_PARAMS,
    ) -> int:
        """Send TRACK_STATUS (§9.19).

        Raises:
            see :meth:`subscribe`.
        """
        rid = self._next_request_id()
        message = TrackStatus(
            request_id=rid,
            track_namespace=track_namespace,
            track_name=track_name,
            parameters=parameters,
        )
        return self._open(RequestKind.TRACK_STATUS, message, rid)

    def request_update(
        self, existing_request_id: int, *, parameters: MessageParameters = _NO_PARAMS
    ) -> int:
        """Send REQUEST_UPDATE (§9.11) for our SUBSCRIBE (or a PUBLISH we accepted).

        Raises:
            LocalProtocolError: the existing request cannot be updated by us.
            see :meth:`subscribe`.
        """
        self.requests.apply(existing_request_id, Signal.UPDATE, by_local=True, kinds=_SUBSCRIPTIONS)
        rid = self._next_request_id()
        message = RequestUpdate(
            request_id=rid, existing_request_id=existing_request_id, parameters=parameters
        )
        return self._open(RequestKind.REQUEST_UPDATE, message, rid)

    def publish_namespace(
        self, track_namespace: TrackNamespace, *, parameters: MessageParameters = _NO_PARAMS
    ) -> int:
        """Send PUBLISH_NAMESPACE (§9.20).

        Raises:
            see :meth:`subscribe`.
        """
        rid = self._next_request_id()
        message = PublishNamespace(
            request_id=rid, track_namespace=track_namespace, parameters=parameters
        )
        return self._open(RequestKind.PUBLISH_NAMESPACE, message, rid)

    def subscribe_namespace(
        self,
        prefix: TrackNamespace,
        *,
        options: SubscribeOptions = SubscribeOptions.NAMESPACE,
        parameters: MessageParameters = _NO_PARAMS,
    ) -> int:
        """Open a bidi stream with SUBSCRIBE_NAMESPACE (§9.25); replies arrive on it.

        Raises:
            StreamsBlockedError: the peer's bidi stream limit is reached (nothing was sent).
            see :meth:`subscribe`.
        """
        if not self._backend.can_open_stream(self._quic, unidirectional=False):
            raise StreamsBlockedError("the peer's bidirectional stream limit is reached")
        rid = self._next_request_id()
        message = SubscribeNamespace(
            request_id=rid,
            track_namespace_prefix=prefix,
            subscribe_options=options,
            parameters=parameters,
        )
        data = message.encode()
        self.requests.ids.commit(rid)
        stream_id = self._quic.get_next_available_stream_id(is_unidirectional=False)
        request = Request(rid, RequestKind.SUBSCRIBE_NAMESPACE, local=True, message=message)
        request.stream_id = stream_id
        self.requests.add(request)
        self._new_namespace_stream(stream_id, rid)
        self._quic.send_stream_data(stream_id, data)
        return rid

    # --- ending our requests -------------------------------------------------------------------

    def unsubscribe(self, request_id: int) -> None:
        """Send UNSUBSCRIBE (§9.12) for our SUBSCRIBE or a PUBLISH we accepted.

        Raises:
            LocalProtocolError: no such open subscription of ours.
        """
        self.requests.apply(request_id, Signal.UNSUBSCRIBE, by_local=True, kinds=_SUBSCRIPTIONS)
        self._send_control(Unsubscribe(request_id=request_id))

    def fetch_cancel(self, request_id: int) -> None:
        """Send FETCH_CANCEL (§9.18).

        Raises:
            LocalProtocolError: no such open fetch of ours.
        """
        kinds = frozenset({RequestKind.FETCH})
        self.requests.apply(request_id, Signal.FETCH_CANCEL, by_local=True, kinds=kinds)
        self._send_control(FetchCancel(request_id=request_id))

    def publish_namespace_done(self, request_id: int) -> None:
        """Send PUBLISH_NAMESPACE_DONE (§9.22).

        Raises:
            LocalProtocolError: no such open PUBLISH_NAMESPACE of ours.
        """
        kinds = frozenset({RequestKind.PUBLISH_NAMESPACE})
        self.requests.apply(request_id, Signal.NAMESPACE_DONE, by_local=True, kinds=kinds)
        self._send_control(PublishNamespaceDone(request_id=request_id))

    def unsubscribe_namespace(self, request_id: int) -> None:
        """End our SUBSCRIBE_NAMESPACE by closing its stream (§9.25).

        Raises:
            LocalProtocolError: no such open SUBSCRIBE_NAMESPACE of ours.
        """
        request = self.requests.get(request_id)
        kinds = frozenset({RequestKind.SUBSCRIBE_NAMESPACE})
        self.requests.apply(request_id, Signal.STREAM_CLOSED, by_local=True, kinds=kinds)
        if request is not None and request.stream_id is not None:
            self._close_namespace_stream(request.stream_id)

    # --- answering the peer --------------------------------------------------------------------

    def _allocate_alias(self, wanted: int | None) -> int:
        in_use = {r.track_alias for r in self.requests.values() if self._publishes(r)}
        if wanted is not None:
            if wanted in in_use:
                raise LocalProtocolError(f"track alias {wanted} is in use")
            return wanted
        while self._next_alias in in_use:
            self._next_alias += 1
        alias = self._next_alias
        self._next_alias += 1
        return alias

    @staticmethod
    def _publishes(request: Request) -> bool:
        if request.kind == RequestKind.PUBLISH:
            return request.local
        return request.kind == RequestKind.SUBSCRIBE and not request.local

    def subscribe_ok(
        self,
        request_id: int,
        *,
        track_alias: int | None = None,
        parameters: MessageParameters = _NO_PARAMS,
        track_extensions: tuple[KeyValuePair, ...] = (),
    ) -> int:
        """Accept a SUBSCRIBE with SUBSCRIBE_OK (§9.10); returns the Track Alias used.

        Raises:
            LocalProtocolError: no such pending SUBSCRIBE from the peer, or the alias is in use.
        """
        alias = self._allocate_alias(track_alias)
        kinds = frozenset({RequestKind.SUBSCRIBE})
        request = self.requests.apply(request_id, Signal.OK, by_local=True, kinds=kinds)
        if request is not None:
            request.track_alias = alias
        self._send_control(
            SubscribeOk(
                request_id=request_id,
                track_alias=alias,
                parameters=parameters,
                track_extensions=track_extensions,
            )
        )
        return alias

    def publish_ok(self, request_id: int, *, parameters: MessageParameters = _NO_PARAMS) -> None:
        """Accept a PUBLISH with PUBLISH_OK (§9.14).

        Raises:
            LocalProtocolError: no such pending PUBLISH from the peer.
        """
        self.requests.apply(
            request_id, Signal.OK, by_local=True, kinds=frozenset({RequestKind.PUBLISH})
        )
        self._send_control(PublishOk(request_id=request_id, parameters=parameters))

    def fetch_ok(
        self,
        request_id: int,
        *,
        end_location: Location,
        end_of_track: bool = False,
        parameters: MessageParameters = _NO_PARAMS,
        track_extensions: tuple[KeyValuePair, ...] = (),
    ) -> None:
        """Accept a FETCH with FETCH_OK (§9.17); then :meth:`open_fetch_stream`.

        Raises:
            LocalProtocolError: no such pending FETCH from the peer.
        """
        self.requests.apply(
            request_id, Signal.OK, by_local=True, kinds=frozenset({RequestKind.FETCH})
        )
        self._send_control(
            FetchOk(
                request_id=request_id,
                end_of_track=end_of_track,
                end_location=end_location,
                parameters=parameters,
                track_extensions=track_extensions,
            )
        )

    def request_ok(self, request_id: int, *, parameters: MessageParameters = _NO_PARAMS) -> None:
        """REQUEST_OK (§9.7) for the peer's PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE,
        TRACK_STATUS or REQUEST_UPDATE.

        Raises:
            LocalProtocolError: no such pending request of those kinds.
        """
        request = self.requests.apply(request_id, Signal.OK, by_local=True, kinds=_REQUEST_OK_KINDS)
        self._send_reply(request, RequestOk(request_id=request_id, parameters=parameters))

    def request_error(
        self, request_id: int, error_code: int, reason: str = "", *, retry_interval: int = 0
    ) -> None:
        """Refuse any pending request of the peer with REQUEST_ERROR (§9.8).

        Raises:
            LocalProtocolError: no such pending request.
        """
        request = self.requests.apply(request_id, Signal.ERROR, by_local=True)
        message = RequestError(
            request_id=request_id,
            error_code=error_code,
            retry_interval=retry_interval,
            reason=reason,
        )
        self._send_reply(request, message)
        if (
            request is not None
            and request.kind == RequestKind.SUBSCRIBE_NAMESPACE
            and request.stream_id is not None
        ):
            self._close_namespace_stream(request.stream_id)

    def _send_reply(self, request: Request | None, message: ControlMessage) -> None:
        if request is not None and request.kind == RequestKind.SUBSCRIBE_NAMESPACE:
            if request.stream_id is None:
                raise LocalProtocolError("SUBSCRIBE_NAMESPACE without a stream")
            self._quic.send_stream_data(request.stream_id, message.encode())
        else:
            self._send_control(message)

    def publish_done(
        self,
        request_id: int,
        status_code: int,
        *,
        stream_count: int | None = None,
        reason: str = "",
    ) -> None:
        """End a subscription we serve, or our PUBLISH, with PUBLISH_DONE (§9.15).

        ``stream_count`` defaults to the number of data streams we opened for it.

        Raises:
            LocalProtocolError: no such subscription we publish.
        """
        request = self.requests.apply(
            request_id, Signal.PUBLISH_DONE, by_local=True, kinds=_SUBSCRIPTIONS
        )
        if stream_count is None:
            stream_count = STREAM_COUNT_UNKNOWN if request is None else request.streams_opened
        self._send_control(
            PublishDone(
                request_id=request_id,
                status_code=status_code,
                stream_count=stream_count,
                reason=reason,
            )
        )

    def namespace(self, request_id: int, suffix: TrackNamespace) -> None:
        """NAMESPACE (§9.21) on the peer's SUBSCRIBE_NAMESPACE stream.

        Raises:
            LocalProtocolError: no such accepted SUBSCRIBE_NAMESPACE.
        """
        self._namespace_notice(request_id, Namespace(track_namespace_suffix=suffix))

    def namespace_done(self, request_id: int, suffix: TrackNamespace) -> None:
        """NAMESPACE_DONE (§9.23) on the peer's SUBSCRIBE_NAMESPACE stream.

        Raises:
            LocalProtocolError: no such accepted SUBSCRIBE_NAMESPACE.
        """
        self._namespace_notice(request_id, NamespaceDone(track_namespace_suffix=suffix))

    def _namespace_notice(self, request_id: int, message: ControlMessage) -> None:
        kinds = frozenset({RequestKind.SUBSCRIBE_NAMESPACE})
        request = self.requests.apply(request_id, Signal.NAMESPACE, by_local=True, kinds=kinds)
        if request is None or request.stream_id is None:
            raise LocalProtocolError(f"SUBSCRIBE_NAMESPACE {request_id} has no stream")
        self._quic.send_stream_data(request.stream_id, message.encode())

    def publish_namespace_cancel(
        self, request_id: int, error_code: int = RequestErrorCode.INTERNAL_ERROR, reason: str = ""
    ) -> None:
        """Withdraw our acceptance of the peer's namespace: PUBLISH_NAMESPACE_CANCEL (§9.24).

        Raises:
            LocalProtocolError: no such accepted PUBLISH_NAMESPACE.
        """
        kinds = frozenset({RequestKind.PUBLISH_NAMESPACE})
        self.requests.apply(request_id, Signal.NAMESPACE_CANCEL, by_local=True, kinds=kinds)
        self._send_control(
            PublishNamespaceCancel(request_id=request_id, error_code=error_code, reason=reason)
        )

    # --- session-wide --------------------------------------------------------------------------

    def goaway(self, new_session_uri: str = "") -> None:
        """Send GOAWAY (§9.4); only a server may name a new session URI.

        Raises:
            LocalProtocolError: a second GOAWAY, or a client naming a URI.
        """
        if self._goaway_sent:
            raise LocalProtocolError("GOAWAY already sent")
        if self.is_client and new_session_uri:
            raise LocalProtocolError("a client's GOAWAY carries no URI")
        self._goaway_sent = True
        self._send_control(Goaway(new_session_uri=new_session_uri))

    def grant_requests(self) -> int | None:
        """Raise the peer's MAX_REQUEST_ID by the configured window now; the new value or None."""
        grant = self.requests.ids.next_grant(force=True)
        if grant is not None:
            self._send_control(MaxRequestId(max_request_id=grant))
        return grant

    def end_subscription_streams(
        self, request_id: int, error_code: int = StreamResetCode.CANCELLED
    ) -> None:
        """Reset every data stream we send for ``request_id``."""
        self._reset_streams_of(request_id, error_code)
