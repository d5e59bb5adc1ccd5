"""moqt._tlsrecords.Records: the TLS 1.3 record layer of an established session (RFC 8446 §5,
§4.6.3, §7.1-7.2), checked against stock OpenSSL (Python's ssl.SSLObject over memory BIOs).

One side of each in-process pair is ours: OpenSSL runs its handshake, then Records seals and
opens every record; the other side stays stock OpenSSL, so what we seal must read back there
byte-exact and what OpenSSL seals (session tickets, KeyUpdates, close_notify included) must open
here. Records that OpenSSL would never send (every malformed inner plaintext, alert and
post-handshake message) come from an independent sealer written here with ``cryptography``
(AES-GCM / ChaCha20-Poly1305 and HKDF-Expand-Label), keyed with the stock side's traffic secrets
from its key log file; the same code opens what we seal, which checks our key schedule (and its
"traffic upd" steps) on its own. Last, our TLSWorkerTransport against asyncio's stock TLS server
on real sockets, with the records taken over and with them left to OpenSSL.
"""

from __future__ import annotations

import _ssl
import asyncio
import contextlib
import ctypes
import random
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand
from hypothesis import given, settings
from hypothesis import strategies as st

from moqt.certs import make_self_signed
from moqt.qmux_asyncio import ReceiveBuffers, client_ssl_context, server_ssl_context
from moqt.qmux_tls import RECORD_ROOM, TLSWorkerTransport, open_tls_connection
from tests.support.tls_peer import Peer

records: Any = pytest.importorskip("moqt._tlsrecords", reason="moqt._tlsrecords is not built")
if not hasattr(records, "Records"):
    pytest.skip("moqt._tlsrecords was built without Records", allow_module_level=True)

MiB = 1 << 20
MAX_PLAIN = 1 << 14
APPLICATION_DATA, ALERT, HANDSHAKE = 23, 21, 22
NEW_SESSION_TICKET, KEY_UPDATE = 4, 24

SUITES: dict[str, tuple[Callable[[bytes], Any], type[hashes.HashAlgorithm], int]] = {
    "TLS_AES_128_GCM_SHA256": (AESGCM, hashes.SHA256, 16),
    "TLS_AES_256_GCM_SHA384": (AESGCM, hashes.SHA384, 32),
    "TLS_CHACHA20_POLY1305_SHA256": (ChaCha20Poly1305, hashes.SHA256, 32),
}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    cert, key = make_self_signed("localhost", tmp_path_factory.mktemp("tls-records-certs"))
    return str(cert), str(key)


# --- an independent record protection (RFC 8446 §5.2, §7.1-7.3), with cryptography -----------


def expand_label(
    hash_kind: type[hashes.HashAlgorithm], secret: bytes, label: bytes, n: int
) -> bytes:
    """HKDF-Expand-Label(secret, label, "", n) (§7.1)."""
    full = b"tls13 " + label
    info = n.to_bytes(2, "big") + bytes([len(full)]) + full + b"\x00"
    return HKDFExpand(hash_kind(), n, info).derive(secret)


class Protection:
    """One direction's record protection, from a traffic secret: seals records with any inner
    content (the test's own sender) or opens what Records sealed."""

    def __init__(self, suite: str, secret: bytes) -> None:
        self.aead, self.hash, self.key_len = SUITES[suite]
        self.secret = secret
        self.seq = 0
        self._keys()

    def _keys(self) -> None:
        self.cipher = self.aead(expand_label(self.hash, self.secret, b"key", self.key_len))
        self.iv = expand_label(self.hash, self.secret, b"iv", 12)
        self.seq = 0

    def update(self) -> None:
        """application_traffic_secret_N+1 (§7.2)."""
        self.secret = expand_label(self.hash, self.secret, b"traffic upd", self.hash().digest_size)
        self._keys()

    def _nonce(self) -> bytes:
        return (int.from_bytes(self.iv, "big") ^ self.seq).to_bytes(12, "big")

    def seal(self, content: bytes, kind: int = APPLICATION_DATA, padding: int = 0) -> bytes:
        """A record of TLSInnerPlaintext ``content || kind || zeros(padding)``."""
        return self.seal_inner(content + bytes([kind]) + bytes(padding))

    def seal_inner(self, inner: bytes) -> bytes:
        header = bytes([APPLICATION_DATA, 3, 3]) + (len(inner) + 16).to_bytes(2, "big")
        body: bytes = self.cipher.encrypt(self._nonce(), inner, header)
        self.seq += 1
        return header + body

    def open_all(self, wire: bytes) -> list[tuple[int, bytes]]:
        """Every record of ``wire`` as (content type, content), the keys updated after each
        KeyUpdate as the receiver would."""
        found = []
        for record in split_records(wire):
            assert record[:3] == bytes([APPLICATION_DATA, 3, 3])
            inner = self.cipher.decrypt(self._nonce(), record[5:], record[:5])
            self.seq += 1
            inner = inner.rstrip(b"\x00")
            kind, content = inner[-1], inner[:-1]
            assert len(content) <= MAX_PLAIN
            found.append((kind, content))
            if kind == HANDSHAKE and content[:1] == bytes([KEY_UPDATE]):
                assert content in (b"\x18\x00\x00\x01\x00", b"\x18\x00\x00\x01\x01")
                self.update()
        return found


