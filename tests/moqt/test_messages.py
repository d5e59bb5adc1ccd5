"""moqt.messages: d16 control messages round-trip, match the vectors, reject garbage (§9)."""

from __future__ import annotations

import contextlib
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moqt.errors import (
    MOQTError,
    ProtocolViolation,
    PublishDoneCode,
    RequestErrorCode,
    SessionError,
)
from moqt.messages import (
    MESSAGE_CLASSES,
    AuthToken,
    ClientSetup,
    ControlMessage,
    ControlMessageParser,
    Fetch,
    FetchCancel,
    FetchOk,
    FetchType,
    FilterType,
    Goaway,
    GroupOrder,
    JoiningFetch,
    MaxRequestId,
    MessageParameters,
    MessageType,
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
    StandaloneFetch,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    SubscribeOptions,
    SubscriptionFilter,
    TokenAliasType,
    TrackStatus,
    Unsubscribe,
    decode_control_message,
)
from moqt.messages_base import (
    AUTH_ONLY_PARAMS,
    FETCH_PARAMS,
    NO_PARAMS,
    PUBLISH_OK_PARAMS,
    PUBLISH_PARAMS,
    REPLY_PARAMS,
    SUBSCRIBE_NAMESPACE_PARAMS,
    SUBSCRIBE_PARAMS,
    UPDATE_PARAMS,
)
from moqt.messages_params import ExtensionType, MessageParameter, track_extension
from moqt.wire import VARINT_MAX, Location, encode_kvps, encode_varint, frame_control_message

NS = (b"kvsp", b"1", b"c0", b"s0", b"1")
NS_HEX = "05 046b767370 0131 026330 027330 0131"

# Control-message test vectors (d16), research/moqt.md §2.2 "verified here": hex → message.
VECTORS: list[tuple[str, ControlMessage]] = [
    (
        "20 000b 02 01 05 2f6b767370 01 4064",
        ClientSetup(parameters=SetupParameters(path="/kvsp", max_request_id=100)),
    ),
    ("21 0004 01 02 4064", ServerSetup(parameters=SetupParameters(max_request_id=100))),
    (
        "03 0017 00 05 04 6b767370 01 31 02 6330 02 7330 01 31 01 62 01 21 01 02",
        Subscribe(
            request_id=0,
            track_namespace=NS,
            track_name=b"b",
            parameters=MessageParameters(
                subscription_filter=SubscriptionFilter(filter_type=FilterType.LARGEST_OBJECT)
            ),
        ),
    ),
    ("04 0003 00 07 00", SubscribeOk(request_id=0, track_alias=7)),
    (f"06 0012 02 {NS_HEX} 00", PublishNamespace(request_id=2, track_namespace=NS)),
    (
        f"16 001e 04 01 {NS_HEX} 01 62 00 02 00 06 02 20 4080 02 01",
        Fetch(
            request_id=4,
            target=StandaloneFetch(
                track_namespace=NS, track_name=b"b", start=Location(0, 2), end=Location(0, 6)
            ),
            parameters=MessageParameters(subscriber_priority=128, group_order=GroupOrder.ASCENDING),
        ),
    ),
]


