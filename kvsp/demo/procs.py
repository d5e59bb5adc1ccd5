"""Service subprocesses for the local cluster (DESIGN.md §1), started so that none outlives
the command that started them.

Every service joins one process group of its own (the first one started leads it), apart from
the terminal's, so that a stop can signal all of them at once and a Ctrl-C reaches only the
parent, which then stops them in order. On Linux each child also asks the kernel for SIGTERM
when its parent dies (``PR_SET_PDEATHSIG``), so even a SIGKILLed parent leaves no orphan;
children are therefore started from the main thread only (the signal follows the thread that
forked). SIGINT and SIGTERM are held back while a child is forked and recorded, so a Ctrl-C
never leaves one unrecorded. A service says it is up by writing its ready file
(:mod:`kvsp.web.runner`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from kvsp.errors import ClusterError

PR_SET_PDEATHSIG = 1
POLL_S = 0.05
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


def reserve_port(kind: int = socket.SOCK_STREAM, host: str = "127.0.0.1") -> int:
    """A port the kernel just handed out as ephemeral for ``kind`` (TCP or UDP) on ``host``.

    Services whose URI must be known before they start (it goes into the principals file as a
    holder they may publish for) are told to listen there.
    """
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _child_hook() -> Callable[[], None]:
    """A ``preexec_fn``: unblock the stop signals (blocked in the parent while it forks), and
    on Linux have the child receive SIGTERM when the parent dies."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    parent = os.getpid()

    def hook() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        if libc is not None:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the parent died before the request took effect
                os._exit(1)

    return hook


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back until the block ends: a Ctrl-C between the fork and the
    bookkeeping would leave a child nobody stops."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class ServiceProcess:
    """One service subprocess: its output log, its ready file and what it wrote there."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], workdir: Path) -> None:
        self.name = name
        self.proc = proc
        self.workdir = workdir
        self.ready_text: str | None = None

    @property
    def pid(self) -> int:
        """The process id."""
        return self.proc.pid

    @property
    def log_path(self) -> Path:
        """The file receiving its stdout and stderr."""
        return self.workdir / "output.log"

    @property
    def ready_path(self) -> Path:
        """The file it writes once it serves."""
        return self.workdir / "ready"

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    def check_ready(self) -> bool:
        """Whether it has written its ready file (the text is kept in :attr:`ready_text`)."""
        if self.ready_text is None and self.ready_path.exists():
            text = self.ready_path.read_text(encoding="utf-8").strip()
            self.ready_text = text or None
        return self.ready_text is not None

    def output_tail(self, chars: int = 3000) -> str:
        """The end of what it wrote so far."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return text[-chars:]


class ProcessGroup:
    """Services started in one process group, stopped together (context manager)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.services: dict[str, ServiceProcess] = {}
        self.pgid: int | None = None
        self._env = None if env is None else dict(env)
        self._preexec = _child_hook()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def spawn(self, name: str, argv: Sequence[str], workdir: Path) -> ServiceProcess:
        """Start ``argv`` plus ``--ready-file WORKDIR/ready``, output to ``WORKDIR/output.log``.

        Raises:
            ClusterError: the program cannot be started.
        """
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "ready").unlink(missing_ok=True)
        command = [*argv, "--ready-file", os.fspath(workdir / "ready")]
        with _stop_signals_held(), open(workdir / "output.log", "wb") as log:
            try:
                proc = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self._env,
                    process_group=self.pgid or 0,
                    preexec_fn=self._preexec,  # runs in the child; we fork from the main thread
                )
            except OSError as exc:
                raise ClusterError(f"cannot start {name}: {exc.strerror or exc}") from exc
            if self.pgid is None:
                self.pgid = proc.pid
            service = ServiceProcess(name, proc, workdir)
            self.services[name] = service
        return service

    def wait_ready(
        self,
        names: Iterable[str],
        timeout_s: float,
        on_ready: Callable[[ServiceProcess], None] | None = None,
    ) -> None:
        """Wait until every service of ``names`` wrote its ready file.

        Raises:
            ClusterError: one exited or stayed silent for ``timeout_s``; the message carries
                the end of its output.
        """
        waiting = [self.services[name] for name in names]
        deadline = time.monotonic() + timeout_s
        while waiting:
            for service in list(waiting):
                if service.check_ready():
                    waiting.remove(service)
                    if on_ready is not None:
                        on_ready(service)
                elif not service.alive():
                    raise ClusterError(self._failure(service, f"exited ({service.proc.poll()})"))
            if waiting and time.monotonic() > deadline:
                raise ClusterError(self._failure(waiting[0], f"not ready after {timeout_s:.0f} s"))
            time.sleep(POLL_S)

    @staticmethod
    def _failure(service: ServiceProcess, why: str) -> str:
        tail = service.output_tail().strip()
        return f"{service.name} {why}; its log {service.log_path} ends:\n{tail}"

    def kill(self, name: str) -> None:
        """SIGKILL one service (no clean shutdown) and reap it."""
        service = self.services[name]
        if service.alive():
            service.proc.kill()
        service.proc.wait()

    def stop(self, grace_s: float = 8.0) -> None:
        """Stop every service and reap it; safe to call more than once.

        The first service started (the one the others report to: the control plane) stops
        last, so that the others can still withdraw their records there: SIGTERM to all the
        others at once, then to the first; SIGKILL to the whole group for what is left after
        ``grace_s`` seconds in all.
        """
        deadline = time.monotonic() + grace_s
        services = list(self.services.values())
        for wave in (services[1:], services[:1]):
            running = [s for s in wave if s.alive()]
            for service in running:
                with contextlib.suppress(ProcessLookupError):
                    service.proc.send_signal(signal.SIGTERM)
            for service in running:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    service.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        if self.pgid is not None and any(s.alive() for s in services):
            # A member is alive, so the group still exists: kill all of it, any child of a
            # service too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
        for service in services:
            service.proc.wait()

    def pids(self) -> list[int]:
        """The process ids of the services still running."""
        return [s.pid for s in self.services.values() if s.alive()]
