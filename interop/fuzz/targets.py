"""Fuzz targets for KVSP's parsers (spec §4.3 container, §4.4 records, MOQT draft-16 §9–§10,
and a MOQT session over QMux, draft-ietf-quic-qmux-01).

Each target takes arbitrary octets and either returns or raises the library's own protocol
error: :class:`~kvsp.errors.KVSPError` for KVSP, :class:`~moqt.errors.MOQTError` for MOQT.
Anything else (IndexError, KeyError, struct.error, OverflowError, UnicodeDecodeError,
RecursionError, MemoryError, an AssertionError from a cross-check) is a finding. Targets also
cross-check what they parse: the whole-input and the incremental parsers must agree (fed whole,
one octet at a time, and in uneven chunks), and whatever is accepted must encode again and
parse to the same value.

The targets are plain functions, shared by the hand-run harness beside this file
(``atheris_fuzz.py TARGET``) and by the test suite (``tests/fuzz``), so the code a campaign
exercises is the code CI checks.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from kvsp.compat import CompatibilityDescriptor
from kvsp.container import ContainerLimits, Geometry, decode_container, encode_container
from kvsp.container_reader import ContainerReader
from kvsp.errors import KVSPError
from kvsp.moqt_mapping import decode_moqt_namespace, layer_digest_extension
from kvsp.placement_plan import DirectiveOptions
from kvsp.records import (
    DirectiveBlock,
    DirectiveStatus,
    InstanceStatusRecord,
    LeaseGrant,
    LeaseRenewal,
    LeaseRequest,
    Link,
    LookupRequest,
    LookupResponse,
    PlaceRequest,
    PlaceResponse,
    PrefetchDirective,
    ReplicaRecord,
    ReshardAbort,
    ReshardCommit,
    ReshardFetch,
    ReshardPlan,
    Residency,
    ResumeRequest,
    Sampler,
    SessionCheckpoint,
    Shard,
    ShardMap,
    StateAnswer,
    TargetEstimate,
    dumps,
    loads,
    parse_reshard_message,
)
from kvsp.services.instance import GenerateRequest
from kvsp.web.http import parse_json
from moqt.errors import MOQTError
from moqt.messages import (
    AuthToken,
    ClientSetup,
    ControlMessage,
    ControlMessageParser,
    Fetch,
    FetchOk,
    MessageParameters,
    Publish,
    PublishDone,
    PublishNamespace,
    RequestError,
    ServerSetup,
    SetupParameters,
    StandaloneFetch,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    TokenAliasType,
    decode_control_message,
)
from moqt.objects import (
    DataStreamParser,
    FetchStreamWriter,
    ObjectChunk,
    ObjectDatagram,
    ObjectRun,
    ObjectStatus,
    SubgroupHeader,
    SubgroupWriter,
)
from moqt.qmux import QMUX_BACKEND, QMuxConfig, QMuxConnection
from moqt.qmux_events import ConnectionTerminated, StreamDataReceived
from moqt.session import MOQTSession
from moqt.session_events import FetchReceived, PublishReceived
from moqt.wire import Location, decode_varint

Target = Callable[[bytes], None]

# --- helpers -----------------------------------------------------------------------------------


def chunk_sizes(data: bytes) -> list[int]:
    """Uneven chunk sizes for ``data``, derived from its hash (deterministic per input)."""
    rng = random.Random(hashlib.sha256(data).digest())
    return [rng.choice((1, 2, 3, 7, 16, 61, 256)) for _ in range(64)]


def chunks(data: bytes, sizes: Sequence[int] | None) -> list[bytes]:
    """``data`` cut whole (``None``), or by ``sizes`` cycled to the end."""
    if sizes is None:
        return [data]
    out, pos, i = [], 0, 0
    while pos < len(data):
        size = sizes[i % len(sizes)]
        out.append(data[pos : pos + size])
        pos += size
        i += 1
    return out


FEEDINGS: tuple[str, ...] = ("whole", "bytes", "uneven")


def feeding(data: bytes, how: str) -> list[bytes]:
    """``data`` cut as ``how`` says: ``whole``, one octet at a time (``bytes``), ``uneven``."""
    if how == "whole":
        return chunks(data, None)
    if how == "bytes":
        return chunks(data, [1])
    return chunks(data, chunk_sizes(data))


# --- KVB1 container (§4.3) ---------------------------------------------------------------------

GEOMETRY = Geometry(layers=4, kv_heads=1, head_dim=2, element_size=2)
"""The geometry the container seeds are built for (fp16, one KV head of dimension 2)."""
SMALL_LIMITS = ContainerLimits(max_layer_count=64, max_total_bytes=1 << 20)
"""Tight limits so that declared sizes are checked, not just the defaults."""


def container_seeds() -> list[bytes]:
    """Valid containers: all layers, a sub-range, one layer, a token count of 3."""
    seeds = []
    for first, count, tokens in ((0, 4, 2), (1, 2, 2), (3, 1, 1), (0, 3, 3)):
        section = GEOMETRY.section_length(tokens)
        layers = [
            (bytes((i * 7 + j) & 0xFF for j in range(section)), bytes([i]) * section)
            for i in range(first, first + count)
        ]
        seeds.append(
            encode_container(layers, first_layer=first, token_count=tokens, geometry=GEOMETRY)
        )
    return seeds


def _read_incrementally(
    data: bytes, how: str, geometry: Geometry | None, limits: ContainerLimits
) -> list[tuple[int, bytes, bytes]]:
    reader = ContainerReader(geometry, limits=limits, compute_digests=True)
    layers = []
    for piece in feeding(data, how):
        layers += reader.feed(piece)
    reader.close()
    if len(reader.digests) != len(layers):
        raise AssertionError("the reader computed a digest per layer it yielded")
    for layer, digest in zip(layers, reader.digests, strict=True):
        if layer.digest() != digest:
            raise AssertionError(f"layer {layer.index}: running digest differs from its octets")
    if reader.container_digest() != hashlib.sha256(data).digest():
        raise AssertionError("container digest differs from SHA-256 of the octets fed")
    return [(layer.index, bytes(layer.k), bytes(layer.v)) for layer in layers]


def _decode_whole(
    data: bytes, geometry: Geometry | None, limits: ContainerLimits
) -> list[tuple[int, bytes, bytes]]:
    container = decode_container(data, geometry, limits=limits)
    again = container.encode()
    if again != data:
        raise AssertionError("a decoded container encodes to other octets")
    return [(layer.index, bytes(layer.k), bytes(layer.v)) for layer in container.layers]


def _outcome(parse: Callable[[], Any], allowed: type[Exception]) -> tuple[str, Any]:
    try:
        return "ok", parse()
    except allowed as exc:
        return "error", type(exc).__name__


def container_target(data: bytes) -> None:
    """Decode ``data`` whole and incrementally, with and without a geometry; all must agree.

    Raises:
        KVSPError: never (it is caught and compared); anything else is a finding.
        AssertionError: two parsers disagree, or a parsed container does not round-trip.
    """
    for geometry, limits in ((None, SMALL_LIMITS), (GEOMETRY, SMALL_LIMITS)):
        whole = _outcome(partial(_decode_whole, data, geometry, limits), KVSPError)
        for how in FEEDINGS:
            got = _outcome(partial(_read_incrementally, data, how, geometry, limits), KVSPError)
            if got[0] != whole[0] or (got[0] == "ok" and got != whole):
                raise AssertionError(
                    f"decode_container gave {whole[0]} but the reader fed {how} gave {got[0]}"
                )


# --- JSON records (§4.4 and the message bodies of §6) ------------------------------------------

HEX32 = "9f" * 32
HEX16 = "3c" * 16
_LAYERS = [hashlib.sha256(bytes([i])).hexdigest() for i in range(4)]
_DIGEST = "sha-256:" + hashlib.sha256(b"".join(bytes.fromhex(d) for d in _LAYERS)).hexdigest()
_UUID = "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11"


def _replica() -> dict[str, Any]:
    return {
        "block_key": HEX32,
        "compat_id": "a1" * 32,
        "scope_id": HEX16,
        "holder": "https://h1.example/kvsp/",
        "codec": 1,
        "size": 4096,
        "digest": _DIGEST,
        "layer_digests": list(_LAYERS),
        "residency": [{"tier": "device", "layers": [0, 1]}, {"tier": "host", "layers": [2, 3]}],
        "ttl_ms": 600000,
    }


def _checkpoint() -> dict[str, Any]:
    return {
        "session": _UUID,
        "epoch": 1,
        "compat_id": "a1" * 32,
        "scope_id": HEX16,
        "prompt_blocks": [HEX32],
        "prompt_tail": [374, 264],
        "generated": [1296, 315, 279],
        "output_offset": 3,
        "sampler": {
            "method": "top-p",
            "params": {"p": 0.9},
            "seed": 7,
            "step": 3,
            "deterministic": False,
        },
    }


def record_documents() -> list[Any]:
    """One valid JSON document per record kind (the spec's examples, made concrete)."""
    status = {
        "instance": "https://ii7.example/kvsp/",
        "epoch": 12,
        "state": "active",
        "running": 18,
        "queued": 3,
        "batch_size": 32,
        "kv_utilization": 0.71,
        "prefill_tokens_per_s": 42000,
        "decode_tokens_per_s": 3100,
        "links": [{"holder": "https://h1.example/kvsp/", "mbit_per_s": 200000, "rtt_us": 12}],
        "requested_state": None,
        "ttl_ms": 3000,
    }
    descriptor = {
        "model": "tiny",
        "model_digest": "sha-256:" + "01" * 32,
        "tokenizer_digest": "sha-256:" + "02" * 32,
        "layers": 4,
        "kv_heads": 1,
        "head_dim": 2,
        "kv_dtype": "fp16",
        "positional": "rope;theta=10000",
        "block_tokens": 2,
        "layout": "kvsp-layout-1",
    }
    return [
        _replica(),
        status,
        _checkpoint(),
        {"epoch": 2, "checkpoint": _checkpoint()},
        {
            "scope_id": HEX16,
            "compat_id": "a1" * 32,
            "block_keys": [HEX32, "00" * 32],
            "targets": ["https://ii7.example/kvsp/"],
        },
        {
            "matched": 1,
            "replicas": [[_replica()]],
            "estimates": {"https://ii7.example/kvsp/": {"fetch_us": 120.5, "recompute_us": 9}},
            "hint": "compat_id differs",
        },
        {
            "directive": _UUID,
            "request_ref": "r",
            "scope_id": HEX16,
            "compat_id": "a1" * 32,
            "blocks": [{"block_key": HEX32, "sources": ["https://h1.example/kvsp/"]}],
            "layer_order": "ascending",
            "deadline_ms": 50,
            "lease_ms": 2000,
        },
        {"directive": _UUID, "state": "partial", "loaded": [HEX32], "detail": "deadline"},
        {
            "map": "c3f8e1",
            "version": 4,
            "shards": [
                {"tokens": [0, 32768], "instance": "https://ii1.example/kvsp/"},
                {"tokens": [32768, 65536], "instance": "https://ii2.example/kvsp/"},
            ],
        },
        {
            "map": "c3f8e1",
            "from": 4,
            "to": 5,
            "deadline_ms": 200,
            "retain": [[0, 32768]],
            "fetch": [{"tokens": [32768, 49152], "from": "https://ii2.example/kvsp/"}],
            "release": [],
        },
        {"map": "c3f8e1", "commit": 5},
        {"map": "c3f8e1", "abort": 5},
        {"state": "draining"},
        {"compat_id": "a1" * 32, "scope_id": HEX16, "block_keys": [HEX32], "ttl_ms": 2000},
        {"ttl_ms": 5000},
        {"lease": "l-7f3a", "ttl_ms": 2000, "block_keys": [HEX32]},
        {
            "scope_id": HEX16,
            "compat_id": "a1" * 32,
            "block_keys": [HEX32],
            "prompt_tokens": 40,
            "session": _UUID,
            "request_ref": "r-17",
            "deadline_ms": 40,
            "lease_ms": 100,
        },
        {"instance": "https://ii7.example/kvsp/", "matched": 1, "cost": 1234.5, "directive": _UUID},
        {"prompt": [1, 2, 3], "max_tokens": 4, "scope_id": HEX16, "session": _UUID},
        descriptor,
    ]


def record_seeds() -> list[bytes]:
    """The documents of :func:`record_documents` as compact and as indented JSON octets."""
    docs = record_documents()
    return [json.dumps(d).encode() for d in docs] + [json.dumps(docs[0], indent=1).encode()]


def _estimate(obj: object) -> TargetEstimate:
    return TargetEstimate.from_json(obj, target="https://t.example/")


def _namespace(obj: object) -> Any:
    return decode_moqt_namespace(obj) if isinstance(obj, str) else None


RECORD_PARSERS: tuple[Callable[[object], Any], ...] = (
    ReplicaRecord.from_json,
    Residency.from_json,
    LookupRequest.from_json,
    LookupResponse.from_json,
    InstanceStatusRecord.from_json,
    Link.from_json,
    StateAnswer.from_json,
    DirectiveBlock.from_json,
    PrefetchDirective.from_json,
    DirectiveStatus.from_json,
    LeaseRequest.from_json,
    LeaseRenewal.from_json,
    LeaseGrant.from_json,
    PlaceRequest.from_json,
    PlaceResponse.from_json,
    SessionCheckpoint.from_json,
    Sampler.from_json,
    ResumeRequest.from_json,
    Shard.from_json,
    ShardMap.from_json,
    ReshardFetch.from_json,
    ReshardPlan.from_json,
    ReshardCommit.from_json,
    ReshardAbort.from_json,
    parse_reshard_message,
    CompatibilityDescriptor.from_json,
    GenerateRequest.from_json,
    DirectiveOptions.from_json,
    _estimate,
    _namespace,
)
"""Every ``from_json`` the services apply to request and response bodies."""


def parse_value(value: Any) -> None:
    """Run every record parser on one JSON value; whatever one accepts must round-trip.

    Raises:
        AssertionError: an accepted record whose ``to_json`` does not parse back to it.
    """
    for parse in RECORD_PARSERS:
        try:
            record = parse(value)
        except KVSPError:
            continue
        to_json = getattr(record, "to_json", None)
        if to_json is None:
            continue
        encoded = to_json()
        if type(record).from_json(encoded) != record:
            raise AssertionError(f"{type(record).__name__} does not round-trip")
        if type(record).from_json(loads(dumps(encoded))) != record:
            raise AssertionError(f"{type(record).__name__} does not survive dumps/loads")


def records_target(data: bytes) -> None:
    """Parse ``data`` as JSON with both body readers, then with every record parser.

    Raises:
        AssertionError: a record that does not round-trip, or the two JSON readers disagree on
            a document that has no duplicate member names.
    """
    at_edge = _outcome(lambda: parse_json(data), KVSPError)
    strict = _outcome(lambda: loads(data), KVSPError)
    if strict[0] == "ok":
        if at_edge[0] != "ok":
            raise AssertionError(f"loads accepted what the HTTP edge refused ({at_edge[1]})")
        parse_value(strict[1])
    elif at_edge[0] == "ok":
        parse_value(at_edge[1])


# --- MOQT control messages (§9) ----------------------------------------------------------------

_NS = (b"kvsp", b"1", b"a1" * 16, b"3c" * 8)
_TOKEN = AuthToken(alias_type=TokenAliasType.USE_VALUE, token_type=0, token_value=b"tok-123")


def control_seeds() -> list[bytes]:
    """Encoded control messages of the kinds the relay and clients exchange."""
    with_token = MessageParameters(authorization_tokens=(_TOKEN,))
    messages: list[ControlMessage] = [
        ClientSetup(
            parameters=SetupParameters(
                path="/moq", max_request_id=100, authorization_tokens=(_TOKEN,)
            )
        ),
        ServerSetup(parameters=SetupParameters(max_request_id=64, moqt_implementation="kvsp")),
        Subscribe(request_id=0, track_namespace=_NS, track_name=b"t", parameters=with_token),
        SubscribeOk(request_id=0, track_alias=5, track_extensions=((2, 600),)),
        Fetch(
            request_id=2,
            target=StandaloneFetch(
                track_namespace=_NS,
                track_name=b"f" * 32,
                start=Location(0, 0),
                end=Location(0, 4),
            ),
            parameters=with_token,
        ),
        FetchOk(request_id=2, end_of_track=True, end_location=Location(0, 3)),
        Publish(request_id=4, track_namespace=_NS, track_name=b"live-x", track_alias=9),
        PublishNamespace(request_id=6, track_namespace=_NS[:4]),
        SubscribeNamespace(request_id=8, track_namespace_prefix=(b"kvsp", b"1")),
        RequestError(request_id=10, error_code=1, reason="unauthorized"),
        PublishDone(request_id=4, status_code=2, stream_count=1, reason="done"),
    ]
    encoded = [m.encode() for m in messages]
    return [*encoded, b"".join(encoded[:4])]


def _normal_control(data: bytes, how: str) -> list[ControlMessage]:
    parser = ControlMessageParser()
    got: list[ControlMessage] = []
    for piece in feeding(data, how):
        got += parser.feed(piece)
    got += parser.feed(b"", end_stream=True)
    return got


def control_target(data: bytes) -> None:
    """Parse ``data`` as a control stream three ways, and its tail as one message's payload.

    Raises:
        AssertionError: the feedings disagree, or a decoded message does not round-trip.
    """
    whole = _outcome(lambda: _normal_control(data, "whole"), MOQTError)
    for how in ("bytes", "uneven"):
        got = _outcome(partial(_normal_control, data, how), MOQTError)
        if got != whole:
            raise AssertionError(f"control stream fed {how}: {got[0]}, whole: {whole[0]}")
    if whole[0] == "ok":
        for message in whole[1]:
            _check_message(message)
    if data:
        try:
            msg_type, used = decode_varint(data)
        except MOQTError:
            return
        try:
            message = decode_control_message(msg_type, data[used:])
        except MOQTError:
            return
        _check_message(message)


def _check_message(message: ControlMessage) -> None:
    wire = message.encode()
    again = ControlMessageParser().feed(wire, end_stream=True)
    if len(again) != 1:
        raise AssertionError(f"{type(message).__name__} re-encodes to {len(again)} messages")
    if again[0].encode() != wire:
        raise AssertionError(f"{type(message).__name__} is not stable under re-encoding")


# --- MOQT data streams (§10.4) and datagrams (§10.3) -------------------------------------------


def data_seeds() -> list[bytes]:
    """A subgroup stream of KV layers with digests, a FETCH stream, and datagrams."""
    layers = [bytes([i]) * 24 for i in range(3)]
    header = SubgroupHeader(
        track_alias=7, group_id=0, publisher_priority=128, has_extensions=True, end_of_group=True
    )
    sub = SubgroupWriter(header)
    stream = bytearray(sub.header_bytes())
    for i, payload in enumerate(layers):
        digest = hashlib.sha256(payload).digest()
        ext = (layer_digest_extension(digest),)
        stream += sub.object_header(object_id=i, payload_length=len(payload), extensions=ext)
        stream += payload
    fetch = FetchStreamWriter(request_id=2)
    fstream = bytearray(fetch.header_bytes())
    for i, payload in enumerate(layers):
        fstream += fetch.object_header(
            group_id=0,
            object_id=i,
            subgroup_id=0,
            publisher_priority=128,
            payload_length=len(payload),
        )
        fstream += payload
    fstream += fetch.end_of_range(0, 9)
    datagram = ObjectDatagram(
        track_alias=7,
        group_id=0,
        object_id=2,
        publisher_priority=5,
        extensions=((4, 1),),
        payload=b"payload",
    )
    status = ObjectDatagram(
        track_alias=7,
        group_id=1,
        object_id=0,
        publisher_priority=None,
        status=ObjectStatus.END_OF_GROUP,
    )
    return [bytes(stream), bytes(fstream), datagram.encode(), status.encode()]


def _events(data: bytes, how: str, runs: bool = False) -> list[Any]:
    parser = DataStreamParser()
    events: list[Any] = []
    pieces = feeding(data, how)
    for i, piece in enumerate(pieces):
        events += parser.feed(piece, end_stream=i == len(pieces) - 1, runs=runs)
    if not pieces:
        events += parser.feed(b"", end_stream=True, runs=runs)
    return _join_chunks(events)


def _join_chunks(events: Sequence[Any]) -> list[Any]:
    """Events with each object's payload chunks merged, so that feedings compare equal."""
    out: list[Any] = []
    for event in events:
        if isinstance(event, ObjectRun):  # a run of whole objects: the events it stands for
            out += _join_chunks(event.events())
        elif isinstance(event, ObjectChunk):
            if out and isinstance(out[-1], bytearray):
                out[-1] += event.data
            else:
                out.append(bytearray(event.data))
        else:
            out.append(event)
    return [bytes(e) if isinstance(e, bytearray) else e for e in out]


def data_target(data: bytes) -> None:
    """Parse ``data`` as a data stream three ways, each also with runs of whole FETCH objects
    (``feed(..., runs=True)``), and as one datagram.

    Raises:
        AssertionError: the feedings disagree, or an accepted datagram does not round-trip.
    """
    whole = _outcome(lambda: _events(data, "whole"), MOQTError)
    for how in ("whole", "bytes", "uneven"):
        for runs in (False, True):
            got = _outcome(partial(_events, data, how, runs), MOQTError)
            if got != whole:
                raise AssertionError(f"data stream fed {how} (runs {runs}): {got}, whole: {whole}")
    try:
        datagram = ObjectDatagram.decode(data)
    except MOQTError:
        return
    if ObjectDatagram.decode(datagram.encode()) != datagram:
        raise AssertionError("an accepted datagram does not round-trip")


# --- a MOQT session over QMux (draft-ietf-quic-qmux-01, draft-nandakumar-moq-qmux-moqt-00) ------

_QMUX_APP = ("moqt-16",)


def _qmux_pair() -> tuple[QMuxConnection, MOQTSession, QMuxConnection, MOQTSession]:
    client = QMuxConnection(is_client=True, config=QMuxConfig(application_protocols=_QMUX_APP))
    server = QMuxConnection(is_client=False, config=QMuxConfig(application_protocols=_QMUX_APP))
    for conn in (client, server):
        conn.connection_made(0.0)
    return (
        client,
        MOQTSession(client, is_client=True, backend=QMUX_BACKEND),
        server,
        MOQTSession(server, is_client=False, backend=QMUX_BACKEND),
    )


def qmux_seeds() -> list[bytes]:
    """The octets a QMux client sends in a MOQT session against our server: its transport
    parameters and CLIENT_SETUP; FETCH, SUBSCRIBE, PUBLISH_NAMESPACE, TRACK_STATUS and
    SUBSCRIBE_NAMESPACE; then PUBLISH, a subgroup stream of three objects and a datagram once
    the server has answered with PUBLISH_OK. Also the first record alone."""
    client, client_session, server, server_session = _qmux_pair()
    sent: list[bytes] = []

    def pump() -> None:
        for _ in range(100):
            out = b"".join(bytes(b) for b in client.data_to_send(None, 0.0))
            back = b"".join(bytes(b) for b in server.data_to_send(None, 0.0))
            if not out and not back:
                return
            sent.append(out)
            server.receive_data(out, 0.0)
            client.receive_data(back, 0.0)
            while (event := server.next_event()) is not None:
                for got in server_session.handle_event(event):
                    if isinstance(got, FetchReceived):
                        server_session.fetch_ok(got.request_id, end_location=Location(0, 2))
                    elif isinstance(got, PublishReceived):
                        server_session.publish_ok(got.request_id)
            while (event := client.next_event()) is not None:
                client_session.handle_event(event)
        raise AssertionError("the QMux seed session never went quiet")

    pump()
    first = sent[0]
    client_session.fetch(_NS, b"f" * 32, Location(0, 0), Location(0, 3))
    client_session.subscribe(_NS, b"live")
    client_session.publish_namespace(_NS[:4])
    client_session.track_status(_NS, b"t")
    client_session.subscribe_namespace((b"kvsp", b"1"))
    pump()
    request = client_session.publish(_NS, b"live-x")
    pump()
    stream = client_session.open_subgroup(request, 0)
    for index in range(3):
        client_session.send_object(stream, index, bytes([index]) * 300, end_stream=index == 2)
    client_session.send_datagram(request, 1, 0, b"datagram" * 8)
    pump()
    return [b"".join(sent), first]


def qmux_carried(data: bytes, how: str) -> tuple[int | None, dict[int, bytes]]:
    """Feed ``data`` to a fresh server connection alone (nothing answered, nothing sent): the
    code it closed with (None: still open) and the octets each stream received."""
    _, _, server, _ = _qmux_pair()
    closed: int | None = None
    streams: dict[int, bytearray] = {}
    for piece in feeding(data, how):
        server.receive_data(piece, 0.0)
        while (event := server.next_event()) is not None:
            if isinstance(event, StreamDataReceived):
                streams.setdefault(event.stream_id, bytearray()).extend(event.data)
            elif isinstance(event, ConnectionTerminated):
                if closed is not None:
                    raise AssertionError("the connection ended twice")
                closed = event.error_code
    return closed, {stream: bytes(octets) for stream, octets in streams.items()}


def _served(data: bytes, how: str) -> None:
    """Feed ``data`` to a fresh server connection with its MOQT session handling every event
    and the connection's output taken after each piece, as the asyncio shell does."""
    _, _, server, session = _qmux_pair()
    ended = 0
    for piece in feeding(data, how):
        server.receive_data(piece, 0.0)
        while (event := server.next_event()) is not None:
            session.handle_event(event)
            ended += isinstance(event, ConnectionTerminated)
        server.data_to_send(None, 0.0)
    if ended > 1:
        raise AssertionError("the connection ended twice")
    if ended and (server.data_to_send(None, 0.0) or session.closed is None):
        raise AssertionError("an ended connection still sends, or its session is not closed")


def qmux_target(data: bytes) -> None:
    """Feed ``data`` as a QMux client's octets to our server connection, whole, one octet at a
    time and in uneven chunks. A peer's error must end the connection with CONNECTION_CLOSE (an
    event, never an exception). The connection alone must end the same way and hand each
    stream the same octets however the input was cut (a stream's octets may only stop earlier
    when an error found later in the same record ends the connection: data is handed on as it
    arrives). With the MOQT session answering after each piece, how it ends may depend on the
    cut (an error the session finds in an early stream can close it before a later record's
    error is read; credit granted between pieces widens the window), so there only the rules
    above are checked.

    Raises:
        AssertionError: the feedings disagree, or the connection ended twice.
    """
    closed, streams = qmux_carried(data, "whole")
    for how in ("bytes", "uneven"):
        got, got_streams = qmux_carried(data, how)
        if got != closed:
            raise AssertionError(f"fed {how} the connection ends with {got}, whole with {closed}")
        for stream, octets in streams.items():
            if not got_streams.get(stream, b"").startswith(octets):
                raise AssertionError(f"fed {how}, stream {stream} got other octets")
        if closed is None and got_streams != streams:
            raise AssertionError(f"fed {how}, the streams got other octets")
    for how in FEEDINGS:
        _served(data, how)


TARGETS: dict[str, tuple[Target, Callable[[], list[bytes]]]] = {
    "container": (container_target, container_seeds),
    "records": (records_target, record_seeds),
    "moqt_control": (control_target, control_seeds),
    "moqt_data": (data_target, data_seeds),
    "moqt_qmux": (qmux_target, qmux_seeds),
}
"""Each target by name, with the function that makes its seed corpus."""
