"""Relay gaps closed: concurrent FETCH misses of one track and range share one
upstream fetch, and PUBLISH_NAMESPACE is forwarded to the upstream relay so it routes requests
for the namespace down to the edge (and withdrawn when the last publisher leaves)."""

from __future__ import annotations

import asyncio

import pytest

from moqt.asyncio import RequestRejected
from moqt.certs import make_self_signed
from moqt.errors import RequestErrorCode
from relay.upstream import UpstreamConfig
from tests.support.polling import until
from tests.support.relay_kit import (
    Certs,
    block_track,
    client,
    fetch_all,
    make_block,
    publishing,
    relay_config,
    run,
    running_relay,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_self_signed("localhost", tmp_path_factory.mktemp("relay-certs"))


def test_concurrent_fetch_misses_share_one_upstream_fetch(certs: Certs) -> None:
    block = make_block(60, layers=6, size=4096)
    other = make_block(61)

    async def scenario() -> None:
        async with running_relay(relay_config(certs)) as relay:
            tracks = {**block_track(block), **block_track(other)}
            async with publishing(relay.url, certs, tracks, [block.namespace[:4]]) as pub:
                pub.answer_fetches.clear()  # the publisher holds its answer back
                async with (
                    client(relay.url, certs) as a,
                    client(relay.url, certs) as b,
                    client(relay.url, certs) as c,
                ):
                    readers = [
                        asyncio.ensure_future(fetch_all(x, block.track, 6)) for x in (a, b, c)
                    ]
                    await until(lambda: relay.merged_fetches >= 2)
                    assert pub.fetches == 1  # one upstream FETCH for three misses
                    pub.answer_fetches.set()
                    for reader in readers:
                        objects = await reader
                        assert [bytes(o.payload) for o in objects] == list(block.layers)
                    assert pub.fetches == 1
                    # another range of the same track is another upstream fetch
                    assert len(await fetch_all(a, other.track, 4)) == 4
                    assert pub.fetches == 2

    run(scenario())


def test_a_failed_shared_fetch_leaves_the_waiters_to_go_upstream_themselves(
    certs: Certs,
) -> None:
    block = make_block(62)

    async def scenario() -> None:
        async with (
            running_relay(relay_config(certs)) as relay,
            publishing(relay.url, certs, block_track(block), [block.namespace]) as pub,
            client(relay.url, certs) as a,
            client(relay.url, certs) as b,
        ):
            pub.answer_fetches.clear()
            leader = asyncio.ensure_future(fetch_all(a, block.track, 4))
            await until(lambda: pub.fetches == 1)
            follower = asyncio.ensure_future(fetch_all(b, block.track, 4))
            await until(lambda: relay.merged_fetches == 1)
            a.close()  # the leader's subscriber leaves: its upstream fetch is cancelled
            with pytest.raises(ConnectionError):
                await leader
            await until(lambda: pub.fetches == 2)  # the waiter went upstream itself
            pub.answer_fetches.set()
            objects = await follower
            assert [bytes(o.payload) for o in objects] == list(block.layers)
            assert pub.fetches == 2

    run(scenario())


def test_publish_namespace_is_forwarded_to_the_upstream_relay(certs: Certs) -> None:
    block = make_block(63)
    live = make_block(64)

    async def scenario() -> None:
        async with running_relay(relay_config(certs)) as origin:
            upstream = UpstreamConfig(url=origin.url, cafile=certs[0])
            async with running_relay(relay_config(certs, upstream=upstream)) as edge:
                scope = block.namespace[:4]
                tracks = {**block_track(block), **block_track(live)}
                async with publishing(edge.url, certs, tracks, [scope]) as pub:
                    await until(lambda: origin.routes.route(block.namespace) is not None)
                    async with client(origin.url, certs) as reader:
                        # origin -> edge -> publisher, cached at both relays on the way back
                        objects = await fetch_all(reader, block.track, 4)
                        assert [bytes(o.payload) for o in objects] == list(block.layers)
                        subscription = await reader.subscribe(*live.track)
                        pub.release.set()
                        payloads = [bytes(o.payload) async for o in subscription.track.objects()]
                        assert payloads == list(live.layers)
                    assert block.track in origin.cache and block.track in edge.cache
                    assert pub.fetches == 1
                # the publisher left: the edge withdraws the namespace upstream
                await until(lambda: origin.routes.route(block.namespace) is None)
                async with client(origin.url, certs) as reader:
                    with pytest.raises(RequestRejected) as info:
                        await fetch_all(reader, make_block(65).track, 4)
                    assert info.value.error_code == RequestErrorCode.DOES_NOT_EXIST
                    cached = await fetch_all(reader, block.track, 4)  # still in the cache
                    assert [bytes(o.payload) for o in cached] == list(block.layers)

    run(scenario())
