"""The front-end library (§6.8 front-end duties) against a scripted PC and scripted instances
served by a real uvicorn on 127.0.0.1: lower epochs and duplicate indices dropped, a broken
stream reattached from the next index, a stalled stream (a frozen instance) abandoned once the
PC names a later epoch, a session that failed before its first token started over, and
failures that must reach the caller raised."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvsp.errors import BadRequest, SessionFailed
from kvsp.ids import CompatId, ScopeId
from kvsp.services.frontend import FrontEnd, FrontendConfig, Token
from kvsp.web.problems import dumps_json
from kvsp.web.runner import bind_socket
from tests.support.polling import eventually

SCOPE = ScopeId(b"\x05" * 16)
COMPAT = CompatId(b"\x06" * 32)
PROBLEM = "urn:ietf:params:kvsp:problem:"
Item = Any  # a token line (dict), ("sleep", s), ("view", {...}), or "hang"


class Script:
    """What the fake PC and instances answer, in order, and what they were asked."""

    def __init__(self) -> None:
        self.base = ""
        self.places: deque[str] = deque()
        self.view: dict[str, Any] = {}
        self.answers: defaultdict[tuple[str, str], deque[Any]] = defaultdict(deque)
        self.asked: list[tuple[str, str, str]] = []
        self.placed: list[dict[str, Any]] = []

    def answer(self, instance: str, kind: str, *items: Item) -> None:
        """Queue one answer: a status code (a problem), or the lines and pauses of a stream."""
        self.answers[(instance, kind)].append(items)

    def set_view(self, instance: str, epoch: int, state: str = "serving", **extra: Any) -> None:
        self.view = {"instance": instance, "epoch": epoch, "state": state, **extra}

    def uri(self, instance: str) -> str:
        return f"{self.base}{instance}/"


def problem(status: int, name: str) -> Response:
    body = {"type": PROBLEM + name, "title": name, "status": status, "detail": name}
    return JSONResponse(body, status, media_type="application/problem+json")


async def play(script: Script, items: tuple[Item, ...]) -> AsyncIterator[bytes]:
    """The lines of one scripted stream, with its pauses and the PC view changes."""
    for item in items:
        if item == "hang":
            await asyncio.sleep(3600)
        elif isinstance(item, tuple) and item[0] == "sleep":
            await asyncio.sleep(item[1])
        elif isinstance(item, tuple) and item[0] == "view":
            script.set_view(*item[1:])
        else:
            yield dumps_json(item) + b"\n"


def app_of(script: Script) -> Starlette:
    async def place(request: Request) -> Response:
        body = await request.json()
        script.placed.append(body)
        instance = script.places.popleft()
        if instance == "busy":  # no instance can take it now: ask again later
            return problem(503, "kvsp-not-active")
        return JSONResponse({"instance": script.uri(instance), "matched": 0, "cost": 1})

    async def session(request: Request) -> Response:
        view = dict(script.view)
        view["instance"] = script.uri(view["instance"])
        view.setdefault("output_offset", 0)
        return JSONResponse({"session": request.path_params["session"], **view})

    async def stream(request: Request, kind: str) -> Response:
        instance = request.path_params["instance"]
        script.asked.append((instance, kind, request.query_params.get("from", "")))
        queued = script.answers[(instance, kind)]
        if not queued:
            return problem(404, "kvsp-not-found")
        items = queued.popleft()
        if items and isinstance(items[0], int):
            return problem(items[0], items[1])

        return StreamingResponse(play(script, items), media_type="application/x-ndjson")

    async def generate(request: Request) -> Response:
        return await stream(request, "generate")

    async def tokens(request: Request) -> Response:
        return await stream(request, "tokens")

    return Starlette(
        routes=[
            Route("/pc/place", place, methods=["POST"]),
            Route("/pc/sessions/{session}", session, methods=["GET"]),
            Route("/{instance}/generate", generate, methods=["POST"]),
            Route("/{instance}/sessions/{session}/tokens", tokens, methods=["GET"]),
        ]
    )


@pytest.fixture
def script() -> Iterator[Script]:
    script = Script()
    sock = bind_socket("127.0.0.1", 0)
    config = uvicorn.Config(
        app_of(script), log_level="warning", lifespan="off", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    eventually(lambda: server.started, 10, "the scripted server to start", interval=0.01)
    script.base = f"http://127.0.0.1:{sock.getsockname()[1]}/"
    try:
        yield script
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def line(index: int, epoch: int, token: int | None = None) -> dict[str, int]:
    return {"index": index, "epoch": epoch, "token": 1000 + index if token is None else token}


def collect(script: Script, count: int, **config: Any) -> tuple[list[Token], FrontEnd]:
    settings = FrontendConfig(**{"stall_s": 0.2, "poll_s": 0.02, "reattach_s": 10, **config})

    async def main() -> tuple[list[Token], FrontEnd]:
        fe = FrontEnd(
            script.base + "pc/",
            "t0k3n",
            scope_id=SCOPE,
            compat_id=COMPAT,
            block_tokens=4,
            config=settings,
        )
        async with fe:
            tokens = [t async for t in fe.generate([1, 2, 3], count, {"method": "greedy"})]
        return tokens, fe

    return asyncio.run(main())


def test_lower_epochs_and_duplicates_are_dropped_across_a_reattach(script: Script) -> None:
    script.places.append("x")
    script.set_view("x", 1)
    script.answer("x", "generate", *(line(i, 1) for i in range(5)), ("view", "y", 2))
    script.answer(
        "y",
        "tokens",
        line(3, 2),
        line(4, 2),  # already delivered: duplicates by index
        line(5, 2),
        line(6, 1, token=666),  # a lower epoch than one seen: dropped
        *(line(i, 2) for i in range(6, 10)),
    )
    tokens, fe = collect(script, 10)
    assert [(t.index, t.token) for t in tokens] == [(i, 1000 + i) for i in range(10)]
    assert [t.epoch for t in tokens] == [1] * 5 + [2] * 5
    assert {t.instance for t in tokens[5:]} == {script.uri("y")}
    assert (fe.stats.duplicates, fe.stats.stale, fe.stats.reattached) == (2, 1, 1)
    assert ("y", "tokens", "5") in script.asked  # reattached from the next index
    placed = script.placed[0]
    assert placed["session"] == str(fe.stats.sessions[0]) and placed["block_keys"] == []


def test_a_stalled_stream_is_left_once_the_pc_names_a_later_epoch(script: Script) -> None:
    script.places.append("x")
    script.set_view("x", 1)
    script.answer(
        "x",
        "generate",
        *(line(i, 1) for i in range(3)),
        ("sleep", 0.5),  # frozen: the stream stays open and silent
        ("view", "y", 2),
        ("sleep", 1.5),
        line(3, 1, token=999),  # the zombie speaks again, long after the move
        "hang",
    )
    script.answer("y", "tokens", 404, "kvsp-not-found")  # not resumed there yet
    script.answer("y", "tokens", *(line(i, 2) for i in range(3, 6)))
    tokens, fe = collect(script, 6)
    # the zombie's token 3 (999) never reaches the caller: the new epoch's does
    assert [(t.index, t.token) for t in tokens] == [(i, 1000 + i) for i in range(6)]
    assert all(t.epoch == 2 for t in tokens[3:])
    assert [a for a in script.asked if a[0] == "y"] == [("y", "tokens", "3")] * 2


def test_a_session_that_failed_before_its_first_token_starts_over(script: Script) -> None:
    script.places.extend(["x", "y"])
    script.set_view("x", 1, "failed", detail="its instance failed before the first checkpoint")
    script.answer("x", "generate", 503, "kvsp-not-active")
    script.answer("y", "generate", *(line(i, 1) for i in range(3)))
    tokens, fe = collect(script, 3)
    assert [t.token for t in tokens] == [1000, 1001, 1002]
    assert fe.stats.restarted == 1 and len(set(fe.stats.sessions)) == 2
    assert [uuid.UUID(p["session"]) for p in script.placed] == fe.stats.sessions


def test_a_session_that_failed_after_tokens_is_reported(script: Script) -> None:
    script.places.append("x")
    script.set_view("x", 1)
    script.answer("x", "generate", line(0, 1), line(1, 1), ("view", "x", 1, "failed"))
    delivered: list[int] = []

    async def main() -> None:
        config = FrontendConfig(stall_s=0.2, poll_s=0.02, reattach_s=5)
        async with FrontEnd(
            script.base + "pc/",
            None,
            scope_id=SCOPE,
            compat_id=COMPAT,
            block_tokens=4,
            config=config,
        ) as fe:
            with pytest.raises(SessionFailed):
                async for token in fe.generate([1], 5):
                    delivered.append(token.index)

    asyncio.run(main())
    assert delivered == [0, 1]


def test_a_request_the_instance_refuses_reaches_the_caller(script: Script) -> None:
    script.places.append("x")
    script.set_view("x", 1)
    script.answer("x", "generate", 400, "kvsp-bad-request")
    with pytest.raises(BadRequest):
        collect(script, 3)


def test_reattaching_gives_up_after_its_deadline(script: Script) -> None:
    script.places.append("x")
    script.set_view("x", 1)
    script.answer("x", "generate", line(0, 1))  # then the stream ends, and x is gone
    with pytest.raises(SessionFailed) as failed:
        collect(script, 3, reattach_s=0.3)
    assert "not found again" in str(failed.value)


def test_a_malformed_line_breaks_the_stream_and_reading_goes_on_from_next(
    script: Script,
) -> None:
    script.places.append("x")
    script.set_view("x", 1)
    script.answer("x", "generate", line(0, 1), line(1, 1), {"index": "2", "epoch": 1, "token": 5})
    script.answer("x", "tokens", line(2, 1), line(3, 1))
    tokens, fe = collect(script, 4)
    assert [t.token for t in tokens] == [1000, 1001, 1002, 1003]
    assert fe.stats.reattached == 1 and ("x", "tokens", "2") in script.asked


def test_a_placement_refused_for_want_of_instances_is_asked_again(script: Script) -> None:
    script.places.extend(["busy", "busy", "x"])
    script.set_view("x", 1)
    script.answer("x", "generate", line(0, 1), line(1, 1))
    tokens, fe = collect(script, 2)
    assert [t.token for t in tokens] == [1000, 1001]
    assert len(script.placed) == 3 and len({p["session"] for p in script.placed}) == 1
