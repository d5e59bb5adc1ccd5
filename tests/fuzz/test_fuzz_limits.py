"""Allocation guards: declared sizes beyond the limits are refused before anything is allocated
(spec §4.3 container lengths, JSON bodies of §6, MOQT draft-16 lengths and counts).

Each case measures the peak of :mod:`tracemalloc` around the parser: a header that announces
2^40 octets or 2^31 layers must fail with a peak of a few MiB at most, and a container within
the limits allocates as its octets arrive, not as its header declares.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest

from kvsp.container import (
    DEFAULT_LIMITS,
    KVB1_HEADER,
    KVB1_LAYER_LENGTHS,
    KVB1_MAGIC,
    ContainerTooLarge,
    Geometry,
    decode_container,
)
from kvsp.container_reader import ContainerReader
from kvsp.errors import BadRequest, ContainerError, KVSPError, PayloadTooLarge, RecordError
from kvsp.records import loads
from kvsp.services.index.app import IndexConfig, create_index_app
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.stores.memory import MemoryStore
from kvsp.web.auth import Principals, principal_entry
from kvsp.web.clock import ManualClock
from kvsp.web.http import parse_json
from moqt.errors import MOQTError, ProtocolViolation
from moqt.messages import ControlMessageParser
from moqt.objects import DataStreamParser, ObjectChunk, SubgroupHeader
from moqt.objects_wire import MAX_EXTENSIONS_LENGTH
from moqt.wire import CONTROL_LENGTH, encode_varint

MIB = 1 << 20
TOKEN = "limits-token-0123456789abcdefghijkl"


def peak_of(action: Callable[[], Any]) -> tuple[int, BaseException | None]:
    """The peak traced allocation while ``action`` runs, and what it raised."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    raised: BaseException | None = None
    try:
        action()
    except Exception as exc:
        raised = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, raised


def header(count: int, lengths: list[tuple[int, int]], tokens: int = 1, first: int = 0) -> bytes:
    fixed = KVB1_HEADER.pack(KVB1_MAGIC, 1, 0, 1, first, count, tokens)
    return fixed + b"".join(KVB1_LAYER_LENGTHS.pack(k, v) for k, v in lengths)


def feed_reader(data: bytes, geometry: Geometry | None = None) -> None:
    ContainerReader(geometry).feed(data)


# --- KVB1 containers (§4.3) --------------------------------------------------------------------

HUGE_HEADERS = {
    "2^31 layers": header(2**31, [(16, 16)]),
    "2^32-1 layers": header(2**32 - 1, []),
    "2^40 octets in one layer": header(1, [(2**39, 2**39)]),
    "2^64-1 octets in one section": header(1, [(2**64 - 1, 2**64 - 1)]),
    "2^40 octets over 4096 layers": header(4096, [(2**27, 2**27)] * 4096),
}


@pytest.mark.parametrize("name", list(HUGE_HEADERS))
@pytest.mark.parametrize("parse", [decode_container, feed_reader], ids=["whole", "reader"])
def test_huge_declarations_fail_before_allocating(name: str, parse: Callable[..., Any]) -> None:
    data = HUGE_HEADERS[name]
    peak, raised = peak_of(lambda: parse(data))
    assert isinstance(raised, ContainerTooLarge), raised
    assert raised.status == 413
    assert peak < max(2 * MIB, 4 * len(data)), f"{name}: peak {peak} octets"


def test_a_geometry_pins_sections_and_a_huge_token_count_is_refused() -> None:
    geometry = Geometry(layers=32, kv_heads=8, head_dim=128, element_size=2)
    section = geometry.section_length(2**32 - 1)
    data = header(1, [(section, section)], tokens=2**32 - 1)
    for parse in (decode_container, feed_reader):
        peak, raised = peak_of(lambda p=parse: p(data, geometry))  # type: ignore[misc]
        assert isinstance(raised, ContainerTooLarge)
        assert peak < 2 * MIB


def test_a_container_within_the_limits_allocates_as_octets_arrive() -> None:
    """400 MiB + 400 MiB declared (under the 1 GiB default), 256 KiB sent: the reader holds
    about what it was sent."""
    declared = 400 * MIB
    assert 2 * declared < DEFAULT_LIMITS.max_total_bytes
    chunk = bytes(64 * 1024)
    reader = ContainerReader()

    def feed() -> None:
        reader.feed(header(1, [(declared, declared)]))
        for _ in range(4):
            assert reader.feed(chunk) == []

    peak, raised = peak_of(feed)
    assert raised is None
    assert peak < 4 * MIB, f"peak {peak} octets"
    with pytest.raises(ContainerError, match="truncated data"):
        reader.close()


# --- JSON bodies (§4.4, §6) --------------------------------------------------------------------

DEEP = {
    "arrays": b"[" * 1_000_000,
    "objects": b'{"a":' * 200_000 + b"1" + b"}" * 200_000,
    "mixed": b'[{"k":' * 100_000 + b"0" + b"}]" * 100_000,
}


@pytest.mark.parametrize("name", list(DEEP))
def test_deep_json_is_refused_before_a_tree_is_built(name: str) -> None:
    data = DEEP[name]
    for parse, error in ((loads, RecordError), (parse_json, BadRequest)):
        peak, raised = peak_of(lambda p=parse: p(data))  # type: ignore[misc]
        assert isinstance(raised, error) and raised.path == "$", raised
        assert "deeper than 64" in str(raised)
        # the depth scan works on octets: about ten bytes per input octet, no tree
        assert peak < 12 * len(data) + MIB, f"{parse.__name__}: peak {peak}"


