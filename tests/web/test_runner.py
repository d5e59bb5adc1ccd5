"""The test app as a real uvicorn process on 127.0.0.1: problems, limits, clean shutdown."""

from __future__ import annotations

import re
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvsp.web.runner import base_url, bind_socket, write_ready_file
from kvsp.web.testing import RunningService, ServiceStartError, start_process
from moqt.errors import ListenError
from tests.support import SUPPORT

PROBLEM = "application/problem+json"
KVSP = {"content-type": "application/kvsp+json"}


@pytest.fixture(scope="module")
def http(service: RunningService) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.base_url, timeout=10) as client:
        yield client


def test_serves_on_an_ephemeral_loopback_port(service: RunningService, http: httpx.Client) -> None:
    assert re.fullmatch(r"http://127\.0\.0\.1:[0-9]+/", service.base_url)
    response = http.get("ok")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/kvsp+json"
    assert response.content == b'{"ok":true}'
    assert "server" not in response.headers


@pytest.mark.parametrize(
    ("path", "status", "type_end"),
    [
        ("missing", 404, "kvsp-not-found"),
        ("nowhere", 404, "kvsp-not-found"),
        ("json", 405, "blank"),
    ],
)
def test_errors_are_problems(http: httpx.Client, path: str, status: int, type_end: str) -> None:
    response = http.get(path)
    assert response.status_code == status
    assert response.headers["content-type"] == PROBLEM
    assert response.json()["type"].endswith(type_end)


def test_unexpected_error_is_500_without_internals(
    service: RunningService, http: httpx.Client
) -> None:
    response = http.get("boom")
    assert response.status_code == 500
    assert response.headers["content-type"] == PROBLEM
    assert response.json()["detail"] == "internal error"
    assert "secret-marker" not in response.text
    assert "Traceback" not in response.text
    assert http.get("ok").status_code == 200  # the connection stays usable
    assert "RuntimeError" in service.output()  # the log has it


def test_body_over_the_limit_is_413(http: httpx.Client) -> None:
    assert http.post("body", content=b"x" * 1000).json() == {"octets": 1000}
    declared = http.post("body", content=b"x" * 1001)
    assert declared.status_code == 413
    assert declared.headers["content-type"] == PROBLEM

    def chunks() -> Iterator[bytes]:
        for _ in range(50):
            yield b"z" * 1000

    streamed = http.post("body", content=chunks())  # chunked: no Content-Length
    assert streamed.status_code == 413
    assert streamed.json()["type"].endswith("kvsp-bad-request")
    assert http.get("ok").status_code == 200


def test_json_errors(http: httpx.Client) -> None:
    assert (
        http.post("json", content=b"{}", headers={"content-type": "text/plain"}).status_code == 415
    )
    malformed = http.post("json", content=b'{"a":', headers=KVSP)
    assert malformed.status_code == 400
    assert malformed.json()["path"] == "$"
    deep = http.post("json", content=b"[" * 65 + b"]" * 65, headers=KVSP)
    assert deep.status_code == 400
    assert http.post("json", content=b'{"a":[1]}', headers=KVSP).json() == {"got": {"a": [1]}}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_cleanly(
    start_service: Callable[..., RunningService], sig: signal.Signals
) -> None:
    service = start_service()
    assert httpx.get(service.base_url + "ok", timeout=10).status_code == 200
    service.proc.send_signal(sig)
    assert service.proc.wait(timeout=15) == 0
    assert "Traceback" not in service.output()
    with pytest.raises(httpx.ConnectError):
        httpx.get(service.base_url + "ok", timeout=2)


def test_stop_returns_exit_status(start_service: Callable[..., RunningService]) -> None:
    service = start_service()
    assert service.stop() == 0
    assert service.stop() == 0  # stopping twice is harmless


def test_a_process_that_exits_is_reported(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('bye'); sys.exit(3)"]
    with pytest.raises(ServiceStartError, match="exited with status 3") as info:
        start_process(argv, workdir=tmp_path)
    assert "bye" in str(info.value)


def test_a_silent_process_is_killed(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(ServiceStartError, match="wrote no ready file"):
        start_process(argv, workdir=tmp_path, ready_timeout=0.5)


def test_bad_principals_file_fails_the_start(tmp_path: Path) -> None:
    bad = tmp_path / "p.toml"
    bad.write_text("[[principal]]\nname = 'x'\n")
    folder = tmp_path / "run"
    folder.mkdir()
    script = SUPPORT / "apps.py"
    with pytest.raises(ServiceStartError, match="token_sha256"):
        start_process([sys.executable, str(script), "--principals", str(bad)], workdir=folder)


def test_base_url_forms() -> None:
    assert base_url("127.0.0.1", 80) == "http://127.0.0.1:80/"
    assert base_url("0.0.0.0", 81) == "http://127.0.0.1:81/"
    assert base_url("::", 82) == "http://[::1]:82/"
    assert base_url("::1", 83, tls=True) == "https://[::1]:83/"
    assert base_url("localhost", 84) == "http://localhost:84/"


def test_bind_socket_on_a_port_in_use_says_where() -> None:
    with bind_socket("127.0.0.1", 0) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(ListenError) as caught:
            bind_socket("127.0.0.1", port)
    reason = "address already in use"
    assert str(caught.value) == f"cannot listen for HTTP on 127.0.0.1:{port}: {reason}"


def test_bind_socket_picks_a_port_and_writes_ready_atomically(tmp_path: Path) -> None:
    with bind_socket("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        assert port > 0
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    ready = tmp_path / "ready"
    write_ready_file(ready, "http://127.0.0.1:1/")
    assert ready.read_text() == "http://127.0.0.1:1/\n"
    assert [p.name for p in tmp_path.iterdir()] == ["ready"]