def split_records(wire: bytes) -> Iterator[bytes]:
    at = 0
    while at < len(wire):
        end = at + 5 + int.from_bytes(wire[at + 3 : at + 5], "big")
        assert end <= len(wire)
        yield wire[at:end]
        at = end


def key_log(path: Path) -> dict[str, bytes]:
    """The secrets of the NSS key log file at ``path`` (one connection), by label."""
    secrets = {}
    for line in path.read_text().splitlines():
        if not line.startswith("#"):  # Python's header line
            label, _random, secret = line.split()
            secrets[label] = bytes.fromhex(secret)
    return secrets


# --- in-process pairs: our Records on one side, stock OpenSSL on the other ----------------------


@dataclass
class Session:
    """A handshaken pair over memory BIOs; ``records`` has taken ``ours`` over."""

    ours: ssl.SSLObject
    stock: ssl.SSLObject
    ours_in: ssl.MemoryBIO
    stock_in: ssl.MemoryBIO
    stock_out: ssl.MemoryBIO
    server_side: bool
    records: Any = None
    suite: str = ""
    secrets: dict[str, bytes] = field(default_factory=dict)
    backlog: bytes = b""  # what the stock side sent with or after the handshake (tickets)

    def to_stock(self, wire: bytes) -> bytes:
        """Give the stock side ``wire``; what it reads (it must read all of it)."""
        self.stock_in.write(wire)
        got = bytearray()
        with contextlib.suppress(ssl.SSLWantReadError):
            while True:
                got += self.stock.read(1 << 20)
        assert not self.stock_in.pending
        return bytes(got)

    def from_stock(self, data: bytes) -> bytes:
        """What the stock side sends when it writes ``data`` (and anything queued before)."""
        if data:
            self.stock.write(data)
        return self.stock_out.read()

    def stock_sender(self) -> Protection:
        """The test's own sender, as the stock side (its next record number after the
        backlog's)."""
        secret = self.secrets[
            "SERVER_TRAFFIC_SECRET_0" if not self.server_side else "CLIENT_TRAFFIC_SECRET_0"
        ]
        sender = Protection(self.suite, secret)
        sender.seq = len(list(split_records(self.backlog)))
        return sender

    def stock_receiver(self) -> Protection:
        """An independent reader of what Records seals."""
        secret = self.secrets[
            "CLIENT_TRAFFIC_SECRET_0" if not self.server_side else "SERVER_TRAFFIC_SECRET_0"
        ]
        return Protection(self.suite, secret)


def contexts(
    certs: tuple[str, str],
    server_side: bool,
    ours: ssl.SSLContext | None,
    stock: ssl.SSLContext | None,
) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """Our context (as QMux makes them) and the stock peer's (a stock server keeps tickets)."""
    cert, key = certs
    if ours is None:
        ours = server_ssl_context(cert, key) if server_side else client_ssl_context(cafile=cert)
    if stock is None:
        if server_side:
            stock = client_ssl_context(cafile=cert)
        else:
            stock = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            stock.load_cert_chain(cert, key)
    return ours, stock


def handshake(
    certs: tuple[str, str],
    tmp_path: Path | None = None,
    *,
    server_side: bool = False,
    suite: str | None = None,
    take: bool = True,
    capture: bool = True,
    ours_context: ssl.SSLContext | None = None,
    stock_context: ssl.SSLContext | None = None,
    rekey_after: int | None = None,
) -> Session:
    """Handshake our side (client, or server when ``server_side``) with a stock peer; with
    ``take``, Records takes our side over. The stock server sends its default two session
    tickets; ours sends none, as Records requires. ``tmp_path``: the stock side logs its
    secrets there."""
    ours_context, stock_context = contexts(certs, server_side, ours_context, stock_context)
    log_file = None
    if tmp_path is not None:
        log_file = tmp_path / f"keys-{random.getrandbits(64):x}.log"
        stock_context.keylog_filename = str(log_file)
    ours_in, ours_out, stock_in, stock_out = (ssl.MemoryBIO() for _ in range(4))
    ours = ours_context.wrap_bio(
        ours_in,
        ours_out,
        server_side=server_side,
        server_hostname=None if server_side else "localhost",
    )
    stock = stock_context.wrap_bio(
        stock_in,
        stock_out,
        server_side=not server_side,
        server_hostname="localhost" if server_side else None,
    )
    if capture:
        assert records.capture(ours._sslobj)  # type: ignore[attr-defined]
    client = stock if server_side else ours
    if suite is not None:
        assert records.ciphersuites(client._sslobj, suite)  # type: ignore[attr-defined]
    server = ours if server_side else stock
    for _ in range(8):
        for side in (client, server):
            with contextlib.suppress(ssl.SSLWantReadError):
                side.do_handshake()
        stock_in.write(ours_out.read())
        ours_in.write(stock_out.read())
        if ours.version() is not None and stock.version() is not None:
            break
    assert ours.version() is not None and stock.version() is not None
    stock_in.write(ours_out.read())  # the client's Finished, where the server has not read it
    with contextlib.suppress(ssl.SSLWantReadError):
        stock.read(1)  # the stock server takes the client's Finished and sends its tickets
    session = Session(ours, stock, ours_in, stock_in, stock_out, server_side)
    cipher = ours.cipher()
    assert cipher is not None
    session.suite = cipher[0]
    if suite is not None:
        assert session.suite == suite
    if log_file is not None:
        session.secrets = key_log(log_file)
    session.backlog = ours_in.read() + stock_out.read()
    if take:
        kwargs = {} if rekey_after is None else {"rekey_after": rekey_after}
        session.records = records.Records(ours._sslobj, server_side, **kwargs)  # type: ignore[attr-defined]
    return session