def _hex(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", ""))


@pytest.mark.parametrize(("hex_", "message"), VECTORS, ids=[type(m).__name__ for _, m in VECTORS])
def test_vector(hex_: str, message: ControlMessage) -> None:
    wire = _hex(hex_)
    assert message.encode() == wire
    assert decode_control_message(wire[0], wire[3:]) == message
    assert ControlMessageParser().feed(wire, end_stream=True) == [message]


def test_vectors_as_one_stream_fed_byte_by_byte() -> None:
    wire = b"".join(_hex(hex_) for hex_, _ in VECTORS)
    parser = ControlMessageParser()
    got: list[ControlMessage] = []
    for i in range(len(wire)):
        got += parser.feed(wire[i : i + 1])
    assert got == [message for _, message in VECTORS]


def test_fetch_vector_is_layers_2_to_5() -> None:
    (_, fetch) = VECTORS[5]
    assert isinstance(fetch, Fetch) and fetch.fetch_type == FetchType.STANDALONE
    assert isinstance(fetch.target, StandaloneFetch)
    assert (fetch.target.start, fetch.target.end) == (Location(0, 2), Location(0, 5 + 1))


# --- hypothesis strategies ---------------------------------------------------------------------

varints = st.integers(0, VARINT_MAX)
small = st.integers(0, 2**20)
names = st.binary(max_size=24)
namespaces = st.lists(st.binary(min_size=1, max_size=12), min_size=1, max_size=32).map(tuple)
prefixes = st.lists(st.binary(min_size=1, max_size=12), max_size=32).map(tuple)
locations = st.builds(Location, varints, varints)
texts = st.text(max_size=40)


def _tokens(setup_client: bool = False) -> st.SearchStrategy[AuthToken]:
    with_value = st.builds(
        AuthToken,
        alias_type=st.sampled_from([TokenAliasType.REGISTER]),
        alias=varints,
        token_type=varints,
        token_value=st.binary(max_size=30),
    )
    use_value = st.builds(
        AuthToken,
        alias_type=st.just(TokenAliasType.USE_VALUE),
        token_type=varints,
        token_value=st.binary(max_size=30),
    )
    alias_only = st.builds(
        AuthToken,
        alias_type=st.sampled_from([TokenAliasType.DELETE, TokenAliasType.USE_ALIAS]),
        alias=varints,
    )
    return (
        st.one_of(with_value, use_value)
        if setup_client
        else st.one_of(with_value, use_value, alias_only)
    )


filters = st.one_of(
    st.builds(
        SubscriptionFilter,
        filter_type=st.sampled_from([FilterType.NEXT_GROUP_START, FilterType.LARGEST_OBJECT]),
    ),
    st.builds(SubscriptionFilter, filter_type=st.just(FilterType.ABSOLUTE_START), start=locations),
    st.builds(
        SubscriptionFilter,
        filter_type=st.just(FilterType.ABSOLUTE_RANGE),
        start=locations,
        end_group=varints,
    ),
)

_PARAM_VALUES: dict[MessageParameter, tuple[str, st.SearchStrategy[Any]]] = {
    MessageParameter.DELIVERY_TIMEOUT: ("delivery_timeout", st.integers(1, VARINT_MAX)),
    MessageParameter.AUTHORIZATION_TOKEN: (
        "authorization_tokens",
        st.lists(_tokens(), max_size=3).map(tuple),
    ),
    MessageParameter.EXPIRES: ("expires", varints),
    MessageParameter.LARGEST_OBJECT: ("largest_object", locations),
    MessageParameter.FORWARD: ("forward", st.integers(0, 1)),
    MessageParameter.SUBSCRIBER_PRIORITY: ("subscriber_priority", st.integers(0, 255)),
    MessageParameter.SUBSCRIPTION_FILTER: ("subscription_filter", filters),
    MessageParameter.GROUP_ORDER: ("group_order", st.sampled_from(GroupOrder)),
    MessageParameter.NEW_GROUP_REQUEST: ("new_group_request", varints),
}


def params_for(allowed: frozenset[MessageParameter]) -> st.SearchStrategy[MessageParameters]:
    """MessageParameters with any subset of the ``allowed`` parameters set."""
    fields: dict[str, st.SearchStrategy[Any]] = {
        name: st.none() | strategy for p, (name, strategy) in _PARAM_VALUES.items() if p in allowed
    }
    if "authorization_tokens" in fields:
        fields["authorization_tokens"] = _PARAM_VALUES[MessageParameter.AUTHORIZATION_TOKEN][1]
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: MessageParameters(**kw))


