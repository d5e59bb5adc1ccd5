"""A relay in service, its cache full (MOQT draft-16 relay caching; DESIGN.md §4): FETCH misses
forwarded while the cache evicts as it admits, with the pool of receive buffers
(:mod:`moqt.receive_buffers`) and without it, side by side.

Run: ``.venv/bin/python bench/bench_relay_steady.py [--rounds R] [--cache SIZE] [--warm W]
[--misses M]``.

Each round starts two relays in turn (``relay.app --open --cache-size SIZE``, QMux on a Unix
socket): one as it is, and one whose pool keeps no free buffer, so that every receive buffer is
fresh memory as before the pool. Each gets its own publisher (an instance's session to it, as
``bench_moqt.py`` runs) and a client that fetches distinct 2 MiB blocks through it, verified:
the first W, which fill the cache, outside the clock, then M timed. The order of the two flips
every round (these 2 cores drift). Prints, per relay and round, MB/s and CPU ms a block of
client | relay | publisher, and the relay's resident memory at the end; last, the ratios of the
medians::

    ratio relay-cpu-fresh/relay-cpu-pooled = X
    ratio miss-rate-pooled/miss-rate-fresh = X
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_moqt as bm  # noqa: E402
from bench_load import MIB, rss_of  # noqa: E402

FRESH = "import moqt.receive_buffers as pool\npool.RECEIVE_POOL.keep = 0"
"""The relay's preamble for the variant without reuse: no buffer is ever kept free."""
BLOCKS = 240
"""Distinct blocks the publisher stores (its spawned process imports this module)."""
bm.SHAPES = (bm.make_shape("2 MiB", 32, 8, 128, BLOCKS),)


def measure(pooled: bool, cache: str, warm: int, misses: int) -> dict[str, float]:
    """One relay (pooled or fresh buffers), its publisher and a client: ``misses`` misses
    after ``warm`` blocks filled the cache."""
    from interop.peers import start_our_relay
    from kvsp.transfer.moqt_client import MoqtBlockClient

    folder = Path(tempfile.mkdtemp(prefix="kvsp-steady-"))
    sock = folder / "relay.sock"
    relay = start_our_relay(
        folder,
        "--qmux-unix",
        str(sock),
        "--cache-size",
        cache,
        preamble=None if pooled else FRESH,
    )
    carrier = next(uri for uri in relay.carriers if uri.startswith("moqt+unix:"))
    process, pipe, _ = bm.in_process(bm.relay_publisher_main, carrier)
    shape = bm.SHAPES[0]
    out: dict[str, float] = {}

    async def run() -> None:
        async with MoqtBlockClient(verify=False, timeout=30) as client:
            records = [
                bm.block_record(shape, relay.url, bm.block_key(shape, n), (carrier,))
                for n in range(warm + misses)
            ]

            async def fetch(record: Any) -> None:
                got = await client.get_block(
                    record, geometry=shape.geometry, block_tokens=bm.TOKENS
                )
                if bm.kv_octets(got) != shape.payload:
                    raise AssertionError("a block came back short")

            for record in records[:warm]:
                await fetch(record)
            pids = (relay.proc.pid, process.pid)
            before = [time.process_time(), *map(bm.process_cpu, pids)]
            started = time.perf_counter()
            for record in records[warm:]:
                await fetch(record)
            elapsed = time.perf_counter() - started
            after = [time.process_time(), *map(bm.process_cpu, pids)]
            count = len(records) - warm
            out["rate"] = count * shape.payload / elapsed / 1e6
            for name, a, b in zip(("client", "relay", "publisher"), before, after, strict=True):
                out[name] = 1000 * (b - a) / count
            out["rss"] = rss_of(relay.proc.pid) / MIB

    try:
        asyncio.run(run())
    finally:
        bm.stop(process, pipe)
        relay.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache", default="32MiB", help="the relays' --cache-size")
    parser.add_argument("--warm", type=int, default=40, help="blocks that fill the cache first")
    parser.add_argument("--misses", type=int, help=f"misses timed a run (default: to {BLOCKS})")
    args = parser.parse_args()
    misses = BLOCKS - args.warm if args.misses is None else args.misses
    if args.warm < 1 or misses < 1 or args.warm + misses > BLOCKS:
        parser.error(f"--warm and --misses: at least 1 each, {BLOCKS} together at most")
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    print(f"{misses} misses of 2 MiB blocks a run, cache {args.cache}, QMux UDS")
    print("variant   round    MB/s   cpu ms/block client | relay | publisher   relay RSS MiB")
    for round_ in range(args.rounds):
        for pooled in (True, False) if round_ % 2 == 0 else (False, True):
            got = measure(pooled, args.cache, args.warm, misses)
            results[pooled].append(got)
            name = "pooled" if pooled else "fresh"
            print(
                f"{name:8}  {round_:5}  {got['rate']:6.1f}   "
                f"{got['client']:5.2f} | {got['relay']:5.2f} | {got['publisher']:5.2f}"
                f"             {got['rss']:6.1f}",
                flush=True,
            )

    def median(pooled: bool, key: str) -> float:
        return statistics.median(run[key] for run in results[pooled])

    cpu = median(False, "relay") / median(True, "relay")
    rate = median(True, "rate") / median(False, "rate")
    print()
    print(f"ratio relay-cpu-fresh/relay-cpu-pooled = {cpu:.2f}")
    print(f"ratio miss-rate-pooled/miss-rate-fresh = {rate:.2f}")


if __name__ == "__main__":
    main()