def open_all(r: Any, wire: bytes | memoryview, room: int = 4 * MiB) -> tuple[bytes, int]:
    """Open every record of ``wire``: (plaintext, last status)."""
    got = bytearray()
    out = bytearray(room)
    view = memoryview(wire)
    while True:
        taken, count, status = r.open(view, out)
        got += out[:count]
        if status != records.MORE:
            return bytes(got), status
        assert taken or count, "MORE with a room that holds any record must make progress"
        view = view[taken:]


SIDES = pytest.mark.parametrize("server_side", [False, True], ids=["ours-client", "ours-server"])


@SIDES
@pytest.mark.parametrize("suite", list(SUITES))
def test_byte_exact_both_ways_for_each_suite(
    certs: tuple[str, str], tmp_path: Path, suite: str, server_side: bool
) -> None:
    """Each size at and around the record limit, both ways; our records are 2^14 octets of
    plaintext each (the last shorter), as the independent reader sees them; the stock server's
    session tickets are skipped on the way in."""
    s = handshake(certs, tmp_path, server_side=server_side, suite=suite)
    r = s.records
    plain, status = open_all(r, s.backlog)
    assert (plain, status) == (b"", records.NEED)
    if not server_side:
        tickets = Protection(suite, s.secrets["SERVER_TRAFFIC_SECRET_0"]).open_all(s.backlog)
        assert [kind for kind, _ in tickets] == [HANDSHAKE, HANDSHAKE]
        assert {content[0] for _, content in tickets} == {NEW_SESSION_TICKET}
    reader = s.stock_receiver()
    rng = random.Random(suite)
    assert r.seal([]) == b"" and r.seal([b""]) == b""
    for size in (1, 16383, 16384, 16385, 3 * MiB + 7):
        data = rng.randbytes(size)
        wire = s.from_stock(data)
        assert open_all(r, wire) == (data, records.NEED)
        sealed = r.seal([data])
        opened = reader.open_all(sealed)
        assert [len(content) for _, content in opened] == [
            min(MAX_PLAIN, size - at) for at in range(0, size, MAX_PLAIN)
        ]
        assert {kind for kind, _ in opened} == {APPLICATION_DATA}
        assert s.to_stock(sealed) == data
    tickets_sent = len(list(split_records(s.backlog)))
    assert r.sequence == (tickets_sent + 1 + 1 + 1 + 2 + 193, reader.seq)


def test_seal_spans_buffers_of_every_kind(certs: tuple[str, str], tmp_path: Path) -> None:
    s = handshake(certs, tmp_path)
    big = bytearray(random.Random(1).randbytes(40000))
    parts: list[Any] = [
        b"ab",
        bytearray(b"cd"),
        memoryview(b"xxefxx")[2:4],
        b"",
        memoryview(big)[1:39999],
        bytearray(),
        memoryview(b""),
        b"z" * 16384,
    ]
    expected = b"".join(bytes(part) for part in parts)
    sealed = s.records.seal(parts)
    opened = s.stock_receiver().open_all(sealed)
    assert [len(content) for _, content in opened] == [
        16384,
        16384,
        16384,
        len(expected) - 3 * 16384,
    ]
    assert s.to_stock(sealed) == expected
    with pytest.raises(BufferError):
        s.records.seal([b"fine", memoryview(b"abcd")[::2]])  # not contiguous
    with pytest.raises(TypeError):
        s.records.seal(["text"])
    assert s.to_stock(s.records.seal([b"still in step"])) == b"still in step"


# --- split streams and small rooms ----------------------------------------------------------


def stream_session(
    certs: tuple[str, str], sizes: list[int], seed: int
) -> tuple[Session, bytes, bytes]:
    """Our client, and the stock server's tickets plus records of ``sizes``: (session, the
    plaintext, the ciphertext)."""
    s = handshake(certs)
    rng = random.Random(seed)
    plain = bytearray()
    wire = bytearray(s.backlog)
    for size in sizes:
        data = rng.randbytes(size)
        plain += data
        if data:
            wire += s.from_stock(data)
    return s, bytes(plain), bytes(wire)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 50000), min_size=1, max_size=5),
    cuts=st.lists(st.integers(1, 40000), min_size=1, max_size=20),
    rooms=st.lists(st.integers(0, 40000), min_size=1, max_size=20),
    seed=st.integers(0, 1 << 30),
)
def test_any_split_and_any_room_reassemble_the_stream(
    certs: tuple[str, str], sizes: list[int], cuts: list[int], rooms: list[int], seed: int
) -> None:
    """Ciphertext cut anywhere (a record's tail is kept for the next call) and plaintext rooms
    of any size: a room too small for the next record gives MORE and loses nothing; the caller
    then offers the rest of its chunk again, with RECORD_ROOM, which always holds a record."""
    s, plain, wire = stream_session(certs, sizes, seed)
    got = bytearray()
    room_sizes = iter(rooms * 100)
    at, cut = 0, 0
    while at < len(wire):
        chunk = memoryview(wire)[at : at + cuts[cut % len(cuts)]]
        at += len(chunk)
        cut += 1
        while True:
            room = next(room_sizes, RECORD_ROOM)
            out = bytearray(room)
            taken, count, status = s.records.open(chunk, out)
            assert 0 <= taken <= len(chunk) and 0 <= count <= room
            got += out[:count]
            chunk = chunk[taken:]
            if status == records.NEED:
                assert not chunk
                break
            assert status == records.MORE
            if room >= RECORD_ROOM:
                assert taken or count
    assert bytes(got) == plain
    assert s.records.open(b"", bytearray(RECORD_ROOM)) == (0, 0, records.NEED)


