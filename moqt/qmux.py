"""QMux connection: QUIC's stream and datagram operations over a reliable byte stream, sans-I/O.

Implements draft-ietf-quic-qmux-01 (records §3.2, frames §4, transport parameters §5, forward
progress §5.3, termination §6) with QUIC v1 stream states and flow control (RFC 9000 §2–§4,
§19) and DATAGRAM (RFC 9221). :class:`QMuxConnection` has the shape of aioquic's
``QuicConnection`` as far as :class:`~moqt.session.MOQTSession` uses it
(:class:`moqt.backend.QuicConnectionLike`), and emits :mod:`moqt.qmux_events`; with
:data:`QMUX_BACKEND` the MOQT session runs on it unchanged. No sockets or clocks: the caller
feeds bytes with :meth:`~QMuxConnection.receive_data`, pulls events with
:meth:`~QMuxConnection.next_event` and writes :meth:`~QMuxConnection.data_to_send`.

Why this shape:

* Bulk data is never joined. Queued stream data stays the caller's buffers (read-only ones by
  reference, writable ones copied once, since a publisher may reuse them); outgoing records
  are lists of buffers (record Size and frame headers, then payload slices) for writev.
  Received STREAM payload is handed on as slices of the bytes fed in (:class:`RecordReader`).
* Stream data counts as consumed when it becomes an event (as in aioquic): credit (MAX_DATA,
  MAX_STREAM_DATA) is re-granted once half a window has been delivered, MAX_STREAMS as peer
  streams close. The carrier is always read (§5.3); the peer's data is bounded by our windows.
* Peer errors close the connection with CONNECTION_CLOSE carrying the RFC 9000 §20.1 code and a
  :class:`~moqt.qmux_events.ConnectionTerminated` event, never an exception or a hang.
* The application protocol: with TLS it is ALPN, passed in by the carrier. Without TLS both
  sides send the ``application_protocols`` transport parameter (a moq-dev convention);
  the server's preference wins; no common protocol closes with CRYPTO_ERROR 0x178
  (no_application_protocol), QUIC's code for a failed ALPN (RFC 9001 §8.1).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from . import qmux_events as events
from .qmux_config import (
    ALPN_MOQT_16_QMUX,
    APP_PROTOCOL_MOQT_16,
    QMuxConfig,
    transport_parameters,
)
from .qmux_frames import (
    DEFAULT_MAX_RECORD_SIZE,
    NO_APPLICATION_PROTOCOL,
    QMUX_DRAFT,
    ConnectionClose,
    DataBlocked,
    Datagram,
    Frame,
    FrameType,
    MaxData,
    MaxStreamData,
    MaxStreams,
    Padding,
    QMuxError,
    QxPing,
    QxTransportParameters,
    ResetStream,
    StopSending,
    StreamDataBlocked,
    StreamsBlocked,
    TransportErrorCode,
    TransportParameters,
    encode_frame,
    stream_frame_header,
)
from .qmux_reader import RecordEnd, RecordReader, StreamPiece
from .qmux_streams import QMuxStream, RecordBuilder
from .wire import Bytes, as_byte_view

__all__ = [
    "ALPN_MOQT_16_QMUX",
    "APP_PROTOCOL_MOQT_16",
    "QMUX_BACKEND",
    "QMUX_DRAFT",
    "QMuxBackend",
    "QMuxConfig",
    "QMuxConnection",
]

REASON_MAX = 1024  # bytes of a CONNECTION_CLOSE reason we send
STREAM_HEADER_MAX = 25  # type + stream ID + offset + length, 8-byte varints at most


class QMuxConnection:
    """One QMux connection (see the module docstring); implements
    :class:`moqt.backend.QuicConnectionLike`."""

    def __init__(
        self,
        *,
        is_client: bool,
        config: QMuxConfig | None = None,
        alpn_protocol: str | None = None,
    ) -> None:
        self.is_client = is_client
        self.config = config = config or QMuxConfig()
        self.negotiated_protocol: str | None = None
        self._alpn = alpn_protocol
        self._reader = RecordReader(config.max_record_size)
        self._events: deque[events.QuicEvent] = deque()
        self._streams: dict[int, QMuxStream] = {}
        self._sendable: dict[int, None] = {}  # streams with data or a FIN to frame, in order
        self._control: list[bytes] = []  # encoded small frames waiting for the next record
        self._stream_credit: dict[int, int] = {}  # MAX_STREAM_DATA to send
        self._close_frame: bytes | None = None
        self._parameters_due = False  # our QX_TRANSPORT_PARAMETERS not yet sent
        self._closed = False
        self._now = 0.0
        self._idle_deadline: float | None = None
        self._idle_timeout = config.idle_timeout
        # the peer's limits (until its transport parameters arrive: nothing)
        self.peer_parameters: TransportParameters | None = None
        self._peer_max_data = 0
        self._peer_max_streams = [0, 0]  # bidi, uni
        self._peer_max_record = DEFAULT_MAX_RECORD_SIZE
        self._peer_max_datagram = 0
        self._sent_data = 0
        self._data_blocked_at = -1
        self._streams_blocked_at = [-1, -1]
        # our limits
        self._local_max_data = config.max_data
        self._received_data = 0
        self._local_max_streams = [config.max_streams_bidi, config.max_streams_uni]
        self._peer_streams_opened = [0, 0]
        self._peer_streams_closed = [0, 0]
        self._next_local = [0, 0]
        # QX_PING (§4.3)
        self._ping_sent = 0
        self._ping_received = 0
        self._pong_due: int | None = None

    # --- the carrier side -------------------------------------------------------------------

    def connection_made(self, now: float) -> None:
        """The carrier is up: queue our QX_TRANSPORT_PARAMETERS as the first frame (§4.2)."""
        self._now = now
        frame = QxTransportParameters(transport_parameters(self.config))
        self._control.insert(0, encode_frame(frame))
        self._parameters_due = True
        self._reset_idle(now)

    def receive_data(self, data: Bytes, now: float) -> None:
        """Bytes from the carrier, in any chunking. ``data`` must not change afterwards:
        stream data events are slices of it."""
        if self._closed:
            return  # §6.2: discard what arrives while closing
        self._now = now
        items, error = self._reader.feed_until_error(data)
        try:
            for item in items:
                if isinstance(item, StreamPiece):
                    self._on_stream_piece(item)
                elif isinstance(item, RecordEnd):
                    self._reset_idle(now)  # §6.1: a record completely received
                else:
                    self._on_frame(item)
                if self.closed:
                    return
            if error is not None:  # after the frames before it, as if they came first
                raise error
        except QMuxError as exc:
            self._fail(exc)
            return
        self._grant_data_credit()

    def carrier_closed(self, reason: str = "") -> None:
        """The carrier ended (EOF, reset, TLS alert): the connection ends now (§6.4)."""
        if not self._closed:
            self._terminate(
                TransportErrorCode.INTERNAL_ERROR,
                None,
                reason or "the carrier closed before CONNECTION_CLOSE",
            )

    def next_event(self) -> events.QuicEvent | None:
        """The next event, or None."""
        return self._events.popleft() if self._events else None

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` must run (the idle timeout), or None."""
        return None if self._closed else self._idle_deadline

    def handle_timer(self, now: float) -> None:
        """Run the idle timeout (§6.1): the connection ends silently, no frame sent."""
        self._now = now
        deadline = self._idle_deadline
        if not self._closed and deadline is not None and now >= deadline:
            self._terminate(TransportErrorCode.NO_ERROR, None, "idle timeout")

    @property
    def closed(self) -> bool:
        """True once the connection is closed (the carrier should be shut down after the last
        :meth:`data_to_send`)."""
        return self._closed

    # --- sending ----------------------------------------------------------------------------

    def data_to_send(self, max_bytes: int | None = None, now: float | None = None) -> list[Bytes]:
        """What to write to the carrier, in order, as a list of buffers: whole records, about
        ``max_bytes`` at most (None: all that flow control allows)."""
        if now is not None:
            self._now = now
        if self._closed:
            frame, self._close_frame = self._close_frame, None
            return [] if frame is None else RecordBuilder.single(frame)
        builder = RecordBuilder(self._peer_max_record)
        self._write_control(builder)
        if self.peer_parameters is not None:
            self._write_streams(builder, max_bytes)
        out = builder.finish()
        if out:
            self._reset_idle(self._now)  # §6.1: a record completely sent
        return out

    def _write_control(self, builder: RecordBuilder) -> None:
        if self._pong_due is not None:
            self._control.append(encode_frame(QxPing(self._pong_due, response=True)))
            self._pong_due = None
        for stream_id, maximum in self._stream_credit.items():
            self._control.append(encode_frame(MaxStreamData(stream_id, maximum)))
        self._stream_credit.clear()
        control, self._control = self._control, []
        self._parameters_due = False
        for data in control:
            builder.add(data)

    def _write_streams(self, builder: RecordBuilder, max_bytes: int | None) -> None:
        budget = max_bytes if max_bytes is not None else 1 << 62
        progress = True
        while progress and self._sendable and budget > 0:
            progress = False
            for stream_id in list(self._sendable):
                sent = self._write_stream(self._streams[stream_id], builder, budget)
                if sent is not None:
                    budget -= sent
                    progress = True

    def _write_stream(self, stream: QMuxStream, builder: RecordBuilder, budget: int) -> int | None:
        """One frame of ``stream`` (at most a record); None if it cannot send now."""
        stream_id = stream.stream_id
        if stream.local and stream_id >> 2 >= self._peer_max_streams[stream.uni]:
            self._streams_blocked(stream.uni)
            return None
        want = min(
            stream.send_queued,
            stream.send_max - stream.send_offset,
            self._peer_max_data - self._sent_data,
            budget,
        )
        if want <= 0 and stream.send_queued:
            self._blocked(stream)
            return None
        if want + STREAM_HEADER_MAX > builder.room():
            builder.flush()
        length = min(want, builder.room() - STREAM_HEADER_MAX)
        payload = stream.pop(length) if length else []
        fin = stream.fin_requested and not stream.send_queued
        builder.add_stream(stream_frame_header(stream_id, stream.send_offset, length, fin), payload)
        stream.send_offset += length
        self._sent_data += length
        if not stream.send_queued:
            del self._sendable[stream_id]
        if fin:
            stream.send_done = True
            self._maybe_discard(stream)
        return length

    def _blocked(self, stream: QMuxStream) -> None:
        if stream.send_offset >= stream.send_max and stream.blocked_at != stream.send_max:
            stream.blocked_at = stream.send_max
            self._control.append(encode_frame(StreamDataBlocked(stream.stream_id, stream.send_max)))
        if self._sent_data >= self._peer_max_data != self._data_blocked_at:
            self._data_blocked_at = self._peer_max_data
            self._control.append(encode_frame(DataBlocked(self._peer_max_data)))

    def _streams_blocked(self, uni: int) -> None:
        limit = self._peer_max_streams[uni]
        if self._streams_blocked_at[uni] != limit:
            self._streams_blocked_at[uni] = limit
            self._control.append(encode_frame(StreamsBlocked(limit, bool(uni))))

    # --- QuicConnectionLike -----------------------------------------------------------------

    def send_stream_data(self, stream_id: int, data: Any, end_stream: bool = False) -> None:
        """Queue ``data`` on a stream (opening a local one). Read-only buffers are kept by
        reference, writable ones copied. Ignored once the connection or the stream's sending
        side was reset or closed.

        Raises:
            ValueError: a stream we cannot send on, or data after FIN.
        """
        if self._closed:
            return
        stream = self._send_stream(stream_id)
        if stream is None or stream.reset_sent:
            return  # reset (by us or at the peer's STOP_SENDING) and forgotten
        if stream.fin_requested:
            raise ValueError(f"stream {stream_id}: data after FIN")
        if len(data):
            view = data if type(data) is bytes else as_byte_view(data)
            if type(view) is memoryview and not view.readonly:
                view = bytes(view)  # the caller may reuse a writable buffer
            stream.push(view)
        stream.fin_requested = end_stream
        if len(data) or end_stream:
            self._sendable[stream_id] = None

    def send_stream_buffers(
        self, stream_id: int, buffers: Sequence[Bytes], end_stream: bool = False
    ) -> None:
        """Queue several buffers on a stream in one call, as :meth:`send_stream_data` would
        queue each (read-only buffers by reference, writable ones copied; ignored once the
        connection or the stream's sending side was reset or closed).

        Raises:
            ValueError: a stream we cannot send on, or data after FIN.
        """
        if self._closed:
            return
        stream = self._send_stream(stream_id)
        if stream is None or stream.reset_sent:
            return
        if stream.fin_requested:
            raise ValueError(f"stream {stream_id}: data after FIN")
        queue = stream.send_queue
        queued = 0
        for data in buffers:
            if type(data) is not bytes:
                if type(data) is not memoryview or data.ndim != 1 or data.format != "B":
                    data = as_byte_view(data)
                if not data.readonly:
                    data = bytes(data)  # the caller may reuse a writable buffer
            size = len(data)
            if size:
                queue.append(data)
                queued += size
        stream.send_queued += queued
        stream.fin_requested = end_stream
        if queued or end_stream:
            self._sendable[stream_id] = None

    def get_next_available_stream_id(self, is_unidirectional: bool = False) -> int:
        """The ID our next stream of that kind gets (RFC 9000 §2.1)."""
        uni = int(is_unidirectional)
        return self._next_local[uni] << 2 | uni << 1 | int(not self.is_client)

    def can_open_stream(self, unidirectional: bool) -> bool:
        """Whether a new local stream is within the peer's MAX_STREAMS."""
        uni = int(unidirectional)
        return self._next_local[uni] < self._peer_max_streams[uni]

    def get_send_buffer_size(self, stream_id: int) -> int:
        """Bytes queued on the stream and not yet framed."""
        stream = self._streams.get(stream_id)
        return 0 if stream is None else stream.send_queued

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        """Abandon sending on a stream (RESET_STREAM, RFC 9000 §19.4)."""
        stream = self._streams.get(stream_id)
        if self._closed or stream is None or stream.send_done:
            return
        self._reset(stream, error_code)

    def stop_stream(self, stream_id: int, error_code: int) -> None:
        """Ask the peer to stop sending (STOP_SENDING, RFC 9000 §19.5); data still arriving on
        the stream is dropped."""
        stream = self._streams.get(stream_id)
        if self._closed or stream is None or stream.recv_done or stream.stop_sent:
            return
        stream.stop_sent = True
        self._control.append(encode_frame(StopSending(stream_id, error_code)))

    def send_datagram_frame(self, data: Bytes) -> None:
        """Queue a DATAGRAM frame (RFC 9221).

        Raises:
            ValueError: the peer did not allow DATAGRAM, or ``data`` is larger than it allows.
        """
        if self._closed:
            return
        frame = encode_frame(Datagram(data))
        limit = min(self._peer_max_datagram, self._peer_max_record)
        if len(frame) > limit:
            raise ValueError(f"DATAGRAM of {len(frame)} bytes above the peer's limit {limit}")
        self._control.append(frame)

    def send_ping(self) -> int:
        """Queue a QX_PING request (§4.3); its sequence number is returned and comes back
        as :class:`~moqt.qmux_events.PingAcknowledged`."""
        self._ping_sent += 1
        self._control.append(encode_frame(QxPing(self._ping_sent)))
        return self._ping_sent

    def close(
        self, error_code: int = 0, frame_type: int | None = None, reason_phrase: str = ""
    ) -> None:
        """Close with CONNECTION_CLOSE: ``frame_type`` None sends the application's (0x1d)."""
        if self._closed:
            return
        reason = reason_phrase.encode("utf-8")[:REASON_MAX]
        frame = encode_frame(ConnectionClose(error_code, frame_type, reason))
        if self._parameters_due:  # §4.2: even a refusal starts with our parameters
            frame = self._control[0] + frame
        self._close_frame = frame
        self._terminate(error_code, frame_type, reason_phrase)

    # --- receiving --------------------------------------------------------------------------

    def _on_frame(self, frame: Frame) -> None:
        if self.peer_parameters is None and not isinstance(frame, QxTransportParameters):
            raise QMuxError(  # §4.2 MUST
                TransportErrorCode.PROTOCOL_VIOLATION,
                "the first frame is not QX_TRANSPORT_PARAMETERS",
            )
        handler = _FRAME_HANDLERS[type(frame)]
        handler(self, frame)

    def _on_transport_parameters(self, frame: QxTransportParameters) -> None:
        if self.peer_parameters is not None:  # §4.2 MUST
            raise QMuxError(
                TransportErrorCode.PROTOCOL_VIOLATION,
                "QX_TRANSPORT_PARAMETERS sent twice",
                FrameType.QX_TRANSPORT_PARAMETERS,
            )
        peer = self.peer_parameters = frame.parameters
        self._peer_max_data = peer.initial_max_data or 0
        self._peer_max_streams = [
            peer.initial_max_streams_bidi or 0,
            peer.initial_max_streams_uni or 0,
        ]
        self._peer_max_record = peer.max_record_size or DEFAULT_MAX_RECORD_SIZE
        self._peer_max_datagram = peer.max_datagram_frame_size or 0
        if peer.max_idle_timeout:
            ours = self._idle_timeout
            theirs = peer.max_idle_timeout / 1000
            self._idle_timeout = min(ours, theirs) if ours else theirs  # RFC 9000 §10.1
            self._reset_idle(self._now)
        for stream in self._streams.values():
            stream.send_max = self._initial_send_max(stream)
        protocol = self.negotiated_protocol = self._agree_protocol(peer)
        self._events.append(events.HandshakeCompleted(alpn_protocol=protocol))

    def _agree_protocol(self, peer: TransportParameters) -> str | None:
        ours = self.config.application_protocols
        if not ours:
            return self._alpn
        theirs = peer.application_protocols or ()
        server_order, client_offer = (theirs, ours) if self.is_client else (ours, theirs)
        for name in server_order:  # the server's preference wins
            if name in client_offer:
                return name
        raise QMuxError(
            NO_APPLICATION_PROTOCOL,
            f"no common application protocol: ours {list(ours)}, the peer's {list(theirs)}",
            FrameType.QX_TRANSPORT_PARAMETERS,
        )

    def _on_stream_piece(self, piece: StreamPiece) -> None:
        if self.peer_parameters is None:  # §4.2 MUST
            raise QMuxError(
                TransportErrorCode.PROTOCOL_VIOLATION,
                "the first frame is not QX_TRANSPORT_PARAMETERS",
            )
        stream = self._recv_stream(piece.stream_id, FrameType.STREAM)
        if stream is None:
            return
        data = piece.data
        if piece.offset != stream.recv_offset:  # §4.1 MUST
            raise QMuxError(
                TransportErrorCode.PROTOCOL_VIOLATION,
                f"stream {piece.stream_id}: data at {piece.offset}, expected {stream.recv_offset}",
                FrameType.STREAM,
            )
        end = piece.frame_end
        self._check_final_size(stream, end, piece.fin, FrameType.STREAM)
        self._check_flow(stream, end, FrameType.STREAM)
        stream.recv_offset += len(data)
        self._received_data += len(data)
        if piece.fin:
            stream.recv_final = end
        if stream.recv_done:
            return
        if not stream.stop_sent and (data or piece.fin):
            self._events.append(events.StreamDataReceived(data, piece.fin, piece.stream_id))
        if piece.fin:
            stream.recv_done = True
            self._maybe_discard(stream)
        elif stream.recv_max - stream.recv_offset < self.config.max_stream_data >> 1:
            stream.recv_max = stream.recv_offset + self.config.max_stream_data
            self._stream_credit[stream.stream_id] = stream.recv_max

    def _check_final_size(self, stream: QMuxStream, end: int, fin: bool, kind: int) -> None:
        final = stream.recv_final
        if (final is not None and (end > final or (fin and end != final))) or (
            fin and end < stream.recv_offset
        ):  # RFC 9000 §4.5
            raise QMuxError(
                TransportErrorCode.FINAL_SIZE_ERROR, f"stream {stream.stream_id}: final size", kind
            )

    def _check_flow(self, stream: QMuxStream, end: int, kind: int) -> None:
        if end > stream.recv_max:  # RFC 9000 §4.1
            raise QMuxError(
                TransportErrorCode.FLOW_CONTROL_ERROR,
                f"stream {stream.stream_id}: data beyond MAX_STREAM_DATA {stream.recv_max}",
                kind,
            )
        if self._received_data + end - stream.recv_offset > self._local_max_data:
            raise QMuxError(
                TransportErrorCode.FLOW_CONTROL_ERROR,
                f"data beyond MAX_DATA {self._local_max_data}",
                kind,
            )

    def _on_reset_stream(self, frame: ResetStream) -> None:
        stream = self._recv_stream(frame.stream_id, FrameType.RESET_STREAM)
        if stream is None:
            return
        final = frame.final_size
        self._check_final_size(stream, final, True, FrameType.RESET_STREAM)
        self._check_flow(stream, final, FrameType.RESET_STREAM)
        self._received_data += final - stream.recv_offset  # RFC 9000 §4.5: counts as received
        stream.recv_offset = stream.recv_final = final
        if not stream.recv_done:
            stream.recv_done = True
            self._events.append(events.StreamReset(frame.error_code, frame.stream_id))
            self._maybe_discard(stream)

    def _on_stop_sending(self, frame: StopSending) -> None:
        stream = self._send_side(frame.stream_id, FrameType.STOP_SENDING)
        if stream is None:
            return
        self._events.append(events.StopSendingReceived(frame.error_code, frame.stream_id))
        if not stream.send_done:  # RFC 9000 §3.5: answer with RESET_STREAM, same code
            self._reset(stream, frame.error_code)

    def _on_max_data(self, frame: MaxData) -> None:
        self._peer_max_data = max(self._peer_max_data, frame.maximum)

    def _on_max_stream_data(self, frame: MaxStreamData) -> None:
        stream = self._send_side(frame.stream_id, FrameType.MAX_STREAM_DATA)
        if stream is not None:
            stream.send_max = max(stream.send_max, frame.maximum)

    def _on_max_streams(self, frame: MaxStreams) -> None:
        uni = int(frame.unidirectional)
        self._peer_max_streams[uni] = max(self._peer_max_streams[uni], frame.maximum)

    def _on_stream_data_blocked(self, frame: StreamDataBlocked) -> None:
        self._recv_stream(frame.stream_id, FrameType.STREAM_DATA_BLOCKED)

    def _on_ignored(self, frame: Frame) -> None:
        """PADDING, DATA_BLOCKED, STREAMS_BLOCKED: nothing to do (credit follows delivery)."""

    def _on_connection_close(self, frame: ConnectionClose) -> None:
        reason = frame.reason.decode("utf-8", "replace")
        self._terminate(frame.error_code, frame.frame_type, reason)  # §6.3: no frame back

    def _on_datagram(self, frame: Datagram) -> None:
        limit = self.config.max_datagram_frame_size
        if len(encode_frame(frame)) > limit:  # RFC 9221 §3 MUST
            raise QMuxError(
                TransportErrorCode.PROTOCOL_VIOLATION,
                "DATAGRAM not allowed" if not limit else f"DATAGRAM above {limit} bytes",
                FrameType.DATAGRAM,
            )
        self._events.append(events.DatagramFrameReceived(bytes(frame.data)))

    def _on_ping(self, frame: QxPing) -> None:
        if frame.response:
            if frame.sequence > self._ping_sent or frame.sequence == 0:  # §4.3 MUST / MAY
                raise _ping_error("QX_PING response to a ping never sent")
            self._events.append(events.PingAcknowledged(frame.sequence))
            return
        if frame.sequence <= self._ping_received and self._ping_received:  # §4.3 MUST
            raise _ping_error("QX_PING sequence numbers must increase")
        self._ping_received = frame.sequence
        self._pong_due = frame.sequence  # §4.3: one response for the largest seen

    # --- streams ----------------------------------------------------------------------------

    def _is_local(self, stream_id: int) -> bool:
        return (stream_id & 1) == (not self.is_client)

    def _send_stream(self, stream_id: int) -> QMuxStream | None:
        stream = self._streams.get(stream_id)
        if stream is not None:
            return stream
        uni = stream_id >> 1 & 1
        if not self._is_local(stream_id):
            raise ValueError(f"stream {stream_id}: not open for sending")
        index = stream_id >> 2
        if index < self._next_local[uni]:
            return None
        self._next_local[uni] = index + 1
        return self._new_stream(stream_id)

    def _new_stream(self, stream_id: int) -> QMuxStream:
        stream = QMuxStream(stream_id, local=self._is_local(stream_id))
        stream.send_max = self._initial_send_max(stream)
        stream.recv_max = self.config.max_stream_data
        if stream.uni:
            stream.recv_done = stream.local  # a local uni stream receives nothing
            stream.send_done = not stream.local
        self._streams[stream_id] = stream
        return stream

    def _initial_send_max(self, stream: QMuxStream) -> int:
        peer = self.peer_parameters
        if peer is None:
            return 0
        if stream.uni:
            value = peer.initial_max_stream_data_uni
        elif stream.local:
            value = peer.initial_max_stream_data_bidi_remote
        else:
            value = peer.initial_max_stream_data_bidi_local
        return value or 0

    def _known_stream(self, stream_id: int, kind: int) -> QMuxStream | None:
        """The stream a received frame names, opening a peer's stream (RFC 9000 §3.2); None
        for a closed one.

        Raises:
            QMuxError: STREAM_LIMIT_ERROR past our MAX_STREAMS, STREAM_STATE_ERROR for a
                local stream not yet opened.
        """
        stream = self._streams.get(stream_id)
        if stream is not None:
            return stream
        uni, index = stream_id >> 1 & 1, stream_id >> 2
        if self._is_local(stream_id):
            if index >= self._next_local[uni]:
                raise QMuxError(
                    TransportErrorCode.STREAM_STATE_ERROR, f"stream {stream_id} not opened", kind
                )
            return None
        if index < self._peer_streams_opened[uni]:
            return None
        if index >= self._local_max_streams[uni]:  # RFC 9000 §4.6
            raise QMuxError(
                TransportErrorCode.STREAM_LIMIT_ERROR,
                f"stream {stream_id} beyond MAX_STREAMS",
                kind,
            )
        self._peer_streams_opened[uni] = index + 1
        return self._new_stream(stream_id)

    def _recv_stream(self, stream_id: int, kind: int) -> QMuxStream | None:
        if (stream_id & 2) and self._is_local(stream_id):
            raise QMuxError(
                TransportErrorCode.STREAM_STATE_ERROR, f"stream {stream_id} is send-only", kind
            )
        return self._known_stream(stream_id, kind)

    def _send_side(self, stream_id: int, kind: int) -> QMuxStream | None:
        if (stream_id & 2) and not self._is_local(stream_id):
            raise QMuxError(
                TransportErrorCode.STREAM_STATE_ERROR, f"stream {stream_id} is receive-only", kind
            )
        return self._known_stream(stream_id, kind)

    def _reset(self, stream: QMuxStream, error_code: int) -> None:
        stream.clear()
        stream.reset_sent = stream.send_done = True
        self._sendable.pop(stream.stream_id, None)
        frame = ResetStream(stream.stream_id, error_code, stream.send_offset)
        self._control.append(encode_frame(frame))
        self._maybe_discard(stream)

    def _maybe_discard(self, stream: QMuxStream) -> None:
        """Forget a stream both of whose sides are done; a peer's returns its MAX_STREAMS
        credit."""
        if not (stream.send_done and stream.recv_done) or stream.stream_id in self._sendable:
            return
        del self._streams[stream.stream_id]
        self._stream_credit.pop(stream.stream_id, None)
        if stream.local:
            return
        uni = int(stream.uni)
        self._peer_streams_closed[uni] += 1
        initial = (self.config.max_streams_bidi, self.config.max_streams_uni)[uni]
        limit = initial + self._peer_streams_closed[uni]
        if limit - self._local_max_streams[uni] >= max(1, initial >> 3):
            self._local_max_streams[uni] = limit
            self._control.append(encode_frame(MaxStreams(limit, bool(uni))))

    def _grant_data_credit(self) -> None:
        window = self.config.max_data
        if self._local_max_data - self._received_data < window >> 1:
            self._local_max_data = self._received_data + window
            self._control.append(encode_frame(MaxData(self._local_max_data)))

    # --- ending -----------------------------------------------------------------------------

    def _fail(self, exc: QMuxError) -> None:
        self.close(exc.error_code, exc.frame_type or 0, exc.reason)

    def _terminate(self, error_code: int, frame_type: int | None, reason: str) -> None:
        self._closed = True
        self._idle_deadline = None
        self._sendable.clear()
        self._control.clear()
        self._events.append(events.ConnectionTerminated(error_code, frame_type, reason))

    def _reset_idle(self, now: float) -> None:
        if self._idle_timeout and not self._closed:
            self._idle_deadline = now + self._idle_timeout


