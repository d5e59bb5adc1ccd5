"""A client that goes away mid-body (DESIGN.md §2 ``web/``; kvsp.web.http ClientDisconnected):
against a real ``kvsp serve index``, the request is logged at info without a traceback and
counted under status 499 in ``kvsp_http_requests_total``, never as a 5xx."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.logs import ACCESS_LOGGER
from kvsp.web.testing import RunningService, start_process
from tests.support.polling import eventually

TOKEN = "disconnect-test-admin-token-0123456789abc"


def records(service: RunningService) -> list[dict[str, object]]:
    return [json.loads(line) for line in service.output().splitlines() if line.strip()]


def _leave_mid_body(url: str, path: str, declared: int, sent: bytes) -> None:
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(
            f"POST /{path} HTTP/1.1\r\nhost: {parts.netloc}\r\n"
            f"authorization: Bearer {TOKEN}\r\ncontent-type: application/kvsp+json\r\n"
            f"content-length: {declared}\r\n\r\n".encode()
            + sent
        )


@pytest.mark.timeout(120)
def test_a_client_leaving_mid_body_is_not_a_server_error(tmp_path: Path) -> None:
    principals = tmp_path / "principals.toml"
    write_principals(principals, [principal_entry("admin", TOKEN, ["admin"], None)])
    argv = [
        sys.executable, "-m", "kvsp", "serve", "index", "--listen", "127.0.0.1:0",
        "--state", str(tmp_path / "state"), "--principals", str(principals),
        "--log-level", "info",
    ]  # fmt: skip
    (tmp_path / "run").mkdir()
    with start_process(argv, workdir=tmp_path / "run") as service:
        for path in ("lookup", "replicas"):
            _leave_mid_body(service.base_url, path, 1000, b'{"scope_id": "')

        def access_records() -> list[dict[str, object]]:
            found = [r for r in records(service) if r["logger"] == ACCESS_LOGGER]
            return found if len(found) >= 2 else []

        access = eventually(access_records, timeout=30, what="two access records")
        assert {r["status"] for r in access} == {499}, access
        auth = {"authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=service.base_url, timeout=10) as http:
            text = http.get("metrics", headers=auth).text
        service.stop()
        output = records(service)
    counted = [line for line in text.splitlines() if line.startswith("kvsp_http_requests_total{")]
    posts = [line for line in counted if 'method="POST"' in line]
    assert posts and all('status="499"' in line for line in posts), posts
    assert not any('status="5' in line for line in counted), counted
    levels = {str(r["level"]) for r in output}
    assert levels <= {"INFO", "DEBUG"}, [r for r in output if r["level"] not in ("INFO", "DEBUG")]
    assert not any("exc" in r for r in output), [r for r in output if "exc" in r]
    assert any("closed the connection" in str(r["msg"]) for r in output)