def test_one_byte_at_a_time(certs: tuple[str, str]) -> None:
    s, plain, wire = stream_session(certs, [3, 0, 20000, 1], 5)
    got = bytearray()
    out = bytearray(RECORD_ROOM)
    for i in range(len(wire)):
        taken, count, status = s.records.open(wire[i : i + 1], out)
        assert (taken, status) == (1, records.NEED)
        got += out[:count]
    assert bytes(got) == plain


def test_a_room_too_small_waits_without_losing_data(certs: tuple[str, str]) -> None:
    """Every record is decrypted in place in ``out`` (a session ticket too): one whose
    inner plaintext does not fit waits, its octets not taken."""
    s, plain, wire = stream_session(certs, [100, 200], 6)
    tickets = len(s.backlog)
    assert s.records.open(wire, bytearray(100)) == (0, 0, records.MORE)  # a ticket is larger
    assert s.records.open(wire, bytearray(RECORD_ROOM)) == (len(wire), 300, records.NEED)
    s, plain, wire = stream_session(certs, [100, 200], 6)
    wire = wire[tickets:]
    assert open_all(s.records, s.backlog) == (b"", records.NEED)
    out = bytearray(150)
    assert s.records.open(wire, out) == (122, 100, records.MORE)  # 200 + 1 octets > 50 left
    assert bytes(out[:100]) == plain[:100]
    assert s.records.open(wire[122:], bytearray(200)) == (0, 0, records.MORE)
    out = bytearray(201)
    assert s.records.open(wire[122:], out) == (222, 200, records.NEED)
    assert bytes(out[:200]) == plain[100:]
    carried = stream_session(certs, [300], 6)  # a record in the carry waits for room too
    assert open_all(carried[0].records, carried[0].backlog)[0] == b""
    body = carried[2][tickets:]
    assert carried[0].records.open(body[:-1], bytearray(RECORD_ROOM)) == (
        len(body) - 1,
        0,
        records.NEED,
    )
    assert carried[0].records.open(body[-1:], bytearray(300)) == (1, 0, records.MORE)
    out = bytearray(301)
    assert carried[0].records.open(b"", out) == (0, 300, records.NEED)
    assert bytes(out[:300]) == carried[1]


# --- KeyUpdate (§4.6.3) -----------------------------------------------------------------------


def ssl_pointer(sslobj: ssl.SSLObject) -> tuple[Any, int]:
    """(libssl through _ssl, the SSL* of ``sslobj``): the pointer-sized field after the object
    header and one PyObject* of _ssl._SSLSocket, checked with SSL_version before use."""
    lib = ctypes.CDLL(_ssl.__file__)
    lib.SSL_version.argtypes = [ctypes.c_void_p]
    lib.SSL_version.restype = ctypes.c_int
    lib.SSL_key_update.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.SSL_key_update.restype = ctypes.c_int
    raw = sslobj._sslobj  # type: ignore[attr-defined]
    pointer = ctypes.c_void_p.from_address(id(raw) + 3 * ctypes.sizeof(ctypes.c_void_p)).value
    if pointer is None or lib.SSL_version(pointer) != 0x0304:
        pytest.skip("the SSL pointer of _ssl._SSLSocket is not where this test expects it")
    return lib, pointer


@SIDES
@pytest.mark.parametrize("requested", [0, 1], ids=["update_not_requested", "update_requested"])
def test_key_update_from_the_stock_peer(
    certs: tuple[str, str], tmp_path: Path, server_side: bool, requested: int
) -> None:
    s = handshake(certs, tmp_path, server_side=server_side)
    r = s.records
    assert open_all(r, s.backlog)[0] == b""
    lib, pointer = ssl_pointer(s.stock)
    assert open_all(r, s.from_stock(b"before"))[0] == b"before"
    assert lib.SSL_key_update(pointer, requested) == 1
    wire = s.from_stock(b"after the update")
    assert len(list(split_records(wire))) == 2  # the KeyUpdate, then the data under new keys
    assert open_all(r, wire) == (b"after the update", records.NEED)
    assert r.sequence[0] == 1
    assert r.respond is bool(requested)
    reader = s.stock_receiver()
    sealed = r.seal([b"reply"])
    opened = reader.open_all(sealed)
    if requested:
        assert opened == [(HANDSHAKE, b"\x18\x00\x00\x01\x00"), (APPLICATION_DATA, b"reply")]
        assert r.sequence[1] == 1  # the new keys have sealed one record
    else:
        assert opened == [(APPLICATION_DATA, b"reply")]
    assert not r.respond
    assert s.to_stock(sealed) == b"reply"
    assert s.to_stock(r.seal([b"and more"])) == b"and more"
    assert open_all(r, s.from_stock(b"still fine"))[0] == b"still fine"


def update_requested(certs: tuple[str, str], tmp_path: Path) -> Session:
    """A server-side handshake whose stock client sent a KeyUpdate asking for ours, read."""
    s = handshake(certs, tmp_path, server_side=True)
    lib, pointer = ssl_pointer(s.stock)
    assert lib.SSL_key_update(pointer, 1) == 1
    assert open_all(s.records, s.from_stock(b"x"))[0] == b"x"
    return s


