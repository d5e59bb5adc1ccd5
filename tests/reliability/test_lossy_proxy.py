"""The lossy UDP proxy itself (``interop/lossy_proxy.py``): what each impairment does to numbered
datagrams, seeded patterns, the counters, and the command-line process."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from interop.lossy_proxy import (
    Impairment,
    LossyProxy,
    build_parser,
    parse_address,
)
from kvsp.web.testing import start_process
from tests.support import REPO
from tests.support.polling import until

T = TypeVar("T")
pytestmark = pytest.mark.timeout(60)


class Echo(asyncio.DatagramProtocol):
    """A UDP server that records what it got and echoes each datagram back."""

    def __init__(self) -> None:
        self.got: list[bytes] = []
        self.transport: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # a _SelectorDatagramTransport: sendto without the ABC

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.got.append(data)
        if self.transport is not None:
            self.transport.sendto(data, addr)


class Receiver(asyncio.DatagramProtocol):
    """The client side: collects the echoes."""

    def __init__(self) -> None:
        self.got: list[bytes] = []
        self.arrived = asyncio.Event()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.got.append(data)
        self.arrived.set()


@asynccontextmanager
async def echo_server() -> AsyncIterator[tuple[Echo, tuple[str, int]]]:
    loop = asyncio.get_running_loop()
    transport, echo = await loop.create_datagram_endpoint(Echo, local_addr=("127.0.0.1", 0))
    try:
        yield echo, transport.get_extra_info("sockname")[:2]
    finally:
        transport.close()


@asynccontextmanager
async def sender(
    to: tuple[str, int],
) -> AsyncIterator[tuple[asyncio.DatagramTransport, Receiver]]:
    loop = asyncio.get_running_loop()
    transport, receiver = await loop.create_datagram_endpoint(Receiver, remote_addr=to)
    try:
        yield transport, receiver
    finally:
        transport.close()


def numbered(n: int) -> list[bytes]:
    return [b"%06d" % i + b"." * 100 for i in range(n)]


async def settle(count: list[bytes], quiet: float = 0.2) -> None:
    """Wait until ``count`` has not grown for ``quiet`` seconds."""
    seen = -1
    while len(count) != seen:
        seen = len(count)
        await asyncio.sleep(quiet)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_clean_proxy_forwards_both_ways_in_order() -> None:
    async def scenario() -> None:
        async with echo_server() as (echo, address), LossyProxy(address) as proxy:
            async with sender(proxy.address) as (out, receiver):
                sent = numbered(100)
                for data in sent:
                    out.sendto(data)
                await until(lambda: len(receiver.got) == 100)
            assert echo.got == sent and receiver.got == sent
            stats = proxy.stats
            assert stats.flows == 1
            for direction in (stats.to_server, stats.to_client):
                assert (direction.received, direction.sent, direction.dropped) == (100, 100, 0)
                assert direction.octets == sum(len(d) for d in sent)

    run(scenario())


def test_one_upstream_socket_per_client_address() -> None:
    async def scenario() -> None:
        async with echo_server() as (echo, address), LossyProxy(address) as proxy:
            async with sender(proxy.address) as (a, got_a), sender(proxy.address) as (b, got_b):
                a.sendto(b"from a")
                b.sendto(b"from b")
                await until(lambda: got_a.got and got_b.got)
            assert (got_a.got, got_b.got) == ([b"from a"], [b"from b"])
            assert proxy.stats.flows == 2

    run(scenario())


@dataclass
class Rig:
    """An echo server behind a proxy, and a client socket sending to the proxy."""

    echo: Echo
    proxy: LossyProxy
    out: Any
    receiver: Receiver


@asynccontextmanager
async def rig(to_server: Impairment, to_client: Impairment | None = None) -> AsyncIterator[Rig]:
    """A :class:`Rig` whose proxy impairs the way to the server (and back, when given)."""
    async with echo_server() as (echo, address):
        proxy = LossyProxy(address, to_server=to_server, to_client=to_client or Impairment())
        async with proxy, sender(proxy.address) as (out, receiver):
            yield Rig(echo, proxy, out, receiver)


async def arrivals(impairment: Impairment, n: int = 300) -> tuple[list[bytes], int]:
    """The datagrams the server got of ``n`` sent through a proxy impairing only the way to
    it, and how many the proxy says it dropped."""
    async with rig(impairment) as r:
        for data in numbered(n):
            r.out.sendto(data)
            await asyncio.sleep(0)  # one at a time, so the proxy reads them in order
        await settle(r.echo.got)
        return r.echo.got, r.proxy.stats.to_server.dropped


def test_drops_follow_the_seed() -> None:
    async def scenario() -> None:
        first, dropped = await arrivals(Impairment(drop=0.3, seed=11))
        again, _ = await arrivals(Impairment(drop=0.3, seed=11))
        other, _ = await arrivals(Impairment(drop=0.3, seed=12))
        assert first == again  # one seed, one pattern
        assert first != other
        assert dropped == 300 - len(first) > 0
        assert first == sorted(first)  # dropping reorders nothing

    run(scenario())


def test_every_datagram_dropped_or_duplicated() -> None:
    async def scenario() -> None:
        nothing, dropped = await arrivals(Impairment(drop=1.0), n=20)
        assert (nothing, dropped) == ([], 20)
        twice, _ = await arrivals(Impairment(duplicate=1.0), n=20)
        assert twice == [d for d in numbered(20) for _ in range(2)]

    run(scenario())


def test_reordered_datagrams_go_out_at_most_gap_later_and_none_is_lost() -> None:
    gap = 3

    async def scenario() -> None:
        impairment = Impairment(reorder=0.2, reorder_gap=gap, reorder_hold_ms=2000, seed=5)
        async with rig(impairment) as r:
            sent = numbered(200)
            for data in sent:  # a burst: the hold timer never runs before the gap
                r.out.sendto(data)
            await until(lambda: len(r.echo.got) == 200)
            assert sorted(r.echo.got) == sent and r.echo.got != sent
            assert r.proxy.stats.to_server.reordered > 0
            for position, data in enumerate(r.echo.got):
                assert position <= sent.index(data) + gap

    run(scenario())


def test_a_held_datagram_on_a_quiet_flow_still_goes_out() -> None:
    async def scenario() -> None:
        async with rig(Impairment(reorder=1.0, reorder_gap=5, reorder_hold_ms=30)) as r:
            r.out.sendto(b"alone")
            await until(lambda: r.echo.got == [b"alone"])
            assert r.proxy.stats.to_server.reordered == 1

    run(scenario())


def test_delay_holds_each_direction_back() -> None:
    async def scenario() -> None:
        delayed = Impairment(delay_ms=60, jitter_ms=10)
        async with rig(delayed, delayed) as r:
            began = time.monotonic()
            r.out.sendto(b"ping")
            await until(lambda: r.receiver.got == [b"ping"])
            assert time.monotonic() - began >= 0.12  # 60 ms each way at least
            stats = r.proxy.stats
            assert (stats.to_server.delayed, stats.to_client.delayed) == (1, 1)

    run(scenario())


@pytest.mark.parametrize(
    "changes",
    [{"drop": 1.5}, {"duplicate": -0.1}, {"reorder": float("nan")}, {"reorder_gap": 0}],
)
def test_impossible_impairments_are_refused(changes: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Impairment(**changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("argv", [["--to", "nowhere"], ["--to", "127.0.0.1:1", "--drop", "2"]])
def test_the_command_line_refuses_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    assert parse_address("[::1]:443") == ("::1", 443)


def test_the_proxy_process_forwards_and_reports_its_counters(tmp_path: Path) -> None:
    async def serve_and_send() -> int:
        async with echo_server() as (echo, address):
            argv = [
                *(sys.executable, "-m", "interop.lossy_proxy"),
                *("--to", f"{address[0]}:{address[1]}", "--drop", "0.5", "--seed", "3"),
                *("--direction", "to_client", "--stats-file", str(tmp_path / "stats.json")),
            ]
            service = await asyncio.to_thread(start_process, argv, cwd=REPO, workdir=tmp_path)
            try:
                host, port = parse_address(service.base_url)
                async with sender((host, port)) as (out, _):
                    for data in numbered(50):
                        out.sendto(data)
                    await until(lambda: len(echo.got) == 50)  # the way in is clean
                    await asyncio.sleep(0.2)
            finally:
                status = await asyncio.to_thread(service.stop)
            assert status == 0, service.output()
            counters = json.loads(service.output().strip().splitlines()[-1])
            assert counters["to_server"]["dropped"] == 0
            assert counters["to_client"]["received"] == 50
            dropped: int = counters["to_client"]["dropped"]
            assert counters["to_client"]["sent"] == 50 - dropped
            periodic = json.loads((tmp_path / "stats.json").read_text())
            assert periodic["flows"] == 1
            return dropped

    assert 0 < run(serve_and_send()) < 50


def test_a_busy_port_is_a_clear_error() -> None:
    async def scenario() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
            taken.bind(("127.0.0.1", 0))
            proxy = LossyProxy(("127.0.0.1", 9), listen=taken.getsockname())
            with pytest.raises(OSError):
                await proxy.start()

    run(scenario())
