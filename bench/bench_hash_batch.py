"""Benchmark the MOQT client's hashing batch (spec §6.7 verified retrieval; DESIGN.md §4 KV
blocks over MOQT): the most octets of landed layers one worker-thread job hashes
(``MoqtBlockClient.hash_batch``, :data:`~kvsp.transfer.moqt_transfer.HASH_BATCH`; a FETCH's
batch is half of it up to that limit, :func:`~kvsp.transfer.moqt_transfer.hash_batch`, so for
the 2 MiB block here each limit up to 1 MiB is the batch itself).

Run: ``.venv/bin/python bench/bench_hash_batch.py [--quick] [--carriers tls,tcp,unix]
[--batches 512,1024] [--rounds N] [--seconds S]``.

A small batch overlaps more of the hashing with the transfer; each batch costs the event loop a
hand-off (a job submitted, a future and a wake-up when it is done). Per carrier, one publisher
process serves a 2 MiB block (32 layers of 64 KiB) over QMux, and one client on one session
fetches it verified, block after block, for ``--seconds`` with each batch size in turn, for
``--rounds`` rounds whose order flips every round, so that the machine's drift reaches every
size alike. It prints the median MB/s and CPU a block of each, then, last, one line a carrier:
``ratio hash-batch-<B>/<A> <carrier> = X`` (the MB/s of the last size over the first).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_moqt as moqt  # noqa: E402 - the publisher and records of bench_moqt

from moqt.certs import make_self_signed  # noqa: E402

SHAPE = moqt.SHAPES[0]  # 2 MiB: the size a batch matters for (smaller FETCHes hash inline)


@dataclass
class Turns:
    """What one batch size measured, a turn at a time."""

    batch: int
    rates: list[float] = field(default_factory=list)
    client_ms: list[float] = field(default_factory=list)
    server_ms: list[float] = field(default_factory=list)


def publisher(carrier: str, cert: str, key: str, folder: str, pipe: Connection) -> None:
    """Serve the 2 MiB block over ``carrier`` until told to stop (a spawned process)."""

    async def main() -> None:
        handler = moqt.block_handler(moqt.stored_blocks((SHAPE,), 1))
        _server, uri = await moqt.serve_carrier(carrier, handler, cert, key, Path(folder))
        pipe.send(uri)
        await asyncio.get_running_loop().run_in_executor(None, pipe.recv)

    asyncio.run(main())


async def measure(
    uri: str, cert: str, server_pid: int, batches: list[int], rounds: int, seconds: float
) -> list[Turns]:
    """Each batch size in turn on one session, ``rounds`` times."""
    from kvsp.transfer.moqt_client import MoqtBlockClient

    record = moqt.block_record(SHAPE, "moqt://127.0.0.1:1/", moqt.block_key(SHAPE, 0), (uri,))
    turns = [Turns(batch) for batch in batches]
    async with MoqtBlockClient(cafile=cert, server_name="localhost", timeout=30) as client:

        async def block() -> None:
            got = await client.get_block(record, geometry=SHAPE.geometry, block_tokens=moqt.TOKENS)
            if moqt.kv_octets(got) != SHAPE.payload:
                raise AssertionError("the block came back short")

        await block()  # the session and the buffers, before the clock
        for round_ in range(rounds):
            for turn in turns if round_ % 2 == 0 else turns[::-1]:
                client.hash_batch = turn.batch
                count, start = 0, time.perf_counter()
                cpu, server = time.process_time(), moqt.process_cpu(server_pid)
                while count < 2 or time.perf_counter() - start < seconds:
                    await block()
                    count += 1
                wall = time.perf_counter() - start
                turn.rates.append(SHAPE.payload * count / wall / 1e6)
                turn.client_ms.append(1000 * (time.process_time() - cpu) / count)
                turn.server_ms.append(1000 * (moqt.process_cpu(server_pid) - server) / count)
    return turns


def run_carrier(carrier: str, batches: list[int], rounds: int, seconds: float) -> list[Turns]:
    """Start the carrier's publisher, measure, stop it."""
    folder = tempfile.mkdtemp(prefix="kvsp-hash-batch-")
    cert, key = (str(path) for path in make_self_signed("localhost", Path(folder)))
    process, pipe, uri = moqt.in_process(publisher, carrier, cert, key, folder)
    try:
        return asyncio.run(measure(uri, cert, process.pid, batches, rounds, seconds))
    finally:
        moqt.stop(process, pipe)


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
    print(f"{'carrier':7} {'batch KiB':>9} {'MB/s':>7} {'client ms':>9} {'server ms':>9}  rounds")
    ratios = []
    for carrier in carriers:
        turns = run_carrier(carrier, batches, rounds, seconds)
        for turn in turns:
            each = " ".join(f"{rate:.0f}" for rate in turn.rates)
            print(
                f"{carrier:7} {turn.batch >> 10:>9} {statistics.median(turn.rates):>7.0f} "
                f"{statistics.median(turn.client_ms):>9.2f} "
                f"{statistics.median(turn.server_ms):>9.2f}  {each}"
            )
        first, last = turns[0], turns[-1]
        ratio = statistics.median(last.rates) / statistics.median(first.rates)
        ratios.append(
            f"ratio hash-batch-{last.batch >> 10}/{first.batch >> 10} {carrier} = {ratio:.2f}"
        )
    print()
    for line in ratios:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
