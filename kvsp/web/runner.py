"""Running a service app under uvicorn (DESIGN.md §1 services, §7 measured HTTP paths).

:func:`serve` binds the listening socket itself (port 0 picks an ephemeral port), runs uvicorn
on it with the fast loop and parser when importable (uvloop and httptools move block bodies
much faster than h11), writes the base URL to a ready file once the server accepts
connections, and shuts down cleanly on SIGTERM or SIGINT with exit status 0.

**Leaving gracefully.** A service may pass ``on_signal``, a coroutine function run on the
first SIGTERM or SIGINT while the server goes on serving (the instance drains its sessions,
withdraws its replicas and ends its epoch there, :mod:`kvsp.services.instance.app`); the server
shuts down once it returns or raises. A second signal shuts down at once (in-flight requests
still get ``graceful_shutdown_s``), a third stops waiting for them.

**Read timeouts.** uvicorn bounds only the wait between a response and the next request
(``timeout_keep_alive``); a connection that sends nothing, or a request head one octet at a
time, or a body that stalls, would hold its socket forever. :func:`bounded_protocol` wraps
uvicorn's HTTP protocol with three more timers (:class:`ReadTimeouts`): the whole request head
(request line and fields, counted from the connection's start or the first octet of the next
request) within ``head_s``; no gap longer than ``body_idle_s`` between two reads of a body the
app is waiting for; and an idle keep-alive connection closed after ``keep_alive_s``. A partial
head that runs out of time is answered ``408`` and closed (a connection that sent nothing is
just closed, as an idle keep-alive one is); a stalled body is closed, and the app sees the
client go away (:class:`~kvsp.web.http.ClientDisconnected`). A TLS handshake is bounded by
asyncio's own ``ssl_handshake_timeout`` (60 s), before the head timer starts.

**The start-up heap.** Once a service serves, :func:`freeze_startup_heap` moves what it holds
(modules, classes, apps, clients: tens of thousands of objects that live as long as the
process) out of the cyclic collector's sight, so that a full collection walks only what was
made since instead of pausing the event loop for tens of milliseconds in the middle of a
transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import ipaddress
import logging
import os
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, ClassVar

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.flow_control import FlowControl

from moqt.errors import listening

_log = logging.getLogger("kvsp.web.runner")

_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadTimeouts:
    """How long an HTTP connection may take to send what the server waits for (seconds)."""

    head_s: float = 10.0
    """The request line and header fields, from the connection's start (or the first octet of
    a later request on it) to the end of the head."""
    body_idle_s: float = 30.0
    """The longest gap between two reads of a request body (not counted while the app has
    not taken what was read)."""
    keep_alive_s: int = 5
    """An idle connection between requests."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig:
    """Where and how to serve one app."""

    host: str = "127.0.0.1"
    port: int = 0
    """0 picks an ephemeral port; the chosen one is in the ready file."""
    ready_file: Path | None = None
    """Receives the base URL (``http://127.0.0.1:PORT/``) once the server is serving."""
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    log_level: str = "warning"
    graceful_shutdown_s: int = 5
    """How long in-flight requests may run on after a shutdown signal."""
    timeouts: ReadTimeouts = ReadTimeouts()
    """Request head, body and keep-alive bounds (:class:`ReadTimeouts`)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``(host, port)``; port 0 picks an ephemeral port.

    Raises:
        ListenError: it cannot bind (e.g. the port is in use, the host is not this one's).
    """
    family = socket.AF_INET6 if _is_ipv6(host) else socket.AF_INET
    with listening("HTTP", (host, port)):
        # IPPROTO_TCP named, not 0: asyncio's own loop disables Nagle (TCP_NODELAY) only on
        # accepted sockets whose proto says TCP. Without it a keep-alive answer written as
        # head then body waits ~40 ms for the client's delayed ACK (uvloop sets it either way).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(2048)
        except BaseException:
            sock.close()
            raise
    return sock


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def base_url(host: str, port: int, tls: bool = False) -> str:
    """The base URL clients use for a server bound to ``(host, port)``.

    A wildcard address is reached through loopback; IPv6 literals are bracketed.
    """
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if _is_ipv6(host):
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}/"


def write_ready_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file, then rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)


_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 21\r\nconnection: close\r\n\r\nrequest head too slow"
)


