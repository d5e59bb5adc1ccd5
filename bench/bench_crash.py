"""A crash loop: replicas SIGKILLed at random points of a transfer, again and again.

Run: ``.venv/bin/python -m bench.bench_crash [--iterations N] [--scenario holder|relay|both]
[--seed S]`` (or ``.venv/bin/python bench/bench_crash.py``).

Real processes from ``tests/support/crash.py``, on 127.0.0.1:

* ``holder``: ``kvsp serve control`` and two ``kvsp serve holder`` processes holding one 32 MiB
  block (8 layers of 4 MiB); the verifying HTTP client fetches it from the replicas the IS
  lists, in a random order, and SIGKILLs the first one when a random layer begins to arrive;
  one iteration in five kills both;
* ``relay``: two ``relay.app`` processes fed by our publisher with a 2 MiB block (32 layers);
  the verifying MOQT client fetches it and SIGKILLs the first relay at a random layer (both,
  one time in five).

After each iteration the killed processes are restarted at their addresses (the holder's block
stored again, the relay's scope announced again) and the same client goes on, so a client that
kept talking to a dead session would show up as slow or failed fetches. Every block handed out
is checked layer by layer against digests computed here; a wrong byte stops the loop. The
table counts outcomes: delivered by the next replica, delivered by the victim before it died
(its octets were already in flight), or no block (every replica died: the caller recomputes),
and the seconds from request to outcome.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import json
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

from kvsp.transfer.block_client import BlockClient  # noqa: E402
from kvsp.transfer.moqt_client import MoqtBlockClient  # noqa: E402
from kvsp.transfer.moqt_publisher import MemoryBlocks, StoredBlock  # noqa: E402
from moqt.certs import make_self_signed  # noqa: E402

BOTH_EVERY = 5
"""One iteration in this many kills both replicas."""


def load(name: str) -> ModuleType:
    """``tests.support.<name>`` (the repository root is on ``sys.path`` by now)."""
    return importlib.import_module(f"tests.support.{name}")


@dataclass
class Tally:
    """Outcomes of one scenario's iterations."""

    outcomes: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, list[float]] = field(default_factory=dict)

    def add(self, outcome: str, seconds: float) -> None:
        self.outcomes[outcome] += 1
        self.seconds.setdefault(outcome, []).append(seconds)


def plan(rng: random.Random, names: list[str], layers: int) -> tuple[list[str], bool, int]:
    """A random replica order, whether both die, and the layer at which the kill comes."""
    order = rng.sample(names, len(names))
    return order, rng.randrange(BOTH_EVERY) == 0, rng.randrange(layers)


def kill(procs: Any, names: list[str]) -> None:
    """SIGKILL every named process (called from the client's layer sink)."""
    for name in names:
        procs.kill(name)


def outcome_of(got: Any, victim: str, both: bool) -> str:
    if got is None:
        return "no block: recompute" if both else "no block (UNEXPECTED)"
    return "victim, before it died" if got.source == victim else "next replica"


async def holder_loop(crash: ModuleType, procs: Any, iterations: int, rng: random.Random) -> Tally:
    procs.control()
    names = ["h1", "h2"]
    procs.together(*(functools.partial(procs.holder, n) for n in names))
    block = crash.make_block(crash.BIG, 1)
    urls = {procs.url(n): n for n in names}

    def store(name: str) -> None:
        answer = procs.put(name, block)
        if answer.status_code != 201:
            raise RuntimeError(f"PUT at {name}: {answer.status_code} {answer.text}")

    for name in names:
        store(name)
    procs.listed(block, set(urls))
    tally = Tally()
    async with BlockClient(crash.CLIENT_TOKEN, timeout=10) as client:
        for _ in range(iterations):
            order, both, at = plan(rng, names, crash.BIG.layers)
            by_name = {urls[r.holder]: r for r in procs.replicas(block)}
            records = [by_name[n] for n in order]
            killed = order if both else order[:1]
            sink = crash.KillingSink(at, functools.partial(kill, procs, killed))
            began = time.monotonic()
            got = await client.fetch(records, geometry=block.geometry, sink=sink)
            if got is not None:
                crash.check_layers(got, block.digests)
            tally.add(outcome_of(got, procs.url(order[0]), both), time.monotonic() - began)
            for name in killed:
                await asyncio.to_thread(procs.restart, name)
                store(name)
            procs.listed(block, set(urls))
    return tally


