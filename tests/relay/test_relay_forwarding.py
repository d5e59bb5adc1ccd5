"""The relay forwards, fans out and serves from its cache: real UDP on 127.0.0.1, both backends."""

from __future__ import annotations

import asyncio

import pytest

from kvsp.moqt_mapping import find_layer_digest
from moqt.asyncio import MOQTConnection, RequestRejected, TrackReader
from moqt.certs import make_self_signed
from moqt.errors import PublishDoneCode, RequestErrorCode
from moqt.messages import SubscribeOptions
from moqt.session_events import (
    DataStreamFinished,
    FetchReceived,
    NamespaceDoneReceived,
    NamespaceReceived,
    ObjectData,
    PublishDoneReceived,
    PublishReceived,
    SubscribeReceived,
)
from moqt.wire import Location
from relay import ingest as ingest_module
from relay import kv
from relay.cache import CacheTrack
from tests.support.backends import BACKENDS
from tests.support.polling import until
from tests.support.relay_kit import (
    Certs,
    Track,
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


async def _collect(track: TrackReader) -> list[bytes]:
    return [bytes(obj.payload) async for obj in track.objects()]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_self_signed("localhost", tmp_path_factory.mktemp("relay-certs"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_subscribe_through_the_relay_is_byte_exact(backend: str, certs: Certs) -> None:
    block = make_block(1)

    async def scenario() -> None:
        async with running_relay(relay_config(certs, backend=backend)) as relay:
            tracks = block_track(block)
            async with (
                publishing(relay.url, certs, tracks, [block.namespace[:4]], backend=backend) as pub,
                client(relay.url, certs, backend=backend) as sub,
            ):
                subscription = await sub.subscribe(*block.track)
                pub.release.set()
                objects = [obj async for obj in subscription.track.objects()]
        assert [bytes(obj.payload) for obj in objects] == list(block.layers)
        assert [find_layer_digest(obj.extensions) for obj in objects] == list(block.digests)
        assert [obj.object_id for obj in objects] == list(range(len(block.layers)))

    run(scenario())


@pytest.mark.parametrize("backend", BACKENDS)
def test_three_subscribers_share_one_upstream_subscription(backend: str, certs: Certs) -> None:
    block = make_block(2)

    async def scenario() -> None:
        async with running_relay(relay_config(certs, backend=backend)) as relay:
            tracks = block_track(block)
            async with (
                publishing(relay.url, certs, tracks, [block.namespace], backend=backend) as pub,
                client(relay.url, certs, backend=backend) as s1,
                client(relay.url, certs, backend=backend) as s2,
                client(relay.url, certs, backend=backend) as s3,
            ):
                subscriptions = [await s.subscribe(*block.track) for s in (s1, s2, s3)]
                pub.release.set()
                received = await asyncio.gather(*(_collect(sub.track) for sub in subscriptions))
                assert pub.subscribes == 1
        assert received == [list(block.layers)] * 3

    run(scenario())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forwarded_fetch_completes_its_replica_once(
    backend: str, certs: Certs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each fetched block is cached whole and its replica found complete by one check,
    however many layers it has (the relay then publishes its record)."""
    blocks = [make_block(70 + n, layers=24, size=4096) for n in range(2)]
    checked: list[int] = []
    real = kv.complete_replica

    def counting(block: kv.BlockTrack, entry: CacheTrack) -> kv.KVReplica | None:
        checked.append(len(entry.objects))
        return real(block, entry)

    monkeypatch.setattr(kv, "complete_replica", counting)
    monkeypatch.setattr(ingest_module, "complete_replica", counting, raising=False)
    tracks = {block.track: Track(block.objects()) for block in blocks}

    async def scenario() -> None:
        prefix = blocks[0].namespace[:4]
        async with (
            running_relay(relay_config(certs, backend=backend)) as relay,
            publishing(relay.url, certs, tracks, [prefix], backend=backend),
            client(relay.url, certs, backend=backend) as sub,
        ):
            for block in blocks:
                objects = await fetch_all(sub, block.track, len(block.layers))
                assert [bytes(o.payload) for o in objects] == list(block.layers)
                # complete (and its record due) before the FIN reached the client
                replica = relay.holder.replica(block.track)
                assert replica is not None and replica.layer_digests == block.digests
                entry = relay.cache.track(block.track)
                assert entry is not None and len(entry.objects) == len(block.layers)
        assert checked == [24, 24]

    run(scenario())


@pytest.mark.parametrize("backend", BACKENDS)
def test_fetch_is_served_from_the_cache_after_the_publisher_left(
    backend: str, certs: Certs
) -> None:
    block = make_block(3)
    count = len(block.layers)

    async def scenario() -> None:
        async with running_relay(relay_config(certs, backend=backend)) as relay:
            async with (
                publishing(
                    relay.url, certs, block_track(block), [block.namespace[:4]], backend=backend
                ) as pub,
                client(relay.url, certs, backend=backend) as first,
            ):
                objects = await fetch_all(first, block.track, count)
                assert [bytes(o.payload) for o in objects] == list(block.layers)
                assert pub.fetches == 1
            async with client(relay.url, certs, backend=backend) as late:
                again = await fetch_all(late, block.track, count)
                assert [bytes(o.payload) for o in again] == list(block.layers)
                assert [find_layer_digest(o.extensions) for o in again] == list(block.digests)
                part = await late.fetch(*block.track, Location(0, 1), Location(0, 3))
                assert part.ok.end_location == Location(0, 2)
                assert [bytes(o.payload) async for o in part.track.objects()] == list(
                    block.layers[1:3]
                )
                whole = await late.fetch(*block.track, Location(0, 0), Location(0, 0))
                assert len([o async for o in whole.track.objects()]) == count

    run(scenario())


def test_requests_without_a_route_do_not_exist(certs: Certs) -> None:
    block = make_block(4)

    async def scenario() -> None:
        async with running_relay(relay_config(certs)) as relay, client(relay.url, certs) as sub:
            with pytest.raises(RequestRejected) as info:
                await sub.subscribe(*block.track)
            assert info.value.error_code == RequestErrorCode.DOES_NOT_EXIST
            with pytest.raises(RequestRejected) as info:
                await fetch_all(sub, block.track, 4)
            assert info.value.error_code == RequestErrorCode.DOES_NOT_EXIST

    run(scenario())


def test_namespace_subscribers_hear_announcements_and_withdrawals(certs: Certs) -> None:
    block = make_block(5)

    async def scenario() -> None:
        async with running_relay(relay_config(certs)) as relay, client(relay.url, certs) as sub:
            _, notices = await sub.subscribe_namespace((b"kvsp", b"1"))
            async with publishing(relay.url, certs, {}, [block.namespace[:4]]):
                event = await asyncio.wait_for(notices.get(), 5)
                assert isinstance(event, NamespaceReceived)
                assert event.suffix == block.namespace[2:4]
            event = await asyncio.wait_for(notices.get(), 5)
            assert isinstance(event, NamespaceDoneReceived)
            assert event.suffix == block.namespace[2:4]

    run(scenario())


def test_a_published_track_fans_out_and_is_cached(certs: Certs) -> None:
    block = make_block(6)

    async def scenario() -> None:
        async with running_relay(relay_config(certs)) as relay:
            async with client(relay.url, certs) as pub, client(relay.url, certs) as sub:
                request_id = pub.session.publish(*block.track)
                pub.transmit()
                for _ in range(100):  # wait until the relay knows the track
                    if block.track in relay.tracks:
                        break
                    await asyncio.sleep(0.01)
                subscription = await sub.subscribe(*block.track)
                stream = await pub.open_subgroup(request_id, 0, end_of_group=True)
                for index, (payload, extensions) in enumerate(block.objects()):
                    await pub.send_object(
                        stream, index, payload, extensions=extensions, end_stream=index == 3
                    )
                pub.session.publish_done(request_id, PublishDoneCode.TRACK_ENDED)
                pub.transmit()
                assert await _collect(subscription.track) == list(block.layers)
            async with client(relay.url, certs) as late:
                objects = await fetch_all(late, block.track, 4)
                assert [bytes(o.payload) for o in objects] == list(block.layers)

    run(scenario())


def test_a_publisher_may_be_asked_again_after_the_track_ended(certs: Certs) -> None:
    block = make_block(7)

    async def scenario() -> None:
        async with running_relay(relay_config(certs)) as relay:
            tracks = {block.track: Track(block.objects())}
            async with (
                publishing(relay.url, certs, tracks, [block.namespace]) as pub,
                client(relay.url, certs) as sub,
            ):
                pub.release.set()
                for expected in (1, 2):
                    subscription = await sub.subscribe(*block.track)
                    assert await _collect(subscription.track) == list(block.layers)
                    assert pub.subscribes == expected

    run(scenario())


def test_the_last_subscriber_leaving_ends_the_upstream_subscription(certs: Certs) -> None:
    block = make_block(8)

    async def scenario() -> None:
        async with (
            running_relay(relay_config(certs)) as relay,
            publishing(relay.url, certs, block_track(block), [block.namespace]) as pub,
            client(relay.url, certs) as s1,
            client(relay.url, certs) as s2,
        ):
            first = await s1.subscribe(*block.track)
            second = await s2.subscribe(*block.track)
            s1.unsubscribe(first.request_id)
            await asyncio.sleep(0.1)
            assert pub.unsubscribes == 0
            s2.unsubscribe(second.request_id)
            await until(lambda: pub.unsubscribes == 1)
            await until(lambda: block.track not in relay.tracks)

    run(scenario())


def test_a_vanished_publisher_ends_its_subscriptions(certs: Certs) -> None:
    block = make_block(9)

    async def scenario() -> None:
        async with running_relay(relay_config(certs)) as relay, client(relay.url, certs) as sub:
            async with publishing(relay.url, certs, block_track(block), [block.namespace]):
                subscription = await sub.subscribe(*block.track)
            events = [e async for e in subscription.track.events()]
            done = [e for e in events if isinstance(e, PublishDoneReceived)]
            assert done[0].message.status_code == PublishDoneCode.GOING_AWAY

    run(scenario())


async def _leave_when_asked(connection: MOQTConnection) -> None:
    """A publisher whose session closes when a request reaches it, unanswered."""
    async for event in connection.requests():
        if isinstance(event, SubscribeReceived | FetchReceived):
            connection.close()
            return


@pytest.mark.parametrize("request_kind", ["subscribe", "fetch"])
def test_a_request_reaching_a_leaving_publisher_goes_to_another(
    request_kind: str, certs: Certs
) -> None:
    """Two sessions announce the namespace; the latest (the route) closes as the request
    reaches it. The relay routes the request to the other, as if the leaver had gone before
    (a REQUEST_ERROR INTERNAL_ERROR here was a race whenever a publisher left)."""
    block = make_block(13)
    count = len(block.layers)

    async def scenario() -> None:
        async with (
            running_relay(relay_config(certs)) as relay,
            publishing(relay.url, certs, block_track(block), [block.namespace[:4]]) as pub,
            client(relay.url, certs) as leaver,
            client(relay.url, certs) as sub,
        ):
            pub.release.set()
            await leaver.publish_namespace(block.namespace)  # the longer prefix: the route
            leaving = asyncio.create_task(_leave_when_asked(leaver))
            if request_kind == "subscribe":
                subscription = await sub.subscribe(*block.track)
                objects = [obj async for obj in subscription.track.objects()]
                assert pub.subscribes == 1
            else:
                objects = await fetch_all(sub, block.track, count)
                assert pub.fetches == 1
            await leaving
            assert leaver.session.closed is not None
        assert [bytes(obj.payload) for obj in objects] == list(block.layers)

    run(scenario())


def test_a_request_whose_only_publisher_leaves_does_not_exist(certs: Certs) -> None:
    block = make_block(14)

    async def scenario() -> None:
        async with (
            running_relay(relay_config(certs)) as relay,
            client(relay.url, certs) as leaver,
            client(relay.url, certs) as sub,
        ):
            await leaver.publish_namespace(block.namespace)
            leaving = asyncio.create_task(_leave_when_asked(leaver))
            with pytest.raises(RequestRejected) as info:
                await sub.subscribe(*block.track)
            assert info.value.error_code == RequestErrorCode.DOES_NOT_EXIST
            await leaving

    run(scenario())


def test_a_request_after_a_publisher_closed_goes_to_another(certs: Certs) -> None:
    """The latest announcer closes its session; a SUBSCRIBE reaching the relay after that
    CONNECTION_CLOSE, while the relay's connection to it still drains (its QUIC library reports
    the end three PTOs later, RFC 9000 §10.2.2), goes to the other announcer: the session ended
    when the close was read. (A qh3 relay raised "connection is closed" sending the SUBSCRIBE
    to the leaver, and the subscriber waited until the idle timeout.)"""
    block = make_block(15)

    async def scenario() -> None:
        async with (
            running_relay(relay_config(certs)) as relay,
            publishing(relay.url, certs, block_track(block), [block.namespace[:4]]) as pub,
            client(relay.url, certs) as sub,
        ):
            pub.release.set()
            async with client(relay.url, certs) as leaver:
                await leaver.publish_namespace(block.namespace)  # the longer prefix: the route
                (route,) = relay.routes.sources_of(block.namespace)
                quic = route.connection._protocol._quic
                leaver.close()
                # the relay's library has read the close (both note it as _close_event)
                await until(lambda: quic._close_event is not None, interval=0.001)
                subscription = await sub.subscribe(*block.track)
                objects = [obj async for obj in subscription.track.objects()]
            assert pub.subscribes == 1
        assert [bytes(obj.payload) for obj in objects] == list(block.layers)

    run(scenario())


def test_namespace_subscribers_are_offered_published_tracks(certs: Certs) -> None:
    block = make_block(10)

    async def scenario() -> None:
        async with (
            running_relay(relay_config(certs)) as relay,
            client(relay.url, certs) as pub,
            client(relay.url, certs) as sub,
        ):
            publish_id = pub.session.publish(*block.track)
            pub.transmit()
            await until(lambda: block.track in relay.tracks)
            sub.session.subscribe_namespace(block.namespace[:2], options=SubscribeOptions.BOTH)
            sub.transmit()
            offer = None
            async for event in sub.requests():
                if isinstance(event, PublishReceived):
                    offer = event
                    break
            assert offer is not None
            assert (offer.message.track_namespace, offer.message.track_name) == block.track
            sub.session.publish_ok(offer.request_id)
            sub.transmit()
            await until(lambda: len(relay.tracks[block.track].downstreams) == 1)
            stream = await pub.open_subgroup(publish_id, 0, end_of_group=True)
            for index, (payload, extensions) in enumerate(block.objects()):
                await pub.send_object(
                    stream, index, payload, extensions=extensions, end_stream=index == 3
                )
            pub.session.publish_done(publish_id, PublishDoneCode.TRACK_ENDED)
            pub.transmit()
            assert await _collect(sub.track(offer.request_id)) == list(block.layers)

    run(scenario())


def test_a_joining_fetch_returns_the_history_the_relay_holds(certs: Certs) -> None:
    block = make_block(11)

    async def scenario() -> None:
        async with (
            running_relay(relay_config(certs)) as relay,
            client(relay.url, certs) as pub,
            client(relay.url, certs) as sub,
        ):
            publish_id = pub.session.publish(*block.track)
            pub.transmit()
            await until(lambda: block.track in relay.tracks)
            stream = await pub.open_subgroup(publish_id, 0, end_of_group=True)
            for index, (payload, extensions) in enumerate(block.objects()):
                await pub.send_object(
                    stream, index, payload, extensions=extensions, end_stream=index == 3
                )
            await until(lambda: len(relay.cache.between(block.track, *SPAN, 0)) == 4)
            subscription = await sub.subscribe(*block.track)
            assert subscription.ok.parameters.largest_object == Location(0, 3)
            fetch_id = sub.session.joining_fetch(subscription.request_id, 0)
            sub.transmit()
            payloads: list[bytes] = []
            async for event in sub.track(fetch_id).events():
                if isinstance(event, ObjectData):
                    payloads.append(bytes(event.data))
                if isinstance(event, DataStreamFinished):
                    break
            assert b"".join(payloads) == b"".join(block.layers)

    run(scenario())


SPAN = (Location(0, 0), Location(0, 3))
