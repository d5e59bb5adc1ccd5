"""How fast a relay's cache miss could be on this machine (MOQT draft-16 relays; DESIGN.md §4):
FETCHes of a 2 MiB block through byte forwarders that speak no MOQT at all, side by side with
the same FETCH straight from its publisher and with a miss through ``relay.app``.

Run: ``.venv/bin/python bench/bench_relay_floor.py [--seconds S] [--rounds R]``.

Every path is QMux over Unix sockets, one block in flight, verified by the client as in
``bench_moqt.py``'s ``relay-miss/direct`` pair:

* ``direct``: the client to the publisher;
* ``pipe``: through a forwarder that copies the bytes both ways (one copy in, one copy out, a
  reused buffer, threads whose socket calls release the GIL): one more process on the path
  and nothing else;
* ``hash``: the same, and a SHA-256 of every octet after forwarding it (two lanes at a time, as
  the relay hashes layer pairs): what verifying costs;
* ``floor``: the same again, reading into fresh memory (``MAP_POPULATE`` mappings of 1 MiB,
  kept up to the relay's default 1 GiB cache, as a relay keeps the slices it cached): what
  every relay that verifies and caches a miss must do. It parses nothing, so its rate bounds
  any such relay here from above;
* ``relay-miss``: ``relay.app --open`` forwarding a block it has never seen (each FETCH
  misses), from an instance's session to it.

Rows take turns (``bench_moqt.in_turns``) so the drift of these 2 shared cores reaches each
alike. Prints MB/s and CPU ms a block (client | forwarder or relay | publisher) per row, then::

    ratio pipe/direct = X
    ratio hash/direct = X
    ratio floor/direct = X
    ratio relay-miss/direct = X
    ratio relay-miss/floor = X
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import shutil
import socket
import sys
import tempfile
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_moqt as bm  # noqa: E402

BLOCKS = 400
"""Distinct blocks the relay's publisher stores: each turn of the miss row takes new ones."""
bm.SHAPES = (bm.make_shape("2 MiB", 32, 8, 128, BLOCKS),)
CHUNK = 1 << 20
"""A forwarder's receive buffer, the size of the relay's (:data:`moqt.receive_buffers`)."""
KEPT = 1 << 30
"""What the floor forwarder keeps of what it received: ``relay.app``'s default cache size."""
ROWS = ("direct", "pipe", "hash", "floor", "relay-miss")
FORWARDERS = ROWS[1:-1]


# --- the forwarders ---------------------------------------------------------------------------


def copy_bytes(source: socket.socket, sink: socket.socket, mode: str = "pipe") -> None:
    """Everything ``source`` sends, on to ``sink``: through one reused buffer ("pipe"); also
    hashed once forwarded ("hash"); or, besides, read into fresh memory that is kept until
    :data:`KEPT` octets are held, as a cache that is filling keeps it ("floor")."""
    from kvsp.sha256x2 import digest_pair
    from moqt.receive_buffers import prefaulted

    hashing, fresh = mode != "pipe", mode == "floor"
    kept: collections.deque[memoryview] = collections.deque()
    buffer, filled = memoryview(prefaulted(CHUNK)), 0
    while received := source.recv_into(buffer[filled:]):
        piece = buffer[filled : filled + received]
        sink.sendall(piece)
        if hashing:
            half = received // 2
            digest_pair((piece[:half],), (piece[half:],))
        filled += received
        if filled == CHUNK:
            if fresh:
                kept.append(buffer)
                if len(kept) * CHUNK > KEPT:
                    kept.popleft()
                buffer = memoryview(prefaulted(CHUNK))
            filled = 0


def forwarder_main(upstream: str, listen: str, mode: str, pipe: Connection) -> None:
    """Accept on the Unix socket ``listen``; join each connection to a new one to ``upstream``
    (the publisher's socket), the publisher's bytes through ``mode`` (:func:`copy_bytes`)."""
    from moqt.backend import DEFAULT_SOCKET_BUFFER
    from moqt.transport import tune_socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(listen)
    listener.listen()

    def accept() -> None:
        while True:
            client, _ = listener.accept()
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.connect(upstream)
            for sock in (client, server):
                tune_socket(sock, DEFAULT_SOCKET_BUFFER)
            for source, sink, how in ((client, server, "pipe"), (server, client, mode)):
                threading.Thread(target=join, args=(source, sink, how), daemon=True).start()

    def join(source: socket.socket, sink: socket.socket, how: str) -> None:
        with contextlib.suppress(OSError):  # the other side went away: so does this half
            copy_bytes(source, sink, how)
        for sock in (source, sink):
            sock.close()

    threading.Thread(target=accept, daemon=True).start()
    pipe.send("ready")
    pipe.recv()  # "stop"


