"""A protocol for the tests of :mod:`moqt.qmux_tls`: records what a TLS transport tells it.

Shared by ``tests/moqt/test_qmux_tls.py`` (pairs of our transports) and
``tests/moqt/test_tls_records.py`` (our transport against asyncio's stock TLS).
"""

from __future__ import annotations

import asyncio

from moqt.qmux_tls import TLSWorkerTransport


class Peer(asyncio.Protocol):
    """Records what the transport tells it; echoes what it reads when ``echo``."""

    def __init__(self, *, echo: bool = False, paused: bool = False) -> None:
        self.echo = echo
        self.start_paused = paused
        self.transport: TLSWorkerTransport | None = None
        self.received = bytearray()
        self.events: list[str] = []
        self.lost: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()
        self.writable = asyncio.Event()
        self.writable.set()
        self.pauses = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, TLSWorkerTransport)
        self.transport = transport
        self.events.append("made")
        if self.start_paused:
            transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        assert "eof" not in self.events
        self.received += data
        if self.echo and self.transport is not None:
            self.transport.write(data)

    def eof_received(self) -> bool | None:
        self.events.append("eof")
        return None

    def pause_writing(self) -> None:
        self.pauses += 1
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.events.append("lost")
        if not self.lost.done():
            self.lost.set_result(exc)