def test_a_requested_update_is_answered_even_without_data(
    certs: tuple[str, str], tmp_path: Path
) -> None:
    """seal([]) with an answer due carries the KeyUpdate alone."""
    s = update_requested(certs, tmp_path)
    sealed = s.records.seal([])
    assert s.stock_receiver().open_all(sealed) == [(HANDSHAKE, b"\x18\x00\x00\x01\x00")]
    assert s.to_stock(sealed) == b""
    assert not s.records.respond and s.records.seal([]) == b""
    assert s.to_stock(s.records.seal([b"y"])) == b"y"


@SIDES
def test_our_own_key_updates_after_rekey_after_records(
    certs: tuple[str, str], tmp_path: Path, server_side: bool
) -> None:
    s = handshake(certs, tmp_path, server_side=server_side, rekey_after=3)
    r = s.records
    reader = s.stock_receiver()
    data = random.Random(9).randbytes(20 * MAX_PLAIN)
    sealed = r.seal([data])
    kinds = [kind for kind, _ in reader.open_all(sealed)]
    assert kinds == ([APPLICATION_DATA] * 3 + [HANDSHAKE]) * 6 + [APPLICATION_DATA] * 2
    assert r.sequence[1] == 2
    assert s.to_stock(sealed) == data
    got = b""
    for i in range(7):
        one = r.seal([bytes([i])])
        reader.open_all(one)
        got += s.to_stock(one)
        assert r.sequence[1] <= 3
    assert got == bytes(range(7))
    assert open_all(r, s.backlog + s.from_stock(b"reverse"))[0] == b"reverse"


# --- closing (§6.1) ---------------------------------------------------------------------------


@SIDES
def test_the_peers_close_notify_closes_and_what_follows_is_ignored(
    certs: tuple[str, str], server_side: bool
) -> None:
    s = handshake(certs, server_side=server_side)
    wire = s.backlog + s.from_stock(b"before")
    with contextlib.suppress(ssl.SSLWantReadError):
        s.stock.unwrap()
    wire += s.stock_out.read() + b"\x17\x03\x03\x00\x05hello and garbage"
    out = bytearray(RECORD_ROOM)
    taken, count, status = s.records.open(wire, out)
    assert (taken, bytes(out[:count]), status) == (len(wire), b"before", records.CLOSED)
    assert s.records.open(b"more", out) == (4, 0, records.CLOSED)
    assert s.to_stock(s.records.seal([b"we may still write"])) == b"we may still write"


@SIDES
def test_our_close_notify(certs: tuple[str, str], server_side: bool) -> None:
    s = handshake(certs, server_side=server_side)
    closing = s.records.close_notify()
    s.stock_in.write(closing)
    assert s.stock.read(10) == b""  # how SSLObject.read reports the peer's close_notify
    s.stock.unwrap()  # both close_notify alerts exchanged: nothing to wait for
    with pytest.raises(ValueError):
        s.records.seal([b"too late"])
    assert s.records.close_notify() == b""


def test_close_notify_carries_a_requested_key_update_first(
    certs: tuple[str, str], tmp_path: Path
) -> None:
    s = update_requested(certs, tmp_path)
    closing = s.records.close_notify()
    assert s.stock_receiver().open_all(closing) == [
        (HANDSHAKE, b"\x18\x00\x00\x01\x00"),
        (ALERT, b"\x01\x00"),
    ]
    s.stock_in.write(closing)
    assert s.stock.read(10) == b""


# --- what a peer must not send (§5, §4.6, §6) --------------------------------------------------


def fails(r: Any, wire: bytes, message: str) -> None:
    """``wire`` makes open() raise ssl.SSLError saying ``message``; nothing is read after."""
    out = bytearray(RECORD_ROOM)
    with pytest.raises(ssl.SSLError, match=message):
        r.open(wire, out)
    assert r.open(b"", out) == (0, 0, records.CLOSED)
    assert r.open(b"\x17\x03\x03", out) == (3, 0, records.CLOSED)


@pytest.mark.parametrize("where", [2, 5, -1], ids=["header", "body", "tag"])
def test_a_tampered_record_is_a_bad_record_mac(certs: tuple[str, str], where: int) -> None:
    s = handshake(certs, server_side=True)
    wire = bytearray(s.from_stock(b"x" * 100))
    wire[where] ^= 0x01
    fails(s.records, bytes(wire), "bad record mac")


def test_a_record_under_the_wrong_keys_is_a_bad_record_mac(
    certs: tuple[str, str], tmp_path: Path
) -> None:
    s = handshake(certs, tmp_path, server_side=True)
    sender = s.stock_sender()
    sender.seq = 1  # a record skipped: the nonce differs
    fails(s.records, sender.seal(b"out of order"), "bad record mac")


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"\x17\x03\x03\x41\x01", "record overflow"),  # 2^14 + 257 octets of ciphertext
        (b"\x16\x03\x03\x00\x20", "unexpected message"),  # every protected record says 23
        (b"\x15\x03\x03\x00\x20", "unexpected message"),
        (b"\x17\x03\x03\x00\x10", "decode error"),  # no room for a content type and the tag
        (b"\x17\x03\x03\x00\x00", "decode error"),
    ],
)
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_malformed_record_headers(
    certs: tuple[str, str], header: bytes, message: str, split: bool
) -> None:
    s = handshake(certs)
    length = int.from_bytes(header[3:], "big")
    wire = s.backlog + header + bytes(min(length, MAX_PLAIN + 256))
    if split:  # the header arrives in pieces, gathered in the carry
        out = bytearray(RECORD_ROOM)
        at = len(s.backlog) + 2
        assert s.records.open(wire[:at], out)[2] == records.NEED
        wire = wire[at:]
    fails(s.records, wire, message)


