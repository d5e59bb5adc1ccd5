"""Crashes: real processes SIGKILLed mid-transfer or mid-directive while clients run.

* a holder mid-GET: the client falls through to the next replica, or, with none left, reports
  that it has no block (the caller recomputes); every delivered layer is checked here;
* a relay mid-FETCH: the same over MOQT;
* an instance mid-directive: a directive loading from an instance that dies ends ``partial``
  with a byte-exact prefix; an instance that dies while loading is marked failed by the PC and,
  restarted, does not claim the directive; neither hangs;
* the control plane mid-publish: clients get a clean error, holders keep storing and serving,
  and after a restart the records come back through the holders' refresh;
* leases do not outlive a killed holder, nor a lessee that stopped renewing;
* a holder with a disk tier restarts with its blocks, re-verifies them, and drops and withdraws
  the ones corrupted while it was down.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from kvsp.compat import compat_id
from kvsp.errors import LeaseQuota, NotFound, TransportError
from kvsp.records import LeaseRequest, LookupRequest
from kvsp.services.index.client import IndexClient
from kvsp.transfer.block_client import BlockClient
from kvsp.transfer.moqt_client import MoqtBlockClient
from kvsp.transfer.moqt_publisher import MemoryBlocks, StoredBlock
from kvsp.transfer.verify import VerifiedBlock
from moqt.certs import make_self_signed
from tests.support import loss as loss_kit
from tests.support.crash import (
    ADMIN,
    BIG,
    CLIENT,
    CLIENT_TOKEN,
    PROBLEM,
    SCOPE,
    SMALL,
    TOY,
    Block,
    KillingSink,
    Processes,
    block_of,
    check_layers,
    make_block,
    prompt_keys,
    reference,
)
from tests.support.polling import eventually, until

T = TypeVar("T")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]  # real processes, killed and restarted


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    processes = Processes(tmp_path)
    try:
        yield processes
    finally:
        processes.stop_all()


def run(coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))


class Background:
    """A client fetching one block in a loop until told to stop; every block it gets is
    checked layer by layer, and misses (``None``: recompute) are counted."""

    def __init__(self, fetch: Callable[[], Awaitable[VerifiedBlock | None]], block: Block) -> None:
        self.fetch = fetch
        self.block = block
        self.delivered = 0
        self.misses = 0
        self.stop = asyncio.Event()

    async def loop(self) -> None:
        while not self.stop.is_set():
            got = await self.fetch()
            if got is None:
                self.misses += 1
                await asyncio.sleep(0.05)  # every replica refused at once: do not spin
                continue
            check_layers(got, self.block.digests)
            self.delivered += 1


# --- a holder mid-GET ----------------------------------------------------------------------------


def test_holder_killed_mid_get_client_falls_through_then_recomputes(procs: Processes) -> None:
    procs.control()
    procs.together(lambda: procs.holder("h1"), lambda: procs.holder("h2"))
    urls = [procs.url("h1"), procs.url("h2")]
    block = make_block(BIG, 1)
    for name in ("h1", "h2"):
        assert procs.put(name, block).status_code == 201
    procs.listed(block, set(urls))
    records = sorted(procs.replicas(block), key=lambda r: urls.index(r.holder))

    async def scenario() -> None:
        async with (
            BlockClient(CLIENT_TOKEN, timeout=10) as client,
            BlockClient(CLIENT_TOKEN, timeout=10) as others,
        ):
            background = Background(lambda: others.fetch(records, geometry=block.geometry), block)
            running = asyncio.ensure_future(background.loop())
            sink = KillingSink(0, lambda: procs.kill("h1"))
            got = await client.fetch(records, geometry=block.geometry, sink=sink)
            assert sink.fired and not procs.alive("h1")
            assert got is not None and got.source == urls[1]
            check_layers(got, block.digests)
            assert [layer.index for layer in got.layers] == list(range(BIG.layers))
            first = client.stats.sources[urls[0]]
            assert (first.attempts, first.successes) == (1, 0), first
            assert sum(first.errors.values()) == 1

            procs.kill("h2")  # no replica left: the caller is told, and recomputes
            began = time.monotonic()
            assert await client.fetch(records, geometry=block.geometry) is None
            assert time.monotonic() - began < 10
            # The background client may still finish a block it had wholly received before the
            # kill (verification ends after the last octet); it must see the end soon after.
            left = max(0.0, began + 10 - time.monotonic())
            await until(lambda: background.misses > 0, left, "the background client to see the end")
            background.stop.set()
            await running

    run(scenario(), 45)


# --- a relay mid-FETCH ---------------------------------------------------------------------------


def test_relay_killed_mid_fetch_client_falls_through_then_recomputes(
    procs: Processes, tmp_path: Path
) -> None:
    cert, key = make_self_signed("localhost", tmp_path / "certs")
    procs.together(*(lambda n=n: procs.relay(n, cert, key) for n in ("r1", "r2")))
    relays = [json.loads(procs.url(name))["moqt"] for name in ("r1", "r2")]
    block = loss_kit.make_block(9)
    records = [block.record(url) for url in relays]

    async def scenario() -> None:
        served = MemoryBlocks()
        served.add(StoredBlock.of(loss_kit.COMPAT, loss_kit.SCOPE, block.key, block.container))
        publishers = [contextlib.AsyncExitStack() for _ in range(3)]
        moqt = MoqtBlockClient(cafile=str(cert), server_name="localhost", timeout=2.0)
        async with contextlib.AsyncExitStack() as outer:
            for stack in publishers:
                outer.push_async_callback(stack.aclose)  # closing twice is harmless
            client = await outer.enter_async_context(BlockClient(None, moqt=moqt))
            for stack, url in zip(publishers, relays, strict=False):
                await loss_kit.publish_blocks(stack, url, served)  # the scope, to each relay
            geometry, tokens = loss_kit.GEOMETRY, loss_kit.TOKENS
            fetch = functools.partial(client.fetch, records, geometry=geometry, block_tokens=tokens)
            sink = KillingSink(2, lambda: procs.kill("r1"))
            got = await fetch(sink=sink)
            assert sink.fired and not procs.alive("r1")
            assert got is not None and got.source == relays[1]
            check_layers(got, block.digests)
            failed = client.stats.sources[relays[0]]
            assert (failed.attempts, failed.successes) == (1, 0)

            # r1 comes back at its address: the client talks to it, not to the dead session.
            await asyncio.to_thread(procs.restart, "r1")
            await loss_kit.publish_blocks(publishers[2], relays[0], served)
            again = await fetch()
            assert again is not None and again.source == relays[0]
            check_layers(again, block.digests)

            # Publishing is over (closed while the relays can still answer), then both die.
            await asyncio.gather(*(stack.aclose() for stack in publishers))
            procs.kill("r1")
            procs.kill("r2")
            began = time.monotonic()
            assert await fetch() is None  # no relay left: the caller recomputes
            assert time.monotonic() - began < 10

    run(scenario(), 45)


# --- an instance mid-directive -------------------------------------------------------------------


def toy_prompt(blocks: int, seed: int) -> list[int]:
    return [(seed * 7_919 + i * 31) % 30_011 for i in range(blocks * TOY.block_tokens)]


def test_directive_from_an_instance_killed_mid_directive_ends_partial(procs: Processes) -> None:
    procs.control()
    procs.together(
        lambda: procs.holder("holder"), lambda: procs.instance("a"), lambda: procs.instance("b")
    )
    prompt = toy_prompt(6, 1)
    keys = prompt_keys(prompt)
    blocks = [block_of(TOY, k, c) for k, c in zip(keys, reference(prompt), strict=True)]
    for block in blocks[:3]:
        assert procs.put("holder", block).status_code == 201
    assert procs.generate("b", prompt).status_code == 200  # b computes and publishes all six
    for block in blocks:
        eventually(lambda b=block: procs.url("b") in procs.holders_of(b) or None)  # type: ignore[misc]

    procs.freeze("b")  # b's blocks are now in flight for as long as it lives
    sources = ["holder"] * 3 + ["b"] * 3
    directive = procs.prefetch("a", list(zip(keys, sources, strict=True)))

    def waiting_on_b() -> dict[str, Any] | None:
        status = procs.directive("a", directive)
        return status if status["state"] == "pending" and len(status["loaded"]) == 3 else None

    pending = eventually(waiting_on_b, what="a to load the holder's three blocks, then wait")
    assert pending["loaded"] == [k.hex() for k in keys[:3]]

    procs.kill("b")
    began = time.monotonic()
    final = procs.outcome("a", directive)
    assert time.monotonic() - began < 10  # ended by the failure, not by its 30 s deadline
    assert final["state"] == "partial" and final["loaded"] == [k.hex() for k in keys[:3]]
    assert "block 3" in final["detail"], final

    # The loaded prefix is byte-exact at a; nothing past it is held there.
    for i, block in enumerate(blocks):
        got = procs.http.get(f"{procs.url('a')}{block.path()}", headers=CLIENT)
        if i < 3:
            assert got.status_code == 200 and got.content == block.data
        else:
            assert got.status_code == 404 and got.json()["type"] == PROBLEM + "kvsp-not-found"

    # The PC marks b failed and places nothing there.
    procs.wait_row("b", "failed")
    placed = procs.place(prompt)
    assert placed.status_code == 200, placed.text
    assert placed.json()["instance"] == procs.url("a")


def test_instance_killed_mid_directive_fails_at_the_pc_and_forgets_it(procs: Processes) -> None:
    procs.control()
    procs.together(lambda: procs.holder("holder"), lambda: procs.instance("a"))
    prompt = toy_prompt(2, 2)
    keys = prompt_keys(prompt)
    blocks = [block_of(TOY, k, c) for k, c in zip(keys, reference(prompt), strict=True)]
    for block in blocks:
        assert procs.put("holder", block).status_code == 201
        procs.listed(block, {procs.url("holder")})
    epoch = procs.wait_row("a", "active")["epoch"]

    procs.freeze("holder")  # a's lease request waits: the directive is mid-flight
    directive = procs.prefetch("a", [(k, "holder") for k in keys])
    assert procs.directive("a", directive)["state"] == "pending"
    procs.kill("a")

    began = time.monotonic()
    with pytest.raises(httpx.TransportError):  # refused at once: nothing hangs
        procs.directive("a", directive)
    assert time.monotonic() - began < 5
    procs.wait_row("a", "failed")
    refused = procs.place(prompt)  # the only instance is gone: a clean 503, no directive to it
    assert refused.status_code == 503, refused.text
    assert refused.json()["type"] == PROBLEM + "kvsp-not-active"

    procs.thaw("holder")
    procs.restart("a")
    gone = procs.http.get(f"{procs.url('a')}prefetch/{directive}", headers=ADMIN)
    assert gone.status_code == 404 and gone.json()["type"] == PROBLEM + "kvsp-not-found"
    row = procs.wait_row("a", "active")
    assert row["epoch"] > epoch  # §6.3: a new epoch after the restart
    placed = procs.place(prompt)
    assert placed.status_code == 200 and placed.json()["instance"] == procs.url("a")
    again = placed.json()["directive"]
    assert procs.outcome("a", again)["state"] == "complete"
    for block in blocks:
        got = procs.http.get(f"{procs.url('a')}{block.path()}", headers=CLIENT)
        assert got.status_code == 200 and got.content == block.data


# --- the control plane mid-publish ---------------------------------------------------------------


def test_control_plane_killed_mid_publish_comes_back_through_refresh(procs: Processes) -> None:
    procs.control()
    procs.holder("holder", "--record-ttl-ms", "1500")
    blocks = [make_block(SMALL, 100 + i) for i in range(16)]
    for block in blocks[:4]:
        assert procs.put("holder", block).status_code == 201
    for block in blocks[:4]:
        procs.listed(block, {procs.url("holder")})
    holder = procs.url("holder")

    async def put_while_killing() -> list[int]:
        async with httpx.AsyncClient(timeout=15) as http:
            headers = CLIENT | {"if-none-match": "*", "content-type": "application/kvsp-block"}
            puts = [
                asyncio.ensure_future(
                    http.put(f"{holder}{b.path()}", content=b.data, headers=headers)
                )
                for b in blocks[4:]
            ]
            await asyncio.wait(puts, return_when=asyncio.FIRST_COMPLETED)
            procs.kill("control")  # while the holder publishes the others
            return [r.status_code for r in await asyncio.gather(*puts)]

    assert run(put_while_killing()) == [201] * 12  # the holder stores and serves on

    async def clients_see_clean_errors() -> None:
        lookup = LookupRequest(
            scope_id=SCOPE, compat_id=compat_id(SMALL), block_keys=(blocks[0].key,)
        )
        began = time.monotonic()
        async with IndexClient(procs.url("control"), CLIENT_TOKEN, timeout=5) as index:
            with pytest.raises(TransportError):
                await index.lookup(lookup)
        assert time.monotonic() - began < 5
        async with BlockClient(CLIENT_TOKEN) as client:
            for block in blocks:
                got = await client.get_block(holder, block.record(holder), geometry=block.geometry)
                check_layers(got, block.digests)

    run(clients_see_clean_errors())
    procs.restart("control")  # an empty index: only the holder's refresh can fill it
    for block in blocks:
        procs.listed(block, {holder}, timeout=15)


# --- leases --------------------------------------------------------------------------------------


def test_leases_do_not_outlive_a_killed_holder_or_a_silent_lessee(procs: Processes) -> None:
    procs.control()
    procs.holder("holder", "--tier", "disk=4MiB", "--lease-max-count", "1")
    block = make_block(SMALL, 200)
    assert procs.put("holder", block).status_code == 201

    async def lease(ttl_ms: int) -> str:
        request = LeaseRequest(
            compat_id=compat_id(SMALL), scope_id=SCOPE, block_keys=(block.key,), ttl_ms=ttl_ms
        )
        async with BlockClient(CLIENT_TOKEN) as client:
            return (await client.acquire_lease(procs.url("holder"), request)).lease

    async def renew(lease_id: str) -> None:
        async with BlockClient(CLIENT_TOKEN) as client:
            await client.renew_lease(procs.url("holder"), lease_id, 60_000)

    def granted() -> bool | None:
        try:
            run(lease(60_000))
        except LeaseQuota:
            return None
        return True

    held = run(lease(60_000))
    with pytest.raises(LeaseQuota):  # one lease per client
        run(lease(60_000))
    procs.kill("holder")
    procs.restart("holder")
    with pytest.raises(NotFound):  # the restarted holder does not know the old lease
        run(renew(held))
    short = run(lease(500))  # and it no longer counts against the quota
    with pytest.raises(LeaseQuota):
        run(lease(60_000))
    # A lessee that stops renewing (killed) loses its lease when the TTL runs out.
    eventually(granted, what="the short lease to expire")
    with pytest.raises(NotFound):
        run(renew(short))


# --- a disk tier across a crash ------------------------------------------------------------------


CORRUPT = (1, 2, 3)
"""Blocks damaged while the holder is down: a flipped bit, a truncated file, a lost file."""
KEPT = (0, 4)


def test_disk_holder_restarts_reverifies_and_withdraws_corrupt_blocks(procs: Processes) -> None:
    procs.control()
    procs.holder("holder", "--tier", "disk=16MiB")
    holder = procs.url("holder")
    blocks = [make_block(SMALL, 300 + i) for i in range(5)]
    for block in blocks:
        assert procs.put("holder", block).status_code == 201
    for block in blocks:
        procs.listed(block, {holder})
        (record,) = procs.replicas(block)
        assert [r.tier for r in record.residency or ()] == ["disk"]

    procs.kill("holder")
    root = procs.folder / "holder" / "state" / "blocks" / compat_id(SMALL).hex() / SCOPE.hex()
    flipped = root / f"{blocks[1].key.hex()}.kvb"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one layer
    flipped.write_bytes(bytes(data))
    truncated = root / f"{blocks[2].key.hex()}.kvb"
    truncated.write_bytes(truncated.read_bytes()[:-1000])
    (root / f"{blocks[3].key.hex()}.kvb").unlink()  # only its sidecar is left
    assert procs.holders_of(blocks[1]) == {holder}  # the IS still has the old records

    procs.restart("holder")
    for i in CORRUPT:
        procs.listed(blocks[i], set())  # withdrawn by the restarted holder
    for i in KEPT:
        procs.listed(blocks[i], {holder})
    output = procs.services["holder"].output()
    assert output.count("dropped block") == len(CORRUPT), output

    async def served() -> None:
        async with BlockClient(CLIENT_TOKEN) as client:
            for i, block in enumerate(blocks):
                record = block.record(holder)
                if i in CORRUPT:
                    with pytest.raises(NotFound):
                        await client.get_block(holder, record, geometry=block.geometry)
                    continue
                got = await client.get_block(holder, record, geometry=block.geometry)
                check_layers(got, block.digests)

    run(served())
