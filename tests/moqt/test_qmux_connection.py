"""moqt.qmux: two QMux connections wired back to back in memory (draft-ietf-quic-qmux-01;
RFC 9000 §2–§4, §19; RFC 9221), and a MOQT session over such a pair.

What one side's ``data_to_send`` returns is fed to the other's ``receive_data``, whole or in
random chunks; crafted records play a misbehaving peer. No sockets.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import pytest

from moqt.qmux import QMUX_BACKEND, QMuxConfig, QMuxConnection
from moqt.qmux_events import (
    ConnectionTerminated,
    DatagramFrameReceived,
    HandshakeCompleted,
    PingAcknowledged,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)
from moqt.qmux_frames import (
    NO_APPLICATION_PROTOCOL,
    ConnectionClose,
    Datagram,
    Frame,
    MaxStreamData,
    QxPing,
    QxTransportParameters,
    ResetStream,
    StopSending,
    StreamDataBlocked,
    StreamFrame,
    TransportErrorCode,
    TransportParameters,
    encode_record,
)
from moqt.qmux_reader import RECORD_END, RecordReader, StreamPiece
from moqt.session import MOQTSession
from moqt.session_events import (
    FetchOkReceived,
    FetchReceived,
    MOQTEvent,
    ObjectData,
    ObjectEnd,
    ObjectHeader,
    SetupComplete,
)
from moqt.wire import Location

APP = ("moqt-16",)
PEER_TP = TransportParameters(
    initial_max_data=1 << 20,
    initial_max_stream_data_bidi_local=1 << 16,
    initial_max_stream_data_bidi_remote=1 << 16,
    initial_max_stream_data_uni=1 << 16,
    initial_max_streams_bidi=10,
    initial_max_streams_uni=10,
    application_protocols=APP,
)


def joined(buffers: list[Any]) -> bytes:
    return b"".join(bytes(buffer) for buffer in buffers)


class Pair:
    """A client and a server connection; ``pump`` moves bytes until both are quiet."""

    def __init__(
        self,
        client: QMuxConfig | None = None,
        server: QMuxConfig | None = None,
        *,
        chunking: random.Random | None = None,
    ) -> None:
        self.client = QMuxConnection(
            is_client=True, config=client or QMuxConfig(application_protocols=APP)
        )
        self.server = QMuxConnection(
            is_client=False, config=server or QMuxConfig(application_protocols=APP)
        )
        self.events: dict[QMuxConnection, list[QuicEvent]] = {self.client: [], self.server: []}
        self.chunking = chunking
        self.now = 0.0
        self.wire_bytes = 0
        self.client.connection_made(self.now)
        self.server.connection_made(self.now)

    def peer(self, conn: QMuxConnection) -> QMuxConnection:
        return self.server if conn is self.client else self.client

    def deliver(self, src: QMuxConnection, max_bytes: int | None = None) -> bool:
        data = joined(src.data_to_send(max_bytes, self.now))
        self.wire_bytes += len(data)
        dst = self.peer(src)
        if self.chunking is None:
            dst.receive_data(data, self.now)
        else:
            pos = 0
            while pos < len(data):
                step = self.chunking.randint(1, 70_000)
                dst.receive_data(data[pos : pos + step], self.now)
                pos += step
        self.collect(dst)
        return bool(data)

    def collect(self, conn: QMuxConnection) -> None:
        while (event := conn.next_event()) is not None:
            self.events[conn].append(event)

    def pump(self, rounds: int = 10_000) -> None:
        for _ in range(rounds):
            moved = self.deliver(self.client) | self.deliver(self.server)
            if not moved:
                return
        raise AssertionError("the pair never went quiet")

    def of(self, conn: QMuxConnection, cls: type) -> list[Any]:
        return [event for event in self.events[conn] if isinstance(event, cls)]

    def stream_bytes(self, conn: QMuxConnection, stream_id: int) -> tuple[bytes, bool]:
        data = [e for e in self.of(conn, StreamDataReceived) if e.stream_id == stream_id]
        return b"".join(bytes(e.data) for e in data), any(e.end_stream for e in data)


def terminated(events: list[QuicEvent]) -> ConnectionTerminated:
    found = [event for event in events if isinstance(event, ConnectionTerminated)]
    assert len(found) == 1, events
    return found[0]


def decoded(buffers: list[Any]) -> list[Frame | StreamPiece]:
    return [i for i in RecordReader(1 << 30).feed(joined(buffers)) if i is not RECORD_END]  # type: ignore[misc]


class Crafted:
    """A hand-driven peer: our connection under test against records we write."""

    def __init__(self, *, is_client: bool = False, config: QMuxConfig | None = None) -> None:
        self.conn = QMuxConnection(
            is_client=is_client,
            config=config
            or QMuxConfig(
                application_protocols=APP,
                max_stream_data=1 << 16,
                max_data=1 << 18,
                max_streams_uni=2,
                max_streams_bidi=2,
            ),
        )
        self.conn.connection_made(0.0)
        self.first = decoded(self.conn.data_to_send())

    def send(self, *frames: Frame, first: bool = True) -> list[QuicEvent]:
        prefix = [QxTransportParameters(PEER_TP)] if first else []
        self.conn.receive_data(encode_record([*prefix, *frames]), 1.0)
        events = []
        while (event := self.conn.next_event()) is not None:
            events.append(event)
        return events

    def closed_with(self, events: list[QuicEvent], code: int) -> None:
        assert terminated(events).error_code == code
        (close,) = decoded(self.conn.data_to_send())
        assert isinstance(close, ConnectionClose) and close.error_code == code
        assert close.frame_type is not None  # a transport CONNECTION_CLOSE (0x1c)
        assert self.conn.data_to_send() == []


# --- handshake ------------------------------------------------------------------------------


def test_transport_parameters_first_then_handshake_completed_both_sides() -> None:
    pair = Pair()
    first = decoded(pair.client.data_to_send())
    assert isinstance(first[0], QxTransportParameters)
    assert first[0].parameters.application_protocols == APP
    pair.client.connection_made(0.0)  # queued again: the test took the first copy
    pair.pump()
    for conn in (pair.client, pair.server):
        (done,) = pair.of(conn, HandshakeCompleted)
        assert done.alpn_protocol == "moqt-16" and conn.negotiated_protocol == "moqt-16"


def test_the_servers_preference_wins() -> None:
    pair = Pair(
        QMuxConfig(application_protocols=("a", "b", "c")),
        QMuxConfig(application_protocols=("c", "b")),
    )
    pair.pump()
    assert pair.client.negotiated_protocol == pair.server.negotiated_protocol == "c"


def test_no_common_application_protocol_closes_with_no_application_protocol() -> None:
    pair = Pair(
        QMuxConfig(application_protocols=("moqt-16",)),
        QMuxConfig(application_protocols=("moqt-99",)),
    )
    pair.pump()
    for conn in (pair.client, pair.server):
        assert not pair.of(conn, HandshakeCompleted)
        closed = terminated(pair.events[conn])
        assert closed.error_code == NO_APPLICATION_PROTOCOL
        assert "no common application protocol" in closed.reason_phrase


def test_alpn_agreed_protocol_passes_through_without_the_parameter() -> None:
    client = QMuxConnection(is_client=True, alpn_protocol="moqt-16")
    server = QMuxConnection(is_client=False, alpn_protocol="moqt-16")
    client.connection_made(0.0)
    server.connection_made(0.0)
    (tp,) = decoded(client.data_to_send())
    assert isinstance(tp, QxTransportParameters) and tp.parameters.application_protocols is None
    server.receive_data(encode_record([tp]), 0.0)
    assert server.next_event() == HandshakeCompleted("moqt-16")


def test_first_frame_must_be_transport_parameters() -> None:
    peer = Crafted()
    events = peer.send(QxPing(1), first=False)
    peer.closed_with(events, TransportErrorCode.PROTOCOL_VIOLATION)


def test_transport_parameters_twice_is_a_protocol_violation() -> None:
    peer = Crafted()
    events = peer.send(QxTransportParameters(PEER_TP))
    peer.closed_with(events, TransportErrorCode.PROTOCOL_VIOLATION)


# --- streams and flow control ---------------------------------------------------------------


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_streams_both_directions_byte_exact(seed: int | None) -> None:
    pair = Pair(chunking=None if seed is None else random.Random(seed))
    pair.pump()
    bidi = pair.client.get_next_available_stream_id()
    uni = pair.server.get_next_available_stream_id(is_unidirectional=True)
    pair.client.send_stream_data(bidi, b"ping" * 1000, end_stream=True)
    pair.server.send_stream_data(uni, bytearray(b"uni" * 5000), end_stream=True)
    pair.pump()
    pair.server.send_stream_data(bidi, b"pong", end_stream=True)
    pair.pump()
    assert pair.stream_bytes(pair.server, bidi) == (b"ping" * 1000, True)
    assert pair.stream_bytes(pair.client, uni) == (b"uni" * 5000, True)
    assert pair.stream_bytes(pair.client, bidi) == (b"pong", True)


def test_large_transfer_is_paced_by_credit_updates() -> None:
    small = QMuxConfig(application_protocols=APP, max_data=256 << 10, max_stream_data=64 << 10)
    pair = Pair(QMuxConfig(application_protocols=APP), small, chunking=random.Random(3))
    pair.pump()
    payload = hashlib.sha256(b"x").digest() * (20 << 15)  # 20 MiB
    stream_id = pair.client.get_next_available_stream_id(is_unidirectional=True)
    pair.client.send_stream_data(stream_id, payload, end_stream=True)
    rounds = 0
    while pair.deliver(pair.client) | pair.deliver(pair.server):
        rounds += 1
        assert pair.client.get_send_buffer_size(stream_id) >= len(payload) - (64 << 10) * rounds
    assert pair.stream_bytes(pair.server, stream_id) == (payload, True)
    assert rounds > len(payload) // (64 << 10) // 2  # many MAX_STREAM_DATA round trips


def test_a_peer_that_stops_reading_stops_the_sender_at_the_window() -> None:
    pair = Pair(
        server=QMuxConfig(application_protocols=APP, max_data=1 << 20, max_stream_data=256 << 10)
    )
    pair.pump()
    stream_id = pair.client.get_next_available_stream_id()
    pair.client.send_stream_data(stream_id, bytes(10 << 20))
    sent = joined(pair.client.data_to_send())
    assert 256 << 10 <= len(sent) < (256 << 10) + 200
    assert pair.client.get_send_buffer_size(stream_id) == (10 << 20) - (256 << 10)
    assert decoded(pair.client.data_to_send()) == [StreamDataBlocked(stream_id, 256 << 10)]
    assert pair.client.data_to_send() == []  # nothing more until the peer grants credit


def test_payload_goes_out_as_a_slice_not_a_copy() -> None:
    pair = Pair()
    pair.pump()
    payload = bytes(range(256)) * 1024
    stream_id = pair.client.get_next_available_stream_id(is_unidirectional=True)
    pair.client.send_stream_data(stream_id, payload)
    buffers = pair.client.data_to_send()
    assert any(buffer is payload for buffer in buffers)  # the caller's bytes, not a copy
    pair.client.send_stream_data(stream_id, memoryview(payload)[1:])
    views = [b for b in pair.client.data_to_send() if isinstance(b, memoryview)]
    assert views and all(view.obj is payload for view in views)


def test_received_stream_data_is_a_slice_of_the_fed_bytes() -> None:
    pair = Pair()
    pair.pump()
    stream_id = pair.client.get_next_available_stream_id(is_unidirectional=True)
    pair.client.send_stream_data(stream_id, b"z" * 50_000)
    data = joined(pair.client.data_to_send())
    pair.server.receive_data(data, 0.0)
    event = pair.server.next_event()
    assert isinstance(event, StreamDataReceived) and isinstance(event.data, memoryview)
    assert event.data.obj is data


def test_data_beyond_max_stream_data_is_a_flow_control_error() -> None:
    peer = Crafted()
    events = peer.send(StreamFrame(2, 0, bytes((1 << 16) + 1)))
    peer.closed_with(events, TransportErrorCode.FLOW_CONTROL_ERROR)


def test_data_beyond_max_data_is_a_flow_control_error() -> None:
    peer = Crafted(
        config=QMuxConfig(application_protocols=APP, max_data=100_000, max_stream_data=60_000)
    )
    events = peer.send(StreamFrame(2, 0, bytes(60_000)), StreamFrame(6, 0, bytes(50_000)))
    peer.closed_with(events, TransportErrorCode.FLOW_CONTROL_ERROR)


def test_reset_with_final_size_beyond_the_window_is_a_flow_control_error() -> None:
    peer = Crafted()
    events = peer.send(ResetStream(2, 0, 1 << 20))
    peer.closed_with(events, TransportErrorCode.FLOW_CONTROL_ERROR)


def test_stream_beyond_max_streams_is_a_stream_limit_error() -> None:
    peer = Crafted()
    events = peer.send(StreamFrame(2 + 4 * 2, 0, b"x"))  # the third uni stream; we allow 2
    peer.closed_with(events, TransportErrorCode.STREAM_LIMIT_ERROR)


@pytest.mark.parametrize("cut", ["whole", "octet by octet"])
def test_the_first_error_in_the_bytes_ends_the_connection_however_they_were_cut(cut: str) -> None:
    """Frames that arrive before a malformed record in the same read are acted on first, as
    they would be had they come in an earlier read: here stream 2's data is delivered and the
    third uni stream ends the connection with STREAM_LIMIT_ERROR, before the empty record
    (FRAME_ENCODING_ERROR) after it is looked at."""
    peer = Crafted()
    wire = encode_record([QxTransportParameters(PEER_TP), StreamFrame(2, 0, b"ok")])
    wire += encode_record([StreamFrame(2 + 4 * 2, 0, b"x")]) + b"\x00"  # then an empty record
    pieces = [wire] if cut == "whole" else [wire[i : i + 1] for i in range(len(wire))]
    for piece in pieces:
        peer.conn.receive_data(piece, 1.0)
    events = []
    while (event := peer.conn.next_event()) is not None:
        events.append(event)
    data = [e for e in events if isinstance(e, StreamDataReceived)]
    assert b"".join(bytes(e.data) for e in data) == b"ok"
    assert {e.stream_id for e in data} == {2}
    peer.closed_with(events, TransportErrorCode.STREAM_LIMIT_ERROR)


@pytest.mark.parametrize(
    "frame",
    [
        StreamFrame(3, 0, b"x"),  # our own (server) uni stream: send-only
        StreamFrame(1, 0, b"x"),  # our bidi stream, never opened
        MaxStreamData(2, 1 << 20),  # the peer's uni stream: receive-only for us
        StopSending(2, 0),
    ],
)
def test_frames_on_the_wrong_stream_are_stream_state_errors(frame: Frame) -> None:
    peer = Crafted()
    peer.closed_with(peer.send(frame), TransportErrorCode.STREAM_STATE_ERROR)


def test_out_of_order_stream_data_is_a_protocol_violation() -> None:
    peer = Crafted()
    events = peer.send(StreamFrame(2, 0, b"abc"), StreamFrame(2, 5, b"def"))
    peer.closed_with(events, TransportErrorCode.PROTOCOL_VIOLATION)


def test_data_past_the_final_size_is_a_final_size_error() -> None:
    peer = Crafted()
    events = peer.send(StreamFrame(2, 0, b"abc"), ResetStream(2, 0, 2))
    peer.closed_with(events, TransportErrorCode.FINAL_SIZE_ERROR)


def test_max_streams_credit_returns_as_streams_close() -> None:
    small = QMuxConfig(application_protocols=APP, max_streams_uni=4)
    pair = Pair(QMuxConfig(application_protocols=APP), small)
    pair.pump()
    for index in range(40):
        assert pair.client.can_open_stream(True)
        stream_id = pair.client.get_next_available_stream_id(is_unidirectional=True)
        pair.client.send_stream_data(stream_id, b"%d" % index, end_stream=True)
        pair.pump()
        assert pair.stream_bytes(pair.server, stream_id) == (b"%d" % index, True)


def test_streams_past_the_peers_limit_wait_for_credit() -> None:
    small = QMuxConfig(application_protocols=APP, max_streams_uni=8)
    pair = Pair(QMuxConfig(application_protocols=APP), small)
    pair.pump()
    ids = []
    for index in range(20):
        ids.append(pair.client.get_next_available_stream_id(is_unidirectional=True))
        pair.client.send_stream_data(ids[-1], b"s%d" % index, end_stream=True)
    assert not pair.client.can_open_stream(True)
    pair.pump()
    assert [pair.stream_bytes(pair.server, i)[0] for i in ids] == [b"s%d" % n for n in range(20)]


# --- resets, datagrams, ping, close, idle ---------------------------------------------------


def test_reset_stream_reaches_the_peer() -> None:
    pair = Pair()
    pair.pump()
    stream_id = pair.client.get_next_available_stream_id(is_unidirectional=True)
    pair.client.send_stream_data(stream_id, b"partial")
    pair.pump()
    pair.client.send_stream_data(stream_id, b"never sent")
    pair.client.reset_stream(stream_id, 7)
    pair.client.send_stream_data(stream_id, b"ignored after reset")
    pair.pump()
    assert pair.stream_bytes(pair.server, stream_id) == (b"partial", False)
    assert pair.of(pair.server, StreamReset) == [StreamReset(7, stream_id)]


def test_stop_sending_is_answered_with_reset_stream() -> None:
    pair = Pair()
    pair.pump()
    stream_id = pair.client.get_next_available_stream_id(is_unidirectional=True)
    pair.client.send_stream_data(stream_id, b"first")
    pair.pump()
    pair.server.stop_stream(stream_id, 9)
    pair.client.send_stream_data(stream_id, b"dropped")
    pair.pump()
    assert pair.of(pair.client, StopSendingReceived) == [StopSendingReceived(9, stream_id)]
    assert pair.of(pair.server, StreamReset) == [StreamReset(9, stream_id)]
    assert pair.stream_bytes(pair.server, stream_id) == (b"first", False)


def test_datagrams_both_ways_and_refused_where_not_allowed() -> None:
    pair = Pair()
    pair.pump()
    pair.client.send_datagram_frame(b"to server")
    pair.server.send_datagram_frame(b"to client")
    pair.pump()
    assert pair.of(pair.server, DatagramFrameReceived) == [DatagramFrameReceived(b"to server")]
    assert pair.of(pair.client, DatagramFrameReceived) == [DatagramFrameReceived(b"to client")]
    with pytest.raises(ValueError, match="DATAGRAM"):
        pair.client.send_datagram_frame(bytes(70_000))
    nodgram = Pair(server=QMuxConfig(application_protocols=APP, max_datagram_frame_size=0))
    nodgram.pump()
    with pytest.raises(ValueError, match="DATAGRAM"):
        nodgram.client.send_datagram_frame(b"x")


def test_a_datagram_we_did_not_allow_is_a_protocol_violation() -> None:
    peer = Crafted(config=QMuxConfig(application_protocols=APP, max_datagram_frame_size=0))
    peer.closed_with(peer.send(Datagram(b"x")), TransportErrorCode.PROTOCOL_VIOLATION)


def test_qx_ping_is_answered_and_acknowledged() -> None:
    pair = Pair()
    pair.pump()
    first, second = pair.client.send_ping(), pair.client.send_ping()
    pair.pump()
    assert second > first
    assert pair.of(pair.client, PingAcknowledged) == [PingAcknowledged(second)]  # the largest


@pytest.mark.parametrize(
    "frames",
    [
        (QxPing(1, response=True),),  # a response to a ping never sent
        (QxPing(5), QxPing(5)),  # request sequence numbers must increase
    ],
)
def test_qx_ping_rules(frames: tuple[Frame, ...]) -> None:
    peer = Crafted()
    peer.closed_with(peer.send(*frames), TransportErrorCode.PROTOCOL_VIOLATION)


def test_connection_close_reaches_the_peer_and_later_data_is_ignored() -> None:
    pair = Pair()
    pair.pump()
    stream_id = pair.client.get_next_available_stream_id()
    pair.client.close(0x10, reason_phrase="bye")
    pair.client.send_stream_data(stream_id, b"after close")
    pair.pump()
    assert terminated(pair.events[pair.server]) == ConnectionTerminated(0x10, None, "bye")
    assert terminated(pair.events[pair.client]).error_code == 0x10
    assert pair.client.closed and pair.server.closed
    pair.server.receive_data(encode_record([StreamFrame(0, 0, b"late")]), 1.0)
    assert pair.server.next_event() is None and pair.server.data_to_send() == []


def test_idle_timeout_ends_the_connection_silently() -> None:
    pair = Pair(
        QMuxConfig(application_protocols=APP, idle_timeout=5),
        QMuxConfig(application_protocols=APP, idle_timeout=10),
    )
    pair.pump()
    deadline = pair.client.get_timer()
    assert deadline == pytest.approx(5.0)  # the smaller of the two
    pair.now = 3.0
    pair.server.send_ping()
    pair.pump()  # a record received resets the timer
    assert pair.client.get_timer() == pytest.approx(8.0)
    pair.client.handle_timer(7.9)
    assert not pair.client.closed
    pair.client.handle_timer(8.0)
    pair.collect(pair.client)
    assert terminated(pair.events[pair.client]) == ConnectionTerminated(0, None, "idle timeout")
    assert pair.client.data_to_send() == [] and pair.client.get_timer() is None


def test_carrier_closed_ends_the_connection() -> None:
    pair = Pair()
    pair.pump()
    pair.client.carrier_closed()
    pair.collect(pair.client)
    assert terminated(pair.events[pair.client]).error_code == TransportErrorCode.INTERNAL_ERROR


# --- MOQT over a QMux pair ------------------------------------------------------------------


def test_moqt_setup_and_fetch_over_a_qmux_pair() -> None:
    pair = Pair(chunking=random.Random(5))
    client = MOQTSession(pair.client, is_client=True, backend=QMUX_BACKEND)
    server = MOQTSession(pair.server, is_client=False, backend=QMUX_BACKEND)
    moqt: dict[QMuxConnection, list[MOQTEvent]] = {pair.client: [], pair.server: []}
    sessions = {pair.client: client, pair.server: server}

    def pump() -> None:
        produced = True
        while produced:
            pair.pump()
            produced = False
            for conn, events in pair.events.items():
                for event in events:
                    moqt[conn].extend(sessions[conn].handle_event(event))
                    produced = True
                events.clear()

    pump()
    assert [type(e) for e in moqt[pair.client]] == [SetupComplete]
    payloads = [hashlib.sha256(b"%d" % i).digest() * 4096 for i in range(3)]  # 128 KiB each
    rid = client.fetch((b"ns",), b"track", Location(0, 0), Location(0, 3))
    pump()
    (request,) = [e for e in moqt[pair.server] if isinstance(e, FetchReceived)]
    server.fetch_ok(request.request_id, end_location=Location(0, 2))
    stream_id = server.open_fetch_stream(request.request_id)
    for index, payload in enumerate(payloads):
        server.send_fetch_object(
            stream_id, group_id=0, object_id=index, payload=payload, end_stream=index == 2
        )
    pump()
    received = moqt[pair.client]
    assert any(isinstance(e, FetchOkReceived) and e.request_id == rid for e in received)
    objects: dict[int, bytearray] = {}
    current = -1
    for event in received:
        if isinstance(event, ObjectHeader):
            current = event.object_id
            objects[current] = bytearray()
        elif isinstance(event, ObjectData):
            objects[current] += event.data
    assert [bytes(objects[i]) for i in range(3)] == payloads
    assert len([e for e in received if isinstance(e, ObjectEnd)]) == 3
