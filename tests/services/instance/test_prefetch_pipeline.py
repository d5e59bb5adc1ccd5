"""The per-block pipeline of prefetch directives (§6.5 directives, §6.6 leases, §6.1
publishing; :mod:`kvsp.services.instance.pipeline`): what it keeps of the block-at-a-time path
(loaded keys in prefix order, the first block that fails everywhere ends the prefix, the
deadline and shutdown stop it, no lease outlives it) and what it changes (leases and
publications per batch, not per block). Blocks come from a real ``kvsp serve holder`` process
whose lease count quota shows a leaked lease; the IS is an in-memory fake that counts requests.
The batchers are also driven alone against fakes, for the cases a holder rarely produces.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.compat import compat_id
from kvsp.container import encode_container
from kvsp.engine.toy import ToyEngine, toy_descriptor
from kvsp.errors import NotFound
from kvsp.ids import BlockKey
from kvsp.keys import scope_id
from kvsp.prefetch import LinkMeter
from kvsp.records import (
    DirectiveBlock,
    LeaseGrant,
    LeaseRequest,
    LookupRequest,
    LookupResponse,
    PrefetchDirective,
    ReplicaRecord,
)
from kvsp.registries import DirectiveState, Tier
from kvsp.services.holder.service import Holder, HolderConfig
from kvsp.services.instance.pipeline import LeaseBatcher, ReplicaBatcher, TransferBudget
from kvsp.services.instance.service import InstanceAgent, InstanceConfig
from kvsp.stores.blocks import BlockRef, StoredBlock
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.transfer.block_client import BlockClient
from kvsp.transfer.verify import VerifiedBlock
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.clock import ManualClock
from kvsp.web.runner import bind_socket
from kvsp.web.testing import RunningService, start_process
from tests.support.polling import until

pytestmark = pytest.mark.timeout(120)
DESCRIPTOR = toy_descriptor(layers=2, kv_heads=2, head_dim=8, kv_dtype="fp16", block_tokens=4)
COMPAT = compat_id(DESCRIPTOR)
SCOPE_KEY = bytes(range(60, 92))
SCOPE = scope_id(SCOPE_KEY)
TOKEN = "pipeline-test-token-0123456789abcdefghij"
AUTH = {"authorization": f"Bearer {TOKEN}"}
URL = "http://ii.test/kvsp/"
MAX_LEASES = 8
"""The holder's lease count quota: taking this many after a test proves none leaked."""