def setup_params(client: bool) -> st.SearchStrategy[SetupParameters]:
    unknown = st.lists(
        st.one_of(
            st.tuples(st.integers(4, 2**30).map(lambda t: t * 2), varints),
            st.tuples(st.integers(4, 2**30).map(lambda t: t * 2 + 1), st.binary(max_size=20)),
        ),
        max_size=4,
    ).map(lambda pairs: tuple(sorted(pairs, key=lambda pair: pair[0])))
    return st.builds(
        SetupParameters,
        path=st.none() | texts,
        max_request_id=st.none() | varints,
        authorization_tokens=st.lists(_tokens(setup_client=client), max_size=2).map(tuple),
        max_auth_token_cache_size=st.none() | varints,
        authority=st.none() | texts,
        moqt_implementation=st.none() | texts,
        unknown=unknown,
    )


track_extensions = st.lists(
    st.one_of(
        st.tuples(st.just(int(ExtensionType.DELIVERY_TIMEOUT)), st.integers(1, VARINT_MAX)),
        st.tuples(st.just(int(ExtensionType.MAX_CACHE_DURATION)), varints),
        st.tuples(st.just(int(ExtensionType.DEFAULT_PUBLISHER_PRIORITY)), st.integers(0, 255)),
        st.tuples(st.just(int(ExtensionType.DEFAULT_PUBLISHER_GROUP_ORDER)), st.integers(1, 2)),
        st.tuples(st.just(int(ExtensionType.DYNAMIC_GROUPS)), st.integers(0, 1)),
        st.tuples(st.integers(0x20, 2**20).map(lambda t: t * 2 + 1), st.binary(max_size=20)),
        st.tuples(st.integers(0x20, 2**20).map(lambda t: t * 2), varints),
    ),
    max_size=5,
).map(lambda pairs: tuple(sorted(pairs, key=lambda pair: pair[0])))

codes = st.one_of(st.sampled_from(RequestErrorCode), varints)

MESSAGES: dict[type[ControlMessage], st.SearchStrategy[Any]] = {
    ClientSetup: st.builds(ClientSetup, parameters=setup_params(client=True)),
    ServerSetup: st.builds(ServerSetup, parameters=setup_params(client=False)),
    Goaway: st.builds(Goaway, new_session_uri=texts),
    MaxRequestId: st.builds(MaxRequestId, max_request_id=varints),
    RequestsBlocked: st.builds(RequestsBlocked, maximum_request_id=varints),
    RequestOk: st.builds(RequestOk, request_id=varints, parameters=params_for(REPLY_PARAMS)),
    RequestError: st.builds(
        RequestError, request_id=varints, error_code=codes, retry_interval=varints, reason=texts
    ),
    Subscribe: st.builds(
        Subscribe,
        request_id=varints,
        track_namespace=namespaces,
        track_name=names,
        parameters=params_for(SUBSCRIBE_PARAMS),
    ),
    SubscribeOk: st.builds(
        SubscribeOk,
        request_id=varints,
        track_alias=varints,
        parameters=params_for(REPLY_PARAMS),
        track_extensions=track_extensions,
    ),
    RequestUpdate: st.builds(
        RequestUpdate,
        request_id=varints,
        existing_request_id=varints,
        parameters=params_for(UPDATE_PARAMS),
    ),
    Unsubscribe: st.builds(Unsubscribe, request_id=varints),
    Publish: st.builds(
        Publish,
        request_id=varints,
        track_namespace=namespaces,
        track_name=names,
        track_alias=varints,
        parameters=params_for(PUBLISH_PARAMS),
        track_extensions=track_extensions,
    ),
    PublishOk: st.builds(PublishOk, request_id=varints, parameters=params_for(PUBLISH_OK_PARAMS)),
    PublishDone: st.builds(
        PublishDone,
        request_id=varints,
        status_code=st.one_of(st.sampled_from(PublishDoneCode), varints),
        stream_count=varints,
        reason=texts,
    ),
    Fetch: st.builds(
        Fetch,
        request_id=varints,
        target=st.one_of(
            st.builds(
                StandaloneFetch,
                track_namespace=namespaces,
                track_name=names,
                start=locations,
                end=locations,
            ),
            st.builds(
                JoiningFetch,
                joining_request_id=varints,
                joining_start=varints,
                absolute=st.booleans(),
            ),
        ),
        parameters=params_for(FETCH_PARAMS),
    ),
    FetchOk: st.builds(
        FetchOk,
        request_id=varints,
        end_of_track=st.booleans(),
        end_location=locations,
        parameters=params_for(NO_PARAMS),
        track_extensions=track_extensions,
    ),
    FetchCancel: st.builds(FetchCancel, request_id=varints),
    TrackStatus: st.builds(
        TrackStatus,
        request_id=varints,
        track_namespace=namespaces,
        track_name=names,
        parameters=params_for(SUBSCRIBE_PARAMS),
    ),
    PublishNamespace: st.builds(
        PublishNamespace,
        request_id=varints,
        track_namespace=namespaces,
        parameters=params_for(AUTH_ONLY_PARAMS),
    ),
    Namespace: st.builds(Namespace, track_namespace_suffix=prefixes),
    PublishNamespaceDone: st.builds(PublishNamespaceDone, request_id=varints),
    NamespaceDone: st.builds(NamespaceDone, track_namespace_suffix=prefixes),
    PublishNamespaceCancel: st.builds(
        PublishNamespaceCancel, request_id=varints, error_code=codes, reason=texts
    ),
    SubscribeNamespace: st.builds(
        SubscribeNamespace,
        request_id=varints,
        track_namespace_prefix=prefixes,
        subscribe_options=st.sampled_from(SubscribeOptions),
        parameters=params_for(SUBSCRIBE_NAMESPACE_PARAMS),
    ),
}

