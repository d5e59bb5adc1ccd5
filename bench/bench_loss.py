"""Goodput of verified 2 MiB block FETCHes through a lossy network, side by side.

Run: ``.venv/bin/python -m bench.bench_loss [--rounds N] [--blocks B] [--kinds client-relay,...]``
(or ``.venv/bin/python bench/bench_loss.py``).

Each visit to a case starts a topology from ``tests/support/loss.py`` in one event loop over
real UDP on 127.0.0.1: a relay fed by our publisher, and
:class:`~interop.lossy_proxy.LossyProxy` on one hop, either between the verifying client and the
relay (``client-relay``) or between an edge relay and its upstream relay (``relay-relay``); it
fetches one untimed block (sessions set up), then ``--blocks`` timed ones. Cases: no
impairment, 1 %, 5 % and 10 % datagram loss (each way), 5 % reordering (held back by 3
datagrams), 5 % duplication, and all three at 5 %. Each round visits every case in a new
order, so load on the shared machine falls on every case alike; every fetch is a block never
fetched before (no relay cache can answer it), fetched once with no retry above QUIC, and
checked layer by layer. The table gives, per case, the median seconds a block, goodput
(payload octets / second), the ratio to the clean case of the same topology, the datagrams the
proxy dropped, duplicated and reordered, and the octets it carried per payload octet toward
the client (QUIC's retransmissions and headers).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from interop.lossy_proxy import Impairment  # noqa: E402
from moqt.certs import make_self_signed  # noqa: E402

CASES: dict[str, Impairment] = {
    "clean": Impairment(),
    "loss 1%": Impairment(drop=0.01, seed=1),
    "loss 5%": Impairment(drop=0.05, seed=5),
    "loss 10%": Impairment(drop=0.10, seed=10),
    "reorder 5% (gap 3)": Impairment(reorder=0.05, reorder_gap=3, seed=21),
    "duplicate 5%": Impairment(duplicate=0.05, seed=22),
    "loss+reorder+dup 5%": Impairment(drop=0.05, reorder=0.05, duplicate=0.05, seed=23),
}


def load_kit() -> ModuleType:
    """:mod:`tests.support.loss` (the repository root is on ``sys.path`` by now)."""
    from tests.support import loss

    return loss


@dataclass
class Case:
    """One topology kind under one impairment, and what its timed fetches measured."""

    kind: str
    name: str
    impairment: Impairment
    seconds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    counters: Counter[str] = field(default_factory=Counter)
    """The proxy's counters over the timed fetches (both directions; ``octets`` toward the
    client)."""

    def count(self, before: dict[str, Any], after: dict[str, Any]) -> None:
        """Add what the proxy counted between two snapshots of its counters."""
        for counter in ("dropped", "duplicated", "reordered"):
            for direction in ("to_server", "to_client"):
                self.counters[counter] += after[direction][counter] - before[direction][counter]
        self.counters["octets"] += after["to_client"]["octets"] - before["to_client"]["octets"]


async def fetch_one(kit: ModuleType, case: Case, topology: Any, seed: int, timeout: float) -> bool:
    """Fetch a new block through ``topology`` once; whether it arrived (timed in ``case``)."""
    block = kit.make_block(seed)
    topology.add(block)
    began = time.perf_counter()
    try:
        got = await asyncio.wait_for(topology.fetch(block), timeout)
    except Exception as exc:  # noqa: BLE001 - a failed fetch is a result to report
        case.failures.append(f"{type(exc).__name__}: {exc}")
        return False
    elapsed = time.perf_counter() - began
    kit.check_block(got, block)
    case.seconds.append(elapsed)
    return True


async def visit(
    kit: ModuleType, case: Case, certs: Any, blocks: int, seed: int, timeout: float
) -> None:
    """Start the case's topology, fetch one untimed block (sessions and upstream links set
    up), then ``blocks`` timed ones, and stop it. A topology lives only this long: a MOQT
    session idle for 60 s ends (QUIC's idle timeout; no keepalive), and with it the
    publisher's announcement at the relay."""
    async with kit.topology(case.kind, case.impairment, certs, timeout=timeout) as topology:
        if not await fetch_one(kit, case, topology, seed, timeout):
            return
        case.seconds.pop()
        before = topology.proxy.stats.to_json()
        for i in range(blocks):
            await fetch_one(kit, case, topology, seed + 1 + i, timeout)
        case.count(before, topology.proxy.stats.to_json())


def report(cases: list[Case], payload: int) -> None:
    """Print the table (see the module docstring)."""
    print(f"block: {payload} payload octets (32 x 64 KiB objects); aioquic, 1200 B datagrams")
    header = (
        f"{'path':<13} {'case':<21} {'n':>3} {'s/block':>8} {'MB/s':>6} {'vs clean':>8} "
        f"{'dropped':>8} {'dup':>5} {'reord':>5} {'octets/payload':>14}"
    )
    print(header)
    print("-" * len(header))
    clean: dict[str, float] = {}
    for case in cases:
        if not case.seconds:
            print(f"{case.kind:<13} {case.name:<21}   0  all {len(case.failures)} fetches failed")
            continue
        median = statistics.median(case.seconds)
        goodput = payload / median / 1e6
        clean.setdefault(case.kind, goodput)
        wire = case.counters["octets"] / (payload * len(case.seconds))
        c = case.counters
        print(
            f"{case.kind:<13} {case.name:<21} {len(case.seconds):>3} {median:>8.2f} "
            f"{goodput:>6.2f} {goodput / clean[case.kind]:>8.2f} {c['dropped']:>8} "
            f"{c['duplicated']:>5} {c['reordered']:>5} {wire:>14.3f}"
        )
    for case in cases:
        for failure in case.failures:
            print(f"FAILED {case.kind} {case.name}: {failure}")


async def run(kinds: list[str], rounds: int, blocks: int, timeout: float, seed: int) -> None:
    kit = load_kit()
    certs = make_self_signed("localhost", tempfile.mkdtemp(prefix="bench-loss-"))
    order = random.Random(seed)
    cases = [Case(kind, name, imp) for kind in kinds for name, imp in CASES.items()]
    block_seed = 10_000
    for _ in range(rounds):
        for case in order.sample(cases, len(cases)):
            await visit(kit, case, certs, blocks, block_seed, timeout)
            block_seed += blocks + 1
    report(cases, kit.make_block(0).payload)


def main() -> None:
    """Parse the options and run the side-by-side measurement."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="visits per case (default 3)")
    parser.add_argument("--blocks", type=int, default=2, help="timed blocks a visit (default 2)")
    parser.add_argument(
        "--kinds",
        default="client-relay,relay-relay",
        help="lossy hop(s): client-relay, relay-relay (default both)",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a fetch may stall")
    parser.add_argument("--seed", type=int, default=1, help="seed of the round orders")
    args = parser.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = set(kinds) - {"client-relay", "relay-relay"}
    if unknown or min(args.rounds, args.blocks) < 1:
        parser.error(f"unknown kinds {sorted(unknown)}" if unknown else "need rounds, blocks >= 1")
    asyncio.run(run(kinds, args.rounds, args.blocks, args.timeout, args.seed))


if __name__ == "__main__":
    main()