# --- the rows ---------------------------------------------------------------------------------


async def measure(
    table: bm.Table,
    uds: dict[str, str],
    quic_holder: str,
    relay_url: str,
    pids: dict[str, tuple[int, ...]],
    seconds: float,
    rounds: int,
) -> None:
    """The rows of :data:`ROWS` in turns: ``uds`` maps each to the Unix-socket URI its client
    takes; ``pids`` to the processes whose CPU it counts."""
    from kvsp.transfer.moqt_client import MoqtBlockClient

    shape = bm.SHAPES[0]
    misses = iter(  # made before the clock: a record's digests are a hash of the whole block
        [
            bm.block_record(shape, relay_url, bm.block_key(shape, n), (uds["relay-miss"],))
            for n in range(BLOCKS)
        ]
    )

    async def miss() -> int:
        record = next(misses)
        return bm.kv_octets(
            await client.get_block(record, geometry=shape.geometry, block_tokens=bm.TOKENS)
        )

    async with MoqtBlockClient(verify=False, timeout=30) as client:
        rows: list[bm.Turns] = []
        for key in ROWS[:-1]:
            record = bm.block_record(shape, quic_holder, bm.block_key(shape, 0), (uds[key],))
            label = f"{key}, QMux UDS"
            rows.append(bm.Turns(key, label, bm.fetcher(client, record, shape), pids[key]))
        label = "relay-miss, QMux UDS (relay.app, each FETCH a new block)"
        rows.append(bm.Turns("relay-miss", label, miss, pids["relay-miss"], limit=BLOCKS - 2))
        for row in rows:  # the sessions, outside the clock
            await row.block()
        await bm.in_turns(table, shape, rows, seconds, rounds)
        for row in rows:
            if row.blocks:
                print(f"{row.label:58} {row.rate:7.1f} MB/s   cpu ms/block {row.cpu_note()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="time each row takes in all")
    parser.add_argument("--rounds", type=int, default=bm.ROUNDS, help="turns each row takes")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="kvsp-floor-"))
    cert, key = (str(path) for path in bm.make_self_signed("localhost", folder))
    publisher = bm.in_process(bm.publisher_main, cert, key, str(folder))
    started: list[tuple[Any, Connection]] = [publisher[:2]]
    relay = None
    try:
        uris = publisher[2]
        published = uris["qmux-uds"].removeprefix("moqt+unix://localhost")
        uds = {"direct": uris["qmux-uds"]}
        pids = {"direct": (publisher[0].pid,)}
        for mode in FORWARDERS:
            path = folder / f"{mode}.sock"
            process, pipe, _ = bm.in_process(forwarder_main, published, str(path), mode)
            started.append((process, pipe))
            uds[mode] = f"moqt+unix://localhost{path}"
            pids[mode] = (process.pid, publisher[0].pid)
        relay_folder = folder / "relay"
        relay_folder.mkdir()
        relay, relay_url, offered = bm.start_relay(relay_folder)
        uds["relay-miss"] = offered["qmux-uds"]
        process, pipe, _ = bm.in_process(bm.relay_publisher_main, offered["qmux-uds"])
        started.append((process, pipe))
        pids["relay-miss"] = (relay.proc.pid, process.pid)
        table = bm.Table()
        print(f"2 MiB blocks ({len(bm.SHAPES[0].layers)} layers), one in flight, QMux UDS")
        holder = uris["quic-default-1452"]
        asyncio.run(measure(table, uds, holder, relay_url, pids, args.seconds, args.rounds))
    finally:
        for process, pipe in reversed(started):
            bm.stop(process, pipe)
        if relay is not None:
            relay.stop()
        shutil.rmtree(folder, ignore_errors=True)
    for row in table.rows.values():  # a row that failed says why (its CPU is printed above)
        for note in row.notes:
            if "cpu ms/block" not in note:
                print(f"{row.label}: {note}")
    rate = {key: table.rate(key) or 0.0 for key in ROWS}
    print()
    pairs = [(row, "direct") for row in ROWS[1:]] + [("relay-miss", "floor")]
    for top, bottom in pairs:
        print(f"ratio {top}/{bottom} = {rate[top] / rate[bottom] if rate[bottom] else 0.0:.2f}")


if __name__ == "__main__":
    main()
