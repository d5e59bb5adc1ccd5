"""JSON logs with request ids (kvsp.web.logs): the formatter, the request-id middleware, the
access record, redaction, and a real ``kvsp serve index`` process whose stderr is all JSON and
never shows a token, an Authorization value or the principals file."""

from __future__ import annotations

import io
import json
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.requests import Request
from starlette.routing import Route

from kvsp.web.auth import principal_entry, token_sha256, write_principals
from kvsp.web.logs import (
    ACCESS_LOGGER,
    JsonFormatter,
    configure_logging,
    make_handler,
    redact,
    request_id_var,
)
from kvsp.web.testing import InProcessClient, start_process
from tests.support import operations as ops

SECRET_TOKEN = "very-secret-token-0123456789abcdefghijklmn"
WRONG_TOKEN = "wrong-token-but-still-secret-0123456789ab"


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """JSON records of every logger at DEBUG and above, for the duration of a test."""
    stream = io.StringIO()
    handler = make_handler("json", stream)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def records(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line]


def test_a_record_is_one_json_object_with_the_request_id() -> None:
    formatter = JsonFormatter()
    record = logging.LogRecord("kvsp.test", logging.WARNING, __file__, 1, "a %s b", ("x",), None)
    token = request_id_var.set("req-1")
    try:
        line = formatter.format(record)
    finally:
        request_id_var.reset(token)
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["level"] == "WARNING" and obj["logger"] == "kvsp.test" and obj["msg"] == "a x b"
    assert obj["request_id"] == "req-1"
    assert obj["ts"].endswith("+00:00")


def test_tracebacks_stay_on_one_line_and_are_redacted() -> None:
    try:
        raise ValueError(f"Authorization: Bearer {SECRET_TOKEN}")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line and SECRET_TOKEN not in line
    assert "ValueError" in json.loads(line)["exc"]


@pytest.mark.parametrize(
    "text",
    [
        f"Authorization: Bearer {SECRET_TOKEN}",
        f"authorization=bearer {SECRET_TOKEN}",
        f"{{'authorization': 'Bearer {SECRET_TOKEN}'}}",
        f'{{"token": "{SECRET_TOKEN}"}}',
        f'token_sha256 = "{token_sha256(SECRET_TOKEN)}"',
    ],
)
def test_redact_blanks_credentials(text: str) -> None:
    out = redact(text)
    assert SECRET_TOKEN not in out and token_sha256(SECRET_TOKEN) not in out
    assert "[redacted]" in out


def test_redact_keeps_ordinary_text() -> None:
    text = "unknown token; lookup of 3 keys matched 2"
    assert redact(text) == text


def test_configure_logging_refuses_unknown_formats_and_levels() -> None:
    with pytest.raises(ValueError):
        configure_logging("xml")
    with pytest.raises(ValueError):
        configure_logging("json", "chatty")


# --- the middleware ---------------------------------------------------------------------------


def _client(tmp_path: Path) -> InProcessClient:
    app = ops.build_app("holder", tmp_path)

    async def boom(request: Request) -> None:
        logging.getLogger("kvsp.test").warning("about to fail")
        raise RuntimeError("broken on purpose")

    # in place of a public route: a route without a role rule is refused before it runs
    app.router.routes.insert(0, Route("/openapi.json", boom, methods=["GET"]))
    return InProcessClient(app)


def test_request_ids_are_echoed_made_or_replaced(tmp_path: Path) -> None:
    client = _client(tmp_path)
    kept = client.get("/healthz", headers={"x-request-id": "trace-42.a_b~c"})
    assert kept.headers["x-request-id"] == "trace-42.a_b~c"
    made = client.get("/healthz").headers["x-request-id"]
    assert re.fullmatch("[0-9a-f]{16}", made)
    for bad in ("has spaces", "x" * 65, "semi;colon", ""):
        replaced = client.get("/healthz", headers={"x-request-id": bad}).headers["x-request-id"]
        assert replaced != bad and len(replaced) == 16
    assert client.get("/nowhere").headers["x-request-id"]  # problems carry one too


def test_every_record_of_a_request_carries_its_id(tmp_path: Path, captured: io.StringIO) -> None:
    client = _client(tmp_path)
    response = client.get("/openapi.json", headers={"x-request-id": "boom-1"})
    assert response.status_code == 500 and response.headers["x-request-id"] == "boom-1"
    mine = [r for r in records(captured) if r.get("request_id") == "boom-1"]
    loggers = {r["logger"] for r in mine}
    assert {"kvsp.test", "kvsp.services", ACCESS_LOGGER} <= loggers
    access = next(r for r in mine if r["logger"] == ACCESS_LOGGER)
    assert access["method"] == "GET" and access["path"] == "/openapi.json"
    assert access["status"] == 500
    assert isinstance(access["duration_ms"], float)


def test_access_records_name_the_route_template_not_the_path(
    tmp_path: Path, captured: io.StringIO
) -> None:
    client = _client(tmp_path)
    key = "ab" * 32
    client.get(f"/blocks/{'0' * 64}/{'1' * 32}/{key}?layers=0-1", headers=ops.ADMIN)
    access = [r for r in records(captured) if r["logger"] == ACCESS_LOGGER]
    assert access[-1]["path"] == "/blocks/{compat}/{scope}/{key}"
    assert access[-1]["status"] == 404
    service = [
        r for r in records(captured) if not str(r["logger"]).startswith(("httpx", "httpcore"))
    ]
    text = json.dumps(service)  # the test's own HTTP client logs URLs; the service must not
    assert key not in text and "layers=0-1" not in text


# --- a real service -------------------------------------------------------------------------


def test_a_served_index_logs_json_without_credentials(tmp_path: Path) -> None:
    principals = tmp_path / "principals.toml"
    write_principals(principals, [principal_entry("admin", SECRET_TOKEN, ["admin"], None)])
    argv = [
        sys.executable, "-m", "kvsp", "serve", "index", "--listen", "127.0.0.1:0",
        "--state", str(tmp_path / "state"), "--principals", str(principals),
        "--log-level", "debug",
    ]  # fmt: skip
    (tmp_path / "run").mkdir()
    with start_process(argv, workdir=tmp_path / "run") as service:
        with httpx.Client(base_url=service.base_url, timeout=10) as http:
            good = {"authorization": f"Bearer {SECRET_TOKEN}", "x-request-id": "served-1"}
            body = {"scope_id": "0" * 32, "compat_id": "1" * 64, "block_keys": []}
            assert http.post("lookup", json=body, headers=good).status_code == 200
            bad = {"authorization": f"Bearer {WRONG_TOKEN}"}
            assert http.post("lookup", json=body, headers=bad).status_code == 401
            odd = {"authorization": f"Basic {SECRET_TOKEN}"}
            assert http.get("metrics", headers=odd).status_code == 401
        service.stop()
        output = service.output()
    lines = [line for line in output.splitlines() if line.strip()]
    parsed = [json.loads(line) for line in lines]  # every line is one JSON object
    access = [r for r in parsed if r["logger"] == ACCESS_LOGGER]
    assert any(r.get("request_id") == "served-1" and r["path"] == "/lookup" for r in access)
    assert {r["status"] for r in access} >= {200, 401}
    for secret in (SECRET_TOKEN, WRONG_TOKEN, token_sha256(SECRET_TOKEN), "[[principal]]"):
        assert secret not in output
