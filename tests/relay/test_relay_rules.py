"""d16 caching rules at the relay over real UDP: MAX_CACHE_DURATION, malformed tracks, chains."""

from __future__ import annotations

import asyncio

import pytest

from moqt.asyncio import RequestRejected
from moqt.certs import make_self_signed
from moqt.errors import PublishDoneCode, RequestErrorCode, StreamResetCode
from moqt.messages_params import ExtensionType, track_extension
from moqt.session_events import DataStreamReset, ObjectData, PublishDoneReceived
from moqt.wire import Location
from relay.upstream import UpstreamConfig
from tests.support.backends import BACKENDS
from tests.support.relay_kit import (
    Certs,
    Track,
    block_track,
    client,
    fetch_all,
    make_block,
    max_cache,
    publishing,
    relay_config,
    run,
    running_relay,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_self_signed("localhost", tmp_path_factory.mktemp("relay-certs"))


def test_objects_expire_after_max_cache_duration(certs: Certs) -> None:
    block = make_block(20)
    tracks = {block.track: Track(block.objects(), max_cache(600))}

    async def scenario() -> None:
        async with running_relay(relay_config(certs)) as relay:
            async with (
                publishing(relay.url, certs, tracks, [block.namespace]),
                client(relay.url, certs) as sub,
            ):
                await fetch_all(sub, block.track, 4)
            async with client(relay.url, certs) as sub:
                response = await sub.fetch(*block.track, Location(0, 0), Location(0, 4))
                extension = track_extension(
                    response.ok.track_extensions, ExtensionType.MAX_CACHE_DURATION
                )
                assert extension == 600
                assert [bytes(o.payload) async for o in response.track.objects()] == list(
                    block.layers
                )
                await asyncio.sleep(0.7)
                with pytest.raises(RequestRejected) as info:
                    await fetch_all(sub, block.track, 4)
                assert info.value.error_code == RequestErrorCode.DOES_NOT_EXIST
            assert block.track not in relay.cache

    run(scenario())


def test_a_differing_payload_makes_the_track_malformed(certs: Certs) -> None:
    block = make_block(21)
    other = [(b"X" * len(p), ext) for p, ext in block.objects()]

    async def scenario() -> None:
        async with running_relay(relay_config(certs)) as relay:
            async with (
                publishing(relay.url, certs, block_track(block), [block.namespace]) as pub,
                client(relay.url, certs) as sub,
            ):
                pub.versions = [Track(block.objects()), Track(other)]
                pub.release.set()
                first = await sub.subscribe(*block.track)
                assert [bytes(o.payload) async for o in first.track.objects()] == list(block.layers)
                second = await sub.subscribe(*block.track)
                seen: list[object] = []
                async for event in second.track.events():
                    seen.append(event)
                data = b"".join(bytes(e.data) for e in seen if isinstance(e, ObjectData))
                assert b"X" not in data  # the differing bytes were never forwarded
                resets = [e.error_code for e in seen if isinstance(e, DataStreamReset)]
                assert resets == [StreamResetCode.MALFORMED_TRACK]
                done = [e for e in seen if isinstance(e, PublishDoneReceived)]
                assert done[0].message.status_code == PublishDoneCode.MALFORMED_TRACK
                with pytest.raises(RequestRejected) as info:
                    await fetch_all(sub, block.track, 4)
                assert info.value.error_code == RequestErrorCode.MALFORMED_TRACK
                with pytest.raises(RequestRejected) as info:
                    await sub.subscribe(*block.track)
                assert info.value.error_code == RequestErrorCode.MALFORMED_TRACK
            assert block.track not in relay.cache

    run(scenario())


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_edge_relay_goes_upstream_on_a_miss_and_caches(backend: str, certs: Certs) -> None:
    block = make_block(22)
    live = make_block(23)

    async def scenario() -> None:
        async with running_relay(relay_config(certs, backend=backend)) as origin:
            upstream = UpstreamConfig(url=origin.url, cafile=certs[0], backend=backend)
            edge_config = relay_config(certs, backend=backend, upstream=upstream)
            async with running_relay(edge_config) as edge:
                tracks = {**block_track(block), **block_track(live)}
                namespaces = [block.namespace, live.namespace]
                async with publishing(
                    origin.url, certs, tracks, namespaces, backend=backend
                ) as pub:
                    async with client(edge.url, certs, backend=backend) as sub:
                        objects = await fetch_all(sub, block.track, 4)
                        assert [bytes(o.payload) for o in objects] == list(block.layers)
                        subs = [await sub.subscribe(*live.track) for _ in range(2)]
                        pub.release.set()
                        for subscription in subs:
                            payloads = [
                                bytes(o.payload) async for o in subscription.track.objects()
                            ]
                            assert payloads == list(live.layers)
                    assert (pub.fetches, pub.subscribes) == (1, 1)
                assert block.track in origin.cache
                assert block.track in edge.cache
                await origin.close()  # the origin is gone: the edge serves from its cache
                async with client(edge.url, certs, backend=backend) as sub:
                    objects = await fetch_all(sub, block.track, 4)
                    assert [bytes(o.payload) for o in objects] == list(block.layers)

    run(scenario())