Crafted = Callable[[Protection], bytes]


def handshake_message(kind: int, body: bytes) -> bytes:
    return bytes([kind]) + len(body).to_bytes(3, "big") + body


TICKET = handshake_message(
    NEW_SESSION_TICKET, bytes(4) + bytes(4) + b"\x00" + b"\x00\x02ab" + b"\x00\x00"
)
ERRORS: list[tuple[str, bool, Crafted, str]] = [
    ("alert", True, lambda p: p.seal(b"\x02\x28", ALERT), "the peer sent TLS alert 40"),
    ("warning alert", True, lambda p: p.seal(b"\x01\x2a", ALERT), "the peer sent TLS alert 42"),
    ("long alert", True, lambda p: p.seal(b"\x01\x00\x00", ALERT), "decode error"),
    ("short alert", True, lambda p: p.seal(b"\x01", ALERT), "decode error"),
    ("empty alert", True, lambda p: p.seal(b"", ALERT), "decode error"),
    (
        "key update 2",
        True,
        lambda p: p.seal(handshake_message(KEY_UPDATE, b"\x02"), HANDSHAKE),
        "illegal parameter",
    ),
    (
        "long key update",
        True,
        lambda p: p.seal(handshake_message(KEY_UPDATE, b"\x00\x00"), HANDSHAKE),
        "decode error",
    ),
    (
        "empty key update",
        False,
        lambda p: p.seal(handshake_message(KEY_UPDATE, b""), HANDSHAKE),
        "decode error",
    ),
    (
        "key update not at the end of its record",
        False,
        lambda p: p.seal(handshake_message(KEY_UPDATE, b"\x00") + TICKET, HANDSHAKE),
        "unexpected message",
    ),
    (
        "key update then part of a message",
        True,
        lambda p: p.seal(handshake_message(KEY_UPDATE, b"\x00") + b"\x18\x00", HANDSHAKE),
        "unexpected message",
    ),
    ("ticket to a server", True, lambda p: p.seal(TICKET, HANDSHAKE), "unexpected message"),
    (
        "finished after the handshake",
        False,
        lambda p: p.seal(handshake_message(20, bytes(32)), HANDSHAKE),
        "unexpected message",
    ),
    (
        "client hello to a server",
        True,
        lambda p: p.seal(handshake_message(1, bytes(40)), HANDSHAKE),
        "unexpected message",
    ),
    ("empty handshake record", False, lambda p: p.seal(b"", HANDSHAKE), "unexpected message"),
    (
        "a message over 64 KiB",
        False,
        lambda p: p.seal(b"\x04\x01\x00\x00" + bytes(100), HANDSHAKE),
        "unexpected message",
    ),
    (
        "64 KiB of messages held",  # a 65532-octet ticket's tail and what follows it
        False,
        lambda p: (
            p.seal(b"\x04\x00\xff\xfc" + bytes(100), HANDSHAKE)
            + b"".join(p.seal(bytes(MAX_PLAIN), HANDSHAKE) for _ in range(4))
        ),
        "unexpected message",
    ),
    ("no content type", True, lambda p: p.seal_inner(bytes(10)), "unexpected message"),
    ("a lone zero", True, lambda p: p.seal_inner(b"\x00"), "unexpected message"),
    ("change cipher spec", True, lambda p: p.seal(b"\x01", 20), "unexpected message"),
    ("heartbeat", True, lambda p: p.seal(b"\x01\x00\x00", 24), "unexpected message"),
    ("type 0xff", True, lambda p: p.seal(b"x", 255), "unexpected message"),
    ("2^14 + 1 octets", True, lambda p: p.seal(bytes(MAX_PLAIN + 1)), "record overflow"),
    (
        "2^14 + 1 octets with padding",
        False,
        lambda p: p.seal(bytes(MAX_PLAIN + 1), padding=200),
        "record overflow",
    ),
    (  # §5.4: TLSInnerPlaintext (content, type and padding) is 2^14 + 1 octets at most
        "2^14 + 2 octets of inner plaintext",
        True,
        lambda p: p.seal(b"x", padding=MAX_PLAIN),
        "record overflow",
    ),
    (
        "ciphertext over 2^14 + 256",
        True,
        lambda p: p.seal(b"x", padding=MAX_PLAIN + 240),
        "record overflow",
    ),
    (
        "data inside a split handshake message",
        False,
        lambda p: p.seal(TICKET[:3], HANDSHAKE) + p.seal(b"data") + p.seal(TICKET[3:], HANDSHAKE),
        "unexpected message",
    ),
    (
        "an alert inside a split handshake message",
        True,
        lambda p: p.seal(b"\x18\x00", HANDSHAKE) + p.seal(b"\x01\x5a", ALERT),
        "unexpected message",
    ),
]


