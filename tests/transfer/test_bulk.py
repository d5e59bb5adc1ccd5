"""The bulk HTTP/1.1 path: the sans-I/O response parser (fed whole, one octet at a time, and
fuzzed), and the client against a real uvicorn process and against scripted raw servers."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsp.errors import TransportError
from kvsp.transfer.bulk import BulkClient, RequestTimeout, split_url
from kvsp.transfer.http11 import (
    END_OF_MESSAGE,
    BulkLimits,
    BytesBody,
    ConnectionClosed,
    HeaderTooLarge,
    HTTPProtocolError,
    ResponseHead,
    ResponseParser,
)
from kvsp.web.testing import RunningService, start_process
from tests.support import SUPPORT
from tests.support import bulk_server as srv

SERVER = SUPPORT / "bulk_server.py"
T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro

    return asyncio.run(main())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    """The test holder as a real uvicorn (uvloop + httptools) process."""
    folder = tmp_path_factory.mktemp("bulk")
    with start_process([sys.executable, str(SERVER)], workdir=folder) as running:
        yield running


# -- the parser ----------------------------------------------------------------------------------


def parse(data: bytes, *, step: int | None = None, eof: bool = False, **kw: Any) -> tuple:
    """Feed ``data`` (in pieces of ``step``); return (head, body, ended, parser)."""
    parser = ResponseParser(**kw)
    events: list[Any] = []
    pieces = [data] if step is None else [data[i : i + step] for i in range(0, len(data), step)]
    for piece in pieces:
        events += [bytes(e) if isinstance(e, memoryview) else e for e in parser.feed(piece)]
    if eof:
        events += parser.eof()
    heads = [e for e in events if isinstance(e, ResponseHead)]
    body = b"".join(e for e in events if isinstance(e, bytes))
    return (heads[0] if heads else None), body, END_OF_MESSAGE in events, parser


STEPS = [None, 1, 3, 7]


@pytest.mark.parametrize("step", STEPS)
def test_content_length_body(step: int | None) -> None:
    data = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\nx-a:  2 \r\n\r\nhello"
    head, body, ended, parser = parse(data, step=step)
    assert head.status == 200 and head.reason == "OK" and head.version == "HTTP/1.1"
    assert head.get("x-a") == "1, 2" and head.get("missing") is None
    assert (body, ended, parser.keep_alive, parser.content_length) == (b"hello", True, True, 5)


@pytest.mark.parametrize("step", STEPS)
def test_chunked_body_with_extensions_and_trailers(step: int | None) -> None:
    data = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;name=value\r\nhello\r\n1A \r\n" + b"x" * 26 + b"\r\n0\r\nTrailer: yes\r\n\r\n"
    )
    head, body, ended, parser = parse(data, step=step)
    assert body == b"hello" + b"x" * 26 and ended and parser.keep_alive
    assert parser.content_length is None


@pytest.mark.parametrize("step", STEPS)
def test_close_delimited_body_ends_at_eof(step: int | None) -> None:
    head, body, ended, parser = parse(b"HTTP/1.1 200 OK\r\n\r\nuntil close", step=step)
    assert body == b"until close" and not ended and not parser.keep_alive
    head, body, ended, parser = parse(b"HTTP/1.1 200 OK\r\n\r\nuntil close", eof=True)
    assert ended and parser.done


@pytest.mark.parametrize("step", STEPS)
def test_interim_responses_are_skipped(step: int | None) -> None:
    data = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early\r\nLink: x\r\n\r\n"
    data += b"HTTP/1.1 204 No Content\r\n\r\n"
    head, body, ended, _ = parse(data, step=step)
    assert head.status == 204 and body == b"" and ended


def test_no_body_for_head_requests_and_304() -> None:
    data = b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n"
    assert parse(data, head_request=True)[2]
    assert parse(b"HTTP/1.1 304 Not Modified\r\nContent-Length: 9\r\n\r\n")[2]


@pytest.mark.parametrize(
    ("data", "keep_alive"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\nConnection: Keep-Alive\r\n\r\n", True),
        (b"HTTP/1.1 200 \r\nContent-Length: 0\r\n\r\n", True),
        (b"HTTP/1.1 200\r\nContent-Length: 0, 0\r\n\r\n", True),
    ],
)
def test_keep_alive(data: bytes, keep_alive: bool) -> None:
    _, _, ended, parser = parse(data)
    assert ended and parser.keep_alive is keep_alive


def test_octets_after_the_response_make_the_connection_unfit() -> None:
    _, body, ended, parser = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA")
    assert (body, ended, parser.trailing, parser.keep_alive) == (b"ok", True, 5, False)


SMALL = BulkLimits(max_head=256, max_body=100, max_chunk_line=16, max_interim=2)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"HTTP/2 200 OK\r\n\r\n", HTTPProtocolError),
        (b"HTTP/1.1 20 OK\r\n\r\n", HTTPProtocolError),
        (b"HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n", HTTPProtocolError),
        (b"HTTP/1.1 200 OK\r\nA: x\r\n folded\r\n\r\n", HTTPProtocolError),
        (b"HTTP/1.1 200 OK\r\nA: x\ry\r\n\r\n", HTTPProtocolError),
        (b"HTTP/1.1 200 OK\r\nA: \x00\r\n\r\n", HTTPProtocolError),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", None),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", HTTPProtocolError),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", HTTPProtocolError),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n", HTTPProtocolError),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 101\r\n\r\n", HTTPProtocolError),
        (b"HTTP/1.1 200 OK\r\n" + b"A: " + b"x" * 300 + b"\r\n\r\n", HeaderTooLarge),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;" + b"e" * 20, HeaderTooLarge),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", HTTPProtocolError),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n65\r\n", HTTPProtocolError),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nab", HTTPProtocolError),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nbad\r\n\r\n", None),
        (b"HTTP/1.1 101 Switching\r\n\r\n", HTTPProtocolError),
        (b"HTTP/1.1 100 A\r\n\r\n" * 3, HTTPProtocolError),
        (b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 101, HTTPProtocolError),
        (b"HTTP/1.1 200 OK\r\n" + b"A: b\n" * 60, HeaderTooLarge),
    ],
)
@pytest.mark.parametrize("step", [None, 1])
def test_malformed_responses_raise_typed_errors(
    data: bytes, error: type[Exception] | None, step: int | None
) -> None:
    with pytest.raises(error or HTTPProtocolError):
        parse(data, step=step, limits=SMALL)


def test_a_failed_parser_stays_failed() -> None:
    parser = ResponseParser()
    with pytest.raises(HTTPProtocolError):
        parser.feed(b"garbage\r\n\r\n")
    with pytest.raises(HTTPProtocolError):
        parser.feed(b"HTTP/1.1 200 OK\r\n\r\n")


@pytest.mark.parametrize(
    ("data", "received"),
    [
        (b"", 0),
        (b"HTTP/1.1 200 OK\r\n", 17),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nab", 40),
    ],
)
def test_eof_before_the_end(data: bytes, received: int) -> None:
    parser = ResponseParser()
    parser.feed(data)
    with pytest.raises(ConnectionClosed) as caught:
        parser.eof()
    assert caught.value.received == received


def test_direct_body_accounting() -> None:
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n")
    assert parser.direct_body == 4
    assert parser.body_received(3) == [] and parser.direct_body == 1
    with pytest.raises(HTTPProtocolError):
        parser.body_received(2)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=600), cuts=st.lists(st.integers(0, 600), max_size=8))
def test_garbage_only_raises_typed_errors(data: bytes, cuts: list[int]) -> None:
    parser = ResponseParser(limits=SMALL)
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    heads = ends = 0
    try:
        for a, b in zip(bounds, bounds[1:], strict=False):
            for event in parser.feed(data[a:b]):
                heads += isinstance(event, ResponseHead)
                ends += event is END_OF_MESSAGE
        for event in parser.eof():
            ends += event is END_OF_MESSAGE
    except (HTTPProtocolError, ConnectionClosed):
        return
    assert heads <= 1 and ends <= 1 and ends <= heads


@st.composite
def responses(draw: st.DrawFn) -> tuple[bytes, bytes, list[int]]:
    body = draw(st.binary(max_size=300))
    fields = draw(
        st.lists(
            st.tuples(
                st.from_regex(r"[a-z][a-z0-9-]{0,10}", fullmatch=True),
                st.from_regex(r"[!-~]([ !-~]{0,20}[!-~])?", fullmatch=True),
            ).filter(lambda f: f[0] not in ("content-length", "transfer-encoding", "connection")),
            max_size=5,
        )
    )
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in fields)
    if draw(st.booleans()):
        wire = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    else:
        sizes = draw(st.lists(st.integers(1, 50), max_size=20))
        chunks, rest = [], body
        for size in sizes:
            if rest:
                chunks.append(rest[:size])
                rest = rest[size:]
        if rest:
            chunks.append(rest)
        framed = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)
        wire = head + b"Transfer-Encoding: chunked\r\n\r\n" + framed + b"0\r\n\r\n"
    cuts = draw(st.lists(st.integers(0, len(wire)), max_size=10))
    return wire, body, cuts


@settings(max_examples=300, deadline=None)
@given(case=responses(), direct=st.lists(st.integers(1, 64), max_size=30))
def test_valid_responses_parse_in_any_pieces(
    case: tuple[bytes, bytes, list[int]], direct: list[int]
) -> None:
    """Like the connection: body octets go "direct" when the parser allows, else are fed."""
    wire, body, cuts = case
    parser, got, ended, pos = ResponseParser(), bytearray(), False, 0
    bounds = sorted({len(wire), *cuts})
    sizes = iter(direct)
    while pos < len(wire):
        n = parser.direct_body
        if n > 0:
            take = min(n, next(sizes, 64), len(wire) - pos)
            got += wire[pos : pos + take]
            events = parser.body_received(take)
            pos += take
        else:
            end = next(b for b in bounds if b > pos)
            events = parser.feed(wire[pos:end])
            pos = end
        for event in events:
            if isinstance(event, memoryview):
                got += event
            ended = ended or event is END_OF_MESSAGE
    assert ended and bytes(got) == body and parser.keep_alive and parser.trailing == 0


def test_split_url() -> None:
    origin, target = split_url("http://[::1]:8080/a/b?x=1")
    assert (origin.host, origin.port, origin.authority, target) == (
        "::1",
        8080,
        "[::1]:8080",
        "/a/b?x=1",
    )
    assert split_url("https://h.example")[0].authority == "h.example"
    for bad in ("moqt://h/", "http:///x", "http://h:99999/"):
        with pytest.raises(ValueError):
            split_url(bad)


# -- against a real uvicorn process --------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 65_536, 2_097_155])
def test_content_length_bodies(server: RunningService, n: int) -> None:
    async def main() -> bytes:
        async with BulkClient() as client:
            response = await client.request("GET", f"{server.base_url}bytes/{n}")
            assert response.status == 200 and response.head.get("content-length") == str(n)
            assert isinstance(response.body, BytesBody)
            return bytes(response.body.data)

    assert run(main()) == srv.pattern(n)


def test_chunked_bodies(server: RunningService) -> None:
    async def main() -> bytes:
        async with BulkClient() as client:
            response = await client.request("GET", f"{server.base_url}stream/250000")
            assert response.head.get("transfer-encoding") == "chunked"
            assert isinstance(response.body, BytesBody)
            return bytes(response.body.data)

    assert run(main()) == srv.pattern(250_000)


def test_keep_alive_reuses_one_connection(server: RunningService) -> None:
    async def main() -> list[bytes]:
        async with BulkClient() as client:
            ports = []
            for path in ("peer", "bytes/100000", "stream/30000", "peer"):
                response = await client.request("GET", server.base_url + path)
                ports.append(bytes(response.body.data) if path == "peer" else b"")  # type: ignore[attr-defined]
            return [p for p in ports if p]

    first, last = run(main())
    assert first == last


def test_timeout_closes_the_connection_and_the_pool_recovers(server: RunningService) -> None:
    async def main() -> int:
        async with BulkClient(timeout=5) as client:
            with pytest.raises(RequestTimeout):
                await client.request("GET", f"{server.base_url}slow?s=3", timeout=0.2)
            return (await client.request("GET", f"{server.base_url}bytes/10")).status

    assert run(main()) == 200


def test_oversized_response_headers(server: RunningService) -> None:
    async def main() -> None:
        async with BulkClient() as client:
            await client.request("GET", f"{server.base_url}headers/70")

    with pytest.raises(HeaderTooLarge):
        run(main())


def test_body_over_the_limit(server: RunningService) -> None:
    async def main() -> None:
        async with BulkClient(limits=BulkLimits(max_body=1000)) as client:
            await client.request("GET", f"{server.base_url}stream/5000")

    with pytest.raises(HTTPProtocolError):
        run(main())


def test_refused_connection_is_a_transport_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connecting is refused

        async def main() -> None:
            async with BulkClient() as client:
                await client.request("GET", f"http://127.0.0.1:{port}/")

        with pytest.raises(TransportError, match="cannot connect"):
            run(main())


def test_runs_on_uvloop(server: RunningService) -> None:
    uvloop = pytest.importorskip("uvloop")

    async def main() -> int:
        async with BulkClient() as client:
            response = await client.request("GET", f"{server.base_url}bytes/300000")
            return len(response.body.data)  # type: ignore[attr-defined]

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(main()) == 300_000


def test_bad_requests_are_refused_before_sending() -> None:
    async def main(method: str, url: str, headers: dict[str, str]) -> None:
        async with BulkClient() as client:
            await client.request(method, url, headers=headers)

    for method, url, headers in [
        ("GET", "ftp://h/", {}),
        ("G T", "http://127.0.0.1:9/", {}),
        ("GET", "http://127.0.0.1:9/a b", {}),
        ("GET", "http://127.0.0.1:9/", {"x": "a\r\nInjected: 1"}),
    ]:
        with pytest.raises(ValueError):
            run(main(method, url, headers))


# -- against scripted raw servers ----------------------------------------------------------------

Script = Callable[[bytes, int], Awaitable[bytes | None]]
"""Given a request head and the number of requests seen on the connection, what to send
(``None``: close the connection without answering)."""


async def scripted(
    answer: Callable[[bytes, int], bytes | None],
    *,
    close_after: bool = False,
    hang: bool = False,
    closed: asyncio.Event | None = None,
) -> tuple[asyncio.Server, str, list[int]]:
    """A raw server; the list counts the connections it accepted. ``closed`` is set each time
    the server has closed a connection."""
    accepted: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            for n in range(100):
                request = await reader.readuntil(b"\r\n\r\n")
                length = [
                    int(line.split(b":")[1])
                    for line in request.lower().split(b"\r\n")
                    if line.startswith(b"content-length:")
                ]
                if length:
                    await reader.readexactly(length[0])
                if hang:
                    await asyncio.sleep(30)
                data = answer(request, n)
                if data is None:
                    break
                writer.write(data)
                await writer.drain()
                if close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            if closed is not None:
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()
                closed.set()

    srv_ = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv_.sockets[0].getsockname()[1]
    return srv_, f"http://127.0.0.1:{port}/", accepted


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def test_server_closing_mid_body() -> None:
    async def main() -> None:
        server, base, _ = await scripted(
            lambda r, n: b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this",
            close_after=True,
        )
        async with server, BulkClient() as client:
            with pytest.raises(ConnectionClosed) as caught:
                await client.request("GET", base)
            assert caught.value.received > 0

    run(main())


def test_garbage_answer() -> None:
    async def main() -> None:
        server, base, _ = await scripted(lambda r, n: b"SSH-2.0-OpenSSH\r\n\r\n")
        async with server, BulkClient() as client:
            with pytest.raises(HTTPProtocolError):
                await client.request("GET", base)

    run(main())


def test_close_delimited_body_and_interim_responses() -> None:
    async def main() -> bytes:
        answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\nuntil the end"
        server, base, _ = await scripted(lambda r, n: answer, close_after=True)
        async with server, BulkClient() as client:
            return bytes((await client.request("GET", base)).body.data)  # type: ignore[attr-defined]

    assert run(main()) == b"until the end"


def test_idle_connection_closed_by_the_peer_is_retried_for_idempotent_requests() -> None:
    async def main() -> tuple[int, int]:
        closed = asyncio.Event()
        server, base, accepted = await scripted(lambda r, n: OK, close_after=True, closed=closed)
        async with server, BulkClient() as client:
            await client.request("GET", base)
            await asyncio.wait_for(closed.wait(), 10)  # the server closed the pooled connection
            status = (await client.request("PUT", base, body=b"x")).status
            return status, len(accepted)

    assert run(main()) == (200, 2)


def test_stale_connection_not_retried_for_post() -> None:
    async def main() -> None:
        # answers the first request, then closes without answering the second
        server, base, _ = await scripted(lambda r, n: OK if n == 0 else None)
        async with server, BulkClient() as client:
            await client.request("POST", base, body=b"{}")
            with pytest.raises(ConnectionClosed):
                await client.request("POST", base, body=b"{}")

    run(main())


def test_extra_octets_after_a_response_retire_the_connection() -> None:
    async def main() -> int:
        server, base, accepted = await scripted(lambda r, n: OK + b"junk")
        async with server, BulkClient() as client:
            await client.request("GET", base)
            await client.request("GET", base)
            return len(accepted)

    assert run(main()) == 2


def test_silent_server_times_out() -> None:
    async def main() -> None:
        server, base, _ = await scripted(lambda r, n: OK, hang=True)
        async with server, BulkClient(timeout=0.3) as client:
            with pytest.raises(RequestTimeout):
                await client.request("GET", base)

    run(main())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answer=st.binary(max_size=300), close=st.booleans())
def test_the_client_turns_any_answer_into_a_response_or_a_typed_error(
    answer: bytes, close: bool
) -> None:
    async def main() -> None:
        server, base, _ = await scripted(lambda r, n: answer, close_after=close)
        async with server, BulkClient(timeout=0.2, limits=SMALL) as client:
            with contextlib.suppress(TransportError):  # any typed error is fine; no other
                await client.request("GET", base)

    run(main())
