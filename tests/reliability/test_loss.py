"""Block transfers over MOQT through a lossy network: 2 MiB blocks FETCHed by the
verifying client through a relay at 1 %, 5 % and 10 % datagram loss (and with reordering,
duplication and jitter), on the client's session to the relay and on an edge relay's session
to its upstream relay. Each block is fetched once, with no retry above QUIC, so aioquic's loss
recovery does all the work; every layer handed out is checked here against its own digest."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moqt.certs import make_self_signed
from tests.support.loss import KINDS, Impairment, Kind, check_block, make_block, topology

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
BLOCKS = 2
"""2 MiB blocks per case: aioquic in one Python process moves about 1-2 MB/s here."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_self_signed("localhost", tmp_path_factory.mktemp("loss-certs"))


def fetch_through(
    kind: Kind, impairment: Impairment, certs: tuple[Path, Path], seed: int
) -> dict[str, dict[str, int]]:
    """Fetch ``BLOCKS`` new blocks through ``kind`` with ``impairment``; the proxy's counters."""
    blocks = [make_block(seed + i) for i in range(BLOCKS)]

    async def scenario() -> dict[str, dict[str, int]]:
        async with topology(kind, impairment, certs, blocks) as running:
            for block in blocks:
                check_block(await running.fetch(block), block)
            counters: dict[str, dict[str, int]] = running.proxy.stats.to_json()
            return counters

    return asyncio.run(asyncio.wait_for(scenario(), 100))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("loss", [0.01, 0.05, 0.10])
def test_blocks_complete_verified_under_loss(
    kind: Kind, loss: float, certs: tuple[Path, Path]
) -> None:
    seed = int(loss * 1000) + (100 if kind == "relay-relay" else 0)
    counters = fetch_through(kind, Impairment(drop=loss, seed=seed), certs, seed)
    toward, back = counters["to_server"], counters["to_client"]
    # The data crossed the lossy hop, and datagrams were lost both ways.
    assert back["octets"] > BLOCKS * make_block(0).payload
    assert toward["dropped"] > 0 and back["dropped"] > 0
    assert back["dropped"] + back["sent"] == back["received"]


def test_blocks_complete_verified_reordered_duplicated_and_jittered(
    certs: tuple[Path, Path],
) -> None:
    impairment = Impairment(
        drop=0.02, duplicate=0.05, reorder=0.05, reorder_gap=4, jitter_ms=1.0, seed=77
    )
    counters = fetch_through("client-relay", impairment, certs, 700)
    back = counters["to_client"]
    assert back["duplicated"] > 0 and back["reordered"] > 0 and back["dropped"] > 0
    assert back["delayed"] > 0
