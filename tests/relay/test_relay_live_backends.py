"""A live track through the relay arrives whole and in order on every QUIC backend.

A publisher answers the relay's SUBSCRIBE with 16 groups of 2 MiB (one subgroup stream per
group, one object or several per group) written back to back; the subscriber must get every
group, in ascending order, byte-exact (relay/downstream.py: groups are written in group order,
a higher one only once the lower ones are acknowledged). Real UDP on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from moqt.asyncio import MOQTConnection
from moqt.certs import make_self_signed
from moqt.errors import PublishDoneCode
from moqt.session_events import SubscribeReceived
from moqt.wire import TrackNamespace
from tests.support.backends import BACKENDS
from tests.support.relay_kit import Certs, client, relay_config, run, running_relay

pytestmark = pytest.mark.timeout(120)
GROUPS = 16
GROUP_SIZE = 2 << 20
NAMESPACE = TrackNamespace((b"live", b"backends"))
TRACK = b"video"


def payload(group: int, obj: int, size: int) -> bytes:
    return (hashlib.sha256(b"%d/%d" % (group, obj)).digest() * (size // 32 + 1))[:size]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_self_signed("localhost", tmp_path_factory.mktemp("live-certs"))


async def publish_groups(connection: MOQTConnection, per_group: int) -> None:
    """Answer the first SUBSCRIBE with every group, each on its own stream, then
    PUBLISH_DONE."""
    size = GROUP_SIZE // per_group
    async for event in connection.requests():
        if not isinstance(event, SubscribeReceived):
            continue
        connection.session.subscribe_ok(event.request_id)
        connection.transmit()
        for group in range(GROUPS):
            stream = await connection.open_subgroup(event.request_id, group, end_of_group=True)
            for obj in range(per_group):
                await connection.send_object(
                    stream, obj, payload(group, obj, size), end_stream=obj == per_group - 1
                )
        connection.session.publish_done(event.request_id, PublishDoneCode.TRACK_ENDED)
        connection.transmit()
        return


@pytest.mark.parametrize("per_group", [1, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_group_arrives_in_order(backend: str, per_group: int, certs: Certs) -> None:
    size = GROUP_SIZE // per_group

    async def scenario() -> list[tuple[int, int, bytes]]:
        async with (
            running_relay(relay_config(certs, backend=backend)) as relay,
            client(relay.url, certs, backend=backend) as pub,
            client(relay.url, certs, backend=backend) as sub,
        ):
            await pub.publish_namespace(NAMESPACE)
            publisher = asyncio.create_task(publish_groups(pub, per_group))
            subscription = await sub.subscribe(NAMESPACE, TRACK)
            got = [
                (obj.group_id, obj.object_id, hashlib.sha256(obj.payload).digest())
                async for obj in subscription.track.objects()
            ]
            await publisher
            return got

    got = run(scenario(), timeout=100)
    expected = [
        (group, obj, hashlib.sha256(payload(group, obj, size)).digest())
        for group in range(GROUPS)
        for obj in range(per_group)
    ]
    assert [(g, o) for g, o, _ in got] == [(g, o) for g, o, _ in expected]
    assert got == expected
