"""Benchmark the MOQT client's hashing batch (spec §6.7 verified retrieval; DESIGN.md §4 KV
blocks over MOQT): the most octets of landed layers one worker-thread job hashes
(``MoqtBlockClient.hash_batch``, :data:`~kvsp.transfer.moqt_transfer.HASH_BATCH`; a FETCH's
batch is half of it up to that limit, :func:`~kvsp.transfer.moqt_transfer.hash_batch`, so for
the 2 MiB block here each limit up to 1 MiB is the batch itself).

Run: ``.venv/bin/python bench/bench_hash_batch.py [--quick] [--carriers tls,tcp,unix]
[--batches 512,1024] [--rounds N] [--seconds S]``.

A small batch overlaps more of the hashing with the transfer; each batch costs the event loop a
hand-off (a job submitted, a future and a wake-up when it is done). ``bench_moqt``'s publisher
process serves a 2 MiB block (32 layers of 64 KiB) on every QMux carrier, and per carrier one
client on one session fetches it verified, block after block, for ``--seconds`` with each
batch size in turn, for ``--rounds`` rounds whose order flips every round, so that the
machine's drift reaches every size alike. It prints each size's median MB/s over its turns and
its CPU a block over all of them (client | publisher), then, last, one line a carrier:
``ratio hash-batch-<B>/<A> <carrier> = X`` (the MB/s of the last size over the first).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_moqt as moqt  # noqa: E402 - the publisher, records and turns of bench_moqt

from moqt.certs import make_self_signed  # noqa: E402

SHAPE = moqt.SHAPES[0]  # 2 MiB: the size a batch matters for (smaller FETCHes hash inline)
ROWS = {carrier: row for row, carrier, _ in moqt.QMUX_ROWS}  # carrier -> the publisher's row


async def measure(
    uri: str, cert: str, server_pid: int, batches: list[int], rounds: int, seconds: float
) -> list[tuple[moqt.Turns, list[float]]]:
    """Each batch size in turn on one session, ``rounds`` times: each size's turns (CPU over
    all of them) and the MB/s of each turn."""
    from kvsp.transfer.moqt_client import MoqtBlockClient

    record = moqt.block_record(SHAPE, "moqt://127.0.0.1:1/", moqt.block_key(SHAPE, 0), (uri,))
    async with MoqtBlockClient(cafile=cert, server_name="localhost", timeout=30) as client:

        def fetch_with(batch: int) -> Callable[[], Awaitable[int]]:
            async def block() -> int:
                client.hash_batch = batch
                got = await client.get_block(
                    record, geometry=SHAPE.geometry, block_tokens=moqt.TOKENS
                )
                return moqt.kv_octets(got)

            return block

        rows = [
            (moqt.Turns(str(batch), f"{batch >> 10}", fetch_with(batch), (server_pid,)), [])
            for batch in batches
        ]
        await rows[0][0].block()  # the session and the buffers, before the clock
        for round_ in range(rounds):
            for row, rates in rows if round_ % 2 == 0 else rows[::-1]:
                octets, wall = row.octets, row.seconds
                await row.turn(SHAPE, seconds, 2, 1 << 30)
                rates.append((row.octets - octets) / (row.seconds - wall) / 1e6)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 rounds of 0.5 s")
    parser.add_argument("--carriers", default="tls,tcp,unix", help="QMux carriers (tls,tcp,unix)")
    parser.add_argument("--batches", default="512,1024", help="batch sizes in KiB, in order")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=1.0, help="each turn's length")
    args = parser.parse_args(argv)
    rounds, seconds = (4, 0.5) if args.quick else (args.rounds, args.seconds)
    batches = [int(kib) << 10 for kib in args.batches.split(",")]
    carriers = args.carriers.split(",")
    print(
        f"# 2 MiB blocks ({len(SHAPE.layers)} layers of 64 KiB), verified; one session a carrier; "
        f"{rounds} rounds of {seconds} s a size, the order flipped each round"
    )
    print(f"{'carrier':7} {'batch KiB':>9} {'MB/s':>7} {'cpu ms/block':>14}  rounds")
    folder = tempfile.mkdtemp(prefix="kvsp-hash-batch-")
    cert, key = (str(path) for path in make_self_signed("localhost", Path(folder)))
    process, pipe, uris = moqt.in_process(moqt.publisher_main, cert, key, folder)
    ratios = []
    try:
        for carrier in carriers:
            uri = uris[ROWS[carrier]]
            rows = asyncio.run(measure(uri, cert, process.pid, batches, rounds, seconds))
            for row, rates in rows:
                each = " ".join(f"{rate:.0f}" for rate in rates)
                print(
                    f"{carrier:7} {row.label:>9} {statistics.median(rates):>7.0f} "
                    f"{row.cpu_note():>14}  {each}"
                )
            (first, first_rates), (last, last_rates) = rows[0], rows[-1]
            ratio = statistics.median(last_rates) / statistics.median(first_rates)
            ratios.append(f"ratio hash-batch-{last.label}/{first.label} {carrier} = {ratio:.2f}")
    finally:
        moqt.stop(process, pipe)
    print()
    for line in ratios:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
