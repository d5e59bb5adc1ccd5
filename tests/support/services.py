"""Starting ``kvsp serve`` processes for a test: each in its own folder under the test's
``tmp_path``, on an ephemeral loopback port, sharing one principals file."""

from __future__ import annotations

import sys
from pathlib import Path

from kvsp.web.testing import RunningService, start_process


class Services:
    """The ``kvsp serve`` processes one test started (``stop_all`` stops them, newest first)."""

    def __init__(self, root: Path, principals: Path) -> None:
        self.root = root
        self.principals = principals
        self.started: list[RunningService] = []

    def start(self, name: str, *argv: str) -> RunningService:
        """``kvsp serve ARGV`` in ``ROOT/NAME``, listening on ``127.0.0.1:0``, ready."""
        work = self.root / name
        work.mkdir()
        command = [sys.executable, "-m", "kvsp", "serve", *argv]
        command += ["--listen", "127.0.0.1:0", "--principals", str(self.principals)]
        command += ["--state", str(work / "state")]
        service = start_process(command, workdir=work, ready_timeout=60)
        self.started.append(service)
        return service

    def stop_all(self) -> None:
        """Stop every started process, the last started first."""
        for service in reversed(self.started):
            service.stop()
