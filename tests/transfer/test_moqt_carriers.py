"""Carrier choice for MOQT sessions (kvsp.transfer.moqt_carriers): which of a record's
``moqt_carriers`` a client may use, in which order, and the URIs that name them."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvsp.errors import UnsupportedHolder
from kvsp.transfer.moqt_carriers import (
    CarrierPolicy,
    carrier_candidates,
    check_allowed,
    is_loopback,
)
from kvsp.transfer.moqt_transfer import MoqtAddress, parse_moqt_uri

HOLDER = "moqt://relay.example:4443/"


@pytest.fixture
def unix_socket(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "relay.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    try:
        yield path
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("uri", "address"),
    [
        ("moqt://h.example/", MoqtAddress("h.example", 443, "/")),
        ("moqt://h.example:9/kv?x=1", MoqtAddress("h.example", 9, "/kv?x=1")),
        ("moqt+tls://h.example:9/", MoqtAddress("h.example", 9, "/", "tls")),
        ("MOQT+TCP://127.0.0.1:9", MoqtAddress("127.0.0.1", 9, None, "tcp")),
        ("moqt+tls://[::1]:9/", MoqtAddress("::1", 9, "/", "tls")),
        (
            "moqt+unix://localhost/run/kvsp/r.sock",
            MoqtAddress("localhost", 0, None, "unix", "/run/kvsp/r.sock"),
        ),
    ],
)
def test_carrier_uris_parse(uri: str, address: MoqtAddress) -> None:
    assert parse_moqt_uri(uri) == address


@pytest.mark.parametrize(
    "uri",
    [
        "https://h.example/",
        "moqt+quic://h.example:9/",
        "moqt+tls://h.example/",  # a QMux carrier has no default port
        "moqt+tcp://h.example:99999/",
        "moqt+unix:///run/r.sock",  # no host
        "moqt+unix://localhost:9/run/r.sock",
        "moqt+unix://localhost/run/r.sock?x",
        "moqt+tls://:9/",
    ],
)
def test_bad_carrier_uris_are_unsupported_holders(uri: str) -> None:
    for _ in range(2):  # a failure is not remembered as an address: it raises again
        with pytest.raises(UnsupportedHolder):
            parse_moqt_uri(uri)


def test_a_uri_read_again_gives_the_address_already_parsed() -> None:
    uri = "moqt+unix://localhost/run/kvsp/again.sock"
    first = parse_moqt_uri(uri)
    assert parse_moqt_uri(uri) is first  # every FETCH reads its record's holder and carriers
    assert parse_moqt_uri("moqt+tcp://127.0.0.1:7/") is not first


def test_same_origin_carriers_come_first_in_record_order_then_quic() -> None:
    carriers = [
        "moqt+tls://relay.example:4444/",
        "moqt+tls://evil.example:4444/",  # another host: never used
        "moqt+tcp://relay.example:4445/",  # plain TCP beyond loopback: not without trust
        "moqt+unix://localhost/nowhere/relay.sock",  # the holder is not this machine
        "ftp://relay.example/",
    ]
    chosen = carrier_candidates(HOLDER, carriers)
    assert [str(a) for a in chosen] == ["tls:relay.example:4444", "quic:relay.example:4443"]
    trusted = carrier_candidates(HOLDER, carriers, CarrierPolicy(trusted_network=True))
    assert [a.carrier for a in trusted] == ["tls", "tcp", "quic"]
    assert carrier_candidates(HOLDER, carriers, CarrierPolicy(qmux=False)) == (
        parse_moqt_uri(HOLDER),
    )
    assert carrier_candidates(HOLDER, None) == (parse_moqt_uri(HOLDER),)


def test_loopback_holders_may_use_tcp_and_an_existing_local_socket(unix_socket: Path) -> None:
    holder = "moqt://127.0.0.1:4443/"
    carriers = [
        f"moqt+unix://localhost{unix_socket}",
        f"moqt+unix://localhost{unix_socket.parent / 'gone.sock'}",
        "moqt+tcp://127.0.0.1:4445/",
        "moqt+tls://127.0.0.1:4444/",
    ]
    chosen = carrier_candidates(holder, carriers)
    assert [a.carrier for a in chosen] == ["unix", "tcp", "tls", "quic"]
    assert chosen[0].socket_path == str(unix_socket)


def test_a_socket_path_that_is_a_plain_file_is_not_used(tmp_path: Path) -> None:
    plain = tmp_path / "not-a-socket"
    plain.write_bytes(b"")
    chosen = carrier_candidates("moqt://127.0.0.1:1/", [f"moqt+unix://localhost{plain}"])
    assert [a.carrier for a in chosen] == ["quic"]


def test_a_carrier_holder_is_dialled_as_given() -> None:
    assert carrier_candidates("moqt+tls://relay.example:4444/", ["moqt+tcp://x:1/"]) == (
        parse_moqt_uri("moqt+tls://relay.example:4444/"),
    )


def test_direct_dials_refuse_plain_tcp_beyond_loopback_without_trust() -> None:
    remote = parse_moqt_uri("moqt+tcp://10.1.2.3:4445/")
    with pytest.raises(UnsupportedHolder, match="trusted network"):
        check_allowed(remote, CarrierPolicy())
    assert check_allowed(remote, CarrierPolicy(trusted_network=True)) == remote
    local = parse_moqt_uri("moqt+tcp://127.0.0.1:4445/")
    assert check_allowed(local, CarrierPolicy()) == local
    with pytest.raises(UnsupportedHolder, match="turned off"):
        check_allowed(parse_moqt_uri("moqt+tls://h:1/"), CarrierPolicy(qmux=False))


@pytest.mark.parametrize(
    ("host", "expected"),
    [("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("LOCALHOST", True)],
)
def test_loopback_names(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected


@pytest.mark.parametrize("host", ["10.0.0.1", "relay.example", "0.0.0.0", "::"])
def test_non_loopback_names(host: str) -> None:
    assert not is_loopback(host)


class _OpenSession:
    """Stands in for a pooled MOQT session: ``session.closed`` None while open."""

    def __init__(self) -> None:
        self.session = self
        self.closed: object = None


def _record(holder: str, carriers: list[str]) -> Any:
    return SimpleNamespace(holder=holder, moqt_carriers=tuple(carriers))


def test_a_clients_carrier_list_is_read_again_unless_its_first_carriers_session_is_open(
    unix_socket: Path,
) -> None:
    from kvsp.transfer.moqt_client import MoqtBlockClient

    holder = "moqt://127.0.0.1:4443/"
    record = _record(holder, [f"moqt+unix://localhost{unix_socket}", "moqt+tcp://127.0.0.1:9/"])
    client = MoqtBlockClient(verify=False)
    first = client.candidates(holder, record)
    assert [a.carrier for a in first] == ["unix", "tcp", "quic"]
    unix_socket.unlink()  # no session over it yet: the next FETCH reads the carriers again
    assert [a.carrier for a in client.candidates(holder, record)] == ["tcp", "quic"]
    unix_socket.touch()
    session = _OpenSession()
    client._sessions[first[0]] = (contextlib.AsyncExitStack(), session)  # type: ignore[assignment]
    assert [a.carrier for a in client.candidates(holder, record)] == ["tcp", "quic"]  # a file
    unix_socket.unlink()
    bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound.bind(str(unix_socket))
    try:
        assert client.candidates(holder, record) == first  # read again: the socket is back
        unix_socket.unlink()  # the open session over it is kept using, not re-checked
        assert client.candidates(holder, record) == first
        session.closed = "gone"
        assert [a.carrier for a in client.candidates(holder, record)] == ["tcp", "quic"]
    finally:
        bound.close()


def test_a_list_whose_first_carrier_was_unusable_is_read_again_each_time(tmp_path: Path) -> None:
    from kvsp.transfer.moqt_client import MoqtBlockClient

    holder = "moqt://127.0.0.1:4443/"
    path = tmp_path / "later.sock"
    record = _record(holder, [f"moqt+unix://localhost{path}", "moqt+tcp://127.0.0.1:9/"])
    client = MoqtBlockClient(verify=False)
    tcp = client.candidates(holder, record)
    assert [a.carrier for a in tcp] == ["tcp", "quic"]
    client._sessions[tcp[0]] = (contextlib.AsyncExitStack(), _OpenSession())  # type: ignore[assignment]
    bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound.bind(str(path))
    try:  # the socket the record lists first appeared: it is preferred from now on
        assert [a.carrier for a in client.candidates(holder, record)] == ["unix", "tcp", "quic"]
    finally:
        bound.close()
