"""moqt.session: two MOQT sessions joined in memory through their QUIC connections (d16 §3, §9).

Each side's ``datagrams_to_send`` is fed to the other's ``receive_datagram`` with a fake clock,
as aioquic's own tests do; no sockets.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvsp.moqt_mapping import find_layer_digest, layer_digest_extension
from moqt.backend import Backend, available_backends, get_backend
from moqt.certs import make_self_signed
from moqt.errors import ObjectStatus, PublishDoneCode, RequestErrorCode, SessionError
from moqt.messages import (
    ClientSetup,
    Fetch,
    Goaway,
    JoiningFetch,
    MessageParameters,
    SetupParameters,
    StandaloneFetch,
    Subscribe,
    SubscribeOk,
)
from moqt.messages_params import ExtensionType
from moqt.objects import DataStreamParser, ObjectRun, SubgroupHeader, SubgroupWriter
from moqt.session import MOQTSession, SessionConfig
from moqt.session_events import (
    DatagramReceived,
    DataStreamFinished,
    DataStreamReset,
    FetchOkReceived,
    FetchReceived,
    FetchStreamOpened,
    GoawayReceived,
    MalformedTrackDetected,
    MaxRequestIdReceived,
    MOQTEvent,
    NamespaceReceived,
    ObjectData,
    ObjectEnd,
    ObjectHeader,
    PublishDoneReceived,
    PublishNamespaceDoneReceived,
    PublishNamespaceReceived,
    PublishOkReceived,
    PublishReceived,
    RequestErrorReceived,
    RequestOkReceived,
    RequestsBlockedReceived,
    RunSink,
    SessionClosed,
    SetupComplete,
    SubgroupStreamOpened,
    SubscribeNamespaceEnded,
    SubscribeNamespaceReceived,
    SubscribeOkReceived,
    SubscribeReceived,
    TrackStatusReceived,
    UnsubscribeReceived,
)
from moqt.session_state import LocalProtocolError, RequestsBlockedError, StreamsBlockedError
from moqt.wire import Location, encode_kvps

NS = (b"kvsp", b"1", b"c0", b"s0", b"k0")
TRACK = b"d" * 64
LAYER = 64 * 1024
CLIENT_ADDR = ("10.0.0.1", 40000)
SERVER_ADDR = ("10.0.0.2", 4443)
E = TypeVar("E", bound=MOQTEvent)


@pytest.fixture(scope="module")
def cert_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_self_signed("localhost", tmp_path_factory.mktemp("certs"))


class Pair:
    """A client and a server session over in-memory QUIC; ``client`` may be None (raw QUIC)."""

    def __init__(
        self,
        backend: Backend,
        certs: tuple[Path, Path],
        *,
        client_config: SessionConfig | None = None,
        server_config: SessionConfig | None = None,
        raw_client: bool = False,
    ) -> None:
        cert, key = certs
        client_quic_config = backend.configuration(
            is_client=True, cafile=str(cert), server_name="localhost"
        )
        server_quic_config = backend.configuration(
            is_client=False, certificate=str(cert), private_key=str(key)
        )
        self.cq: Any = backend.QuicConnection(configuration=client_quic_config)
        self.sq: Any = backend.QuicConnection(
            configuration=server_quic_config,
            original_destination_connection_id=self.cq.original_destination_connection_id,
        )
        self.client = (
            None
            if raw_client
            else MOQTSession(self.cq, is_client=True, config=client_config, backend=backend)
        )
        self.server = MOQTSession(self.sq, is_client=False, config=server_config, backend=backend)
        self.client_events: list[MOQTEvent] = []
        self.server_events: list[MOQTEvent] = []
        self.raw_client_events: list[Any] = []
        self.now = 0.0
        self.cq.connect(SERVER_ADDR, now=self.now)
        self.pump()

    def _drain(self, quic: Any, session: MOQTSession | None, sink: list[Any]) -> None:
        while (event := quic.next_event()) is not None:
            if session is None:
                sink.append(event)
            else:
                sink.extend(session.handle_event(event))

    def pump(self, rounds: int = 20000) -> None:
        """Move datagrams both ways until both sides are quiet."""
        for _ in range(rounds):
            moved = 0
            for data, _addr in self.cq.datagrams_to_send(now=self.now):
                self.sq.receive_datagram(data, CLIENT_ADDR, now=self.now)
                moved += 1
            self._drain(self.sq, self.server, self.server_events)
            for data, _addr in self.sq.datagrams_to_send(now=self.now):
                self.cq.receive_datagram(data, SERVER_ADDR, now=self.now)
                moved += 1
            sink = self.raw_client_events if self.client is None else self.client_events
            self._drain(self.cq, self.client, sink)
            if not moved and not self._advance_clock():
                return
        raise AssertionError("the connections never went quiet")

    def _advance_clock(self) -> bool:
        timers = [t for t in (self.cq.get_timer(), self.sq.get_timer()) if t is not None]
        if not timers or min(timers) - self.now > 0.5:
            return False
        self.now = max(self.now, min(timers))
        for quic in (self.cq, self.sq):
            timer = quic.get_timer()
            if timer is not None and timer <= self.now:
                quic.handle_timer(now=self.now)
        self._drain(self.sq, self.server, self.server_events)
        sink = self.raw_client_events if self.client is None else self.client_events
        self._drain(self.cq, self.client, sink)
        return True

    def settle_close(self) -> None:
        """Let a closing connection run out its drain period."""
        for _ in range(50):
            timers = [t for t in (self.cq.get_timer(), self.sq.get_timer()) if t is not None]
            if not timers:
                return
            self.now = max(self.now, min(timers))
            for quic in (self.cq, self.sq):
                timer = quic.get_timer()
                if timer is not None and timer <= self.now:
                    quic.handle_timer(now=self.now)
            self.pump()

    def send_raw(self, data: bytes, stream_id: int = 0) -> None:
        self.cq.send_stream_data(stream_id, data)
        self.pump()

    @property
    def c(self) -> MOQTSession:
        assert self.client is not None
        return self.client


def of_type(events: list[MOQTEvent], cls: type[E]) -> list[E]:
    return [event for event in events if isinstance(event, cls)]


def one(events: list[MOQTEvent], cls: type[E]) -> E:
    found = of_type(events, cls)
    assert len(found) == 1, f"expected one {cls.__name__}, got {found}"
    return found[0]


def layers(count: int, size: int = LAYER) -> list[bytes]:
    return [hashlib.sha256(b"layer%d" % i).digest() * (size // 32) for i in range(count)]


def collect_objects(events: list[MOQTEvent], request_id: int) -> dict[int, bytes]:
    """Reassemble payloads from ObjectHeader/ObjectData/ObjectEnd events of one request."""
    buffers: dict[tuple[int, int], bytearray] = {}
    current: dict[int, tuple[int, int]] = {}
    done: dict[int, bytes] = {}
    for event in events:
        if isinstance(event, ObjectHeader) and event.request_id == request_id:
            key = (event.group_id, event.object_id)
            buffers[key] = bytearray()
            current[event.stream_id] = key
        elif isinstance(event, ObjectData) and event.request_id == request_id:
            buffer = buffers[current[event.stream_id]]
            assert event.offset == len(buffer)
            buffer += event.data
        elif isinstance(event, ObjectEnd) and event.request_id == request_id:
            done[event.object_id] = bytes(buffers.pop((event.group_id, event.object_id)))
    return done


@pytest.fixture(params=available_backends())
def backend(request: pytest.FixtureRequest) -> Backend:
    return get_backend(request.param)


@pytest.fixture
def pair(backend: Backend, cert_pair: tuple[Path, Path]) -> Iterator[Pair]:
    yield Pair(backend, cert_pair)


# --- setup ---------------------------------------------------------------------------------------


def test_setup_completes_both_ways(pair: Pair) -> None:
    client_setup = one(pair.client_events, SetupComplete)
    server_setup = one(pair.server_events, SetupComplete)
    assert client_setup.parameters.max_request_id == 200  # 100 requests from id 1
    assert server_setup.parameters.max_request_id == 200  # 100 requests from id 0
    assert server_setup.parameters.moqt_implementation == "kvsp-moqt/0.1"
    assert pair.c.setup_complete and pair.server.setup_complete
    assert pair.c.closed is None and pair.server.closed is None


def test_client_setup_carries_path_authority_and_token(
    backend: Backend, cert_pair: tuple[Path, Path]
) -> None:
    from moqt.messages import AuthToken, TokenAliasType

    token = AuthToken(alias_type=TokenAliasType.USE_VALUE, token_type=0, token_value=b"secret")
    config = SessionConfig(path="/kvsp", authority="localhost:4443", authorization_tokens=(token,))
    pair = Pair(backend, cert_pair, client_config=config)
    params = one(pair.server_events, SetupComplete).parameters
    assert (params.path, params.authority) == ("/kvsp", "localhost:4443")
    assert params.authorization_tokens == (token,)


def test_unknown_setup_parameters_are_ignored(cert_pair: tuple[Path, Path]) -> None:
    pair = Pair(get_backend("aioquic"), cert_pair, raw_client=True)
    params = SetupParameters(max_request_id=10, unknown=((0x40B5A, 1), (0x3F, b"grease")))
    pair.send_raw(ClientSetup(parameters=params).encode())
    setup = one(pair.server_events, SetupComplete)
    assert setup.parameters.unknown == ((0x3F, b"grease"), (0x40B5A, 1))
    assert pair.server.closed is None
    replies = [e for e in pair.raw_client_events if type(e).__name__ == "StreamDataReceived"]
    assert replies and bytes(replies[0].data)[0] == 0x21  # SERVER_SETUP


# --- subscribe -----------------------------------------------------------------------------------


def test_subscribe_objects_with_layer_digests_then_publish_done(pair: Pair) -> None:
    rid = pair.c.subscribe(NS, TRACK)
    pair.pump()
    received = one(pair.server_events, SubscribeReceived)
    assert (received.request_id, received.message.track_name) == (rid, TRACK)
    alias = pair.server.subscribe_ok(rid)
    pair.pump()
    assert one(pair.client_events, SubscribeOkReceived).message.track_alias == alias

    payloads = layers(4)
    stream_id = pair.server.open_subgroup(rid, 0, end_of_group=True)
    for index, payload in enumerate(payloads):
        digest = hashlib.sha256(payload).digest()
        extension = layer_digest_extension(digest)
        last = index == len(payloads) - 1
        pair.server.send_object(
            stream_id, index, memoryview(payload), extensions=[extension], end_stream=last
        )
    pair.pump()
    pair.server.publish_done(rid, PublishDoneCode.TRACK_ENDED)
    pair.pump()

    opened = one(pair.client_events, SubgroupStreamOpened)
    assert (opened.request_id, opened.header.track_alias) == (rid, alias)
    assert opened.header.end_of_group
    headers = of_type(pair.client_events, ObjectHeader)
    assert [h.object_id for h in headers] == [0, 1, 2, 3]
    for header, payload in zip(headers, payloads, strict=True):
        assert find_layer_digest(header.object.extensions) == hashlib.sha256(payload).digest()
    assert collect_objects(pair.client_events, rid) == dict(enumerate(payloads))
    assert one(pair.client_events, DataStreamFinished).request_id == rid
    done = one(pair.client_events, PublishDoneReceived)
    assert (done.message.status_code, done.message.stream_count) == (PublishDoneCode.TRACK_ENDED, 1)
    assert rid not in pair.c.requests and rid not in pair.server.requests


def test_subscribe_refused_with_request_error(pair: Pair) -> None:
    rid = pair.c.subscribe(NS, TRACK)
    pair.pump()
    pair.server.request_error(rid, RequestErrorCode.DOES_NOT_EXIST, "no such track")
    pair.pump()
    error = one(pair.client_events, RequestErrorReceived)
    assert (error.request_id, error.message.error_code) == (rid, RequestErrorCode.DOES_NOT_EXIST)
    assert error.message.reason == "no such track"
    assert rid not in pair.c.requests
    with pytest.raises(LocalProtocolError):
        pair.server.subscribe_ok(rid)


def test_unsubscribe_reaches_publisher_and_resets_its_streams(pair: Pair) -> None:
    rid = pair.c.subscribe(NS, TRACK)
    pair.pump()
    pair.server.subscribe_ok(rid)
    stream_id = pair.server.open_subgroup(rid, 0)
    pair.pump()
    pair.c.unsubscribe(rid)
    pair.pump()
    assert one(pair.server_events, UnsubscribeReceived).request_id == rid
    assert pair.server.open_data_streams(rid) == []
    with pytest.raises(LocalProtocolError):
        pair.server.send_object(stream_id, 0, b"late")


def test_objects_before_subscribe_ok_are_held_until_the_alias_is_bound(pair: Pair) -> None:
    rid = pair.c.subscribe(NS, TRACK)
    pair.pump()
    writer = SubgroupWriter(SubgroupHeader(track_alias=7, group_id=0, publisher_priority=1))
    data = writer.header_bytes() + writer.object_header(0, 5) + b"early"
    stream_data = pair.c._backend.events.StreamDataReceived(data=data, end_stream=True, stream_id=3)
    assert pair.c.handle_event(stream_data) == []
    pair.server.subscribe_ok(rid, track_alias=7)
    pair.pump()
    ok_index = pair.client_events.index(one(pair.client_events, SubscribeOkReceived))
    opened = one(pair.client_events, SubgroupStreamOpened)
    assert pair.client_events.index(opened) > ok_index
    assert collect_objects(pair.client_events, rid) == {0: b"early"}


def test_malformed_track_cancels_the_subscription(pair: Pair) -> None:
    rid = pair.c.subscribe(NS, TRACK)
    pair.pump()
    pair.server.subscribe_ok(rid)
    stream_id = pair.server.open_subgroup(rid, 0)
    immutable = (ExtensionType.IMMUTABLE_EXTENSIONS, encode_kvps([(0x4B57, b"x" * 32)]))
    pair.server.send_object(stream_id, 0, b"abc", extensions=[immutable, immutable])
    pair.pump()
    detected = one(pair.client_events, MalformedTrackDetected)
    assert detected.request_id == rid
    assert one(pair.server_events, UnsubscribeReceived).request_id == rid
    assert pair.c.closed is None


def test_datagram_objects(pair: Pair) -> None:
    rid = pair.c.subscribe(NS, TRACK)
    pair.pump()
    pair.server.subscribe_ok(rid)
    pair.pump()
    pair.server.send_datagram(rid, 3, 1, b"tiny object")
    pair.pump()
    datagram = one(pair.client_events, DatagramReceived)
    assert datagram.request_id == rid
    assert (datagram.datagram.group_id, datagram.datagram.object_id) == (3, 1)
    assert bytes(datagram.datagram.payload) == b"tiny object"


# --- fetch ---------------------------------------------------------------------------------------


def serve_fetch(pair: Pair, rid: int, first: int, last: int, payloads: list[bytes]) -> None:
    pair.server.fetch_ok(rid, end_location=Location(0, last))
    stream_id = pair.server.open_fetch_stream(rid)
    for index in range(first, last + 1):
        extension = layer_digest_extension(hashlib.sha256(payloads[index]).digest())
        pair.server.send_fetch_object(
            stream_id,
            group_id=0,
            object_id=index,
            payload=payloads[index],
            extensions=[extension],
            end_stream=index == last,
        )
    pair.pump()


def test_standalone_fetch_of_a_layer_range(pair: Pair) -> None:
    payloads = layers(6)
    rid = pair.c.fetch(NS, TRACK, Location(0, 2), Location(0, 5))  # layers 2..4
    pair.pump()
    received = one(pair.server_events, FetchReceived)
    target = received.message.target
    assert isinstance(target, StandaloneFetch)
    assert (target.start, target.end) == (Location(0, 2), Location(0, 5))
    assert received.joined is None
    serve_fetch(pair, rid, target.start.object, target.end.object - 1, payloads)
    assert one(pair.client_events, FetchOkReceived).message.end_location == Location(0, 4)
    assert one(pair.client_events, FetchStreamOpened).request_id == rid
    objects = collect_objects(pair.client_events, rid)
    assert objects == {i: payloads[i] for i in (2, 3, 4)}
    for header in of_type(pair.client_events, ObjectHeader):
        assert header.track_alias is None
        digest = find_layer_digest(header.object.extensions)
        assert digest == hashlib.sha256(objects[header.object_id]).digest()
    assert one(pair.client_events, DataStreamFinished).request_id == rid
    assert rid not in pair.c.requests and rid not in pair.server.requests


def test_joining_fetch_names_the_subscription(pair: Pair) -> None:
    sub = pair.c.subscribe(NS, TRACK)
    pair.pump()
    pair.server.subscribe_ok(sub)
    pair.pump()
    rid = pair.c.joining_fetch(sub, 0)
    pair.pump()
    received = one(pair.server_events, FetchReceived)
    assert isinstance(received.message.target, JoiningFetch)
    assert isinstance(received.joined, Subscribe)
    assert received.joined.track_name == TRACK
    serve_fetch(pair, rid, 0, 1, layers(2))
    assert collect_objects(pair.client_events, rid) == dict(enumerate(layers(2)))


def test_joining_fetch_of_an_unknown_subscription_is_refused(cert_pair: tuple[Path, Path]) -> None:
    pair = Pair(get_backend("aioquic"), cert_pair)
    target = JoiningFetch(joining_request_id=40, joining_start=0)
    rid = pair.c.requests.ids.allocate()
    pair.send_raw(Fetch(request_id=rid, target=target).encode())
    assert of_type(pair.server_events, FetchReceived) == []
    assert pair.server.closed is None
    assert rid not in pair.server.requests


def test_fetch_cancel(pair: Pair) -> None:
    rid = pair.c.fetch(NS, TRACK, Location(0, 0), Location(0, 2))
    pair.pump()
    pair.server.fetch_ok(rid, end_location=Location(0, 1))
    stream_id = pair.server.open_fetch_stream(rid)
    pair.c.fetch_cancel(rid)
    pair.pump()
    assert rid not in pair.server.requests
    with pytest.raises(LocalProtocolError):
        pair.server.send_fetch_object(stream_id, group_id=0, object_id=0, payload=b"late")
    assert pair.c.closed is None and pair.server.closed is None


# --- namespaces, track status, goaway ------------------------------------------------------------


def test_publish_namespace_then_done(pair: Pair) -> None:
    rid = pair.c.publish_namespace(NS[:4])
    pair.pump()
    assert one(pair.server_events, PublishNamespaceReceived).message.track_namespace == NS[:4]
    pair.server.request_ok(rid)
    pair.pump()
    assert one(pair.client_events, RequestOkReceived).request_id == rid
    pair.c.publish_namespace_done(rid)
    pair.pump()
    done = one(pair.server_events, PublishNamespaceDoneReceived)
    assert (done.request_id, done.track_namespace) == (rid, NS[:4])


def test_subscribe_namespace_on_its_own_stream(pair: Pair) -> None:
    rid = pair.c.subscribe_namespace(NS[:2])
    pair.pump()
    received = one(pair.server_events, SubscribeNamespaceReceived)
    assert received.message.track_namespace_prefix == NS[:2]
    pair.server.request_ok(rid)
    pair.server.namespace(rid, NS[2:4])
    pair.pump()
    assert one(pair.client_events, RequestOkReceived).request_id == rid
    assert one(pair.client_events, NamespaceReceived).suffix == NS[2:4]
    pair.c.unsubscribe_namespace(rid)
    pair.pump()
    assert one(pair.server_events, SubscribeNamespaceEnded).request_id == rid
    assert rid not in pair.server.requests
    assert pair.c.closed is None and pair.server.closed is None


def test_track_status_answered_with_request_ok(pair: Pair) -> None:
    rid = pair.c.track_status(NS, TRACK)
    pair.pump()
    assert one(pair.server_events, TrackStatusReceived).request_id == rid
    pair.server.request_ok(rid, parameters=MessageParameters(largest_object=Location(0, 31)))
    pair.pump()
    ok = one(pair.client_events, RequestOkReceived)
    assert ok.message.parameters.largest_object == Location(0, 31)


def test_goaway_stops_new_requests(pair: Pair) -> None:
    pair.server.goaway("moqt://elsewhere:4443/kvsp")
    pair.pump()
    assert one(pair.client_events, GoawayReceived).new_session_uri == "moqt://elsewhere:4443/kvsp"
    with pytest.raises(LocalProtocolError):
        pair.c.subscribe(NS, TRACK)


def test_client_goaway_with_uri_closes_the_session(cert_pair: tuple[Path, Path]) -> None:
    pair = Pair(get_backend("aioquic"), cert_pair)
    pair.c._send_control(Goaway(new_session_uri="moqt://x"))
    pair.pump()
    closed = one(pair.server_events, SessionClosed)
    assert (closed.error_code, closed.by_peer) == (SessionError.PROTOCOL_VIOLATION, False)


# --- request IDs and violations ------------------------------------------------------------------


def test_request_ids_grow_by_two_and_grants_follow(cert_pair: tuple[Path, Path]) -> None:
    config = SessionConfig(max_requests=2)
    pair = Pair(get_backend("aioquic"), cert_pair, server_config=config)
    rids = []
    for _ in range(5):
        rids.append(pair.c.track_status(NS, TRACK))
        pair.pump()
    assert rids == [0, 2, 4, 6, 8]
    assert of_type(pair.client_events, MaxRequestIdReceived)
    assert pair.server.closed is None


def test_requests_blocked_at_the_peer_limit(cert_pair: tuple[Path, Path]) -> None:
    config = SessionConfig(max_requests=1, auto_grant=False)
    pair = Pair(get_backend("aioquic"), cert_pair, server_config=config)
    pair.c.subscribe(NS, TRACK)
    with pytest.raises(RequestsBlockedError) as info:
        pair.c.subscribe(NS, TRACK)
    assert info.value.maximum_request_id == 2
    pair.pump()
    assert one(pair.server_events, RequestsBlockedReceived).maximum_request_id == 2


def test_request_beyond_max_request_id_is_too_many_requests(cert_pair: tuple[Path, Path]) -> None:
    config = SessionConfig(max_requests=1, auto_grant=False)
    pair = Pair(get_backend("aioquic"), cert_pair, server_config=config)
    pair.c.subscribe(NS, TRACK)
    pair.c._send_control(Subscribe(request_id=2, track_namespace=NS, track_name=TRACK))
    pair.pump()
    closed = one(pair.server_events, SessionClosed)
    assert closed.error_code == SessionError.TOO_MANY_REQUESTS
    pair.settle_close()
    peer_view = one(pair.client_events, SessionClosed)
    assert (peer_view.error_code, peer_view.by_peer) == (SessionError.TOO_MANY_REQUESTS, True)


@pytest.mark.parametrize("request_id", [1, 4], ids=["wrong-parity", "out-of-sequence"])
def test_bad_request_id_is_invalid_request_id(
    cert_pair: tuple[Path, Path], request_id: int
) -> None:
    pair = Pair(get_backend("aioquic"), cert_pair)
    pair.c._send_control(Subscribe(request_id=request_id, track_namespace=NS, track_name=TRACK))
    pair.pump()
    assert one(pair.server_events, SessionClosed).error_code == SessionError.INVALID_REQUEST_ID
    pair.settle_close()
    assert one(pair.client_events, SessionClosed).error_code == SessionError.INVALID_REQUEST_ID


@pytest.mark.parametrize(
    "garbage",
    [b"\x3f\x00\x00", b"\x03\x00\x02\xff\xff", b"\x20\x00\x00"],
    ids=["unknown-type", "short-payload", "second-setup"],
)
def test_garbage_on_the_control_stream_is_a_protocol_violation(
    cert_pair: tuple[Path, Path], garbage: bytes
) -> None:
    pair = Pair(get_backend("aioquic"), cert_pair)
    pair.cq.send_stream_data(0, garbage)
    pair.pump()
    assert one(pair.server_events, SessionClosed).error_code == SessionError.PROTOCOL_VIOLATION


def test_closing_the_control_stream_is_a_protocol_violation(cert_pair: tuple[Path, Path]) -> None:
    pair = Pair(get_backend("aioquic"), cert_pair)
    pair.cq.send_stream_data(0, b"", end_stream=True)
    pair.pump()
    assert one(pair.server_events, SessionClosed).error_code == SessionError.PROTOCOL_VIOLATION


def test_duplicate_track_alias_closes_the_session(pair: Pair) -> None:
    first = pair.c.subscribe(NS, TRACK)
    second = pair.c.subscribe(NS, b"other")
    pair.pump()
    pair.server.subscribe_ok(first, track_alias=5)
    pair.server._send_control(SubscribeOk(request_id=second, track_alias=5))
    pair.pump()
    assert one(pair.client_events, SessionClosed).error_code == SessionError.DUPLICATE_TRACK_ALIAS


def test_status_object_ends_the_group(pair: Pair) -> None:
    rid = pair.c.subscribe(NS, TRACK)
    pair.pump()
    pair.server.subscribe_ok(rid)
    stream_id = pair.server.open_subgroup(rid, 0, extensions=False)
    pair.server.send_object(stream_id, 0, b"x")
    pair.server.begin_object(stream_id, 1, 0, status=ObjectStatus.END_OF_GROUP)
    pair.server.finish_stream(stream_id)
    pair.pump()
    statuses = [h.object.status for h in of_type(pair.client_events, ObjectHeader)]
    assert statuses == [ObjectStatus.NORMAL, ObjectStatus.END_OF_GROUP]


def test_publish_flow_routes_objects_to_the_publish_request(pair: Pair) -> None:
    rid = pair.c.publish(NS, TRACK)
    pair.pump()
    received = one(pair.server_events, PublishReceived)
    assert (received.request_id, received.message.track_name) == (rid, TRACK)
    pair.server.publish_ok(rid)
    stream_id = pair.c.open_subgroup(rid, 0)
    pair.c.send_object(stream_id, 0, b"layer zero", end_stream=True)
    pair.pump()
    assert one(pair.client_events, PublishOkReceived).request_id == rid
    assert collect_objects(pair.server_events, rid) == {0: b"layer zero"}
    pair.c.publish_done(rid, PublishDoneCode.TRACK_ENDED)
    pair.pump()
    assert one(pair.server_events, PublishDoneReceived).message.stream_count == 1
    assert rid not in pair.server.requests


def test_stream_limit_raises_before_the_stream_is_used(cert_pair: tuple[Path, Path]) -> None:
    if "qh3" not in available_backends():
        pytest.skip("qh3 (extra quic-fast) not installed")
    pair = Pair(get_backend("qh3"), cert_pair)
    rid = pair.c.subscribe(NS, TRACK)
    pair.pump()
    pair.server.subscribe_ok(rid)
    opened = []
    with pytest.raises(StreamsBlockedError):
        for group in range(1000):
            opened.append(pair.server.open_subgroup(rid, group))
    assert not pair.server.can_open_data_stream()
    for stream_id in opened:
        pair.server.finish_stream(stream_id)
    pair.pump()
    assert pair.server.can_open_data_stream()
    pair.server.open_subgroup(rid, 1000)
    pair.pump()
    assert len(of_type(pair.client_events, SubgroupStreamOpened)) == len(opened) + 1
    assert pair.server.closed is None and pair.c.closed is None


def test_a_request_that_does_not_encode_uses_no_request_id(pair: Pair) -> None:
    with pytest.raises(ValueError):
        pair.c.subscribe((b"",), TRACK)  # §2.4.1: an empty namespace field
    assert pair.c.subscribe(NS, TRACK) == 0
    pair.pump()
    assert one(pair.server_events, SubscribeReceived).request_id == 0
    assert pair.server.closed is None


# --- track sinks ---------------------------------------------------------------------------------


class RecordingSink:
    """A TrackSink that keeps what it was handed, payload pieces as bytes."""

    def __init__(self) -> None:
        self.events: list[MOQTEvent] = []
        self.payload: list[tuple[int, bytes, int]] = []

    def on_event(self, event: MOQTEvent) -> None:
        self.events.append(event)

    def on_payload(self, stream_id: int, data: memoryview, offset: int) -> None:
        assert isinstance(data, memoryview)
        self.payload.append((stream_id, bytes(data), offset))


def test_a_track_sink_gets_the_data_events_and_payload_without_object_data(pair: Pair) -> None:
    rid = pair.c.subscribe(NS, TRACK)
    sink = RecordingSink()
    pair.c.set_track_sink(rid, sink)
    pair.pump()
    pair.server.subscribe_ok(rid)
    stream_id = pair.server.open_subgroup(rid, 0, end_of_group=True)
    big = b"K" * 40_000 + b"V" * 40_000
    pair.server.send_object(stream_id, 0, big)
    pair.server.send_object(stream_id, 1, b"small", end_stream=True)
    pair.pump()
    assert of_type(pair.client_events, ObjectData) == []
    kinds = [type(event) for event in sink.events]
    objects = [ObjectHeader, ObjectEnd] * 2
    assert kinds == [SubgroupStreamOpened, *objects, DataStreamFinished]
    first = b"".join(data for _, data, _ in sink.payload[:-1])
    assert first == big and sink.payload[-1] == (stream_id, b"small", 0)
    offsets = [offset for _, _, offset in sink.payload[:-1]]
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_a_track_sink_gets_datagrams_and_the_malformed_track(pair: Pair) -> None:
    rid = pair.c.subscribe(NS, TRACK)
    sink = RecordingSink()
    pair.c.set_track_sink(rid, sink)
    pair.pump()
    pair.server.subscribe_ok(rid)
    pair.pump()
    pair.server.send_datagram(rid, 0, 0, b"dgram")
    stream_id = pair.server.open_subgroup(rid, 1)
    immutable = (ExtensionType.IMMUTABLE_EXTENSIONS, encode_kvps([(0x4B57, b"x" * 32)]))
    pair.server.send_object(stream_id, 0, b"abc", extensions=[immutable, immutable])
    pair.pump()
    datagram = next(e for e in sink.events if isinstance(e, DatagramReceived))
    assert bytes(datagram.datagram.payload) == b"dgram"
    kinds = [type(event) for event in sink.events]
    assert kinds[-2:] == [MalformedTrackDetected, DataStreamReset]  # the publisher's reset too
    assert of_type(pair.client_events, DatagramReceived) == []
    assert of_type(pair.client_events, MalformedTrackDetected) == []
    assert of_type(pair.client_events, DataStreamReset) == []


def watch_crossings(monkeypatch: pytest.MonkeyPatch) -> tuple[list[bool], list[str]]:
    """Record each :meth:`DataStreamParser.cross_boundary` call: whether it took the piece,
    and the name of each error it raised."""
    took: list[bool] = []
    raised: list[str] = []
    cross = DataStreamParser.cross_boundary

    def spy(parser: DataStreamParser, view: memoryview) -> Any:
        try:
            crossing = cross(parser, view)
        except Exception as exc:
            raised.append(type(exc).__name__)
            raise
        took.append(crossing is not None)
        return crossing

    monkeypatch.setattr(DataStreamParser, "cross_boundary", spy)
    return took, raised


def test_a_sink_sees_objects_crossing_packets_as_the_event_path_does(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    crossed, _ = watch_crossings(monkeypatch)
    payloads = layers(12, 900)  # smaller than a datagram: most packets end one, start another
    rid = pair.c.fetch(NS, TRACK, Location(0, 0), Location(0, 12))
    sink = RecordingSink()
    pair.c.set_track_sink(rid, sink)
    pair.pump()
    before = pair.c.payload_octets_received
    serve_fetch(pair, rid, 0, 11, payloads)
    assert any(crossed), "no packet took the boundary path"
    bounds = [
        (type(event).__name__, event.object_id)
        for event in sink.events
        if isinstance(event, ObjectHeader | ObjectEnd)
    ]
    assert bounds == [(kind, i) for i in range(12) for kind in ("ObjectHeader", "ObjectEnd")]
    headers = [event for event in sink.events if isinstance(event, ObjectHeader)]
    assert [h.object.extensions for h in headers] == [
        (layer_digest_extension(hashlib.sha256(payload).digest()),) for payload in payloads
    ]
    objects: dict[int, bytearray] = {}
    current = -1
    pieces = iter(sink.payload)
    for event in sink.events:  # payload pieces fall between each object's header and end
        if isinstance(event, ObjectHeader):
            current, objects[event.object_id] = event.object_id, bytearray()
        elif isinstance(event, ObjectEnd):
            while len(objects[current]) < len(payloads[current]):
                _, data, offset = next(pieces)
                assert offset == len(objects[current])
                objects[current] += data
    assert [bytes(objects[i]) for i in range(12)] == payloads
    assert next(pieces, None) is None
    assert pair.c.payload_octets_received - before == sum(map(len, payloads))
    assert type(sink.events[-1]) is DataStreamFinished


def test_a_malformed_header_after_a_boundary_still_marks_the_track(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, raised = watch_crossings(monkeypatch)
    rid = pair.c.fetch(NS, TRACK, Location(0, 0), Location(0, 2))
    sink = RecordingSink()
    pair.c.set_track_sink(rid, sink)
    pair.pump()
    pair.server.fetch_ok(rid, end_location=Location(0, 1))
    stream_id = pair.server.open_fetch_stream(rid)
    # object 0 outlasts the first datagram, so the next one holds its end and object 1's header
    pair.server.send_fetch_object(stream_id, group_id=0, object_id=0, payload=b"a" * 1500)
    immutable = (ExtensionType.IMMUTABLE_EXTENSIONS, encode_kvps([(0x4B57, b"x" * 32)]))
    pair.server.send_fetch_object(
        stream_id, group_id=0, object_id=1, payload=b"b" * 300, extensions=[immutable] * 2
    )
    pair.pump()
    assert raised == ["MalformedTrack"]  # found on the boundary path, then by feed again
    kinds = [type(event) for event in sink.events]
    assert kinds[:2] == [FetchStreamOpened, ObjectHeader] and MalformedTrackDetected in kinds
    got = b"".join(data for _, data, _ in sink.payload)
    assert len(got) < 1500 and got == b"a" * len(got)  # the piece ending it went with the track
    assert ObjectEnd not in kinds
    assert pair.c.closed is None  # a malformed track, not a session error


def test_removing_the_sink_returns_events_again(pair: Pair) -> None:
    rid = pair.c.fetch(NS, TRACK, Location(0, 0), Location(0, 2))
    sink = RecordingSink()
    pair.c.set_track_sink(rid, sink)
    pair.c.set_track_sink(rid, None)
    pair.pump()
    serve_fetch(pair, rid, 0, 1, layers(2, 1000))
    assert sink.events == [] and sink.payload == []
    assert of_type(pair.client_events, FetchStreamOpened)[0].request_id == rid
    assert collect_objects(pair.client_events, rid) == dict(enumerate(layers(2, 1000)))


def routed_objects(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the object events that went through the session's general dispatch
    (:meth:`DataPlane._route`) rather than straight to a track's sink."""
    from moqt.objects import ObjectChunk, ObjectStart
    from moqt.objects import ObjectEnd as ParsedEnd
    from moqt.session_data import DataPlane

    routed: list[str] = []
    route = DataPlane._route

    def spy(plane: DataPlane, stream_id: int, stream: Any, event: Any, out: Any) -> None:
        if isinstance(event, ObjectStart | ObjectChunk | ParsedEnd):
            routed.append(type(event).__name__)
        route(plane, stream_id, stream, event, out)

    monkeypatch.setattr(DataPlane, "_route", spy)
    return routed