async def relay_loop(
    crash: ModuleType, procs: Any, iterations: int, rng: random.Random, folder: Path
) -> Tally:
    kit = load("loss")
    cert, key = make_self_signed("localhost", folder / "certs")
    names = ["r1", "r2"]
    procs.together(*(functools.partial(procs.relay, n, cert, key) for n in names))
    urls = {n: json.loads(procs.url(n))["moqt"] for n in names}
    block = kit.make_block(9)
    served = MemoryBlocks()
    served.add(StoredBlock.of(kit.COMPAT, kit.SCOPE, block.key, block.container))
    tally = Tally()
    publishers: dict[str, contextlib.AsyncExitStack] = {}
    closing: set[asyncio.Task[None]] = set()

    async def announce(name: str) -> None:
        old = publishers.pop(name, None)
        if old is not None:  # a session to the dead relay: close it in the background
            task = asyncio.ensure_future(old.aclose())
            closing.add(task)
            task.add_done_callback(closing.discard)
        publishers[name] = contextlib.AsyncExitStack()
        await kit.publish_blocks(publishers[name], urls[name], served)

    for name in names:
        await announce(name)
    moqt = MoqtBlockClient(cafile=str(cert), server_name="localhost", timeout=2.0)
    try:
        async with BlockClient(None, moqt=moqt) as client:
            for _ in range(iterations):
                order, both, at = plan(rng, names, kit.GEOMETRY.layers)
                records = [block.record(urls[n]) for n in order]
                killed = order if both else order[:1]
                sink = crash.KillingSink(at, functools.partial(kill, procs, killed))
                began = time.monotonic()
                got = await client.fetch(
                    records, geometry=kit.GEOMETRY, block_tokens=kit.TOKENS, sink=sink
                )
                if got is not None:
                    crash.check_layers(got, block.digests)
                tally.add(outcome_of(got, urls[order[0]], both), time.monotonic() - began)
                for name in killed:
                    await asyncio.to_thread(procs.restart, name)
                    await announce(name)
    finally:
        stacks = [stack.aclose() for stack in publishers.values()]
        await asyncio.gather(*stacks, *closing, return_exceptions=True)
    return tally


def report(scenario: str, tally: Tally) -> None:
    print(f"{scenario}: {sum(tally.outcomes.values())} iterations, 0 wrong bytes")
    for outcome, count in sorted(tally.outcomes.items()):
        seconds = tally.seconds[outcome]
        print(
            f"  {outcome:<26} {count:>4}   s to outcome: median {statistics.median(seconds):6.2f}"
            f"  max {max(seconds):6.2f}"
        )


async def run(scenarios: list[str], iterations: int, seed: int) -> None:
    crash = load("crash")
    rng = random.Random(seed)
    for scenario in scenarios:
        folder = Path(tempfile.mkdtemp(prefix=f"bench-crash-{scenario}-"))
        procs = crash.Processes(folder)
        try:
            if scenario == "holder":
                tally = await holder_loop(crash, procs, iterations, rng)
            else:
                tally = await relay_loop(crash, procs, iterations, rng, folder)
        finally:
            await asyncio.to_thread(procs.stop_all)
        report(scenario, tally)


def main() -> None:
    """Parse the options and run the crash loop."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10, help="kills per scenario")
    parser.add_argument("--scenario", choices=("holder", "relay", "both"), default="both")
    parser.add_argument("--seed", type=int, default=1, help="seed of the kill points")
    args = parser.parse_args()
    if args.iterations < 1:
        parser.error("--iterations must be >= 1")
    scenarios = ["holder", "relay"] if args.scenario == "both" else [args.scenario]
    asyncio.run(run(scenarios, args.iterations, args.seed))


if __name__ == "__main__":
    main()