def _ping_error(reason: str) -> QMuxError:
    return QMuxError(TransportErrorCode.PROTOCOL_VIOLATION, reason, FrameType.QX_PING_REQUEST)


_FRAME_HANDLERS: dict[type, Any] = {
    QxTransportParameters: QMuxConnection._on_transport_parameters,
    ResetStream: QMuxConnection._on_reset_stream,
    StopSending: QMuxConnection._on_stop_sending,
    MaxData: QMuxConnection._on_max_data,
    MaxStreamData: QMuxConnection._on_max_stream_data,
    MaxStreams: QMuxConnection._on_max_streams,
    StreamDataBlocked: QMuxConnection._on_stream_data_blocked,
    DataBlocked: QMuxConnection._on_ignored,
    StreamsBlocked: QMuxConnection._on_ignored,
    Padding: QMuxConnection._on_ignored,
    ConnectionClose: QMuxConnection._on_connection_close,
    Datagram: QMuxConnection._on_datagram,
    QxPing: QMuxConnection._on_ping,
}


class QMuxBackend:
    """The :class:`moqt.backend.SessionBackend` of QMux: ``MOQTSession(QMuxConnection(...),
    is_client=..., backend=QMUX_BACKEND)``."""

    name = "qmux"
    version = QMUX_DRAFT
    events: ModuleType = events

    def can_open_stream(self, quic: Any, *, unidirectional: bool) -> bool:
        """Whether a new local stream is within the peer's MAX_STREAMS."""
        return bool(quic.can_open_stream(unidirectional))

    def send_buffer_size(self, quic: Any, stream_id: int) -> int:
        """Bytes queued on the stream and not yet framed."""
        return int(quic.get_send_buffer_size(stream_id))

    def quiet(self, quic: Any) -> None:
        """Nothing to quiet: QMux logs nothing per record."""


QMUX_BACKEND = QMuxBackend()
