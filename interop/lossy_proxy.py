"""A lossy UDP proxy on loopback, for QUIC (MOQT) under loss.

It sits between a QUIC client and a QUIC server, or between an edge relay and its upstream
relay: datagrams from each client address go to the target from a socket of their own (one
upstream socket per client, so the server sees one peer per client), and the answers come back
from the listening socket. Each direction passes an :class:`Impairment` that drops, duplicates,
reorders (holds a datagram back until ``reorder_gap`` later ones have passed, or
``reorder_hold_ms`` elapsed) and delays (``delay_ms`` plus up to ``jitter_ms``) datagrams at the
configured rates. The random source is seeded per flow and direction and draws the same number
of values for every datagram, so one seed gives one pattern for a given sequence of datagrams;
:class:`ProxyStats` counts every action. The proxy never looks inside a datagram: QUIC's loss
recovery has to do all the work.

As a library::

    async with LossyProxy(("127.0.0.1", server_port), Impairment(drop=0.05, seed=1)) as proxy:
        ...  # connect the client to proxy.address
        print(proxy.stats.to_json())

As a process (prints the counters as one JSON line on SIGTERM/SIGINT; ``--ready-file`` receives
``HOST:PORT`` once it listens, ``--stats-file`` the counters every ``--stats-interval``)::

    python -m interop.lossy_proxy --listen 127.0.0.1:4444 --to 127.0.0.1:4443 \\
        --drop 0.05 --duplicate 0.01 --reorder 0.02 --reorder-gap 3 --delay-ms 1 --seed 7
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

Address = tuple[str, int]
MAX_DATAGRAM = 65_535
SOCKET_BUFFER = 4 << 20  # DESIGN §7: the default 212 KiB UDP buffer drops datagrams itself
DIRECTIONS = ("to_server", "to_client")


@dataclass(frozen=True, slots=True, kw_only=True)
class Impairment:
    """What happens to the datagrams of one direction; rates are probabilities in [0, 1]."""

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    reorder_gap: int = 3
    """A reordered datagram goes out after this many later datagrams of its direction..."""
    reorder_hold_ms: float = 20.0
    """...or after this long, whichever comes first (a quiet flow still gets it)."""
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("drop", "duplicate", "reorder"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0 or math.isnan(value):
                raise ValueError(f"{name} must be a probability in [0, 1], got {value}")
        for name in ("reorder_hold_ms", "delay_ms", "jitter_ms"):
            value = getattr(self, name)
            if not 0.0 <= value < 3_600_000 or math.isnan(value):
                raise ValueError(f"{name} must be a duration in ms >= 0, got {value}")
        if self.reorder_gap < 1:
            raise ValueError(f"reorder_gap must be at least 1, got {self.reorder_gap}")

    @property
    def clean(self) -> bool:
        """Whether it passes every datagram unchanged and at once."""
        return not (self.drop or self.duplicate or self.reorder or self.delay_ms or self.jitter_ms)


@dataclass(slots=True)
class DirectionStats:
    """Counters of one direction (over all flows)."""

    received: int = 0
    """Datagrams that reached the proxy."""
    sent: int = 0
    """Datagrams the proxy sent on (duplicates included)."""
    octets: int = 0
    """Octets of the datagrams sent on."""
    dropped: int = 0
    duplicated: int = 0
    reordered: int = 0
    delayed: int = 0
    send_errors: int = 0
    """Sends the operating system refused (the far end gone, or its buffer full)."""


@dataclass(slots=True)
class ProxyStats:
    """Counters per direction, and how many flows (client addresses) were seen."""

    to_server: DirectionStats = field(default_factory=DirectionStats)
    to_client: DirectionStats = field(default_factory=DirectionStats)
    flows: int = 0

    def to_json(self) -> dict[str, Any]:
        """The counters as plain JSON."""
        return asdict(self)

    @property
    def dropped(self) -> int:
        """Datagrams dropped in both directions."""
        return self.to_server.dropped + self.to_client.dropped


@dataclass(eq=False, slots=True)
class _Held:
    """A datagram held back to be reordered."""

    waiting: int
    """Later datagrams still to pass before it goes."""
    data: bytes
    copies: int
    u_jitter: float
    timer: asyncio.TimerHandle | None = None


class _Pipe:
    """One direction of one flow: impairments between ``receive`` and ``send``."""

    def __init__(
        self,
        impairment: Impairment,
        rng: random.Random,
        stats: DirectionStats,
        send: Callable[[bytes], object],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._imp = impairment
        self._rng = rng
        self._stats = stats
        self._send = send
        self._loop = loop
        self._held: list[_Held] = []
        self._timers: set[asyncio.TimerHandle] = set()
        self.closed = False

    def receive(self, data: bytes) -> None:
        """Apply the impairments to one datagram."""
        imp, stats = self._imp, self._stats
        stats.received += 1
        # Four draws whatever happens, so that one datagram's fate never shifts the next one's.
        u_drop, u_dup, u_reorder, u_jitter = (self._rng.random() for _ in range(4))
        if u_drop < imp.drop:
            stats.dropped += 1
            return
        copies = 1
        if u_dup < imp.duplicate:
            stats.duplicated += 1
            copies = 2
        self._pass_held()
        if u_reorder < imp.reorder:
            stats.reordered += 1
            self._hold(data, copies, u_jitter)
            return
        for _ in range(copies):
            self._out(data, u_jitter)

    def _pass_held(self) -> None:
        """A datagram goes by: count it against every held one, releasing those it was due."""
        due = []
        for entry in self._held:
            entry.waiting -= 1
            if entry.waiting <= 0:
                due.append(entry)
        for entry in due:
            self._release(entry)

    def _hold(self, data: bytes, copies: int, u_jitter: float) -> None:
        entry = _Held(self._imp.reorder_gap, data, copies, u_jitter)
        entry.timer = self._loop.call_later(self._imp.reorder_hold_ms / 1000, self._release, entry)
        self._held.append(entry)

    def _release(self, entry: _Held) -> None:
        if entry not in self._held:
            return
        self._held.remove(entry)
        if entry.timer is not None:
            entry.timer.cancel()
        for _ in range(entry.copies):
            self._out(entry.data, entry.u_jitter)

    def _out(self, data: bytes, u_jitter: float) -> None:
        delay = self._imp.delay_ms + u_jitter * self._imp.jitter_ms
        if delay <= 0:
            self._emit(data)
            return
        self._stats.delayed += 1
        handle: asyncio.TimerHandle | None = None

        def fire() -> None:
            if handle is not None:
                self._timers.discard(handle)
            self._emit(data)

        handle = self._loop.call_later(delay / 1000, fire)
        self._timers.add(handle)

    def _emit(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            self._send(data)
        except OSError:  # ICMP unreachable after the far end died, or a full buffer
            self._stats.send_errors += 1
            return
        self._stats.sent += 1
        self._stats.octets += len(data)

    def close(self) -> None:
        """Drop whatever is held or delayed."""
        self.closed = True
        for entry in self._held:
            if entry.timer is not None:
                entry.timer.cancel()
        self._held.clear()
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()


class _Flow:
    """One client address: its upstream socket and a pipe each way."""

    def __init__(self, proxy: LossyProxy, client: Address, index: int) -> None:
        loop = proxy.loop
        family = socket.AF_INET6 if ":" in proxy.target[0] else socket.AF_INET
        self.sock = _udp_socket(family)
        try:
            self.sock.connect(proxy.target)
        except OSError:
            self.sock.close()
            raise
        self.client = client
        self.last_active = loop.time()
        listen = proxy.listening_socket
        seed = proxy.to_server.seed
        self.up = _Pipe(
            proxy.to_server,
            random.Random(f"{seed}/{index}/to_server"),
            proxy.stats.to_server,
            self.sock.send,
            loop,
        )
        self.down = _Pipe(
            proxy.to_client,
            random.Random(f"{proxy.to_client.seed}/{index}/to_client"),
            proxy.stats.to_client,
            lambda data: _sendto(listen, data, client),
            loop,
        )
        loop.add_reader(self.sock.fileno(), self._readable, loop)

    def _readable(self, loop: asyncio.AbstractEventLoop) -> None:
        for data in _drain(self.sock):
            self.last_active = loop.time()
            self.down.receive(data)

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self.sock.fileno())
        self.up.close()
        self.down.close()
        self.sock.close()


class LossyProxy:
    """The proxy: listens on ``listen`` and forwards to ``target`` (use ``async with``).

    ``impairment`` applies to both directions unless ``to_server`` / ``to_client`` is given.
    Flows idle for ``flow_idle_s`` seconds are closed.
    """

    def __init__(
        self,
        target: Address,
        impairment: Impairment | None = None,
        *,
        listen: Address = ("127.0.0.1", 0),
        to_server: Impairment | None = None,
        to_client: Impairment | None = None,
        flow_idle_s: float = 120.0,
    ) -> None:
        base = impairment or Impairment()
        self.target = target
        self.listen = listen
        self.to_server = to_server or base
        self.to_client = to_client or base
        self.flow_idle_s = flow_idle_s
        self.stats = ProxyStats()
        self._flows: dict[Address, _Flow] = {}
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop it runs on (once started)."""
        if self._loop is None:
            raise RuntimeError("the proxy is not started")
        return self._loop

    @property
    def listening_socket(self) -> socket.socket:
        """The socket clients send to (once started)."""
        if self._sock is None:
            raise RuntimeError("the proxy is not started")
        return self._sock

    @property
    def address(self) -> Address:
        """Where clients send to: (host, port)."""
        host, port = self.listening_socket.getsockname()[:2]
        return str(host), int(port)

    async def start(self) -> None:
        """Bind the listening socket and start forwarding.

        Raises:
            OSError: the address cannot be bound.
        """
        self._loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in self.listen[0] else socket.AF_INET
        sock = _udp_socket(family)
        try:
            sock.bind(self.listen)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._loop.add_reader(sock.fileno(), self._readable)
        self._sweeper = self._loop.call_later(self.flow_idle_s / 2, self._sweep)

    def _readable(self) -> None:
        sock = self.listening_socket
        while True:
            try:
                data, client = sock.recvfrom(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # an ICMP error queued on the socket: read on
                continue
            address: Address = (str(client[0]), int(client[1]))
            flow = self._flows.get(address)
            if flow is None:
                try:
                    flow = _Flow(self, address, self.stats.flows)
                except OSError:
                    self.stats.to_server.send_errors += 1
                    continue
                self._flows[address] = flow
                self.stats.flows += 1
            flow.last_active = self.loop.time()
            flow.up.receive(data)

    def _sweep(self) -> None:
        now = self.loop.time()
        for address, flow in list(self._flows.items()):
            if now - flow.last_active > self.flow_idle_s:
                del self._flows[address]
                flow.close(self.loop)
        self._sweeper = self.loop.call_later(self.flow_idle_s / 2, self._sweep)

    async def close(self) -> None:
        """Stop forwarding and close every socket."""
        if self._loop is None or self._sock is None:
            return
        if self._sweeper is not None:
            self._sweeper.cancel()
        for flow in self._flows.values():
            flow.close(self._loop)
        self._flows.clear()
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock = None

    async def __aenter__(self) -> LossyProxy:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


def _udp_socket(family: socket.AddressFamily) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sock.setblocking(False)
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
    return sock


def _drain(sock: socket.socket) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(sock.recv(MAX_DATAGRAM))
        except (BlockingIOError, InterruptedError):
            return out
        except OSError:  # ConnectionRefused: the target is not there (yet); read on
            continue


def _sendto(sock: socket.socket, data: bytes, address: Address) -> None:
    sock.sendto(data, address)


# --- the command line ----------------------------------------------------------------------------


def parse_address(text: str) -> Address:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as a tuple.

    Raises:
        argparse.ArgumentTypeError: not of that form.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65_535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a rate is a probability in [0, 1], got {text}")
    return value


def _duration(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value < 3_600_000:
        raise argparse.ArgumentTypeError(f"a duration in ms >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m interop.lossy_proxy``."""
    parser = argparse.ArgumentParser(
        prog="python -m interop.lossy_proxy",
        description="A UDP proxy that drops, duplicates, reorders and delays datagrams.",
    )
    parser.add_argument("--listen", type=parse_address, default=("127.0.0.1", 0))
    parser.add_argument("--to", type=parse_address, required=True, help="target HOST:PORT")
    parser.add_argument("--drop", type=_probability, default=0.0)
    parser.add_argument("--duplicate", type=_probability, default=0.0)
    parser.add_argument("--reorder", type=_probability, default=0.0)
    parser.add_argument("--reorder-gap", type=int, default=3, help="later datagrams to wait")
    parser.add_argument("--reorder-hold-ms", type=_duration, default=20.0)
    parser.add_argument("--delay-ms", type=_duration, default=0.0)
    parser.add_argument("--jitter-ms", type=_duration, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--direction",
        choices=("both", *DIRECTIONS),
        default="both",
        help="which direction is impaired (the other passes clean)",
    )
    parser.add_argument("--ready-file", type=Path, help="receives HOST:PORT once listening")
    parser.add_argument("--stats-file", type=Path, help="receives the counters (JSON)")
    parser.add_argument("--stats-interval", type=float, default=1.0)
    return parser


def impairments(args: argparse.Namespace) -> tuple[Impairment, Impairment]:
    """The (to_server, to_client) impairments the arguments ask for.

    Raises:
        ValueError: an inconsistent setting (e.g. a reorder gap below 1).
    """
    impaired = Impairment(
        drop=args.drop,
        duplicate=args.duplicate,
        reorder=args.reorder,
        reorder_gap=args.reorder_gap,
        reorder_hold_ms=args.reorder_hold_ms,
        delay_ms=args.delay_ms,
        jitter_ms=args.jitter_ms,
        seed=args.seed,
    )
    clean = Impairment(seed=args.seed)
    up = impaired if args.direction in ("both", "to_server") else clean
    down = impaired if args.direction in ("both", "to_client") else clean
    return up, down


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


async def _serve(args: argparse.Namespace) -> ProxyStats:
    up, down = impairments(args)
    proxy = LossyProxy(args.to, listen=args.listen, to_server=up, to_client=down)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with proxy:
        host, port = proxy.address
        if args.ready_file is not None:
            _write(args.ready_file, f"{host}:{port}\n")
        print(f"lossy proxy {host}:{port} -> {args.to[0]}:{args.to[1]}", file=sys.stderr)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.05, args.stats_interval))
            if args.stats_file is not None:
                _write(args.stats_file, json.dumps(proxy.stats.to_json()) + "\n")
    return proxy.stats


def main(argv: Sequence[str] | None = None) -> int:
    """Run the proxy until SIGTERM/SIGINT; print its counters as one JSON line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        impairments(args)
    except ValueError as exc:
        parser.error(str(exc))
    stats = asyncio.run(_serve(args))
    print(json.dumps(stats.to_json()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