def container(key: bytes) -> bytes:
    """A block of the descriptor's geometry whose octets depend on ``key``."""
    section = 4 * 2 * 8 * 2
    data = (key * (2 * section // len(key) + 1))[: 2 * section]
    pairs = [(data[:section], data[section:])] * DESCRIPTOR.layers
    return encode_container(pairs, first_layer=0, token_count=4)


class CountingIndex:
    """The IS in memory: a replica table for lookups; counts publication requests, each of
    which takes ``rtt_s`` (the round trip to a real IS, during which blocks keep arriving)."""

    rtt_s = 0.02

    def __init__(self) -> None:
        self.records: dict[BlockKey, list[ReplicaRecord]] = {}
        self.published: list[ReplicaRecord] = []
        self.requests = 0

    async def lookup(self, request: LookupRequest, /) -> LookupResponse:
        replicas = []
        for key in request.block_keys:
            found = self.records.get(key)
            if not found:
                break
            replicas.append(tuple(found))
        return LookupResponse(matched=len(replicas), replicas=tuple(replicas))

    async def publish(self, record: ReplicaRecord, /) -> int:
        self.requests += 1
        await asyncio.sleep(self.rtt_s)
        self.published.append(record)
        return record.ttl_ms

    async def publish_batch(self, records: Sequence[ReplicaRecord], /) -> list[int | Any]:
        self.requests += 1
        await asyncio.sleep(self.rtt_s)
        self.published.extend(records)
        return [r.ttl_ms for r in records]

    async def withdraw(self, compat: bytes, scope: bytes, key: bytes, holder: str, /) -> bool:
        return True

    async def put_status(self, record: Any, /) -> Any:
        raise AssertionError("no status loop in these tests")


class CountingClient(BlockClient):
    """A real block client that counts lease requests and, with ``gate``, holds every GET
    until the gate opens."""

    def __init__(self, *, gate: asyncio.Event | None = None) -> None:
        super().__init__(TOKEN)
        self.lease_requests: list[int] = []
        self.gets_started = 0
        self.gate = gate

    async def acquire_lease(self, holder_base: str, request: LeaseRequest) -> LeaseGrant:
        self.lease_requests.append(len(request.block_keys))
        return await super().acquire_lease(holder_base, request)

    async def get_block(
        self, holder_base: str, record: ReplicaRecord, **kwargs: Any
    ) -> VerifiedBlock:
        self.gets_started += 1
        if self.gate is not None:
            await self.gate.wait()
        return await super().get_block(holder_base, record, **kwargs)


@dataclass
class Source:
    service: RunningService
    http: httpx.Client

    @property
    def url(self) -> str:
        return self.service.base_url

    def put(self, key: bytes) -> ReplicaRecord:
        url = f"{self.url}blocks/{COMPAT.hex()}/{SCOPE.hex()}/{key.hex()}"
        headers = AUTH | {"if-none-match": "*", "content-type": "application/kvsp-block"}
        answer = self.http.put(url, content=container(key), headers=headers)
        assert answer.status_code == 201, answer.text
        return ReplicaRecord.from_json(answer.json())

    def assert_no_lease_leaked(self, keys: Sequence[bytes]) -> None:
        """Take the quota's every lease (each on one key), then release them."""
        leases = []
        for i in range(MAX_LEASES):
            body = {
                "compat_id": COMPAT.hex(),
                "scope_id": SCOPE.hex(),
                "block_keys": [keys[i % len(keys)].hex()],
                "ttl_ms": 60_000,
            }
            answer = self.http.post(f"{self.url}leases", json=body, headers=AUTH)
            assert answer.status_code == 201, f"lease {i}: {answer.text}"
            leases.append(answer.json()["lease"])
        for lease in leases:
            self.http.delete(f"{self.url}leases/{lease}", headers=AUTH)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Source]:
    folder = tmp_path_factory.mktemp("pipeline-holder")
    principals = folder / "principals.toml"
    write_principals(principals, [principal_entry("ii", TOKEN, ["admin"], None)])
    descriptor = folder / "descriptor.json"
    descriptor.write_text(json.dumps(DESCRIPTOR.to_json()))
    argv = [sys.executable, "-m", "kvsp", "serve", "holder", "--listen", "127.0.0.1:0"]
    argv += ["--principals", str(principals), "--descriptor", str(descriptor)]
    argv += ["--state", str(folder / "state"), "--lease-max-count", str(MAX_LEASES)]
    with start_process(argv, workdir=folder) as service, httpx.Client(timeout=30) as http:
        yield Source(service, http)


def stored_keys(source: Source, index: CountingIndex, count: int) -> list[BlockKey]:
    keys = [BlockKey(uuid.uuid4().bytes * 2) for _ in range(count)]
    for key in keys:
        index.records[key] = [source.put(key)]
    return keys


def directive_for(
    keys: Sequence[BlockKey], source: str, deadline_ms: int = 60_000
) -> PrefetchDirective:
    return PrefetchDirective(
        directive=uuid.uuid4(),
        request_ref=None,
        scope_id=SCOPE,
        compat_id=COMPAT,
        blocks=tuple(DirectiveBlock(block_key=k, sources=(source,)) for k in keys),
        deadline_ms=deadline_ms,
        lease_ms=60_000,
    )


@contextlib.asynccontextmanager
async def running_agent(
    tmp_path: Path, index: CountingIndex, client: BlockClient, clock: ManualClock, **options: Any
) -> AsyncIterator[InstanceAgent]:
    engine = ToyEngine(DESCRIPTOR, capacity_blocks=4096)
    registry = DescriptorRegistry()
    registry.add(DESCRIPTOR, persist=False)
    holder = Holder(
        HolderConfig(tiers={Tier.HOST: 64 << 20}), index=index, descriptors=registry, clock=clock
    )
    config = InstanceConfig(
        public_url=URL,
        status_loop=False,
        state_dir=tmp_path / "state",
        warmup_tokens=16,
        **options,
    )
    agent = InstanceAgent(engine, holder, index, client, index, clock, config)
    await agent.start()
    try:
        yield agent
    finally:
        await agent.close()
        await client.aclose()
        await engine.aclose()


# -- the pipeline in the agent, against a real holder ----------------------------------------------


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipeline", "block-at-a-time"])
def test_blocks_load_in_prefix_order_with_leases_and_publications_per_batch(
    tmp_path: Path, source: Source, pipeline: bool
) -> None:
    index = CountingIndex()
    keys = stored_keys(source, index, 24)
    client = CountingClient()

    async def scenario() -> None:
        clock = ManualClock(1_000_000)
        async with running_agent(tmp_path, index, client, clock, pipeline=pipeline) as agent:
            published_before = index.requests
            progress = agent.accept_directive(directive_for(keys, source.url))
            await agent.wait_directive(progress)
            assert progress.state is DirectiveState.COMPLETE, progress.detail
            assert progress.loaded == tuple(keys)
            mine = [r.block_key for r in index.published if r.holder == URL]
            assert set(mine) == set(keys)  # §6.5: every loaded block is published once loaded
            for key in keys:
                stored = agent.holder.store.get(BlockRef(COMPAT, SCOPE, key))
                assert stored is not None
                assert bytes(agent.holder.store.read(stored)) == container(key)
            publications = index.requests - published_before
            if pipeline:
                assert sum(client.lease_requests) == len(keys)
                assert len(client.lease_requests) <= 2  # one per half window at most
                assert publications < len(keys) // 2
                assert agent.leases.requests == len(client.lease_requests)
            else:
                assert client.lease_requests == [1] * len(keys)
                assert publications == len(keys)

    asyncio.run(scenario())
    source.assert_no_lease_leaked(keys)


def test_the_engine_and_the_holder_share_one_copy_and_receive_buffers_go_back(
    tmp_path: Path, source: Source
) -> None:
    """A pipelined block kept in the holder's host tier is held by the engine as views of
    that copy (the same octets, no second copy), so the buffer it was received in goes back
    to the client's pool once the block is placed."""
    index = CountingIndex()
    keys = stored_keys(source, index, 6)
    client = CountingClient()

    async def scenario() -> None:
        clock = ManualClock(1_000_000)
        async with running_agent(tmp_path, index, client, clock) as agent:
            progress = agent.accept_directive(directive_for(keys, source.url))
            await agent.wait_directive(progress)
            assert progress.state is DirectiveState.COMPLETE, progress.detail
            held = agent.engine.lookup(keys)
            assert len(held) == len(keys)
            for key, block in zip(keys, held, strict=True):
                stored = agent.holder.store.get(BlockRef(COMPAT, SCOPE, key))
                assert stored is not None
                octets = agent.holder.store.read(stored)
                assert all(layer.k.obj is octets.obj for layer in block.layers)
                assert all(layer.v.obj is octets.obj for layer in block.layers)
                assert block.encode() == container(key) == bytes(octets)
            await until(lambda: client.buffers.idle_bytes > 0, what="a buffer back in the pool")

    asyncio.run(scenario())
    source.assert_no_lease_leaked(keys)


def test_a_block_no_source_holds_ends_the_prefix_and_its_batch_still_leases(
    tmp_path: Path, source: Source
) -> None:
    index = CountingIndex()
    keys = stored_keys(source, index, 8)
    gone = BlockKey(uuid.uuid4().bytes * 2)  # advertised, never stored: the holder answers 404
    index.records[gone] = [
        ReplicaRecord.from_json({**index.records[keys[0]][0].to_json(), "block_key": gone.hex()})
    ]
    wanted = [*keys[:3], gone, *keys[3:]]
    client = CountingClient()

    async def scenario() -> None:
        clock = ManualClock(1_000_000)
        async with running_agent(tmp_path, index, client, clock) as agent:
            progress = agent.accept_directive(directive_for(wanted, source.url))
            await agent.wait_directive(progress)
            assert progress.state is DirectiveState.PARTIAL
            assert progress.loaded == tuple(keys[:3])
            assert progress.detail is not None and "block 3 unavailable" in progress.detail
            assert "kvsp-not-found" in progress.detail
            # the batch lease was refused for the missing block; each block then asked alone
            assert client.lease_requests[0] == len(wanted)
            assert sorted(client.lease_requests[1:]) == [1] * len(wanted)

    asyncio.run(scenario())
    source.assert_no_lease_leaked(keys)


def test_a_block_that_fails_verification_ends_the_prefix_and_is_neither_kept_nor_published(
    tmp_path: Path, source: Source
) -> None:
    """§6.7: every block is checked against its Replica Record before it is placed. A record
    whose layer digests are not the held block's (here: another block's) fails its block
    alone; the blocks before it load, those after it load too but are not reported (prefix
    order), and no lease outlives the directive."""
    index = CountingIndex()
    keys = stored_keys(source, index, 8)
    bad = 3
    good = index.records[keys[bad]][0]
    other = index.records[keys[0]][0]
    index.records[keys[bad]] = [
        ReplicaRecord.from_json(
            {
                **good.to_json(),
                "digest": other.to_json()["digest"],
                "layer_digests": other.to_json()["layer_digests"],
            }
        )
    ]
    client = CountingClient()

    async def scenario() -> None:
        clock = ManualClock(1_000_000)
        async with running_agent(tmp_path, index, client, clock) as agent:
            progress = agent.accept_directive(directive_for(keys, source.url))
            await agent.wait_directive(progress)
            assert progress.state is DirectiveState.PARTIAL
            assert progress.loaded == tuple(keys[:bad])
            assert progress.detail is not None and f"block {bad} unavailable" in progress.detail
            assert "kvsp-digest-mismatch" in progress.detail
            await until(lambda: not agent._loads, what="the loads after it settle")
            assert agent.holder.store.get(BlockRef(COMPAT, SCOPE, keys[bad])) is None
            mine = {r.block_key for r in index.published if r.holder == URL}
            assert set(keys[:bad]) <= mine and keys[bad] not in mine
            assert client.lease_requests == [len(keys)]  # verification is not a lease refusal

    asyncio.run(scenario())
    source.assert_no_lease_leaked(keys)


def test_the_deadline_stops_a_pipelined_directive_with_a_loaded_prefix(
    tmp_path: Path, source: Source
) -> None:
    index = CountingIndex()
    keys = stored_keys(source, index, 6)
    clock = ManualClock(1_000_000)

    class SlowClock(CountingClient):
        async def get_block(
            self, holder_base: str, record: ReplicaRecord, **kwargs: Any
        ) -> VerifiedBlock:
            block = await super().get_block(holder_base, record, **kwargs)
            clock.advance(2_000)  # each GET takes 2 s of the instance's clock
            return block

    client = SlowClock()

    async def scenario() -> None:
        async with running_agent(tmp_path, index, client, clock, prefetch_concurrency=1) as agent:
            progress = agent.accept_directive(directive_for(keys, source.url, deadline_ms=5_000))
            await agent.wait_directive(progress)
            assert progress.state is DirectiveState.PARTIAL
            assert 1 <= len(progress.loaded) <= 3  # at most the GETs done by 6 s
            assert progress.loaded == tuple(keys[: len(progress.loaded)])
            assert progress.detail is not None and "deadline passed" in progress.detail
            await until(lambda: not agent._loads, what="the loads left are cancelled")

    asyncio.run(scenario())
    source.assert_no_lease_leaked(keys)


def test_closing_the_instance_stops_a_pipelined_directive_and_releases_its_lease(
    tmp_path: Path, source: Source
) -> None:
    index = CountingIndex()
    keys = stored_keys(source, index, 6)

    async def scenario() -> None:
        gate = asyncio.Event()  # never opened: every GET hangs
        client = CountingClient(gate=gate)
        clock = ManualClock(1_000_000)
        async with running_agent(tmp_path, index, client, clock) as agent:
            progress = agent.accept_directive(directive_for(keys, source.url))
            await until(lambda: client.gets_started > 0, what="a GET under way")
            assert client.lease_requests == [len(keys)]
        assert progress.state is DirectiveState.FAILED
        assert progress.detail == "the instance is shutting down"

    asyncio.run(scenario())
    source.assert_no_lease_leaked(keys)  # the batch's lease was released on close


def test_the_rest_of_a_directive_starts_while_its_first_block_is_still_loading(
    tmp_path: Path, source: Source
) -> None:
    """The first blocks' records come in a small lookup of their own; the rest's transfers
    start as soon as their records come, not once the first block has settled: here the first
    block's GET waits until every block's GET has started."""
    index = CountingIndex()
    keys = stored_keys(source, index, 24)  # the first lookup asks for 16 (a quarter window)

    class HeadWaits(CountingClient):
        def __init__(self) -> None:
            super().__init__()
            self.all_started = asyncio.Event()

        async def get_block(
            self, holder_base: str, record: ReplicaRecord, **kwargs: Any
        ) -> VerifiedBlock:
            if self.gets_started + 1 == len(keys):
                self.all_started.set()
            if record.block_key == keys[0]:
                self.gets_started += 1
                await self.all_started.wait()
                return await BlockClient.get_block(self, holder_base, record, **kwargs)
            return await super().get_block(holder_base, record, **kwargs)

    client = HeadWaits()

    async def scenario() -> None:
        clock = ManualClock(1_000_000)
        async with running_agent(tmp_path, index, client, clock) as agent:
            progress = agent.accept_directive(directive_for(keys, source.url, deadline_ms=20_000))
            await agent.wait_directive(progress)
            assert progress.state is DirectiveState.COMPLETE, progress.detail
            assert progress.loaded == tuple(keys)
            assert sorted(client.lease_requests) == [8, 16]  # one per lookup's blocks

    asyncio.run(scenario())
    source.assert_no_lease_leaked(keys)


class SlowLookups(CountingIndex):
    """The IS in memory, whose lookups are answered once ``gate`` opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.lookups = 0

    async def lookup(self, request: LookupRequest, /) -> LookupResponse:
        self.lookups += 1
        await self.gate.wait()
        return await super().lookup(request)


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipeline", "block-at-a-time"])
def test_a_prompt_waits_for_the_blocks_a_directive_is_still_looking_up(
    tmp_path: Path, source: Source, pipeline: bool
) -> None:
    """A request that comes right after the PC's directive (§6.5) uses the blocks the
    directive loads, even while the IS has not yet answered the directive's lookup and no
    transfer has started: it waits for them rather than computing them again. A directive for
    another scope does not hold it up, and once a directive has failed there is no wait."""
    index = SlowLookups()
    keys = stored_keys(source, index, 6)
    client = CountingClient()

    async def scenario() -> None:
        clock = ManualClock(1_000_000)
        async with running_agent(tmp_path, index, client, clock, pipeline=pipeline) as agent:
            other = directive_for(keys, source.url)
            other = dataclasses.replace(other, scope_id=scope_id(bytes(32)))
            agent.accept_directive(other)
            assert await agent.held_prefix(SCOPE, keys) == []  # no directive of this scope
            progress = agent.accept_directive(directive_for(keys, source.url))
            prefix = asyncio.ensure_future(agent.held_prefix(SCOPE, keys))
            await until(lambda: index.lookups >= 2, what="the directive's lookup under way")
            await asyncio.sleep(0.05)
            assert not prefix.done(), "the prompt did not wait for the directive"
            assert client.gets_started == 0
            index.gate.set()
            found = await asyncio.wait_for(prefix, 30)
            assert [block.encode() for block in found] == [container(k) for k in keys]
            await agent.wait_directive(progress)
            assert progress.state is DirectiveState.COMPLETE, progress.detail

            missing = [BlockKey(uuid.uuid4().bytes * 2) for _ in range(2)]  # held nowhere
            failing = agent.accept_directive(directive_for(missing, source.url))
            await asyncio.wait_for(agent.wait_directive(failing), 30)
            assert failing.state is DirectiveState.FAILED, failing.detail
            assert await asyncio.wait_for(agent.held_prefix(SCOPE, missing), 1) == []

    asyncio.run(scenario())
    source.assert_no_lease_leaked(keys)


def test_closing_before_a_directive_ran_wakes_whoever_waits_for_it(
    tmp_path: Path, source: Source
) -> None:
    """A directive whose run is cancelled before it started (the instance closes at once)
    still lets go of a prompt waiting for its blocks and of a ``wait_directive``."""
    index = CountingIndex()
    keys = stored_keys(source, index, 2)
    client = CountingClient()

    async def scenario() -> None:
        clock = ManualClock(1_000_000)
        async with running_agent(tmp_path, index, client, clock) as agent:
            progress = agent.accept_directive(directive_for(keys, source.url))
            prefix = asyncio.ensure_future(agent.held_prefix(SCOPE, keys))
            waited = asyncio.ensure_future(agent.wait_directive(progress))
            await agent.close()
            assert await asyncio.wait_for(prefix, 10) == []
            await asyncio.wait_for(waited, 10)
            assert progress.detail == "the instance is shutting down"
            assert agent.busy() == (0, 0)

    asyncio.run(scenario())


# -- the batchers alone -------------------------------------------------------------------------


@dataclass
class FakeLeases:
    """A holder's lease face in memory: refuses any request naming a key in ``missing``."""

    missing: set[bytes] = field(default_factory=set)
    requests: list[tuple[str, tuple[bytes, ...]]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    answer: asyncio.Event | None = None

    async def acquire_lease(self, holder_base: str, request: LeaseRequest, /) -> LeaseGrant:
        self.requests.append((holder_base, tuple(request.block_keys)))
        if self.answer is not None:
            await self.answer.wait()
        for i, key in enumerate(request.block_keys):
            if key in self.missing:
                raise NotFound("not held", path=f"$.block_keys[{i}]")
        return LeaseGrant(
            lease=f"l{len(self.requests)}", ttl_ms=request.ttl_ms, block_keys=request.block_keys
        )

    async def release_lease(self, holder_base: str, lease: str, /) -> None:
        self.released.append(lease)


def ref(n: int) -> BlockRef:
    return BlockRef(COMPAT, SCOPE, BlockKey(bytes([n]) * 32))


def test_leases_asked_together_go_in_one_request_per_source_and_go_back_with_the_last() -> None:
    async def scenario() -> None:
        fake = FakeLeases()
        batcher = LeaseBatcher(fake, LinkMeter())
        asks = [batcher.acquire("http://a/", "http://a/", ref(i), 100, 1000) for i in range(5)]
        asks += [batcher.acquire("http://b/", "http://b/", ref(i), 100, 1000) for i in range(2)]
        holds = await asyncio.gather(*asks)
        assert sorted((base, len(keys)) for base, keys in fake.requests) == [
            ("http://a/", 5),
            ("http://b/", 2),
        ]
        assert len({h.lease for h in holds[:5]}) == 1
        for hold in holds[:4]:
            hold.release()
        holds[0].release()  # releasing twice counts once
        await asyncio.sleep(0)
        assert fake.released == []  # one block of the batch still uses the lease
        holds[4].release()
        await batcher.aclose()
        assert fake.released == [holds[0].lease]

    asyncio.run(scenario())


def test_a_refused_batch_is_asked_key_by_key_and_a_cap_splits_large_batches() -> None:
    async def scenario() -> None:
        fake = FakeLeases(missing={ref(2).key})
        batcher = LeaseBatcher(fake, LinkMeter(), max_octets=250)
        asks = [batcher.acquire("http://a/", "http://a/", ref(i), 100, 1000) for i in range(4)]
        outcomes = await asyncio.gather(*asks, return_exceptions=True)
        assert isinstance(outcomes[2], NotFound)
        assert all(not isinstance(o, BaseException) for i, o in enumerate(outcomes) if i != 2)
        sizes = [len(keys) for _, keys in fake.requests]
        assert sizes[:2] == [2, 2]  # 250 octets: two blocks of 100 to a request
        assert sorted(sizes[2:]) == [1, 1]  # the refused second batch, key by key
        await batcher.aclose()

    asyncio.run(scenario())


def test_a_waiter_cancelled_during_the_request_gives_its_share_back() -> None:
    async def scenario() -> None:
        fake = FakeLeases(answer=asyncio.Event())
        batcher = LeaseBatcher(fake, LinkMeter())
        first = asyncio.ensure_future(batcher.acquire("http://a/", "http://a/", ref(1), 1, 1000))
        second = asyncio.ensure_future(batcher.acquire("http://a/", "http://a/", ref(2), 1, 1000))
        await until(lambda: fake.requests, what="the lease request sent")
        first.cancel()
        fake.answer.set()  # type: ignore[union-attr]
        hold = await second
        assert first.cancelled()
        hold.release()
        await batcher.aclose()
        assert fake.released == [hold.lease]  # the cancelled share did not keep it

    asyncio.run(scenario())


def test_publications_gather_while_one_is_in_flight() -> None:
    class SlowHolder:
        def __init__(self) -> None:
            self.batches: list[int] = []
            self.gate = asyncio.Event()

        async def publish_blocks(self, blocks: Sequence[StoredBlock], /) -> int:
            self.batches.append(len(blocks))
            await self.gate.wait()
            return len(blocks)

    async def scenario() -> None:
        holder = SlowHolder()
        tasks: set[asyncio.Task[object]] = set()

        def spawn(coro: Any, name: str) -> None:
            tasks.add(asyncio.create_task(coro, name=name))

        batcher = ReplicaBatcher(holder, spawn)
        blocks: list[Any] = [object() for _ in range(6)]
        first = batcher.add(blocks[0])
        await until(lambda: holder.batches, what="the first batch sent")
        rest = [batcher.add(b) for b in blocks[1:]]
        holder.gate.set()
        await asyncio.gather(first, *rest)
        assert holder.batches == [1, 5]
        assert batcher.requests == 2
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_records_gather_while_announced_blocks_are_still_to_come() -> None:
    class CountingHolder:
        def __init__(self) -> None:
            self.batches: list[int] = []

        async def publish_blocks(self, blocks: Sequence[StoredBlock], /) -> int:
            self.batches.append(len(blocks))
            return len(blocks)

    async def scenario() -> None:
        holder = CountingHolder()
        tasks: set[asyncio.Task[object]] = set()

        def spawn(coro: Any, name: str) -> None:
            tasks.add(asyncio.create_task(coro, name=name))

        batcher = ReplicaBatcher(holder, spawn, max_batch=4, linger_s=60)
        for _ in range(7):
            batcher.expect()
        blocks: list[Any] = [object() for _ in range(7)]
        first = [batcher.add(b, expected=True) for b in blocks[:4]]  # a full batch goes
        await asyncio.gather(*first)
        assert holder.batches == [4]
        rest = [batcher.add(b, expected=True) for b in blocks[4:6]]
        await asyncio.sleep(0.01)
        assert holder.batches == [4] and not rest[0].done()  # one block is still to come
        batcher.forget()  # it failed: nothing else is coming, the rest goes
        await asyncio.gather(*rest)
        assert holder.batches == [4, 2]
        alone = batcher.add(blocks[6])  # not announced: goes at once
        await alone
        assert holder.batches == [4, 2, 1]
        await asyncio.gather(*tasks)

        lingering = ReplicaBatcher(holder, spawn, max_batch=4, linger_s=0.02)
        lingering.expect()
        lingering.expect()
        waited = lingering.add(object(), expected=True)  # type: ignore[arg-type]
        await asyncio.wait_for(waited, 10)  # the other never comes: the linger sends it
        assert holder.batches[-1] == 1
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_a_transfer_budget_bounds_the_count_and_octets_in_flight() -> None:
    async def scenario() -> None:
        budget = TransferBudget(max_count=3, max_octets=100)
        running: list[int] = []
        peak = {"count": 0, "octets": 0}
        release = asyncio.Event()

        async def transfer(octets: int) -> None:
            async with budget.take(octets):
                running.append(octets)
                peak["count"] = max(peak["count"], budget.count)
                peak["octets"] = max(peak["octets"], budget.octets)
                await release.wait()

        small = [asyncio.create_task(transfer(10)) for _ in range(5)]
        await until(lambda: len(running) == 3, what="three small transfers")
        assert budget.count == 3  # the count caps them
        release.set()
        await asyncio.gather(*small)
        assert peak == {"count": 3, "octets": 30}

        release.clear()
        running.clear()
        large = [asyncio.create_task(transfer(60)) for _ in range(2)]
        huge = asyncio.create_task(transfer(500))  # over the budget alone: goes by itself
        await until(lambda: len(running) == 1, what="one large transfer")
        await asyncio.sleep(0.01)
        assert running == [60] and budget.octets == 60  # the octets cap the second
        release.set()
        await asyncio.gather(*large, huge)
        assert running == [60, 60, 500]
        assert budget.count == 0 and budget.octets == 0

        release.clear()
        blocker = asyncio.create_task(transfer(100))
        await until(lambda: budget.count == 1, what="the blocker")
        waiting = asyncio.create_task(transfer(50))
        behind = asyncio.create_task(transfer(50))
        await asyncio.sleep(0.01)
        waiting.cancel()  # a cancelled waiter leaves no place taken
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        release.set()
        await asyncio.gather(blocker, behind)
        assert budget.count == 0 and budget.octets == 0

    asyncio.run(scenario())


def test_a_status_long_poll_answers_as_the_directive_stops(tmp_path: Path, source: Source) -> None:
    index = CountingIndex()
    keys = stored_keys(source, index, 4)
    client = CountingClient(gate=asyncio.Event())

    async def scenario() -> None:
        assert client.gate is not None
        clock = ManualClock(1_000_000)
        async with running_agent(tmp_path, index, client, clock) as agent:
            progress = agent.accept_directive(directive_for(keys, source.url))
            await agent.wait_directive(progress, timeout=0.05)  # held: the wait runs out
            assert progress.state is DirectiveState.PENDING
            waiting = asyncio.create_task(agent.wait_directive(progress, timeout=60))
            await asyncio.sleep(0.01)
            assert not waiting.done()
            client.gate.set()
            await asyncio.wait_for(waiting, 30)
            assert progress.loaded == tuple(keys), progress.detail

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("text", "ok"), [("0", True), ("60000", True), ("60001", False), ("-1", False), ("1e3", False)]
)
def test_the_wait_ms_parameter_is_bounded(text: str, ok: bool) -> None:
    from kvsp.errors import BadRequest
    from kvsp.services.instance.app import _wait_ms

    if ok:
        assert _wait_ms(text) == int(text)
    else:
        with pytest.raises(BadRequest, match="wait_ms"):
            _wait_ms(text)


@pytest.mark.parametrize(
    "argv",
    [["--pipeline-transfers", "0"], ["--pipeline-octets", "0"], ["--prefetch-pipeline", "fast"]],
)
def test_bad_pipeline_options_are_argparse_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from kvsp.services.instance.app import configure_parser

    parser = argparse.ArgumentParser(prog="kvsp serve instance")
    configure_parser(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--pc", "http://c/", "--token-file", "t", *argv])
    assert argv[0] in capsys.readouterr().err


# -- the listening socket ------------------------------------------------------------------------


def test_accepted_connections_of_a_service_socket_have_nagle_off() -> None:
    """A keep-alive answer written as head then body must not wait for a delayed ACK: asyncio
    disables Nagle on accepted sockets only when the listening socket says IPPROTO_TCP."""

    async def scenario() -> int:
        sock = bind_socket("127.0.0.1", 0)
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                raw = transport.get_extra_info("socket")
                accepted.set_result(raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        port = sock.getsockname()[1]
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            value = await asyncio.wait_for(accepted, 10)
            writer.close()
        finally:
            server.close()
        return value

    assert asyncio.run(scenario()) != 0
