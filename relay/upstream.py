"""The relay's session to an upstream relay (``--upstream moqt://host:port/``; asyncio shell).

Connected on first use and again after it drops; requests the relay cannot route locally go
there (edge → origin). The session authenticates with the relay's own token, if configured:
the edge has already checked the downstream principal's scope, and does not forward its
credential.

Namespaces announced to this relay are announced upstream too (:meth:`UpstreamLink.announce`:
PUBLISH_NAMESPACE on the upstream session, again after every reconnect; PUBLISH_NAMESPACE_DONE
once the last local publisher withdrew), so the upstream relay routes SUBSCRIBE and FETCH for
them here. Whatever the upstream asks of this relay goes through the relay's dispatcher with a
principal that may use nothing, except reading under the namespaces announced to it
(:meth:`UpstreamLink.covers`); such a request is never passed back upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from moqt.asyncio import MOQTConnection, RequestRejected, SessionClosedError, connect
from moqt.backend import TransportConfig, get_backend
from moqt.session_state import LocalProtocolError
from moqt.wire import TrackNamespace

from .routing import is_prefix

log = logging.getLogger(__name__)
DEFAULT_MOQT_PORT = 443


@dataclass(frozen=True, slots=True, kw_only=True)
class UpstreamConfig:
    """Where the upstream relay is and how to reach it."""

    url: str
    token: str | None = None
    cafile: Path | None = None
    verify: bool = True
    backend: str | None = None
    connect_timeout: float = 10.0


def parse_moqt_url(url: str) -> tuple[str, int, str]:
    """``moqt://host[:port]/path`` → (host, port, path).

    Raises:
        ValueError: not a moqt URL with a host.
    """
    parts = urlsplit(url)
    if parts.scheme != "moqt" or not parts.hostname:
        raise ValueError(f"expected moqt://host:port/, got {url!r}")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return parts.hostname, parts.port or DEFAULT_MOQT_PORT, path


Attach = Callable[[MOQTConnection], Awaitable[None]]


class UpstreamLink:
    """A lazily connected, reconnecting client session to the upstream relay.

    ``serve`` is run on each new connection (the relay's dispatcher for what the upstream
    sends); the connection stays open while it runs.
    """

    def __init__(self, config: UpstreamConfig, serve: Attach) -> None:
        self.config = config
        self.host, self.port, self.path = parse_moqt_url(config.url)
        self._serve = serve
        self._connection: MOQTConnection | None = None
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        # announced upstream: namespace -> its PUBLISH_NAMESPACE on the current session, if sent
        self._announced: dict[TrackNamespace, tuple[MOQTConnection, int] | None] = {}
        self._sending: set[asyncio.Task[None]] = set()
        self._inflight: set[TrackNamespace] = set()  # PUBLISH_NAMESPACE on its way

    async def connection(self) -> MOQTConnection:
        """The open upstream session, connecting first when needed.

        Raises:
            ConnectionError: the upstream relay cannot be reached or refused the session.
        """
        async with self._lock:
            current = self._connection
            if current is not None and current.session.closed is None:
                return current
            ready: asyncio.Future[MOQTConnection] = asyncio.get_running_loop().create_future()
            self._task = asyncio.get_running_loop().create_task(self._hold(ready))
            try:
                self._connection = await asyncio.wait_for(ready, self.config.connect_timeout)
            except (OSError, TimeoutError) as exc:
                self._task.cancel()
                raise ConnectionError(f"upstream {self.config.url}: {exc!r}") from exc
            return self._connection

    async def _hold(self, ready: asyncio.Future[MOQTConnection]) -> None:
        cfg = self.config
        backend = get_backend(cfg.backend)
        configuration = backend.configuration(
            is_client=True,
            transport=TransportConfig(),
            cafile=None if cfg.cafile is None else str(cfg.cafile),
            verify=cfg.verify,
            server_name=self.host,
        )
        token = None if cfg.token is None else cfg.token.encode("ascii")
        try:
            async with connect(
                self.host,
                self.port,
                configuration=configuration,
                backend=cfg.backend,
                path=self.path,
                auth_token=token,
                setup_timeout=cfg.connect_timeout,
            ) as connection:
                ready.set_result(connection)
                for namespace in self._announced:  # a new session: announce them all again
                    if namespace not in self._inflight:
                        self._announced[namespace] = None
                        self._spawn(self._send_announce(namespace))
                await self._serve(connection)
        except Exception as exc:  # noqa: BLE001 - any failure is "upstream unavailable"
            if not ready.done():
                ready.set_exception(ConnectionError(f"upstream {cfg.url}: {exc!r}"))
            else:
                log.warning("upstream session ended: %r", exc)

    # --- namespaces announced upstream ----------------------------------------------------------

    def announce(self, namespace: TrackNamespace) -> None:
        """Announce ``namespace`` upstream (connecting when needed), now and after reconnects."""
        if namespace in self._announced:
            return
        self._announced[namespace] = None
        self._spawn(self._send_announce(namespace))

    def withdraw(self, namespace: TrackNamespace) -> None:
        """No publisher here has ``namespace`` any more: PUBLISH_NAMESPACE_DONE upstream."""
        if namespace not in self._announced:
            return
        sent = self._announced.pop(namespace)
        if sent is None:
            return
        connection, request_id = sent
        with contextlib.suppress(LocalProtocolError):
            connection.session.publish_namespace_done(request_id)
            connection.transmit()

    def covers(self, namespace: TrackNamespace) -> bool:
        """Whether ``namespace`` is at or under a namespace announced upstream."""
        return any(is_prefix(prefix, namespace) for prefix in self._announced)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send_announce(self, namespace: TrackNamespace) -> None:
        if namespace in self._inflight:
            return
        self._inflight.add(namespace)
        try:
            connection = await self.connection()
            if namespace not in self._announced:
                return  # withdrawn meanwhile
            ok = await connection.publish_namespace(namespace)
        except (ConnectionError, RequestRejected, SessionClosedError, LocalProtocolError) as exc:
            log.warning("announcing %r upstream failed: %s", namespace, exc)
            return
        finally:
            self._inflight.discard(namespace)
        if namespace in self._announced:
            self._announced[namespace] = (connection, ok.request_id)
        else:  # withdrawn while the announcement was on its way
            with contextlib.suppress(LocalProtocolError):
                connection.session.publish_namespace_done(ok.request_id)
                connection.transmit()

    async def close(self) -> None:
        """Close the upstream session."""
        connection, self._connection = self._connection, None
        if connection is not None and connection.session.closed is None:
            connection.close()
        for task in list(self._sending):
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