@pytest.mark.parametrize("size", [40, 700])  # whole objects, and one cut by the piece's end
def test_objects_in_the_piece_that_opens_a_fetch_stream_go_straight_to_the_sink(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    routed = routed_objects(monkeypatch)
    payloads = layers(12, size)
    rid = pair.c.fetch(NS, TRACK, Location(0, 0), Location(0, 12))
    sink = RecordingSink()
    pair.c.set_track_sink(rid, sink)
    pair.pump()
    before = pair.c.payload_octets_received
    serve_fetch(pair, rid, 0, 11, payloads)
    assert routed == []  # the FETCH_HEADER bound the stream; its piece's objects followed it
    kinds = [type(event) for event in sink.events]
    assert kinds == [FetchStreamOpened, *[ObjectHeader, ObjectEnd] * 12, DataStreamFinished]
    assert [e.object_id for e in sink.events if isinstance(e, ObjectEnd)] == list(range(12))
    pieces = iter(sink.payload)
    for index, payload in enumerate(payloads):  # each object's pieces, in order, whole
        got = bytearray()
        while len(got) < len(payload):
            _, data, offset = next(pieces)
            assert offset == len(got), f"object {index}"
            got += data
        assert bytes(got) == payload
    assert next(pieces, None) is None
    assert pair.c.payload_octets_received - before == sum(map(len, payloads))
    assert of_type(pair.client_events, ObjectHeader) == []


class RunSinkRecording(RecordingSink):
    """A RunSink that takes runs of whole objects (``take``) or declines them."""

    def __init__(self, take: bool) -> None:
        super().__init__()
        self.take = take
        self.runs: list[tuple[int, ObjectRun]] = []

    def on_run(self, stream_id: int, run: ObjectRun) -> bool:
        if self.take:
            self.runs.append((stream_id, run))
        return self.take


def sink_view(sink: RecordingSink) -> list[Any]:
    """What a sink was handed, in order, each run as the events and pieces it stands for."""
    # the relative order of events and pieces is checked by test_objects_in_the_piece_...;
    # here: the objects' fields, payloads and ends, and the other events
    objects: list[Any] = []
    runs = getattr(sink, "runs", [])
    for _, run in runs:
        for group, subgroup, object_id, priority, extensions, start, length in run.objects:
            payload = bytes(run.data[start : start + length])
            objects.append((group, subgroup, object_id, priority, extensions, payload))
    payload = iter(sink.payload)
    for event in sink.events:
        if isinstance(event, ObjectHeader):
            got = bytearray()
            while len(got) < event.object.payload_length:
                got += next(payload)[1]
            start = event.object
            objects.append(
                (start.group_id, start.subgroup_id, start.object_id, start.publisher_priority,
                 start.extensions, bytes(got))
            )  # fmt: skip
    others = [type(e) for e in sink.events if not isinstance(e, ObjectHeader | ObjectEnd)]
    return [sorted(objects, key=lambda item: item[2]), others]


@pytest.mark.parametrize("size", [40, 700, 5000])
def test_a_run_sink_gets_the_whole_objects_of_a_piece_in_one_call(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    routed = routed_objects(monkeypatch)
    payloads = layers(12, size)
    seen = []
    for sink in (RecordingSink(), RunSinkRecording(take=False), RunSinkRecording(take=True)):
        rid = pair.c.fetch(NS, TRACK, Location(0, 0), Location(0, 12))
        pair.c.set_track_sink(rid, sink)
        pair.pump()
        pair.server_events.clear()
        before = pair.c.payload_octets_received
        serve_fetch(pair, rid, 0, 11, payloads)
        assert pair.c.payload_octets_received - before == sum(map(len, payloads))
        seen.append(sink_view(sink))
    assert routed == []
    assert seen[0] == seen[1] == seen[2]
    assert [item[5] for item in seen[2][0]] == payloads
    assert seen[2][1] == [FetchStreamOpened, DataStreamFinished]
    taking = sink
    assert isinstance(taking, RunSinkRecording)
    if size == 40:  # small objects: every one whole in the piece that opened the stream
        assert len(taking.runs) == 1 and not taking.payload
        assert [type(e) for e in taking.events] == [FetchStreamOpened, DataStreamFinished]
    elif size == 5000:  # each cut by a packet's end: no run
        assert taking.runs == []
    # RunSink is a protocol a TrackReader meets, and a plain sink does not
    assert isinstance(taking, RunSink) and not isinstance(RecordingSink(), RunSink)


def test_objects_in_the_piece_that_opens_a_subgroup_go_straight_to_the_sink(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    routed = routed_objects(monkeypatch)
    rid = pair.c.subscribe(NS, TRACK)
    sink = RecordingSink()
    pair.c.set_track_sink(rid, sink)
    pair.pump()
    pair.server.subscribe_ok(rid)
    pair.pump()
    stream_id = pair.server.open_subgroup(rid, 0, end_of_group=True)
    for index in range(5):
        pair.server.send_object(stream_id, index, b"%d" % index * 30, end_stream=index == 4)
    pair.pump()
    assert routed == []
    kinds = [type(event) for event in sink.events]
    assert kinds == [SubgroupStreamOpened, *[ObjectHeader, ObjectEnd] * 5, DataStreamFinished]
    assert [data for _, data, _ in sink.payload] == [b"%d" % i * 30 for i in range(5)]
