"""Problem rendering (RFC 9457) and KVSP JSON bodies, in-process."""

from __future__ import annotations

import json

import pytest

from kvsp.errors import LeaseQuota, PayloadTooLarge, Unauthorized
from kvsp.web import problems
from kvsp.web.problems import (
    KVSP_JSON,
    PROBLEM_JSON,
    http_problem,
    kvsp_json,
    problem_response,
)
from kvsp.web.testing import InProcessClient

PREFIX = "urn:ietf:params:kvsp:problem:"


def test_kvsp_json_is_compact_and_typed() -> None:
    response = kvsp_json({"a": [1, 2], "b": "é"}, status=201, headers={"Location": "x/1"})
    assert response.status_code == 201
    assert response.headers["content-type"] == KVSP_JSON
    assert response.headers["location"] == "x/1"
    assert response.body == '{"a":[1,2],"b":"é"}'.encode()


def test_stdlib_fallback_matches_and_refuses_nan() -> None:
    value = {"k": [1, 2.5, None, True, "s"], "n": {"x": -1}}
    assert problems._dumps_stdlib(value) == problems.dumps_json(value)
    with pytest.raises(ValueError):
        problems._dumps_stdlib(float("nan"))


def test_problem_response_renders_the_error() -> None:
    response = problem_response(LeaseQuota("over", path="$.ttl_ms"), instance="/leases")
    assert response.status_code == 429
    assert response.headers["content-type"] == PROBLEM_JSON
    assert json.loads(bytes(response.body)) == {
        "type": PREFIX + "kvsp-lease-quota",
        "title": "Lease quota exceeded",
        "status": 429,
        "detail": "$.ttl_ms: over",
        "path": "$.ttl_ms",
        "instance": "/leases",
    }


def test_unauthorized_carries_www_authenticate() -> None:
    response = problem_response(Unauthorized("no token"))
    assert response.headers["www-authenticate"].startswith("Bearer")


def test_http_problem_without_kvsp_type_is_about_blank() -> None:
    body = json.loads(bytes(http_problem(418, instance="/t").body))
    assert body == {"type": "about:blank", "title": "I'm a Teapot", "status": 418, "instance": "/t"}
    assert json.loads(bytes(http_problem(413).body))["type"] == PREFIX + PayloadTooLarge.problem


def test_kvsp_error_in_handler(client: InProcessClient) -> None:
    response = client.get("/missing")
    assert response.status_code == 404
    assert response.headers["content-type"] == PROBLEM_JSON
    body = response.json()
    assert body["type"] == PREFIX + "kvsp-not-found"
    assert body["detail"] == "nothing here"
    assert body["instance"] == "/missing"


def test_unknown_route_is_not_found_problem(client: InProcessClient) -> None:
    response = client.get("/no/such/route")
    assert response.status_code == 404
    assert response.headers["content-type"] == PROBLEM_JSON
    assert response.json()["type"] == PREFIX + "kvsp-not-found"


def test_wrong_method_is_405_with_allow(client: InProcessClient) -> None:
    response = client.get("/json")
    assert response.status_code == 405
    assert response.headers["content-type"] == PROBLEM_JSON
    assert response.headers["allow"] == "POST"
    body = response.json()
    assert body["type"] == "about:blank"
    assert body["title"] == "Method Not Allowed"


def test_unexpected_exception_is_bare_500(
    client: InProcessClient, caplog: pytest.LogCaptureFixture
) -> None:
    response = client.get("/boom")
    assert response.status_code == 500
    assert response.headers["content-type"] == PROBLEM_JSON
    assert response.json() == {
        "type": "about:blank",
        "title": "Internal Server Error",
        "status": 500,
        "detail": "internal error",
        "instance": "/boom",
    }
    assert "secret-marker" not in response.text
    assert "Traceback" not in response.text
    logged = [r for r in caplog.records if r.name == "kvsp.services"]
    assert logged and logged[0].exc_info is not None
