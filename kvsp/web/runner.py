"""Running a service app under uvicorn (DESIGN.md §1 services, §7 measured HTTP paths).

:func:`serve` binds the listening socket itself (port 0 picks an ephemeral port), runs uvicorn
on it with the fast loop and parser when importable (uvloop and httptools move block bodies
much faster than h11), writes the base URL to a ready file once the server accepts
connections, and shuts down cleanly on SIGTERM or SIGINT with exit status 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import ipaddress
import os
import signal
import socket
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``(host, port)``; port 0 picks an ephemeral port."""
    family = socket.AF_INET6 if _is_ipv6(host) else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio's own loop disables Nagle (TCP_NODELAY) only on
    # accepted sockets whose proto says TCP. Without it a keep-alive answer written as head
    # then body waits ~40 ms for the client's delayed ACK (uvloop sets it either way).
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


def _uvicorn_config(app: ASGIApp, config: ServeConfig) -> uvicorn.Config:
    fast_loop = importlib.util.find_spec("uvloop") is not None
    fast_http = importlib.util.find_spec("httptools") is not None
    return uvicorn.Config(
        app,
        loop="uvloop" if fast_loop else "asyncio",
        http="httptools" if fast_http else "h11",
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

    def __init__(self, config: uvicorn.Config, on_serving: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_serving = on_serving

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
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
        if self.should_exit:
            self.force_exit = True  # a second signal: stop waiting for in-flight requests
        self.should_exit = True


async def serve_async(
    app: ASGIApp, config: ServeConfig, on_serving: Callable[[str], None] | None = None
) -> None:
    """Serve ``app`` until a shutdown signal; ``on_serving(base_url)`` runs once it is serving.

    Signal handlers are installed only when called from the main thread.
    """
    sock = bind_socket(config.host, config.port)
    url = base_url(config.host, sock.getsockname()[1], tls=config.ssl_certfile is not None)

    def serving() -> None:
        if config.ready_file is not None:
            write_ready_file(config.ready_file, url)
        if on_serving is not None:
            on_serving(url)

    server = _Server(_uvicorn_config(app, config), serving)
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