any_message = st.one_of(*MESSAGES.values())


def test_every_message_type_has_a_strategy() -> None:
    assert set(MESSAGES) == set(MESSAGE_CLASSES.values())
    assert {cls.TYPE for cls in MESSAGES} == set(MessageType)


@pytest.mark.parametrize("cls", list(MESSAGES), ids=lambda cls: cls.__name__)
@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip(cls: type[ControlMessage], data: st.DataObject) -> None:
    message = data.draw(MESSAGES[cls])
    wire = message.encode()
    msg_type, size = wire[0], 1
    if msg_type & 0xC0:
        pytest.fail("all d16 control types are one-byte varints")
    length = int.from_bytes(wire[size : size + 2], "big")
    assert length == len(wire) - 3
    decoded = decode_control_message(msg_type, wire[3:])
    assert decoded == message
    assert type(decoded) is cls
    assert ControlMessageParser().feed(wire) == [message]


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(any_message, min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_stream_of_messages_any_chunking(
    messages: list[ControlMessage], rng: random.Random
) -> None:
    wire = b"".join(message.encode() for message in messages)
    parser, got, pos = ControlMessageParser(), [], 0
    while pos < len(wire):
        size = rng.choice([1, 2, 3, 7, 64, 1000])
        got += parser.feed(wire[pos : pos + size])
        pos += size
    got += parser.feed(b"", end_stream=True)
    assert got == messages


# --- decoding errors ---------------------------------------------------------------------------


def _payload(*parts: bytes) -> bytes:
    return b"".join(parts)


def _violation(msg_type: int, payload: bytes) -> ProtocolViolation:
    with pytest.raises(ProtocolViolation) as info:
        decode_control_message(msg_type, payload)
    return info.value


def _subscribe_with(params: list[tuple[int, int | bytes]]) -> bytes:
    return _payload(
        b"\x00", _hex(NS_HEX), b"\x01b", encode_varint(len(params)), encode_kvps(params)
    )


def test_unknown_message_type() -> None:
    for msg_type in (0x00, 0x01, 0x0F, 0x12, 0x40, 0x2F00):
        assert _violation(msg_type, b"").error_code == SessionError.PROTOCOL_VIOLATION
    wire = frame_control_message(0x12, b"")
    with pytest.raises(ProtocolViolation):
        ControlMessageParser().feed(wire)


def test_length_mismatch() -> None:
    good = Unsubscribe(request_id=300).encode()
    assert _violation(good[0], good[3:] + b"\x00").error_code == SessionError.PROTOCOL_VIOLATION
    assert _violation(good[0], good[3:-1]).error_code == SessionError.PROTOCOL_VIOLATION
    # a Length (16) field shorter than the message: the parser sees a truncated payload
    wire = bytearray(VECTORS[2][1].encode())
    wire[2] -= 1
    with pytest.raises(ProtocolViolation):
        ControlMessageParser().feed(bytes(wire) + b"\x00")


def test_message_parameter_rules() -> None:
    decode_control_message(MessageType.SUBSCRIBE, _subscribe_with([(0x20, 255)]))
    # unknown message parameter
    assert _violation(3, _subscribe_with([(0x40, 1)])).error_code == SessionError.PROTOCOL_VIOLATION
    # duplicates (AUTHORIZATION TOKEN may repeat)
    _violation(3, _subscribe_with([(0x20, 1), (0x20, 2)]))
    token = AuthToken(alias_type=TokenAliasType.USE_VALUE, token_type=0, token_value=b"t").encode()
    message = decode_control_message(3, _subscribe_with([(0x03, token), (0x03, token)]))
    assert isinstance(message, Subscribe) and len(message.parameters.authorization_tokens) == 2
    # a parameter defined for other messages is ignored, even with a value that is invalid there
    message = decode_control_message(3, _subscribe_with([(0x08, 5), (0x09, b"\xff")]))
    assert isinstance(message, Subscribe) and message.parameters == MessageParameters()
    # range rules
    for pair in [(0x02, 0), (0x10, 2), (0x20, 256), (0x22, 0), (0x22, 3)]:
        assert _violation(3, _subscribe_with([pair])).error_code == SessionError.PROTOCOL_VIOLATION


def test_key_value_formatting_errors() -> None:
    ok = _payload(b"\x00\x07", b"\x01", encode_kvps([(0x09, b"\x01\x02")]))
    message = decode_control_message(MessageType.SUBSCRIBE_OK, ok)
    assert isinstance(message, SubscribeOk)
    assert message.parameters.largest_object == Location(1, 2)
    for bad in (b"\x01", b"\x01\x02\x03", b""):
        payload = _payload(b"\x00\x07", b"\x01", encode_kvps([(0x09, bad)]))
        assert _violation(4, payload).error_code == SessionError.KEY_VALUE_FORMATTING_ERROR
    for bad_token in (b"", b"\x07", b"\x01\x05", b"\x00\x01extra", b"\x03"):
        payload = _subscribe_with([(0x03, bad_token)])
        assert _violation(3, payload).error_code == SessionError.KEY_VALUE_FORMATTING_ERROR


def test_subscription_filter_errors() -> None:
    for bad in (b"\x05", b"\x03\x01", b"\x02\x00", b"\x04\x01\x02"):
        assert _violation(3, _subscribe_with([(0x21, bad)])).error_code == 3
    message = decode_control_message(3, _subscribe_with([(0x21, b"\x04\x01\x02\x03")]))
    assert isinstance(message, Subscribe)
    assert message.parameters.subscription_filter == SubscriptionFilter(
        filter_type=FilterType.ABSOLUTE_RANGE, start=Location(1, 2), end_group=3
    )


def test_auth_tokens() -> None:
    token = AuthToken(alias_type=TokenAliasType.REGISTER, alias=9, token_type=1, token_value=b"jwt")
    assert token.encode() == b"\x01\x09\x01jwt"
    assert AuthToken.decode(token.encode()) == token
    with pytest.raises(ValueError):
        AuthToken(
            alias_type=TokenAliasType.USE_VALUE, alias=1, token_type=1, token_value=b""
        ).encode()
    # DELETE and USE_ALIAS are forbidden in CLIENT_SETUP, fine in SERVER_SETUP
    for alias_type in (TokenAliasType.DELETE, TokenAliasType.USE_ALIAS):
        value = AuthToken(alias_type=alias_type, alias=1).encode()
        payload = _payload(b"\x01", encode_kvps([(0x03, value)]))
        assert _violation(MessageType.CLIENT_SETUP, payload).error_code == 3
        decode_control_message(MessageType.SERVER_SETUP, payload)


def test_setup_parameters() -> None:
    # moq-ffi sends unknown setup parameters 0x40b5a=1, 0x40b5c=1; duplicates of unknown ones too
    payload = _payload(b"\x04", encode_kvps([(2, 5), (0x40B5A, 1), (0x40B5C, 1), (0x40B5C, 1)]))
    message = decode_control_message(MessageType.SERVER_SETUP, payload)
    assert isinstance(message, ServerSetup)
    assert message.parameters.max_request_id == 5
    assert message.parameters.unknown == ((0x40B5A, 1), (0x40B5C, 1), (0x40B5C, 1))
    assert message.encode()[3:] == payload
    # a repeated known parameter
    _violation(0x21, _payload(b"\x02", encode_kvps([(2, 5), (2, 6)])))
    # PATH / AUTHORITY that are not UTF-8
    bad_path = _payload(b"\x01", encode_kvps([(1, b"\xff")]))
    assert _violation(0x20, bad_path).error_code == SessionError.MALFORMED_PATH
    bad_authority = _payload(b"\x01", encode_kvps([(5, b"\xff")]))
    assert _violation(0x20, bad_authority).error_code == SessionError.MALFORMED_AUTHORITY
    # MOQT_IMPLEMENTATION is only a SHOULD-be-UTF-8: decoded leniently
    odd_name = _payload(b"\x01", encode_kvps([(7, b"moq\xff")]))
    message = decode_control_message(0x21, odd_name)
    assert isinstance(message, ServerSetup)
    assert message.parameters.moqt_implementation == "moq\ufffd"


def test_field_rules() -> None:
    # Fetch Type 4
    assert _violation(MessageType.FETCH, b"\x00\x04\x00").error_code == 3
    # FETCH_OK End Of Track other than 0/1
    _violation(MessageType.FETCH_OK, b"\x00\x02\x00\x00\x00")
    # GOAWAY URI limit
    assert Goaway(new_session_uri="u" * 8192).encode()
    with pytest.raises(ValueError):
        Goaway(new_session_uri="u" * 8193).encode()
    _violation(MessageType.GOAWAY, encode_varint(8193) + b"u" * 8193)
    # SUBSCRIBE_NAMESPACE options
    _violation(MessageType.SUBSCRIBE_NAMESPACE, b"\x00\x00\x03\x00")
    empty = decode_control_message(MessageType.SUBSCRIBE_NAMESPACE, b"\x00\x00\x02\x00")
    assert isinstance(empty, SubscribeNamespace) and empty.track_namespace_prefix == ()
    # track extension DELIVERY_TIMEOUT 0 and other range rules (§11)
    for pair in [(0x02, 0), (0x0E, 256), (0x22, 3), (0x30, 2)]:
        _violation(MessageType.SUBSCRIBE_OK, _payload(b"\x00\x07\x00", encode_kvps([pair])))


def test_namespace_limits_in_messages() -> None:
    def subscribe(fields: int, name_len: int) -> bytes:
        ns = encode_varint(fields) + (b"\x01a" * fields)
        return _payload(b"\x00", ns, encode_varint(name_len), b"n" * name_len, b"\x00")

    decode_control_message(3, subscribe(32, 10))
    assert _violation(3, subscribe(33, 10)).error_code == SessionError.PROTOCOL_VIOLATION
    assert _violation(3, subscribe(0, 10)).error_code == SessionError.PROTOCOL_VIOLATION
    decode_control_message(3, subscribe(1, 4095))
    assert _violation(3, subscribe(1, 4096)).error_code == SessionError.PROTOCOL_VIOLATION
    with pytest.raises(ValueError):
        Subscribe(request_id=0, track_namespace=(b"a",) * 33, track_name=b"").encode()
    with pytest.raises(ValueError):
        Subscribe(request_id=0, track_namespace=(b"a",), track_name=b"n" * 4096).encode()


def test_codes_become_enums() -> None:
    error = decode_control_message(5, RequestError(request_id=1, error_code=0x11).encode()[3:])
    assert isinstance(error, RequestError) and error.error_code is RequestErrorCode.INVALID_RANGE
    odd = decode_control_message(5, RequestError(request_id=1, error_code=0x99).encode()[3:])
    assert isinstance(odd, RequestError) and odd.error_code == 0x99


def test_encoder_rejects_parameters_the_message_does_not_define() -> None:
    with pytest.raises(ValueError):
        Subscribe(
            request_id=0,
            track_namespace=NS,
            track_name=b"",
            parameters=MessageParameters(expires=1),
        ).encode()
    with pytest.raises(ValueError):
        FetchOk(
            request_id=0,
            end_of_track=False,
            end_location=Location(0, 0),
            parameters=MessageParameters(forward=1),
        ).encode()


def test_kvsp_track_extensions() -> None:
    ok = SubscribeOk(
        request_id=2,
        track_alias=1,
        parameters=MessageParameters(largest_object=Location(0, 31)),
        track_extensions=((ExtensionType.MAX_CACHE_DURATION, 600_000),),
    )
    decoded = decode_control_message(4, ok.encode()[3:])
    assert decoded == ok and isinstance(decoded, SubscribeOk)
    assert track_extension(decoded.track_extensions, ExtensionType.MAX_CACHE_DURATION) == 600_000
    assert track_extension(decoded.track_extensions, ExtensionType.DYNAMIC_GROUPS) is None


# --- garbage in: parse or raise MOQTError, nothing else -----------------------------------------


def _mutate(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.4 and buf:
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif choice < 0.6 and buf:
            del buf[rng.randrange(len(buf)) :]
        elif choice < 0.8:
            buf.insert(rng.randint(0, len(buf)), rng.randrange(256))
        elif buf:
            del buf[rng.randrange(len(buf))]
    return bytes(buf)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(MESSAGE_CLASSES)), st.binary(max_size=80))
