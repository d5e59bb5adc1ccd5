"""Failing over between several base URLs of one service (kvsp.web.failover, BaseClient),
against scripted services served by real uvicorn servers on 127.0.0.1: a dead first URL, a
first that answers 503 or never answers, every URL down, and answers (4xx, 503
kvsp-not-active) that must not move the request; the URL-list flag; the credentials each URL
receives."""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvsp.audience import audience_credential
from kvsp.errors import BadRequest, NotActive, NotFound, RemoteError, TransportError
from kvsp.web.client import BaseClient
from kvsp.web.failover import AppendUrls, Failover, add_url_list_argument, url_list
from kvsp.web.runner import bind_socket
from tests.support.polling import eventually

PROBLEM = "urn:ietf:params:kvsp:problem:"
TOKEN = "failover-token-0123456789abcdef"


class Scripted:
    """One scripted service: ``mode`` says how it answers; ``hits`` and ``auth`` record what
    it was sent."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "ok"
        self.hits: Counter[str] = Counter()
        self.auth: list[str] = []
        self.base = ""

    async def handle(self, request: Request) -> Response:
        self.hits[request.method] += 1
        self.auth.append(request.headers.get("authorization", ""))
        if self.mode == "hang":
            await asyncio.sleep(30)
        if self.mode == "503":
            return Response(b"down", status_code=503, media_type="text/plain")
        if self.mode in ("404", "not-active", "store-down"):
            kind, status = {
                "404": ("kvsp-not-found", 404),
                "not-active": ("kvsp-not-active", 503),
                "store-down": ("kvsp-store-unavailable", 503),
            }[self.mode]
            body = {"type": PROBLEM + kind, "title": kind, "status": status, "detail": self.name}
            return JSONResponse(body, status_code=status, media_type="application/problem+json")
        return JSONResponse({"server": self.name}, media_type="application/kvsp+json")


@pytest.fixture
def services() -> Iterator[list[Scripted]]:
    """Two scripted services on real uvicorn servers (each in its own thread)."""
    started: list[tuple[uvicorn.Server, threading.Thread, Any]] = []
    scripted = [Scripted("one"), Scripted("two")]
    for service in scripted:
        app = Starlette(routes=[Route("/thing", service.handle, methods=["GET", "POST"])])
        sock = bind_socket("127.0.0.1", 0)
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        config.timeout_graceful_shutdown = 1
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        eventually(lambda s=server: s.started, 10, "a scripted server to start", interval=0.01)
        service.base = f"http://127.0.0.1:{sock.getsockname()[1]}/"
        started.append((server, thread, sock))
    try:
        yield scripted
    finally:
        for server, _, _ in started:
            server.should_exit = True
            server.force_exit = True
        for _, thread, sock in started:
            thread.join(10)
            sock.close()


def dead_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (a port bound, then closed)."""
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}/"


class ControlClient(BaseClient):
    control_plane = True
    service = "PC"

    async def thing(self, method: str = "GET", *, resend: bool | None = None) -> Any:
        return await self._request_json(
            method, "thing", {} if method == "POST" else None, resend=resend
        )


class PeerClient(BaseClient):
    async def thing(self) -> Any:
        return await self._request_json("GET", "thing")


def ask(urls: list[str], *calls: dict[str, Any], timeout: float = 5.0) -> tuple[list[Any], int]:
    """Run ``calls`` (``thing`` keyword arguments) one after another on one client; the
    answers (or the errors raised) and the client's failover count."""

    async def main() -> tuple[list[Any], int]:
        out: list[Any] = []
        async with ControlClient(urls, TOKEN, timeout=timeout) as client:
            for call in calls:
                try:
                    out.append(await client.thing(**call))
                except Exception as exc:  # the test looks at which error it was
                    out.append(exc)
            return out, client.failover.failovers

    return asyncio.run(main())


def test_a_dead_first_url_fails_over_and_the_next_one_sticks(
    services: list[Scripted], caplog: pytest.LogCaptureFixture
) -> None:
    one, _ = services
    dead = dead_url()
    with caplog.at_level(logging.WARNING, logger="kvsp.web.failover"):
        answers, failovers = ask([dead, one.base], {}, {}, {"method": "POST"})
    assert answers == [{"server": "one"}] * 3
    assert failovers == 1  # the second and third requests went straight to the one that answered
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and dead in warnings[0] and one.base in warnings[0]


