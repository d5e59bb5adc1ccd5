"""A QUIC client's socket is closed on exit even when its exit is cancelled (moqt.transport's
quic_client on both backends): the libraries close their transport only after waiting for the
connection's end (RFC 9000 §10.2), and a cancelled wait used to leave the socket open."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import socket
from typing import Any

import pytest

from moqt.backend import get_backend
from moqt.transport import quic_client
from tests.support.backends import BACKENDS


def silent_port() -> socket.socket:
    """A bound UDP socket that never answers: a handshake to it waits."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_client_cancelled_while_it_closes_still_closes_its_socket(backend: str) -> None:
    quic = get_backend(backend)
    made: list[Any] = []
    base = importlib.import_module(f"{backend}.asyncio.protocol").QuicConnectionProtocol

    def create_protocol(connection: Any, stream_handler: Any = None) -> Any:
        made.append(base(connection, stream_handler))
        return made[-1]

    async def scenario(port: int) -> None:
        configuration = quic.configuration(is_client=True, verify=False)

        async def connect() -> None:
            client = quic_client(
                quic,
                "127.0.0.1",
                port,
                configuration=configuration,
                create_protocol=create_protocol,
            )
            async with client:
                raise AssertionError("no server answered, yet the handshake completed")

        task = asyncio.create_task(connect())
        await asyncio.sleep(0.2)  # waiting for the handshake
        task.cancel()  # the exit starts: close, then wait for the connection's end
        await asyncio.sleep(0.05)
        task.cancel()  # that wait is cancelled too
        with pytest.raises(asyncio.CancelledError):
            await task
        transport = made[0]._transport
        assert transport is not None and transport.is_closing()

    listener = silent_port()
    try:
        asyncio.run(scenario(listener.getsockname()[1]))
    finally:
        listener.close()