@pytest.mark.parametrize(
    ("name", "server_side", "crafted", "message"), ERRORS, ids=[e[0] for e in ERRORS]
)
def test_what_a_peer_must_not_send_fails_the_connection(
    certs: tuple[str, str],
    tmp_path: Path,
    name: str,
    server_side: bool,
    crafted: Crafted,
    message: str,
) -> None:
    """Each violation, sealed by the independent sender under the stock side's keys after a
    good record, raises ssl.SSLError naming the alert RFC 8446 §6.2 gives it (or the peer's
    alert); every later open() says CLOSED."""
    s = handshake(certs, tmp_path, server_side=server_side)
    assert open_all(s.records, s.backlog)[0] == b""
    sender = s.stock_sender()
    assert open_all(s.records, sender.seal(b"good"))[0] == b"good"
    fails(s.records, crafted(sender), message)


def updated(p: Protection, data: bytes) -> bytes:
    """``data`` sealed under the sender's next keys (after the KeyUpdate it sealed)."""
    p.update()
    return p.seal(data)


VALID: list[tuple[str, bool, Crafted, bytes]] = [
    ("padding", True, lambda p: p.seal(b"abc", padding=100), b"abc"),
    ("most padding", True, lambda p: p.seal(b"", padding=MAX_PLAIN), b""),
    ("zero-length data", True, lambda p: p.seal(b""), b""),
    ("zero-length data between", True, lambda p: p.seal(b"a") + p.seal(b"") + p.seal(b"b"), b"ab"),
    ("user_canceled", True, lambda p: p.seal(b"\x01\x5a", ALERT) + p.seal(b"on"), b"on"),
    ("padded alert", True, lambda p: p.seal(b"\x01\x5a", ALERT, padding=7) + p.seal(b"on"), b"on"),
    ("ticket to a client", False, lambda p: p.seal(TICKET, HANDSHAKE) + p.seal(b"on"), b"on"),
    (
        "tickets split over records",
        False,
        lambda p: (
            p.seal(TICKET[:1], HANDSHAKE)
            + p.seal(TICKET[1:5], HANDSHAKE)
            + p.seal(TICKET[5:] + TICKET, HANDSHAKE)
            + p.seal(b"on")
        ),
        b"on",
    ),
    (
        "a ticket and a key update in one record",
        False,
        lambda p: (
            p.seal(TICKET + handshake_message(KEY_UPDATE, b"\x00"), HANDSHAKE)
            + updated(p, b"new keys")
        ),
        b"new keys",
    ),
    (
        "a key update split over records",
        True,
        lambda p: (
            p.seal(b"\x18\x00", HANDSHAKE)
            + p.seal(b"\x00\x01\x00", HANDSHAKE)
            + updated(p, b"new keys")
        ),
        b"new keys",
    ),
    (
        "a padded key update",
        True,
        lambda p: (
            p.seal(handshake_message(KEY_UPDATE, b"\x00"), HANDSHAKE, padding=30)
            + updated(p, b"new keys")
        ),
        b"new keys",
    ),
]


@pytest.mark.parametrize(
    ("name", "server_side", "crafted", "plain"), VALID, ids=[v[0] for v in VALID]
)
def test_what_a_peer_may_send_is_accepted(
    certs: tuple[str, str],
    tmp_path: Path,
    name: str,
    server_side: bool,
    crafted: Crafted,
    plain: bytes,
) -> None:
    """Valid records OpenSSL does not send by itself (padding, empty data, user_canceled,
    fragmented post-handshake messages), from the independent sender; whole or a byte at a
    time."""
    for whole in (True, False):
        s = handshake(certs, tmp_path, server_side=server_side)
        assert open_all(s.records, s.backlog)[0] == b""
        sender = s.stock_sender()
        wire = crafted(sender) + sender.seal(b"!")
        if whole:
            assert open_all(s.records, wire) == (plain + b"!", records.NEED)
        else:
            got = b"".join(open_all(s.records, wire[i : i + 1])[0] for i in range(len(wire)))
            assert got == plain + b"!"
        assert not s.records.respond
        assert s.to_stock(s.records.seal([b"back"])) == b"back"


# --- refusals: the records stay with OpenSSL ---------------------------------------------------


def test_capture_refuses_a_context_that_logs_keys(certs: tuple[str, str], tmp_path: Path) -> None:
    context = client_ssl_context(cafile=certs[0])
    context.keylog_filename = str(tmp_path / "keys.log")
    sslobj = context.wrap_bio(ssl.MemoryBIO(), ssl.MemoryBIO(), server_hostname="localhost")
    assert not records.capture(sslobj._sslobj)  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        records.capture(sslobj)


def test_records_refuses_tls_1_2(certs: tuple[str, str]) -> None:
    stock = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    stock.load_cert_chain(*certs)
    stock.maximum_version = ssl.TLSVersion.TLSv1_2
    ours = ssl.create_default_context(cafile=certs[0])
    s = handshake(certs, take=False, ours_context=ours, stock_context=stock)
    assert s.ours.version() == "TLSv1.2"
    with pytest.raises(ValueError, match="not TLS 1.3"):
        records.Records(s.ours._sslobj, False)  # type: ignore[attr-defined]


@SIDES
def test_records_refuses_without_capture(certs: tuple[str, str], server_side: bool) -> None:
    s = handshake(certs, server_side=server_side, take=False, capture=False)
    with pytest.raises(ValueError, match="secrets"):
        records.Records(s.ours._sslobj, server_side)  # type: ignore[attr-defined]


