"""Listeners that cannot bind, as an operator meets them: ``kvsp serve`` and ``python -m
relay.app`` say which listener, where and why in one line and exit non-zero, never with a
traceback (HTTP faces, MOQT over QUIC, MOQT over QMux on TLS, TCP and Unix sockets); a
malformed address names its flag; a relay whose later listener fails closes the earlier ones.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsp.cli import main
from moqt.certs import make_self_signed
from moqt.errors import ListenError
from relay.relay import Relay
from tests.support.relay_kit import relay_config


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )


@pytest.fixture
def busy_tcp() -> Iterator[int]:
    """A port something else listens on (TCP)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


def test_a_service_on_a_port_in_use_says_so_in_one_line(tmp_path: Path, busy_tcp: int) -> None:
    done = _run(
        "-m", "kvsp", "serve", "control", "--state", str(tmp_path / "s"),
        "--listen", f"127.0.0.1:{busy_tcp}",
    )  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    expected = (
        f"kvsp: error: cannot listen for HTTP on 127.0.0.1:{busy_tcp}: address already in use"
    )
    assert done.stderr.strip().splitlines()[-1] == expected


@pytest.mark.parametrize("carrier", ["--qmux-tcp-listen", "--qmux-listen", "--holder-listen"])
def test_the_relay_names_the_listener_on_a_port_in_use(
    tmp_path: Path, busy_tcp: int, carrier: str
) -> None:
    what = {
        "--qmux-tcp-listen": "MOQT over QMux (TCP)",
        "--qmux-listen": "MOQT over QMux (TLS)",
        "--holder-listen": "HTTP",
    }[carrier]
    done = _run(
        "-m", "kvsp", "serve", "relay", "--open", "--state", str(tmp_path / "s"),
        "--listen", "127.0.0.1:0", carrier, f"127.0.0.1:{busy_tcp}",
    )  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr
    reason = "address already in use"
    line = f"kvsp: error: cannot listen for {what} on 127.0.0.1:{busy_tcp}: {reason}"
    assert done.stderr.strip().splitlines()[-1] == line


def test_the_relay_names_its_quic_port_in_use(tmp_path: Path) -> None:
    with socket.socket(type=socket.SOCK_DGRAM) as busy:
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        done = _run(
            "-m", "relay.app", "--open", "--state", str(tmp_path / "s"),
            "--listen", f"127.0.0.1:{port}",
        )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    what, reason = "MOQT over QUIC", "address already in use"
    line = f"relay: error: cannot listen for {what} on 127.0.0.1:{port}: {reason}"
    assert done.stderr.strip().splitlines()[-1] == line


def test_the_relay_names_a_unix_socket_it_cannot_make(tmp_path: Path) -> None:
    notes = tmp_path / "notes.sock"
    notes.write_text("not a socket")
    missing = tmp_path / "missing" / "r.sock"
    for path, reason in (
        (missing, "no such file or directory"),
        (notes, "a file that is not a socket is there"),
    ):
        done = _run(
            "-m", "relay.app", "--open", "--state", str(tmp_path / "s"),
            "--listen", "127.0.0.1:0", "--qmux-unix", str(path),
        )  # fmt: skip
        assert done.returncode == 2 and "Traceback" not in done.stderr
        line = f"relay: error: cannot listen for MOQT over QMux (Unix socket) on {path}: {reason}"
        assert done.stderr.strip().splitlines()[-1] == line
    assert notes.read_text() == "not a socket"


def test_a_malformed_listen_address_names_its_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for flag in ("--qmux-tcp-listen", "--qmux-listen", "--holder-listen", "--listen"):
        argv = ["serve", "relay", "--open", "--state", str(tmp_path / "s"), flag, "127.0.0.1:x"]
        assert main(argv) == 1
        expected = f"kvsp: error: {flag}: expected HOST:PORT, got '127.0.0.1:x'"
        assert capsys.readouterr().err.strip().splitlines()[-1] == expected


def test_a_relay_whose_qmux_listener_fails_closes_its_quic_socket(
    tmp_path: Path, busy_tcp: int
) -> None:
    with socket.socket(type=socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        quic_port = probe.getsockname()[1]
    certs = make_self_signed("localhost", tmp_path)
    config = relay_config(certs, port=quic_port, qmux_tcp=("127.0.0.1", busy_tcp))

    async def start() -> None:
        with pytest.raises(ListenError, match="MOQT over QMux \\(TCP\\)"):
            await Relay(config).start()

    asyncio.run(start())
    with socket.socket(type=socket.SOCK_DGRAM) as again:
        again.bind(("127.0.0.1", quic_port))  # free again: the failed start let it go


@pytest.mark.parametrize("path", ["", "/run/kvsp/"])
def test_a_qmux_unix_path_that_names_no_file_is_an_argument_error(
    path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty path would be read as the current folder (refused later, confusingly, as "a
    file that is not a socket"); one ending in ``/`` names a folder."""
    argv = ["serve", "relay", "--open", "--state", str(tmp_path / "s"), "--qmux-unix", path]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    expected = f"argument --qmux-unix: expected the path of a socket file, got {path!r}"
    assert expected in capsys.readouterr().err
