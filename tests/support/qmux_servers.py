"""A QMux server for tests that watch what it keeps: every connection its handler reached, and
a wait until it holds no connection and no handler task (moqt.qmux_asyncio.QMuxServer)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from moqt.asyncio import MOQTConnection
from moqt.qmux_asyncio import QMuxEndpoint, QMuxServer, serve_qmux


@contextlib.asynccontextmanager
async def listening(
    endpoint: QMuxEndpoint, **options: Any
) -> AsyncIterator[tuple[QMuxServer, list[MOQTConnection]]]:
    """``serve_qmux(endpoint, **options)`` whose handler appends each connection it reaches to
    the list yielded with the server; closed at the end."""
    reached: list[MOQTConnection] = []

    async def handler(connection: MOQTConnection) -> None:
        reached.append(connection)

    server = await serve_qmux(endpoint, handler=handler, **options)
    try:
        yield server, reached
    finally:
        server.close()
        await server.wait_closed()


async def released(server: QMuxServer) -> None:
    """Return once the server holds no connection and no handler task."""
    while server.protocols or server.tasks:
        await asyncio.sleep(0.01)
