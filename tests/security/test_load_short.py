"""Short load runs against real processes (the minute-long campaign is
``bench/bench_load.py``): 64 concurrent clients against ``kvsp serve index`` for about five
seconds, and 100 MOQT subscribers on one ``kvsp serve relay`` receiving a published track.

Both must finish with zero errors: every answer as expected (lookups of a client's own keys
match them all, lookups in another client's scope are misses, refreshes succeed; every object
arrives once, intact, in order). The server's RSS must not grow past warm-up beyond a loose
allowance (10 % + 8 MiB from a third of the run to its end). Latency percentiles are printed,
never asserted.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.bench_load import run_index_load, run_relay_load

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_64_clients_against_the_index_service(tmp_path: Path) -> None:
    result = asyncio.run(run_index_load(tmp_path, seconds=5.0, clients=64))
    print(result.report())
    assert not result.errors, result.errors[:5]
    # every client published its 16 records and then kept going
    assert result.operations > 64 * 16
    assert len(result.rss) >= 3
    assert result.rss_flat(), result.report()


def test_100_subscribers_on_one_relay(tmp_path: Path) -> None:
    result = asyncio.run(run_relay_load(tmp_path, seconds=2.0, subscribers=100, rate=2.0))
    print(result.report())
    assert not result.errors, result.errors[:5]
    assert result.operations == 100 * 4  # every subscriber got every object
    assert result.rss_flat(), result.report()
