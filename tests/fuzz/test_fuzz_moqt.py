"""Garbage in, protocol errors out: the MOQT draft-16 parsers (control messages §9, data
streams §10.4, datagrams §10.3).

Every input either parses or raises a :class:`~moqt.errors.MOQTError` carrying its wire code;
a stream fed whole, one octet at a time and in uneven chunks gives the same messages or events
(payload chunks joined), and what is accepted encodes back to a stable form
(``targets.control_target`` / ``targets.data_target``).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from moqt.errors import MOQTError, ProtocolViolation, SessionError
from moqt.messages import MESSAGE_CLASSES, decode_control_message
from moqt.wire import CONTROL_LENGTH, encode_varint
from tests.support.fuzz_strategies import mutated, targets

CONTROL = targets.control_seeds()
DATA = targets.data_seeds()
MALFORMED_MESSAGE = {
    SessionError.PROTOCOL_VIOLATION,
    SessionError.KEY_VALUE_FORMATTING_ERROR,
    SessionError.MALFORMED_PATH,
    SessionError.MALFORMED_AUTHORITY,
}
"""The session errors a malformed control message closes the session with (§9, §9.3.1)."""
FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_the_seeds_parse() -> None:
    for seed in CONTROL:
        targets.control_target(seed)
    for seed in DATA:
        targets.data_target(seed)


@FUZZ
@given(mutated(CONTROL))
def test_mutated_control_streams_parse_or_raise_moqt_errors(data: bytes) -> None:
    targets.control_target(data)


@st.composite
def framed(draw: st.DrawFn) -> bytes:
    """A control frame of a known (or unknown) type whose payload is varints and octets."""
    msg_type = draw(st.sampled_from(sorted(MESSAGE_CLASSES)) | st.integers(0, 2**62 - 1))
    pieces = draw(
        st.lists(
            st.integers(0, 2**62 - 1).map(encode_varint) | st.binary(max_size=12),
            max_size=10,
        )
    )
    payload = b"".join(pieces)[:0xFFFF]
    return encode_varint(msg_type) + CONTROL_LENGTH.pack(len(payload)) + payload


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(framed(), min_size=1, max_size=3).map(b"".join))
def test_frames_of_varints_parse_or_raise_moqt_errors(data: bytes) -> None:
    targets.control_target(data)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(MESSAGE_CLASSES)), st.binary(max_size=120))
def test_every_message_type_takes_any_payload(msg_type: int, payload: bytes) -> None:
    try:
        message = decode_control_message(msg_type, payload)
    except MOQTError as exc:
        assert isinstance(exc, ProtocolViolation) and exc.error_code in MALFORMED_MESSAGE, exc
        return
    assert message.encode()


@FUZZ
@given(mutated(DATA))
def test_mutated_data_streams_and_datagrams_parse_or_raise_moqt_errors(data: bytes) -> None:
    targets.data_target(data)


@FUZZ
@given(
    st.sampled_from([0x05, 0x10, 0x11, 0x13, 0x15, 0x19, 0x1D, 0x30, 0x39, 0x00, 0x01, 0x20])
    .map(encode_varint)
    .flatmap(
        lambda prefix: st.lists(
            st.integers(0, 2**62 - 1).map(encode_varint) | st.binary(max_size=8), max_size=12
        ).map(lambda parts: prefix + b"".join(parts))
    )
)
@example(b"\x11\x07\x00\x80\x00" + encode_varint(2**40) + b"\x00" * 16)  # extensions: 2^40
@example(b"\x10\x07\x00\x80\x00" + encode_varint(2**62 - 1))  # a payload of 2^62 - 1 octets
def test_stream_headers_of_varints_parse_or_raise_moqt_errors(data: bytes) -> None:
    targets.data_target(data)


@pytest.mark.parametrize("seed", range(len(DATA)))
def test_every_truncation_of_a_seed_parses_or_raises(seed: int) -> None:
    data = DATA[seed]
    for end in range(len(data)):
        targets.data_target(data[:end])