def http_protocol_class() -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol: httptools when importable (much faster), else h11."""
    if importlib.util.find_spec("httptools") is not None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return H11Protocol


class _ReadDeadlines:
    """The head and body timers, mixed in before a uvicorn HTTP protocol.

    Both uvicorn protocols keep the request being received in ``cycle`` (a new one once a
    head is complete; ``more_body`` until the body is) and their flow control in ``flow``,
    so the timers need only watch those around each read.
    """

    kvsp_timeouts: ClassVar[ReadTimeouts]
    cycle: Any
    transport: asyncio.Transport
    flow: FlowControl
    _kvsp_timer: asyncio.TimerHandle | None = None
    _kvsp_partial = False  # some octets of a request head, not all of it, have arrived

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._kvsp_arm(self.kvsp_timeouts.head_s, self._kvsp_head_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self._kvsp_cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        super().data_received(data)  # type: ignore[misc]
        cycle = self.cycle
        if self.transport.is_closing():
            self._kvsp_cancel()
        elif cycle is not None and not cycle.response_complete and cycle.more_body:
            self._kvsp_arm(self.kvsp_timeouts.body_idle_s, self._kvsp_body_stalled)
        elif cycle is before and (cycle is None or cycle.response_complete):
            self._kvsp_partial = True
            if self._kvsp_timer is None:  # the first octets of a head
                self._kvsp_arm(self.kvsp_timeouts.head_s, self._kvsp_head_expired)
        else:  # a complete request: the app has it; uvicorn's keep-alive timer follows it
            self._kvsp_cancel()
        if cycle is not before:
            self._kvsp_partial = False

    def _kvsp_arm(self, delay: float, callback: Callable[[], None]) -> None:
        self._kvsp_cancel()
        self._kvsp_timer = asyncio.get_running_loop().call_later(delay, callback)

    def _kvsp_cancel(self) -> None:
        if self._kvsp_timer is not None:
            self._kvsp_timer.cancel()
            self._kvsp_timer = None

    def _kvsp_head_expired(self) -> None:
        self._kvsp_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or (cycle is not None and not cycle.response_complete):
            return  # a request is being handled: not a head timeout
        _log.info("closing a connection: no request head within %s s", self.kvsp_timeouts.head_s)
        if self._kvsp_partial:  # never on a connection that sent nothing: a client may be
            self.transport.write(_REQUEST_TIMEOUT)  # about to send on it, and read this
        self.transport.close()

    def _kvsp_body_stalled(self) -> None:
        self._kvsp_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or not cycle.more_body:
            return
        if self.flow.read_paused:  # the app has not taken what was read: not the client's fault
            self._kvsp_arm(self.kvsp_timeouts.body_idle_s, self._kvsp_body_stalled)
            return
        _log.info("closing a connection: its body stalled %s s", self.kvsp_timeouts.body_idle_s)
        self.transport.close()


def bounded_protocol(
    base: type[asyncio.Protocol], timeouts: ReadTimeouts
) -> type[asyncio.Protocol]:
    """``base`` (a uvicorn HTTP protocol class) with the head and body timers of
    ``timeouts``; pass it to ``uvicorn.Config(http=...)``."""
    bounded: type[asyncio.Protocol] = type(
        f"Bounded{base.__name__}", (_ReadDeadlines, base), {"kvsp_timeouts": timeouts}
    )
    return bounded


def _uvicorn_config(app: ASGIApp, config: ServeConfig) -> uvicorn.Config:
    fast_loop = importlib.util.find_spec("uvloop") is not None
    return uvicorn.Config(
        app,
        loop="uvloop" if fast_loop else "asyncio",
        http=bounded_protocol(http_protocol_class(), config.timeouts),
        timeout_keep_alive=config.timeouts.keep_alive_s,
        lifespan="auto",
        access_log=False,
        log_config=None,  # records go to the root logger (kvsp.web.logs formats them)
        log_level=config.log_level,
        ssl_certfile=os.fspath(config.ssl_certfile) if config.ssl_certfile else None,
        ssl_keyfile=os.fspath(config.ssl_keyfile) if config.ssl_keyfile else None,
        timeout_graceful_shutdown=config.graceful_shutdown_s,
        server_header=False,
    )


class _Server(uvicorn.Server):
    """uvicorn's server with our own signal handling and a hook for "now serving".

    uvicorn re-raises a captured SIGTERM after shutting down, which ends the process with
    -SIGTERM; a service stopped on purpose should exit 0, so the signals are handled here.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        on_serving: Callable[[], None],
        on_signal: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(config)
        self._on_serving = on_serving
        self._on_signal_hook = on_signal
        self._loop: asyncio.AbstractEventLoop | None = None
        self._leaving: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            self._on_serving()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self._on_signal_hook is not None and self._leaving is None and not self.should_exit:
            loop = self._loop
            if loop is not None and self.started:
                _log.info("signal %s: leaving gracefully before shutting down", sig)
                loop.call_soon_threadsafe(self._leave)
                return
        if self.should_exit:
            self.force_exit = True  # a second signal: stop waiting for in-flight requests
        self.should_exit = True

    def _leave(self) -> None:
        self._leaving = asyncio.ensure_future(self._run_leave())

    async def _run_leave(self) -> None:
        hook = self._on_signal_hook
        try:
            if hook is not None:
                await hook()
        except Exception:
            _log.exception("leaving gracefully failed; shutting down")
        finally:
            self.should_exit = True


def freeze_startup_heap(*, collect: bool = False) -> int:
    """Move every object alive now out of the cyclic collector's sight (``gc.freeze``), after
    a full collection with ``collect``; how many are frozen in all.

    Called once a service serves: its start-up objects live as long as it does, and without
    this every full collection would walk them all. Without ``collect`` it takes no time (the
    little cyclic garbage of start-up stays); with it, the pause of one collection.
    """
    if collect:
        gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def serve_async(
    app: ASGIApp,
    config: ServeConfig,
    on_serving: Callable[[str], None] | None = None,
    on_signal: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serve ``app`` until a shutdown signal; ``on_serving(base_url)`` runs once it is serving,
    ``on_signal()`` on the first signal before the server shuts down (see the module
    docstring).

    Signal handlers are installed only when called from the main thread.
    """
    sock = bind_socket(config.host, config.port)
    url = base_url(config.host, sock.getsockname()[1], tls=config.ssl_certfile is not None)

    def serving() -> None:
        freeze_startup_heap()
        if config.ready_file is not None:
            write_ready_file(config.ready_file, url)
        if on_serving is not None:
            on_serving(url)

    server = _Server(_uvicorn_config(app, config), serving, on_signal)
    try:
        await server.serve(sockets=[sock])
    finally:
        sock.close()


def serve(app: ASGIApp, config: ServeConfig) -> int:
    """Serve ``app`` in this process until SIGTERM/SIGINT; returns the exit status (0)."""
    loop_factory = _uvicorn_config(app, config).get_loop_factory()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve_async(app, config))
    return 0