def test_the_depth_limit_itself_is_accepted() -> None:
    assert loads(b"[" * 64 + b"]" * 64) == parse_json(b"[" * 64 + b"]" * 64)


# --- HTTP bodies -------------------------------------------------------------------------------


class _Body:
    """An ASGI receive callable that hands out ``chunks`` and counts what was taken."""

    def __init__(self, chunk: bytes, count: int) -> None:
        self.chunk = chunk
        self.left = count
        self.taken = 0

    async def __call__(self) -> dict[str, Any]:
        if self.left == 0:
            return {"type": "http.disconnect"}
        self.left -= 1
        self.taken += len(self.chunk)
        return {"type": "http.request", "body": self.chunk, "more_body": self.left > 0}


def _lookup(headers: dict[str, str], body: _Body, limit: int) -> tuple[int, dict[str, Any]]:
    principals = Principals.from_entries([principal_entry("c", TOKEN, ["client"], None)])
    app = create_index_app(
        IndexConfig(body_limit=limit, gc_freeze_interval_s=None),
        store=MemoryStore(),
        principals=principals,
        clock=ManualClock(1_000),
        descriptors=DescriptorRegistry(),
    )
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    raw.append((b"authorization", f"Bearer {TOKEN}".encode()))
    raw.append((b"content-type", b"application/kvsp+json"))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/lookup",
        "raw_path": b"/lookup",
        "query_string": b"",
        "root_path": "",
        "headers": raw,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, body, send))
    import json

    status = sent[0]["status"]
    return status, json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_a_declared_length_over_the_limit_is_refused_unread() -> None:
    body = _Body(b"x" * 65536, 16)
    status, problem = _lookup({"content-length": str(2**40)}, body, limit=64 * 1024)
    assert status == 413 and problem["type"].endswith("kvsp-bad-request")
    assert body.taken == 0


def test_a_streamed_body_is_cut_off_just_past_the_limit() -> None:
    body = _Body(b"x" * 16384, 1024)  # 16 MiB on offer, no Content-Length
    status, problem = _lookup({}, body, limit=64 * 1024)
    assert status == 413 and problem["status"] == 413
    assert body.taken <= 64 * 1024 + 16384


def test_payload_too_large_is_a_kvsp_error() -> None:
    assert issubclass(PayloadTooLarge, KVSPError) and PayloadTooLarge.status == 413


# --- MOQT lengths and counts -------------------------------------------------------------------


def test_a_payload_length_of_2_62_streams_without_buffering() -> None:
    parser = DataStreamParser()
    # SUBGROUP_HEADER (alias 7, group 0, priority 128), then object 0 of 2^62 - 1 octets
    start = b"\x10\x07\x00\x80" + b"\x00" + encode_varint(2**62 - 1)
    chunk = bytes(64 * 1024)

    def feed() -> None:
        parser.feed(start)
        for _ in range(16):
            events = parser.feed(chunk)
            assert len(events) == 1 and isinstance(events[0], ObjectChunk)
            assert events[0].data.obj is chunk  # a view of the input, not a copy

    peak, raised = peak_of(feed)
    assert raised is None
    assert peak < MIB, f"peak {peak}"
    with pytest.raises(ProtocolViolation):
        parser.feed(b"", end_stream=True)


def test_key_value_lengths_beyond_65535_close_at_once() -> None:
    # CLIENT_SETUP with one parameter of odd type whose declared length is 2^40
    payload = encode_varint(1) + encode_varint(0x21) + encode_varint(2**40)
    frame = encode_varint(0x20) + CONTROL_LENGTH.pack(len(payload)) + payload
    peak, raised = peak_of(lambda: ControlMessageParser().feed(frame))
    assert isinstance(raised, MOQTError), raised
    assert peak < MIB


def test_a_namespace_of_2_62_fields_closes_at_once() -> None:
    # SUBSCRIBE_NAMESPACE: request id 0, then a field count of 2^62 - 1
    payload = encode_varint(0) + encode_varint(2**62 - 1) + b"\x01a"
    frame = encode_varint(0x11) + CONTROL_LENGTH.pack(len(payload)) + payload
    peak, raised = peak_of(lambda: ControlMessageParser().feed(frame))
    assert isinstance(raised, ProtocolViolation), raised
    assert peak < MIB


def test_an_extension_block_longer_than_the_cap_closes_before_buffering() -> None:
    """An object header is buffered until whole; a declared Extension Headers Length of 2^40
    would buffer whatever followed, so it closes at once (MAX_EXTENSIONS_LENGTH)."""
    parser = DataStreamParser()
    # SUBGROUP_HEADER with extensions (alias 7, group 0, priority 128), object 0, then 2^40
    head = b"\x11\x07\x00\x80" + b"\x00" + encode_varint(2**40)
    peak, raised = peak_of(lambda: parser.feed(head + bytes(64 * 1024)))
    assert isinstance(raised, ProtocolViolation), raised
    assert peak < MIB
    within = DataStreamParser()  # at the cap: waits for the rest of the header
    events = within.feed(b"\x11\x07\x00\x80" + b"\x00" + encode_varint(MAX_EXTENSIONS_LENGTH))
    assert [type(e) for e in events] == [SubgroupHeader]
