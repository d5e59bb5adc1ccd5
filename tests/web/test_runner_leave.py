"""Leaving gracefully on a signal (kvsp.web.runner ``on_signal``), in a real uvicorn process:
the server keeps serving while the leave runs, shuts down when it ends with exit status 0, and
a second signal shuts down at once."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import httpx

from kvsp.web.testing import RunningService, start_process
from tests.support import SUPPORT
from tests.support.polling import eventually


def start(tmp_path: Path, leave_s: float) -> tuple[RunningService, Path]:
    marks = tmp_path / "marks"
    argv = [sys.executable, str(SUPPORT / "leaving_app.py"), "--marks", str(marks)]
    service = start_process([*argv, "--leave-s", str(leave_s)], workdir=tmp_path)
    return service, marks


def lines(marks: Path) -> list[str]:
    return marks.read_text().split() if marks.exists() else []


def test_the_server_serves_while_it_leaves_then_exits_0(tmp_path: Path) -> None:
    service, marks = start(tmp_path, 1.5)
    try:
        service.proc.send_signal(signal.SIGTERM)
        eventually(lambda: lines(marks) == ["leaving"], 10, "the leave to begin")
        assert httpx.get(service.base_url + "ok", timeout=5).text == "ok"  # still serving
        assert service.proc.wait(timeout=20) == 0
        assert lines(marks) == ["leaving", "left"]  # it shut down once the leave ended
        assert "Traceback" not in service.output()
    finally:
        service.stop()


def test_a_second_signal_shuts_down_at_once(tmp_path: Path) -> None:
    service, marks = start(tmp_path, 60)
    try:
        service.proc.send_signal(signal.SIGINT)
        eventually(lambda: lines(marks) == ["leaving"], 10, "the leave to begin")
        service.proc.send_signal(signal.SIGINT)
        assert service.proc.wait(timeout=20) == 0  # long before the 60 s leave would end
        assert lines(marks) == ["leaving"]
    finally:
        service.stop()
