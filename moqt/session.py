"""MOQT draft-16 session over one QUIC connection (§3, §9): sans-I/O, aioquic H3Connection shape.

:class:`MOQTSession` wraps a ``QuicConnection`` of the chosen backend (:mod:`moqt.backend`).
Feed it every QUIC event with :meth:`MOQTSession.handle_event`; it writes through the
connection and returns :mod:`moqt.session_events`. The caller then sends the connection's
datagrams, as with aioquic's H3. No sockets, no clocks, no asyncio here.

* Control stream: the first client-initiated bidirectional stream. The client opens it with
  CLIENT_SETUP when the handshake completes; the server answers SERVER_SETUP. ALPN ``moqt-16``
  settles the version, so neither message lists versions; unknown Setup Parameters are ignored.
* Other bidirectional streams carry one SUBSCRIBE_NAMESPACE each (§9.25); unidirectional
  streams carry objects (§10). Streams that arrive before the setup completes are held.
* Request IDs: client even, server odd, +2 each; a peer request at or above our MAX_REQUEST_ID
  closes the session with TOO_MANY_REQUESTS, one out of sequence or of the wrong parity with
  INVALID_REQUEST_ID. Our own requests beyond the peer's limit raise
  :class:`~moqt.session_state.RequestsBlockedError` after REQUESTS_BLOCKED is sent.
* Every violation closes the QUIC connection with its MOQT error code and yields
  :class:`~moqt.session_events.SessionClosed`.

The request API (subscribe, fetch, respond, ...) is in :mod:`moqt.session_api`; the data plane
(objects on streams, datagrams) in :mod:`moqt.session_data`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .backend import QuicConnectionLike, SessionBackend, get_backend
from .errors import (
    MOQTError,
    ProtocolViolation,
    RequestErrorCode,
    SessionError,
    StreamResetCode,
)
from .messages import (
    AuthToken,
    ClientSetup,
    ControlMessage,
    ControlMessageParser,
    Fetch,
    FetchCancel,
    FetchOk,
    Goaway,
    JoiningFetch,
    MaxRequestId,
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
    ServerSetup,
    SetupParameters,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    TrackStatus,
    Unsubscribe,
)
from .session_api import RequestAPI
from .session_data import DataPlane
from .session_events import (
    FetchCancelReceived,
    FetchOkReceived,
    FetchReceived,
    GoawayReceived,
    MaxRequestIdReceived,
    MOQTEvent,
    NamespaceDoneReceived,
    NamespaceReceived,
    PublishDoneReceived,
    PublishNamespaceCancelReceived,
    PublishNamespaceDoneReceived,
    PublishNamespaceReceived,
    PublishOkReceived,
    PublishReceived,
    RequestErrorReceived,
    RequestOkReceived,
    RequestsBlockedReceived,
    RequestUpdateReceived,
    SessionClosed,
    SetupComplete,
    SubscribeNamespaceEnded,
    SubscribeNamespaceReceived,
    SubscribeOkReceived,
    SubscribeReceived,
    TrackStatusReceived,
    UnsubscribeReceived,
)
from .session_state import (
    LocalProtocolError,
    Request,
    RequestIds,
    RequestKind,
    RequestTable,
    Signal,
)

_ANY_KIND = frozenset(RequestKind) - {RequestKind.SUBSCRIBE_NAMESPACE}
_REQUEST_OK_KINDS = frozenset(
    {RequestKind.TRACK_STATUS, RequestKind.REQUEST_UPDATE, RequestKind.PUBLISH_NAMESPACE}
)
_SUBSCRIPTIONS = frozenset({RequestKind.SUBSCRIBE, RequestKind.PUBLISH})
EARLY_BYTES_MAX = 1 << 20  # data on other streams before the setup completes


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionConfig:
    """Session settings. ``path``/``authority`` are sent by a client only (raw QUIC, §9.3.1).

    ``max_requests`` is how many requests the peer may send at first; with ``auto_grant`` the
    session keeps the peer's MAX_REQUEST_ID that many requests ahead of its last request.
    """

    path: str | None = None
    authority: str | None = None
    authorization_tokens: tuple[AuthToken, ...] = ()
    implementation: str | None = "kvsp-moqt/0.1"
    max_requests: int = 100
    auto_grant: bool = True


@dataclass(slots=True)
class _NamespaceStream:
    """A SUBSCRIBE_NAMESPACE bidi stream; ``local`` when we opened it (we asked)."""

    local: bool
    parser: ControlMessageParser
    request_id: int | None = None
    replied: bool = False


class MOQTSession(RequestAPI, DataPlane):
    """One MOQT session driven by QUIC events (see the module docstring)."""

    def __init__(
        self,
        quic: QuicConnectionLike,
        *,
        is_client: bool,
        config: SessionConfig | None = None,
        backend: SessionBackend | None = None,
    ) -> None:
        self._quic = quic
        self._backend: SessionBackend = backend or get_backend("aioquic")
        self.is_client = is_client
        self.config = config or SessionConfig()
        window = self.config.max_requests if self.config.auto_grant else 0
        ids = RequestIds(is_client=is_client, max_requests=self.config.max_requests, window=window)
        self.requests = RequestTable(ids)
        self.peer_parameters: SetupParameters | None = None
        self._control_stream_id: int | None = None if is_client else 0
        self._control_parser = ControlMessageParser()
        self._setup_done = False
        self._closed: SessionClosed | None = None
        self._goaway_received = False
        self._goaway_sent = False
        self._early: list[tuple[int, bytes, bool]] = []
        self._early_bytes = 0
        self._ns_streams: dict[int, _NamespaceStream] = {}
        self._next_alias = 0
        self._init_data_plane()
        ev = self._backend.events
        self._stream_data_type: type = ev.StreamDataReceived
        self._quic_handlers: dict[type, Callable[[Any, list[MOQTEvent]], None]] = {
            ev.HandshakeCompleted: self._on_handshake_completed,
            ev.StreamDataReceived: self._on_stream_data,
            ev.StreamReset: self._on_stream_reset,
            ev.StopSendingReceived: self._on_stop_sending_event,
            ev.DatagramFrameReceived: self._on_datagram_event,
            ev.ConnectionTerminated: self._on_terminated,
        }
        self._handlers: dict[type[ControlMessage], Callable[[Any, list[MOQTEvent]], None]] = {
            ClientSetup: self._on_client_setup,
            ServerSetup: self._on_server_setup,
            Goaway: self._on_goaway,
            MaxRequestId: self._on_max_request_id,
            RequestsBlocked: self._on_requests_blocked,
            Subscribe: self._on_subscribe,
            SubscribeOk: self._on_subscribe_ok,
            Unsubscribe: self._on_unsubscribe,
            Publish: self._on_publish,
            PublishOk: self._on_publish_ok,
            PublishDone: self._on_publish_done,
            Fetch: self._on_fetch,
            FetchOk: self._on_fetch_ok,
            FetchCancel: self._on_fetch_cancel,
            TrackStatus: self._on_track_status,
            RequestUpdate: self._on_request_update,
            RequestOk: self._on_request_ok,
            RequestError: self._on_request_error,
            PublishNamespace: self._on_publish_namespace,
            PublishNamespaceDone: self._on_publish_namespace_done,
            PublishNamespaceCancel: self._on_publish_namespace_cancel,
        }

    # --- state ---------------------------------------------------------------------------------

    @property
    def setup_complete(self) -> bool:
        """True once CLIENT_SETUP and SERVER_SETUP were exchanged."""
        return self._setup_done

    @property
    def closed(self) -> SessionClosed | None:
        """How the session ended, or None while it is open."""
        return self._closed

    @property
    def goaway_received(self) -> bool:
        """True once the peer sent GOAWAY."""
        return self._goaway_received

    # --- QUIC events ---------------------------------------------------------------------------

    def handle_event(self, event: object) -> list[MOQTEvent]:
        """Process one QUIC event of this session's backend; return the MOQT events it caused.

        A peer error found here closes the QUIC connection with its MOQT code and yields
        :class:`SessionClosed` (``by_peer`` False); nothing raises.
        """
        out: list[MOQTEvent] = []
        if type(event) is self._stream_data_type and self._closed is None and self._setup_done:
            data: Any = event
            if data.stream_id & 2:  # objects on a unidirectional stream: the bulk of the traffic
                try:
                    self._on_data_stream(data.stream_id, data.data, data.end_stream, out)
                except MOQTError as exc:
                    self._fail(exc.error_code, exc.reason, out)
                return out
        handler = self._quic_handlers.get(type(event))
        if handler is None:
            return out
        if self._closed is not None and handler != self._on_terminated:
            return out
        try:
            handler(event, out)
        except MOQTError as exc:
            self._fail(exc.error_code, exc.reason, out)
        return out

    def close(self, error_code: int = SessionError.NO_ERROR, reason: str = "") -> None:
        """Close the session (QUIC CONNECTION_CLOSE with a §13.4.1 code); no event follows."""
        if self._closed is None:
            self._closed = SessionClosed(error_code, reason, by_peer=False)
            self._quic.close(error_code=error_code, reason_phrase=reason)

    def _fail(self, error_code: int, reason: str, out: list[MOQTEvent]) -> None:
        self.close(error_code, reason)
        if self._closed is not None:
            out.append(self._closed)

    def _on_terminated(self, event: Any, out: list[MOQTEvent]) -> None:
        if self._closed is None:
            self._closed = SessionClosed(int(event.error_code), event.reason_phrase, by_peer=True)
            out.append(self._closed)

    def _on_handshake_completed(self, event: Any, out: list[MOQTEvent]) -> None:
        if not self.is_client or self._control_stream_id is not None:
            return
        stream_id = self._quic.get_next_available_stream_id(is_unidirectional=False)
        self._control_stream_id = stream_id
        cfg = self.config
        params = SetupParameters(
            path=cfg.path,
            authority=cfg.authority,
            max_request_id=self.requests.ids.granted,
            authorization_tokens=cfg.authorization_tokens,
            moqt_implementation=cfg.implementation,
        )
        self._quic.send_stream_data(stream_id, ClientSetup(parameters=params).encode())

    def _on_stream_data(self, event: Any, out: list[MOQTEvent]) -> None:
        stream_id, data, end_stream = int(event.stream_id), event.data, bool(event.end_stream)
        if stream_id == self._control_stream_id:
            self._on_control_data(data, end_stream, out)
        elif not self._setup_done:
            self._hold_early(stream_id, data, end_stream)
        elif stream_id & 2:
            self._on_data_stream(stream_id, data, end_stream, out)
        else:
            self._on_namespace_stream(stream_id, data, end_stream, out)

    def _hold_early(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        """§3.3: streams may arrive before the setup completes; keep them (up to a limit)."""
        self._early_bytes += len(data)
        if self._early_bytes > EARLY_BYTES_MAX:
            raise ProtocolViolation("too much stream data before the setup completed")
        self._early.append((stream_id, data, end_stream))

    def _replay_early(self, out: list[MOQTEvent]) -> None:
        early, self._early = self._early, []
        for stream_id, data, end_stream in early:
            if stream_id & 2:
                self._on_data_stream(stream_id, data, end_stream, out)
            else:
                self._on_namespace_stream(stream_id, data, end_stream, out)

    def _on_stream_reset(self, event: Any, out: list[MOQTEvent]) -> None:
        stream_id, code = int(event.stream_id), int(event.error_code)
        if stream_id == self._control_stream_id:
            raise ProtocolViolation("the peer reset the control stream")
        if stream_id & 2:
            self._on_data_stream_reset(stream_id, code, out)
        else:
            self._end_namespace_stream(stream_id, code, out)

    def _on_stop_sending_event(self, event: Any, out: list[MOQTEvent]) -> None:
        stream_id, code = int(event.stream_id), int(event.error_code)
        if stream_id == self._control_stream_id:
            raise ProtocolViolation("the peer stopped the control stream")
        if stream_id & 2:
            self._on_stop_sending(stream_id, code, out)
        else:
            self._end_namespace_stream(stream_id, code, out)

    def _on_datagram_event(self, event: Any, out: list[MOQTEvent]) -> None:
        if self._setup_done:
            self._on_datagram(event.data, out)

    # --- control stream ------------------------------------------------------------------------

    def _on_control_data(self, data: bytes, end_stream: bool, out: list[MOQTEvent]) -> None:
        for message in self._control_parser.feed(data, end_stream=end_stream):
            self._on_control_message(message, out)
        if end_stream:
            # §3.3: closing the control stream is a PROTOCOL_VIOLATION
            raise ProtocolViolation("the peer closed the control stream")

    def _on_control_message(self, message: ControlMessage, out: list[MOQTEvent]) -> None:
        if not self._setup_done and not isinstance(message, ClientSetup | ServerSetup):
            raise ProtocolViolation(f"{message.TYPE.name} before the setup completed")
        handler = self._handlers.get(type(message))
        if handler is None:
            raise ProtocolViolation(f"{message.TYPE.name} is not allowed on the control stream")
        handler(message, out)

    def _on_client_setup(self, message: ClientSetup, out: list[MOQTEvent]) -> None:
        if self.is_client or self._setup_done:
            raise ProtocolViolation("unexpected CLIENT_SETUP")
        self._apply_peer_setup(message.parameters)
        params = SetupParameters(
            max_request_id=self.requests.ids.granted,
            moqt_implementation=self.config.implementation,
        )
        self._send_control(ServerSetup(parameters=params))
        self._finish_setup(message.parameters, out)

    def _on_server_setup(self, message: ServerSetup, out: list[MOQTEvent]) -> None:
        if not self.is_client or self._setup_done:
            raise ProtocolViolation("unexpected SERVER_SETUP")
        self._apply_peer_setup(message.parameters)
        self._finish_setup(message.parameters, out)

    def _apply_peer_setup(self, params: SetupParameters) -> None:
        self.peer_parameters = params
        if params.max_request_id:
            self.requests.ids.raise_peer_limit(params.max_request_id)

    def _finish_setup(self, params: SetupParameters, out: list[MOQTEvent]) -> None:
        self._setup_done = True
        out.append(SetupComplete(params))
        self._replay_early(out)

    def _send_control(self, message: ControlMessage) -> None:
        self._send_control_data(message.encode())

    def _send_control_data(self, data: bytes) -> None:
        if self._control_stream_id is None:
            raise LocalProtocolError("no control stream before the handshake completes")
        self._quic.send_stream_data(self._control_stream_id, data)

    def _on_goaway(self, message: Goaway, out: list[MOQTEvent]) -> None:
        if self._goaway_received:
            raise ProtocolViolation("a second GOAWAY")  # §9.4
        if not self.is_client and message.new_session_uri:
            raise ProtocolViolation("a client sent GOAWAY with a New Session URI")  # §9.4
        self._goaway_received = True
        out.append(GoawayReceived(message.new_session_uri))

    def _on_max_request_id(self, message: MaxRequestId, out: list[MOQTEvent]) -> None:
        self.requests.ids.raise_peer_limit(message.max_request_id)
        out.append(MaxRequestIdReceived(message.max_request_id))

    def _on_requests_blocked(self, message: RequestsBlocked, out: list[MOQTEvent]) -> None:
        out.append(RequestsBlockedReceived(message.maximum_request_id))
        grant = self.requests.ids.next_grant(force=True)
        if grant is not None:
            self._send_control(MaxRequestId(max_request_id=grant))

    # --- requests from the peer ----------------------------------------------------------------

    def _accept(self, request_id: int, kind: RequestKind, message: ControlMessage) -> Request:
        self.requests.ids.accept_peer(request_id)
        grant = self.requests.ids.next_grant()
        if grant is not None:
            self._send_control(MaxRequestId(max_request_id=grant))
        request = Request(request_id, kind, local=False, message=message)
        self.requests.add(request)
        return request

    def _on_subscribe(self, message: Subscribe, out: list[MOQTEvent]) -> None:
        self._accept(message.request_id, RequestKind.SUBSCRIBE, message)
        out.append(SubscribeReceived(message.request_id, message))

    def _on_publish(self, message: Publish, out: list[MOQTEvent]) -> None:
        request = self._accept(message.request_id, RequestKind.PUBLISH, message)
        self._check_new_alias(message.track_alias)
        request.track_alias = message.track_alias
        self._bind_alias(message.track_alias, message.request_id, out)
        out.append(PublishReceived(message.request_id, message))

    def _on_fetch(self, message: Fetch, out: list[MOQTEvent]) -> None:
        self._accept(message.request_id, RequestKind.FETCH, message)
        joined = None
        if isinstance(message.target, JoiningFetch):
            subscription = self.requests.get(message.target.joining_request_id)
            if (
                subscription is None
                or subscription.kind != RequestKind.SUBSCRIBE
                or subscription.local
            ):
                self.request_error(
                    message.request_id, RequestErrorCode.INVALID_JOINING_REQUEST_ID, "no such"
                )
                return
            joined = subscription.message
        out.append(
            FetchReceived(
                message.request_id, message, joined if isinstance(joined, Subscribe) else None
            )
        )

    def _on_track_status(self, message: TrackStatus, out: list[MOQTEvent]) -> None:
        self._accept(message.request_id, RequestKind.TRACK_STATUS, message)
        out.append(TrackStatusReceived(message.request_id, message))

    def _on_request_update(self, message: RequestUpdate, out: list[MOQTEvent]) -> None:
        self._accept(message.request_id, RequestKind.REQUEST_UPDATE, message)
        existing = message.existing_request_id
        if self.requests.apply(existing, Signal.UPDATE, by_local=False, kinds=_SUBSCRIPTIONS):
            out.append(RequestUpdateReceived(message.request_id, message))
        else:  # the subscription ended while the update was in flight
            self.request_error(message.request_id, RequestErrorCode.DOES_NOT_EXIST, "ended")

    def _on_publish_namespace(self, message: PublishNamespace, out: list[MOQTEvent]) -> None:
        self._accept(message.request_id, RequestKind.PUBLISH_NAMESPACE, message)
        out.append(PublishNamespaceReceived(message.request_id, message))

    def _on_unsubscribe(self, message: Unsubscribe, out: list[MOQTEvent]) -> None:
        rid = message.request_id
        if self.requests.apply(rid, Signal.UNSUBSCRIBE, by_local=False, kinds=_SUBSCRIPTIONS):
            self._reset_streams_of(rid, StreamResetCode.CANCELLED)
            out.append(UnsubscribeReceived(rid))

    def _on_fetch_cancel(self, message: FetchCancel, out: list[MOQTEvent]) -> None:
        rid = message.request_id
        kinds = frozenset({RequestKind.FETCH})
        if self.requests.apply(rid, Signal.FETCH_CANCEL, by_local=False, kinds=kinds):
            self._reset_streams_of(rid, StreamResetCode.CANCELLED)
            out.append(FetchCancelReceived(rid))

    def _on_publish_namespace_done(
        self, message: PublishNamespaceDone, out: list[MOQTEvent]
    ) -> None:
        kinds = frozenset({RequestKind.PUBLISH_NAMESPACE})
        request = self.requests.apply(
            message.request_id, Signal.NAMESPACE_DONE, by_local=False, kinds=kinds
        )
        if request is not None and isinstance(request.message, PublishNamespace):
            namespace = request.message.track_namespace
            out.append(PublishNamespaceDoneReceived(message.request_id, namespace))

    # --- replies from the peer -----------------------------------------------------------------

    def _reply(self, request_id: int, signal: Signal, kinds: frozenset[RequestKind]) -> bool:
        return self.requests.apply(request_id, signal, by_local=False, kinds=kinds) is not None

    def _on_subscribe_ok(self, message: SubscribeOk, out: list[MOQTEvent]) -> None:
        rid = message.request_id
        if self.requests.get(rid) is not None:
            self._check_new_alias(message.track_alias)
        if self._reply(rid, Signal.OK, frozenset({RequestKind.SUBSCRIBE})):
            request = self.requests.get(rid)
            if request is not None:
                request.track_alias = message.track_alias
            out.append(SubscribeOkReceived(rid, message))
            self._bind_alias(message.track_alias, rid, out)

    def _check_new_alias(self, alias: int) -> None:
        if self._alias_in_use(alias):
            raise ProtocolViolation(
                f"track alias {alias} already names another track",
                error_code=SessionError.DUPLICATE_TRACK_ALIAS,
            )

    def _on_publish_ok(self, message: PublishOk, out: list[MOQTEvent]) -> None:
        if self._reply(message.request_id, Signal.OK, frozenset({RequestKind.PUBLISH})):
            out.append(PublishOkReceived(message.request_id, message))

    def _on_fetch_ok(self, message: FetchOk, out: list[MOQTEvent]) -> None:
        if self._reply(message.request_id, Signal.OK, frozenset({RequestKind.FETCH})):
            out.append(FetchOkReceived(message.request_id, message))

    def _on_request_ok(self, message: RequestOk, out: list[MOQTEvent]) -> None:
        if self._reply(message.request_id, Signal.OK, _REQUEST_OK_KINDS):
            out.append(RequestOkReceived(message.request_id, message))

    def _on_request_error(self, message: RequestError, out: list[MOQTEvent]) -> None:
        if self._reply(message.request_id, Signal.ERROR, _ANY_KIND):
            out.append(RequestErrorReceived(message.request_id, message))

    def _on_publish_done(self, message: PublishDone, out: list[MOQTEvent]) -> None:
        if self._reply(message.request_id, Signal.PUBLISH_DONE, _SUBSCRIPTIONS):
            out.append(PublishDoneReceived(message.request_id, message))

    def _on_publish_namespace_cancel(
        self, message: PublishNamespaceCancel, out: list[MOQTEvent]
    ) -> None:
        kinds = frozenset({RequestKind.PUBLISH_NAMESPACE})
        if self._reply(message.request_id, Signal.NAMESPACE_CANCEL, kinds):
            out.append(
                PublishNamespaceCancelReceived(
                    message.request_id, int(message.error_code), message.reason
                )
            )

    # --- SUBSCRIBE_NAMESPACE streams (§9.25) ---------------------------------------------------

    def _on_namespace_stream(
        self, stream_id: int, data: bytes, end_stream: bool, out: list[MOQTEvent]
    ) -> None:
        stream = self._ns_streams.get(stream_id)
        if stream is None:
            if self._is_local_stream(stream_id):
                return  # our stream, already closed: late data
            stream = self._ns_streams[stream_id] = _NamespaceStream(False, ControlMessageParser())
        for message in stream.parser.feed(data, end_stream=end_stream):
            if stream.local:
                self._on_namespace_reply(stream_id, stream, message, out)
            else:
                self._on_namespace_request(stream_id, stream, message, out)
        if end_stream:
            self._end_namespace_stream(stream_id, None, out)

    def _is_local_stream(self, stream_id: int) -> bool:
        return (stream_id & 1) == (0 if self.is_client else 1)

    def _on_namespace_request(
        self,
        stream_id: int,
        stream: _NamespaceStream,
        message: ControlMessage,
        out: list[MOQTEvent],
    ) -> None:
        if stream.request_id is not None or not isinstance(message, SubscribeNamespace):
            # §3.3: a bidi stream opens with SUBSCRIBE_NAMESPACE and carries nothing else
            raise ProtocolViolation(f"{message.TYPE.name} on a SUBSCRIBE_NAMESPACE stream")
        request = self._accept(message.request_id, RequestKind.SUBSCRIBE_NAMESPACE, message)
        request.stream_id = stream_id
        stream.request_id = message.request_id
        out.append(SubscribeNamespaceReceived(message.request_id, message))

    def _on_namespace_reply(
        self,
        stream_id: int,
        stream: _NamespaceStream,
        message: ControlMessage,
        out: list[MOQTEvent],
    ) -> None:
        rid = stream.request_id
        if rid is None:
            raise ProtocolViolation("reply on a namespace stream with no request")
        kinds = frozenset({RequestKind.SUBSCRIBE_NAMESPACE})
        if not stream.replied:
            # §9.25: the first message back is REQUEST_OK or REQUEST_ERROR
            if isinstance(message, RequestOk):
                self._reply(rid, Signal.OK, kinds)
                out.append(RequestOkReceived(rid, message))
            elif isinstance(message, RequestError):
                self._reply(rid, Signal.ERROR, kinds)
                self._fin_namespace_stream(stream_id, None)
                stream.request_id = None  # our side is done; the peer's FIN follows
                out.append(RequestErrorReceived(rid, message))
            else:
                raise ProtocolViolation(f"{message.TYPE.name} before REQUEST_OK")
            stream.replied = True
        elif isinstance(message, Namespace | NamespaceDone):
            if self.requests.apply(rid, Signal.NAMESPACE, by_local=False, kinds=kinds) is None:
                return
            if isinstance(message, Namespace):
                out.append(NamespaceReceived(rid, message.track_namespace_suffix))
            else:
                out.append(NamespaceDoneReceived(rid, message.track_namespace_suffix))
        else:
            raise ProtocolViolation(f"{message.TYPE.name} on a SUBSCRIBE_NAMESPACE stream")

    def _end_namespace_stream(
        self, stream_id: int, error_code: int | None, out: list[MOQTEvent]
    ) -> None:
        stream = self._ns_streams.pop(stream_id, None)
        if stream is None or stream.request_id is None:
            return
        rid = stream.request_id
        kinds = frozenset({RequestKind.SUBSCRIBE_NAMESPACE})
        if self.requests.apply(rid, Signal.STREAM_CLOSED, by_local=False, kinds=kinds):
            self._fin_namespace_stream(stream_id, error_code)
            out.append(SubscribeNamespaceEnded(rid, error_code))

    def _new_namespace_stream(self, stream_id: int, request_id: int) -> None:
        self._ns_streams[stream_id] = _NamespaceStream(True, ControlMessageParser(), request_id)

    def _close_namespace_stream(self, stream_id: int) -> None:
        self._ns_streams.pop(stream_id, None)
        self._fin_namespace_stream(stream_id, None)

    def _fin_namespace_stream(self, stream_id: int, error_code: int | None) -> None:
        if error_code is None:
            self._quic.send_stream_data(stream_id, b"", True)
        else:
            self._quic.reset_stream(stream_id, error_code)