def test_records_refuses_a_server_that_sends_tickets(certs: tuple[str, str]) -> None:
    ours = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ours.load_cert_chain(*certs)
    assert ours.num_tickets == 2
    s = handshake(certs, server_side=True, take=False, ours_context=ours)
    with pytest.raises(ValueError, match="session tickets"):
        records.Records(s.ours._sslobj, True)  # type: ignore[attr-defined]


def test_records_refuses_unread_records_and_a_second_take(certs: tuple[str, str]) -> None:
    s = handshake(certs, server_side=True, take=False)
    s.ours_in.write(s.from_stock(b"hello"))
    assert s.ours.read(1) == b"h"  # OpenSSL holds "ello"
    with pytest.raises(ValueError, match="unread"):
        records.Records(s.ours._sslobj, True)  # type: ignore[attr-defined]
    t = handshake(certs, server_side=True)
    with pytest.raises(ValueError, match="secrets"):  # the first took and wiped them
        records.Records(t.ours._sslobj, True)  # type: ignore[attr-defined]


def test_records_refuses_before_the_handshake(certs: tuple[str, str]) -> None:
    context = client_ssl_context(cafile=certs[0])
    sslobj = context.wrap_bio(ssl.MemoryBIO(), ssl.MemoryBIO(), server_hostname="localhost")
    assert records.capture(sslobj._sslobj)  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        records.Records(sslobj._sslobj, False)  # type: ignore[attr-defined]


# --- real sockets: our transport against asyncio's stock TLS server --------------------------


class SmallTails:
    """Plain buffers (PlainBuffers) whose free tail may hold less than a record: a
    ReceiveBuffers with a small ``min_read``. A long run of get_buffer calls with nothing
    filled is reported as an error instead of spinning the event loop."""

    def __init__(self) -> None:
        self.buffers = ReceiveBuffers(40_000, 1000, prefault=False)
        self.idle = 0
        self.short = 0  # tails handed out shorter than the record room asked for

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        self.idle += 1
        if self.idle > 1000:
            raise AssertionError("the records asked for a buffer 1000 times without filling it")
        tail = self.buffers.get_buffer(sizehint)
        self.short += len(tail) < sizehint
        return tail

    def filled(self, nbytes: int) -> memoryview:
        self.idle = 0
        return self.buffers.filled(nbytes)


def against_stock_server(
    certs: tuple[str, str],
    tmp_path: Path,
    *,
    keylog: bool,
    plain_buffers: Callable[[], Any] = ReceiveBuffers,
) -> TLSWorkerTransport:
    """Our inline TLSWorkerTransport (client) against asyncio.start_server with a stock TLS
    context (two session tickets, as by default): 3 MiB up, echoed back byte-exact, then our
    close; the transport, for the caller to look into."""
    cert, key = certs
    data = random.Random(11).randbytes(3 * MiB + 17)
    kept: list[TLSWorkerTransport] = []

    async def main() -> None:
        server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_context.load_cert_chain(cert, key)
        echoed = asyncio.get_running_loop().create_future()

        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            total = 0
            while chunk := await reader.read(1 << 20):
                writer.write(chunk)
                await writer.drain()
                total += len(chunk)
            echoed.set_result(total)
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()

        server = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=server_context)
        port = server.sockets[0].getsockname()[1]
        context = client_ssl_context(cafile=cert)
        if keylog:
            context.keylog_filename = str(tmp_path / "client-keys.log")
        try:
            client = Peer()
            tls = await open_tls_connection(
                client,
                "127.0.0.1",
                port,
                context=context,
                server_hostname="localhost",
                plain_buffers=plain_buffers(),
                threaded=False,
            )
            kept.append(tls)
            assert tls.get_extra_info("tls_version") == "TLSv1.3"
            taken_over = tls._worker._sealed is not None
            for at in range(0, len(data), 100_000):
                await client.writable.wait()
                tls.write(data[at : at + 100_000])
            while len(client.received) < len(data):
                assert not client.lost.done(), client.lost.result()
                await asyncio.sleep(0.01)
            assert bytes(client.received) == data
            tls.close()
            assert await asyncio.wait_for(echoed, 30) == len(data)
            assert await asyncio.wait_for(client.lost, 30) is None
            assert taken_over is not keylog
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())
    return kept[0]


def test_our_transport_against_a_stock_tls_server(certs: tuple[str, str], tmp_path: Path) -> None:
    """The records taken over (the stock server's tickets skipped on the way)."""
    against_stock_server(certs, tmp_path, keylog=False)


def test_our_transport_with_a_key_log_leaves_the_records_to_openssl(
    certs: tuple[str, str], tmp_path: Path
) -> None:
    """keylog_filename (SSLKEYLOGFILE) owns the key log callback: capture() refuses and
    OpenSSL keeps the records; the connection works the same."""
    against_stock_server(certs, tmp_path, keylog=True)
    assert "CLIENT_TRAFFIC_SECRET_0" in (tmp_path / "client-keys.log").read_text()


def test_our_transport_with_plain_buffers_shorter_than_a_record(
    certs: tuple[str, str], tmp_path: Path
) -> None:
    """A PlainBuffers tail under RECORD_ROOM (a ReceiveBuffers with a small min_read): a
    record that does not fit there still opens (Records answers MORE without progress)."""
    made: list[SmallTails] = []

    def buffers() -> SmallTails:
        made.append(SmallTails())
        return made[-1]

    against_stock_server(certs, tmp_path, keylog=False, plain_buffers=buffers)
    assert made[0].short > 0
