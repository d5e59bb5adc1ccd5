"""Read timeouts (DESIGN.md §2 ``web/``; kvsp.web.runner ReadTimeouts, moqt.qmux_asyncio
setup bound): slow and idle connections are closed within their bound.

Against real processes (``kvsp serve index`` and the relay's HTTP face, each run with 1 s
bounds), sixty connections at once: idle from the start, a request head sent one octet at a
time, a body that stops after a few octets, and a keep-alive connection left idle after an
answer. Each must be closed within its bound plus a margin, and the service still answers.
In-process, a QMux listener aborts connections that never finish TLS or MOQT setup.
"""

from __future__ import annotations

import asyncio
import json
import selectors
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService, start_process
from moqt.certs import make_self_signed
from moqt.qmux_asyncio import QMuxEndpoint, serve_qmux, server_ssl_context

TOKEN = "timeouts-test-admin-token-0123456789abcd"
BOUND_S = 1.0
MARGIN_S = 2.5  # a loaded test machine; without the bounds these connections stay open
TIMEOUT_ARGS = ("--head-timeout", "1", "--body-timeout", "1", "--keep-alive-timeout", "1")


def _index(tmp_path: Path, principals: Path) -> tuple[RunningService, str, str]:
    argv = [
        sys.executable, "-m", "kvsp", "serve", "index", "--listen", "127.0.0.1:0",
        "--state", str(tmp_path / "state"), "--principals", str(principals), *TIMEOUT_ARGS,
    ]  # fmt: skip
    service = start_process(argv, workdir=tmp_path)
    return service, service.base_url, "lookup"


def _relay(tmp_path: Path, principals: Path) -> tuple[RunningService, str, str]:
    argv = [
        sys.executable, "-m", "relay.app", "--listen", "127.0.0.1:0",
        "--state", str(tmp_path / "state"), "--principals", str(principals),
        "--qmux-listen", "off", *TIMEOUT_ARGS,
    ]  # fmt: skip
    service = start_process(argv, workdir=tmp_path)
    return service, json.loads(service.base_url)["http"], "leases"


@dataclass
class Probe:
    """One slow connection: what it sends when, and when the server closed it."""

    kind: str
    sock: socket.socket
    pending: bytes = b""
    opened: float = field(default_factory=time.monotonic)
    closed: float | None = None
    received: bytes = b""


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    sock.setblocking(False)
    return sock


def _probes(url: str, body_path: str) -> list[Probe]:
    host = urlsplit(url).netloc
    trickled = f"GET /healthz HTTP/1.1\r\nhost: {host}\r\nx-padding: {'p' * 200}\r\n\r\n"
    stalled = (
        f"POST /{body_path} HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {TOKEN}\r\n"
        'content-type: application/kvsp+json\r\ncontent-length: 1000\r\n\r\n{"scope_id": '
    ).encode()
    probes: list[Probe] = []
    for _ in range(20):
        probes.append(Probe("idle", _connect(url)))
        probes.append(Probe("head octet by octet", _connect(url), trickled.encode()))
    for _ in range(10):
        probe = Probe("stalled body", _connect(url))
        probe.sock.sendall(stalled)
        probes.append(probe)
        probe = Probe("idle keep-alive", _connect(url))
        probe.sock.sendall(f"GET /healthz HTTP/1.1\r\nhost: {host}\r\n\r\n".encode())
        probes.append(probe)
    return probes


def _watch(probes: list[Probe], deadline_s: float) -> None:
    """Send the trickled heads an octet per 0.1 s each, and note when each probe is closed."""
    selector = selectors.DefaultSelector()
    for probe in probes:
        selector.register(probe.sock, selectors.EVENT_READ, probe)
    end = time.monotonic() + deadline_s
    next_octet = 0.0
    while any(p.closed is None for p in probes) and time.monotonic() < end:
        now = time.monotonic()
        if now >= next_octet:
            next_octet = now + 0.1
            for probe in probes:
                if probe.closed is None and probe.pending:
                    try:
                        probe.sock.send(probe.pending[:1])
                    except OSError:
                        _closed(selector, probe)
                        continue
                    probe.pending = probe.pending[1:]
        for key, _ in selector.select(timeout=0.05):
            probe = key.data
            try:
                data = probe.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                _closed(selector, probe)
            probe.received += data
    selector.close()


def _closed(selector: selectors.BaseSelector, probe: Probe) -> None:
    probe.closed = time.monotonic()
    selector.unregister(probe.sock)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", [_index, _relay], ids=["index", "relay"])
def test_slow_and_idle_connections_are_closed_within_the_bound(
    tmp_path: Path, start: Callable[[Path, Path], tuple[RunningService, str, str]]
) -> None:
    principals = tmp_path / "principals.toml"
    write_principals(principals, [principal_entry("admin", TOKEN, ["admin"], None)])
    (tmp_path / "run").mkdir()
    service, url, body_path = start(tmp_path / "run", principals)
    with service:
        probes = _probes(url, body_path)
        try:
            _watch(probes, deadline_s=BOUND_S + MARGIN_S + 3)
            late = [
                (p.kind, None if p.closed is None else round(p.closed - p.opened, 2))
                for p in probes
                if p.closed is None or p.closed - p.opened > BOUND_S + MARGIN_S
            ]
            assert not late, late
            for probe in probes:
                if probe.kind == "idle":  # a client may be about to use it: no stray answer
                    assert probe.received == b"", probe.received[:40]
                elif probe.kind == "head octet by octet":
                    assert probe.received.startswith(b"HTTP/1.1 408 "), probe.received[:40]
        finally:
            for probe in probes:
                probe.sock.close()
        assert httpx.get(url + "healthz", timeout=10).json() == {"status": "ok"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("carrier", ["tcp", "tls", "unix"])
def test_qmux_connections_without_setup_are_aborted(carrier: str, tmp_path: Path) -> None:
    async def handler(connection: object) -> None:
        raise AssertionError("no connection here completes its setup")

    async def main() -> float:
        context = None
        if carrier == "tls":
            context = server_ssl_context(*map(str, make_self_signed("localhost", tmp_path)))
        endpoint = (
            QMuxEndpoint("unix", path=str(tmp_path / "q.sock"))
            if carrier == "unix"
            else QMuxEndpoint(carrier, host="127.0.0.1", port=0)  # type: ignore[arg-type]
        )
        server = await serve_qmux(endpoint, handler=handler, ssl_context=context, setup_timeout=0.5)
        began = time.monotonic()
        try:
            if carrier == "unix":
                reader, writer = await asyncio.open_unix_connection(str(tmp_path / "q.sock"))
            else:
                address = server.address
                assert isinstance(address, tuple)
                reader, writer = await asyncio.open_connection(*address)
            await asyncio.wait_for(reader.read(), 10)  # sends nothing; EOF once aborted
            writer.close()
            return time.monotonic() - began
        except ConnectionResetError:
            return time.monotonic() - began
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) < 0.5 + MARGIN_S
