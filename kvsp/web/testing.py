"""Service apps under test: in-process and as real processes (STYLE.md rule 12: service tests
against real servers on 127.0.0.1 plus fast in-process ones).

:class:`InProcessClient` sends requests straight into an ASGI app (no sockets, no threads).
:func:`start_process` starts a command that serves on an ephemeral port and writes its base URL
to a ready file (:mod:`kvsp.web.runner` does), waits for that file, and returns a
:class:`RunningService` that stops the process on exit: SIGTERM, then SIGKILL after a grace
period. Pytest fixtures wrap it so that no process outlives its test.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
from starlette.types import ASGIApp


class InProcessClient:
    """A synchronous client that runs each request through ``app`` on a fresh event loop.

    Exceptions in the app become the responses a real server would send (the app's 500
    handler), not test failures. Lifespan events are not run.
    """

    def __init__(self, app: ASGIApp, base_url: str = "http://testserver/") -> None:
        self.app = app
        self.base_url = base_url

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """Send one request (``httpx.AsyncClient.request`` arguments) and read the response."""
        return asyncio.run(self._request(method, url, **kwargs))

    async def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url=self.base_url) as client:
            return await client.request(method, url, **kwargs)

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        """GET ``url``."""
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        """POST to ``url``."""
        return self.request("POST", url, **kwargs)

    def put(self, url: str, **kwargs: Any) -> httpx.Response:
        """PUT to ``url``."""
        return self.request("PUT", url, **kwargs)

    def delete(self, url: str, **kwargs: Any) -> httpx.Response:
        """DELETE ``url``."""
        return self.request("DELETE", url, **kwargs)


class ServiceStartError(RuntimeError):
    """The service exited or stayed silent before writing its ready file."""


class RunningService:
    """A service subprocess that has written its base URL; stop it with :meth:`stop`."""

    def __init__(self, proc: subprocess.Popen[bytes], base_url: str, workdir: Path) -> None:
        self.proc = proc
        self.base_url = base_url
        self.workdir = workdir

    @property
    def log_path(self) -> Path:
        """The file that receives the process's stdout and stderr."""
        return self.workdir / "output.log"

    def output(self) -> str:
        """Everything the process has written to stdout and stderr so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def stop(self, grace_s: float = 5.0) -> int:
        """SIGTERM, then SIGKILL after ``grace_s`` seconds; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def __enter__(self) -> RunningService:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_process(
    argv: Sequence[str],
    *,
    ready_timeout: float = 30.0,
    ready_flag: str = "--ready-file",
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
) -> RunningService:
    """Start ``argv`` plus ``[ready_flag, <file>]`` and wait until the file names a base URL.

    The ready file and the output log live in ``workdir`` (a new temporary folder when
    ``None``; pass pytest's ``tmp_path`` to have it cleaned up). Output goes to a file, so a
    chatty process never blocks on a full pipe.

    Raises:
        ServiceStartError: the process exited, or wrote nothing within ``ready_timeout``
            seconds (it is killed); the message carries the tail of its output.
    """
    folder = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="kvsp-"))
    ready = folder / "ready"
    with open(folder / "output.log", "wb") as log:
        proc = subprocess.Popen(
            [*argv, ready_flag, os.fspath(ready)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            cwd=cwd,
        )
    service = RunningService(proc, "", folder)
    deadline = time.monotonic() + ready_timeout
    while not ready.exists():
        status = proc.poll()
        if status is not None or time.monotonic() > deadline:
            service.stop(grace_s=1.0)
            why = f"exited with status {status}" if status is not None else "wrote no ready file"
            raise ServiceStartError(f"{list(argv[:4])} {why}:\n{service.output()[-4000:]}")
        time.sleep(0.02)
    service.base_url = ready.read_text(encoding="utf-8").strip()
    return service