def test_a_first_answering_503_fails_over(services: list[Scripted]) -> None:
    one, two = services
    one.mode = "503"
    answers, failovers = ask([one.base, two.base], {}, {})
    assert answers == [{"server": "two"}] * 2
    assert one.hits["GET"] == 1 and two.hits["GET"] == 2
    assert failovers == 1


def test_a_store_unavailable_503_problem_fails_over(services: list[Scripted]) -> None:
    one, two = services
    one.mode = "store-down"
    answers, _ = ask([one.base, two.base], {})
    assert answers == [{"server": "two"}]


def test_a_first_that_never_answers_times_out_and_fails_over(services: list[Scripted]) -> None:
    one, two = services
    one.mode = "hang"
    answers, _ = ask([one.base, two.base], {}, timeout=0.5)
    assert answers == [{"server": "two"}]
    assert one.hits["GET"] == 1


def test_a_post_that_may_have_arrived_is_not_sent_again(services: list[Scripted]) -> None:
    one, two = services
    one.mode = "hang"
    (answer,), failovers = ask([one.base, two.base], {"method": "POST"}, timeout=0.5)
    assert isinstance(answer, TransportError)
    assert two.hits["POST"] == 0 and failovers == 0
    (answer,), _ = ask([one.base, two.base], {"method": "POST", "resend": True}, timeout=0.5)
    assert answer == {"server": "two"}


def test_every_url_down_raises_the_last_error(services: list[Scripted]) -> None:
    one, two = services
    (answer,), failovers = ask([dead_url(), dead_url()], {})
    assert isinstance(answer, TransportError)
    assert failovers == 1
    one.mode = two.mode = "503"
    (answer,), _ = ask([one.base, two.base], {})
    assert isinstance(answer, RemoteError) and answer.remote_status == 503
    assert one.hits["GET"] == 1 and two.hits["GET"] == 1


@pytest.mark.parametrize(("mode", "error"), [("404", NotFound), ("not-active", NotActive)])
def test_an_answer_is_never_failed_over(
    services: list[Scripted], mode: str, error: type[Exception]
) -> None:
    one, two = services
    one.mode = mode
    (answer,), failovers = ask([one.base, two.base], {})
    assert isinstance(answer, error)
    assert two.hits["GET"] == 0 and failovers == 0


def test_each_url_gets_its_own_credential(services: list[Scripted]) -> None:
    one, two = services
    one.mode = "503"

    async def main() -> None:
        async with PeerClient([one.base, two.base], TOKEN) as peer:
            await peer.thing()
        async with ControlClient([one.base, two.base], TOKEN) as control:
            await control.thing()

    asyncio.run(main())
    # a service that is not the control plane gets a credential bound to its own origin only
    assert one.auth[0] == "Bearer " + audience_credential(TOKEN, one.base)
    assert two.auth[0] == "Bearer " + audience_credential(TOKEN, two.base)
    # the control plane gets the token itself, at every one of its URLs
    assert one.auth[1] == two.auth[1] == f"Bearer {TOKEN}"


def test_url_list_reads_repeats_and_commas() -> None:
    assert url_list("http://a:1, http://b:2/") == ("http://a:1/", "http://b:2/")
    assert url_list(["http://a:1", "http://b:2,http://a:1/"]) == ("http://a:1/", "http://b:2/")
    with pytest.raises(BadRequest):
        url_list("http://a:1,,http://b:2")
    with pytest.raises(BadRequest):
        url_list([])


def test_the_flag_takes_several_urls() -> None:
    parser = argparse.ArgumentParser()
    add_url_list_argument(parser, "--pc", required=True, help="the PC")
    args = parser.parse_args(["--pc", "http://a:1,http://b:2", "--pc", "http://c:3/"])
    assert args.pc == ["http://a:1/", "http://b:2/", "http://c:3/"]
    assert isinstance(parser._option_string_actions["--pc"], AppendUrls)
    with pytest.raises(SystemExit):
        parser.parse_args(["--pc", "http://a:1,"])


def test_failover_order_wraps_from_the_current_url() -> None:
    async def main() -> list[str]:
        failover = Failover(["http://a/", "http://b/", "http://c/"], "IS")
        tried: list[str] = []

        async def attempt(base: str) -> str:
            tried.append(base)
            if base != "http://b/":
                raise TransportError("down")
            return base

        await failover.call(attempt, resend=True)
        tried.append("|")
        await failover.call(attempt, resend=True)
        return tried

    assert asyncio.run(main()) == ["http://a/", "http://b/", "|", "http://b/"]