def test_random_payloads_parse_or_raise(msg_type: int, payload: bytes) -> None:
    with contextlib.suppress(MOQTError):
        decode_control_message(msg_type, payload)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(any_message, st.randoms(use_true_random=False))
def test_mutated_messages_parse_or_raise(message: ControlMessage, rng: random.Random) -> None:
    wire = message.encode()
    mutated = _mutate(wire[3:], rng)
    try:
        decoded = decode_control_message(wire[0], mutated)
    except MOQTError:
        return
    # whatever decoded must encode again (parameters a message ignores drop out)
    decoded.encode()


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(any_message, max_size=3), st.randoms(use_true_random=False))
def test_mutated_streams_whole_and_byte_by_byte(
    messages: list[ControlMessage], rng: random.Random
) -> None:
    wire = _mutate(b"".join(message.encode() for message in messages), rng)
    outcomes: list[tuple[str, list[Any]]] = []
    for size in (len(wire) or 1, 1, rng.randint(1, 9)):
        parser, got = ControlMessageParser(), []
        try:
            for pos in range(0, len(wire), size):
                got += parser.feed(wire[pos : pos + size])
            got += parser.feed(b"", end_stream=True)
            outcomes.append(("ok", got))
        except MOQTError as exc:
            outcomes.append(("error", [exc.error_code]))
    assert outcomes[0][0] == outcomes[1][0] == outcomes[2][0]
    if outcomes[0][0] == "ok":
        assert outcomes[0] == outcomes[1] == outcomes[2]
