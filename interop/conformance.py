"""Our MOQT conformance client, on the moq-interop-runner contract (TEST-CLIENT-INTERFACE.md).

Run: ``python -m interop.conformance -r moqt://127.0.0.1:4443 [-t CASE] [-l]
[--tls-disable-verify | --cafile PEM]``; the environment variables ``RELAY_URL``, ``TESTCASE``,
``TLS_DISABLE_VERIFY`` and ``VERBOSE`` work too. Output is TAP version 14 on stdout; the exit
status is 0 when every case passed, 1 when one failed, 127 for an unknown case.

The cases follow englishm/moq-interop-runner's test cases as aiomoqt's client implements them
(the reference we check against), driven by this project's MOQT stack (draft-16, raw QUIC,
ALPN ``moqt-16``) in the client role against a relay: we play publisher, subscriber, fetcher
and namespace subscriber on separate sessions. ``rendezvous-timeout`` is a draft-18 case and
is not offered. ``fetch`` and ``join`` are not in the default run (as in aiomoqt's client).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moqt.asyncio import MOQTConnection, RequestRejected, connect  # noqa: E402
from moqt.backend import get_backend  # noqa: E402
from moqt.errors import PublishDoneCode, RequestErrorCode  # noqa: E402
from moqt.messages import MessageParameters, StandaloneFetch  # noqa: E402
from moqt.messages_base import SubscribeOptions  # noqa: E402
from moqt.messages_params import FilterType, SubscriptionFilter  # noqa: E402
from moqt.session_events import (  # noqa: E402
    DataStreamFinished,
    FetchOkReceived,
    FetchReceived,
    MOQTEvent,
    NamespaceDoneReceived,
    NamespaceReceived,
    ObjectEnd,
    ObjectHeader,
    PublishOkReceived,
    PublishReceived,
    RequestErrorReceived,
    RequestOkReceived,
    SubscribeReceived,
)
from moqt.session_state import LocalProtocolError  # noqa: E402
from moqt.wire import Location, TrackNamespace  # noqa: E402

CASES = (
    "setup-only",
    "announce-only",
    "publish-namespace-done",
    "subscribe-error",
    "announce-subscribe",
    "subscribe-before-announce",
    "data-subgroup-basic",
    "subscribe-namespace-lifecycle",
    "namespace-discovery",
    "fetch",
    "join",
    "publish-track-only",
    "publish-track-subscribe",
)
DEFAULT_RUN = tuple(c for c in CASES if c not in ("fetch", "join"))
DATA_CASE: tuple[bytes, ...] = (
    *(b"moq-test-00", b"0", b"0", b"0", b"2", b"4", b"5", b"64", b"32", b"2", b"1", b"1"),
    *(b"0", b"-1", b"-1", b"0"),  # the MoQT Test tuple of data-subgroup-basic
)
STEP_S = 5.0
DELIVERY_S = 10.0


class CaseFailed(Exception):
    """The relay did something the case does not accept."""


@dataclass
class Result:
    """One case's outcome for the TAP report."""

    name: str
    passed: bool
    message: str
    duration_ms: float = 0.0


@dataclass(frozen=True)
class Target:
    """The relay under test and how to reach it."""

    host: str
    port: int
    path: str | None
    verify: bool
    cafile: str | None
    backend: str | None

    def configuration(self) -> Any:
        quic = get_backend(self.backend)
        return quic.configuration(
            is_client=True, cafile=self.cafile, verify=self.verify, server_name=self.host
        )


def parse_relay_url(url: str) -> tuple[str, int, str | None]:
    """Host, port and path of ``moqt://host[:port][/path]`` (raw QUIC only).

    Raises:
        ValueError: another scheme, or no host.
    """
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme != "moqt" or not parts.hostname:
        raise ValueError(f"expected moqt://host:port, got {url!r} (WebTransport is not spoken)")
    return parts.hostname, parts.port or 443, parts.path or None


# --- one session and what the relay says on it -------------------------------------------------


@dataclass
class Track:
    """A synthetic track we publish: groups of ``group_size`` objects of ``size`` octets,
    produced at ``rate`` objects per second from when the endpoint starts."""

    namespace: TrackNamespace
    name: bytes
    group_size: int = 5
    size: int = 64
    rate: float = 50.0
    started: float = field(default_factory=time.monotonic)

    def payload(self, group: int, obj: int) -> bytes:
        return (b"%d.%d:" % (group, obj)).ljust(self.size, b"t")

    def produced(self) -> int:
        """Objects produced so far."""
        return int((time.monotonic() - self.started) * self.rate)


class Endpoint:
    """One MOQT session: every event the relay sends is recorded (waitable), and SUBSCRIBE or
    FETCH of ``track`` is served live."""

    def __init__(
        self, connection: MOQTConnection, track: Track | None = None, *, refuse: bool = True
    ) -> None:
        self.connection = connection
        self.refuse_unknown = refuse
        self.session = connection.session
        self.track = track
        self.events: list[MOQTEvent] = []
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.subscribed = asyncio.Event()
        self.accept_publish = True

    async def pump(self) -> None:
        async for event in self.connection.requests():
            self.events.append(event)
            self._changed.set()
            self._answer(event)

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _answer(self, event: MOQTEvent) -> None:
        try:
            if isinstance(event, SubscribeReceived):
                if self._ours(event.message.track_namespace, event.message.track_name):
                    self._spawn(self._serve_subscribe(event.request_id))
                elif self.refuse_unknown:
                    self.refuse(event.request_id)
            elif isinstance(event, FetchReceived):
                target = event.message.target
                if isinstance(target, StandaloneFetch) and self._ours(
                    target.track_namespace, target.track_name
                ):
                    self._spawn(self._serve_fetch(event.request_id, target))
                else:
                    self.refuse(event.request_id)
            elif isinstance(event, PublishReceived):
                if self.accept_publish:
                    self.session.publish_ok(event.request_id)
                else:
                    self.refuse(event.request_id)
        except LocalProtocolError:
            return
        self.connection.transmit()

    def refuse(self, request_id: int) -> None:
        self.session.request_error(request_id, RequestErrorCode.DOES_NOT_EXIST, "no such track")
        self.connection.transmit()

    def _ours(self, namespace: TrackNamespace, name: bytes) -> bool:
        track = self.track
        return track is not None and tuple(namespace) == track.namespace and name == track.name

    async def _serve_subscribe(self, request_id: int) -> None:
        track = self.track
        if track is None:
            return
        self.session.subscribe_ok(request_id)
        self.connection.transmit()
        self.subscribed.set()
        await self._send_live(request_id, track)

    async def _send_live(self, request_id: int, track: Track) -> None:
        index = track.produced()
        stream_id: int | None = None
        while request_id in self.session.requests:
            group, obj = divmod(index, track.group_size)
            if obj == 0 or stream_id is None:
                stream_id = await self.connection.open_subgroup(request_id, group)
            last = obj == track.group_size - 1
            await self.connection.send_object(
                stream_id, obj, track.payload(group, obj), end_stream=last
            )
            if last:
                stream_id = None
            index += 1
            await asyncio.sleep(max(0.0, (index / track.rate) - (time.monotonic() - track.started)))

    async def _serve_fetch(self, request_id: int, target: StandaloneFetch) -> None:
        track = self.track
        if track is None:
            return
        whole = track.produced() // track.group_size
        first = target.start.group
        last = min(target.end.group, whole - 1)
        if first > last:
            self.session.request_error(request_id, RequestErrorCode.INVALID_RANGE, "not yet")
            self.connection.transmit()
            return
        self.session.fetch_ok(request_id, end_location=Location(last, track.group_size - 1))
        stream_id = await self.connection.open_fetch_stream(request_id)
        for group in range(first, last + 1):
            for obj in range(track.group_size):
                end = group == last and obj == track.group_size - 1
                await self.connection.send_fetch_object(
                    stream_id,
                    group_id=group,
                    object_id=obj,
                    payload=track.payload(group, obj),
                    end_stream=end,
                )

    async def wait(self, match: Callable[[MOQTEvent], bool], timeout: float = STEP_S) -> MOQTEvent:
        """The first recorded event ``match`` accepts, waiting up to ``timeout``.

        Raises:
            TimeoutError: none in time.
        """
        async with asyncio.timeout(timeout):
            while True:
                for event in self.events:
                    if match(event):
                        return event
                self._changed.clear()
                await self._changed.wait()

    async def reply(self, request_id: int, timeout: float = STEP_S) -> MOQTEvent:
        """The reply to one of our requests that the connection does not await itself.

        Raises:
            CaseFailed: REQUEST_ERROR. TimeoutError: no reply in time.
        """
        event = await self.wait(
            lambda e: (
                getattr(e, "request_id", None) == request_id
                and isinstance(
                    e,
                    PublishOkReceived | RequestOkReceived | FetchOkReceived | RequestErrorReceived,
                )
            ),
            timeout,
        )
        if isinstance(event, RequestErrorReceived):
            code, reason = int(event.message.error_code), event.message.reason
            raise CaseFailed(f"request {request_id} refused: {code:#x} {reason}")
        return event

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


@asynccontextmanager
async def session(
    target: Target, track: Track | None = None, *, refuse: bool = True
) -> AsyncIterator[Endpoint]:
    """A session with the relay, its events pumped into an :class:`Endpoint` (which refuses
    requests for tracks other than ``track`` unless ``refuse`` is False)."""
    async with AsyncExitStack() as stack:
        async with asyncio.timeout(STEP_S):  # the QUIC handshake itself has no deadline
            connection = await stack.enter_async_context(
                connect(
                    target.host,
                    target.port,
                    configuration=target.configuration(),
                    backend=target.backend,
                    path=target.path,
                    setup_timeout=STEP_S,
                )
            )
        endpoint = Endpoint(connection, track, refuse=refuse)
        pump = asyncio.ensure_future(endpoint.pump())
        try:
            yield endpoint
        finally:
            endpoint.close()
            pump.cancel()


def run_namespace(case: str) -> TrackNamespace:
    """A namespace no other run or case shares."""
    return (b"moq-test", case.encode(), secrets.token_hex(8).encode())


# --- the cases -----------------------------------------------------------------------------------


async def case_setup_only(target: Target) -> str:
    async with session(target):
        return "SERVER_SETUP received"


async def case_announce_only(target: Target) -> str:
    async with session(target) as pub:
        await pub.connection.publish_namespace(run_namespace("announce-only"))
        return "PUBLISH_NAMESPACE answered REQUEST_OK"


async def case_publish_namespace_done(target: Target) -> str:
    async with session(target) as pub:
        ok = await pub.connection.publish_namespace(run_namespace("publish-namespace-done"))
        pub.session.publish_namespace_done(ok.request_id)
        pub.connection.transmit()
        await asyncio.sleep(0.1)
        return "REQUEST_OK received, PUBLISH_NAMESPACE_DONE sent"


async def case_subscribe_error(target: Target) -> str:
    async with session(target) as sub:
        try:
            await sub.connection.subscribe((b"nonexistent", b"namespace"), b"test-track")
        except RequestRejected as exc:
            if exc.error_code == RequestErrorCode.INTERNAL_ERROR:
                raise CaseFailed("INTERNAL_ERROR is not a refusal of an unknown track") from exc
            return f"REQUEST_ERROR {exc.error_code:#x} for an unknown track"
        raise CaseFailed("SUBSCRIBE_OK for a track nobody publishes")


async def case_announce_subscribe(target: Target) -> str:
    namespace = run_namespace("announce-subscribe")
    track = Track(namespace, b"track")
    async with session(target, track) as pub:
        await pub.connection.publish_namespace(namespace)
        async with session(target) as sub:
            try:
                async with asyncio.timeout(STEP_S):
                    await sub.connection.subscribe(namespace, b"track")
            except TimeoutError:
                return "the relay holds the subscription pending (forward-and-wait)"
            except RequestRejected as exc:
                raise CaseFailed(f"SUBSCRIBE refused: {exc.error_code:#x} {exc.reason}") from exc
            return "SUBSCRIBE_OK: the relay routed the subscription to the publisher"


async def case_subscribe_before_announce(target: Target) -> str:
    namespace = run_namespace("subscribe-before-announce")
    async with session(target) as sub:
        early = asyncio.ensure_future(sub.connection.subscribe(namespace, b"track"))
        early.add_done_callback(lambda f: f.cancelled() or f.exception())
        await asyncio.sleep(0.5)
        async with session(target, Track(namespace, b"track")) as pub:
            await pub.connection.publish_namespace(namespace)
            try:
                async with asyncio.timeout(2.0):
                    await early
            except TimeoutError as exc:
                raise CaseFailed("no answer to the early SUBSCRIBE") from exc
            except RequestRejected as exc:
                if exc.error_code == RequestErrorCode.INTERNAL_ERROR:
                    raise CaseFailed("INTERNAL_ERROR for the early SUBSCRIBE") from exc
                return f"REQUEST_ERROR {exc.error_code:#x}: the relay did not hold it"
            return "SUBSCRIBE_OK after the late announce: the relay held it"


async def _send_data_case(pub: Endpoint, request_id: int) -> int:
    """data-subgroup-basic's objects: groups 0-2 of objects 0-4, one stream per group, FIN
    without end-of-group, then PUBLISH_DONE with the stream count."""
    for group in range(3):
        stream_id = await pub.connection.open_subgroup(request_id, group, extensions=False)
        for obj in range(5):
            await asyncio.sleep(0.002)
            payload = b"t" * (64 if obj == 0 else 32)
            await pub.connection.send_object(stream_id, obj, payload, end_stream=obj == 4)
    pub.session.publish_done(request_id, PublishDoneCode.TRACK_ENDED, stream_count=3)
    pub.connection.transmit()
    return 3


async def case_data_subgroup_basic(target: Target) -> str:
    prefix = run_namespace("data-subgroup-basic")
    full = (*prefix, *DATA_CASE)
    async with session(target, refuse=False) as pub:
        await pub.connection.publish_namespace(prefix)
        async with session(target) as sub:
            subscribing = asyncio.ensure_future(sub.connection.subscribe(full, b"track"))
            try:
                asked = await pub.wait(lambda e: isinstance(e, SubscribeReceived))
            except TimeoutError:
                subscribing.cancel()
                raise CaseFailed("the relay did not SUBSCRIBE upstream") from None
            assert isinstance(asked, SubscribeReceived)
            if tuple(asked.message.track_namespace) != full:
                raise CaseFailed("the relay asked for another namespace")
            pub.session.subscribe_ok(asked.request_id)
            pub.connection.transmit()
            subscription = await asyncio.wait_for(subscribing, STEP_S)
            await _send_data_case(pub, asked.request_id)
            objects = []
            async with asyncio.timeout(DELIVERY_S):
                async for obj in subscription.track.objects():
                    if obj.status == 0:
                        objects.append((obj.group_id, obj.object_id, bytes(obj.payload)))
    expected = [(g, o, b"t" * (64 if o == 0 else 32)) for g in range(3) for o in range(5)]
    if sorted(objects) != expected:
        raise CaseFailed(f"{len(objects)} objects, not the 15 expected: {sorted(objects)[:3]}…")
    return "15 objects received, PUBLISH_DONE TRACK_ENDED"


async def case_subscribe_namespace_lifecycle(target: Target) -> str:
    namespace = run_namespace("subscribe-namespace-lifecycle")
    async with session(target) as sub:
        request_id, notices = await sub.connection.subscribe_namespace(namespace)
        async with session(target) as pub:
            ok = await pub.connection.publish_namespace(namespace)
            first = await asyncio.wait_for(notices.get(), STEP_S)
            if not isinstance(first, NamespaceReceived) or first.suffix != ():
                raise CaseFailed(f"expected NAMESPACE (), got {first}")
            pub.session.publish_namespace_done(ok.request_id)
            pub.connection.transmit()
            second = await asyncio.wait_for(notices.get(), STEP_S)
            if not isinstance(second, NamespaceDoneReceived) or second.suffix != ():
                raise CaseFailed(f"expected NAMESPACE_DONE (), got {second}")
    del request_id
    return "NAMESPACE then NAMESPACE_DONE received"


async def _publish(pub: Endpoint, namespace: TrackNamespace, name: bytes) -> int:
    request_id = pub.session.publish(namespace, name, parameters=MessageParameters(forward=1))
    pub.connection.transmit()
    await pub.reply(request_id)
    return request_id


async def case_namespace_discovery(target: Target) -> str:
    namespace = run_namespace("namespace-discovery")
    async with session(target) as pub:
        await pub.connection.publish_namespace(namespace)
        await _publish(pub, namespace, b"discovered-track")
        async with session(target) as sub:
            request_id = sub.session.subscribe_namespace(namespace, options=SubscribeOptions.BOTH)
            sub.connection.transmit()
            await sub.reply(request_id)
            event = await sub.wait(lambda e: isinstance(e, PublishReceived))
    assert isinstance(event, PublishReceived)
    name = event.message.track_name
    if name != b"discovered-track":
        raise CaseFailed(f"discovered {name!r}")
    return "PUBLISH announced 'discovered-track'"


@asynccontextmanager
async def _history(target: Target, case: str) -> AsyncIterator[tuple[TrackNamespace, int]]:
    """A live track the relay has forwarded two whole groups of; yields (namespace, a whole
    group)."""
    namespace = run_namespace(case)
    async with session(target, Track(namespace, b"track")) as pub:
        await pub.connection.publish_namespace(namespace)
        async with session(target) as sub:
            subscription = await sub.connection.subscribe(namespace, b"track")
            groups: list[int] = []
            async with asyncio.timeout(STEP_S):
                async for event in subscription.track.events():
                    if isinstance(event, ObjectHeader) and event.group_id not in groups:
                        groups.append(event.group_id)
                    if len(groups) >= 3:
                        break
            yield namespace, groups[1]


async def _count_objects(endpoint: Endpoint, request_id: int) -> int:
    count = 0
    async with asyncio.timeout(STEP_S):
        async for event in endpoint.connection.track(request_id).events():
            if isinstance(event, ObjectEnd):
                count += 1
            elif isinstance(event, DataStreamFinished):
                break
    return count


async def case_fetch(target: Target) -> str:
    async with _history(target, "fetch") as (namespace, group), session(target) as fetcher:
        response = await fetcher.connection.fetch(
            namespace, b"track", Location(group, 0), Location(group, 0)
        )
        count = len([o async for o in _aiter_timeout(response.track.objects())])
    if count == 0:
        raise CaseFailed("no objects received by the FETCH")
    return f"{count} objects received by the FETCH"


async def _aiter_timeout(source: AsyncIterator[Any], timeout: float = STEP_S) -> AsyncIterator[Any]:
    async with asyncio.timeout(timeout):
        async for item in source:
            yield item


async def case_join(target: Target) -> str:
    async with _history(target, "join") as (namespace, _), session(target) as joiner:
        largest = MessageParameters(
            subscription_filter=SubscriptionFilter(filter_type=FilterType.LARGEST_OBJECT)
        )
        subscription = await joiner.connection.subscribe(namespace, b"track", parameters=largest)
        request_id = joiner.session.joining_fetch(subscription.request_id, 1)
        joiner.connection.transmit()
        await joiner.reply(request_id)
        count = await _count_objects(joiner, request_id)
    if count == 0:
        raise CaseFailed("no objects received by the joining FETCH")
    return f"{count} objects received by the joining FETCH"


async def case_publish_track_only(target: Target) -> str:
    async with session(target) as pub:
        request_id = await _publish(pub, run_namespace("publish-track-only"), b"track")
        pub.session.publish_done(request_id, PublishDoneCode.TRACK_ENDED, stream_count=0)
        pub.connection.transmit()
        await asyncio.sleep(0.1)
    return "PUBLISH_OK received, PUBLISH_DONE sent"


async def case_publish_track_subscribe(target: Target) -> str:
    namespace = run_namespace("publish-track-subscribe")
    track = Track(namespace, b"track")
    async with session(target, track) as pub:
        request_id = await _publish(pub, namespace, b"track")
        sender = asyncio.ensure_future(pub._send_live(request_id, track))
        try:
            async with session(target) as sub:
                subscription = await asyncio.wait_for(
                    sub.connection.subscribe(namespace, b"track"), STEP_S
                )
                seen = 0
                async with asyncio.timeout(DELIVERY_S):
                    async for _ in subscription.track.objects():
                        seen += 1
                        if seen >= 5:
                            break
        finally:
            sender.cancel()
    return f"{seen} objects received from the published track"


CASE_FUNCTIONS: dict[str, Callable[[Target], Awaitable[str]]] = {
    "setup-only": case_setup_only,
    "announce-only": case_announce_only,
    "publish-namespace-done": case_publish_namespace_done,
    "subscribe-error": case_subscribe_error,
    "announce-subscribe": case_announce_subscribe,
    "subscribe-before-announce": case_subscribe_before_announce,
    "data-subgroup-basic": case_data_subgroup_basic,
    "subscribe-namespace-lifecycle": case_subscribe_namespace_lifecycle,
    "namespace-discovery": case_namespace_discovery,
    "fetch": case_fetch,
    "join": case_join,
    "publish-track-only": case_publish_track_only,
    "publish-track-subscribe": case_publish_track_subscribe,
}


async def run_case(name: str, target: Target, timeout: float = 20.0) -> Result:
    """One case, bounded; any exception is its failure message."""
    started = time.monotonic()
    try:
        message = await asyncio.wait_for(CASE_FUNCTIONS[name](target), timeout)
        passed = True
    except CaseFailed as exc:
        message, passed = str(exc), False
    except Exception as exc:  # noqa: BLE001 - the report names whatever went wrong
        message, passed = f"{type(exc).__name__}: {exc}", False
    return Result(name, passed, message, (time.monotonic() - started) * 1000)


def tap(results: list[Result], target_url: str) -> str:
    """The TAP version 14 report."""
    lines = ["TAP version 14", f"# target: {target_url}", f"1..{len(results)}"]
    for number, result in enumerate(results, 1):
        lines.append(f"{'ok' if result.passed else 'not ok'} {number} - {result.name}")
        lines += ["  ---", f"  duration_ms: {round(result.duration_ms)}"]
        lines += [f"  message: {json.dumps(result.message)}", "  ..."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit status."""
    env = os.environ
    truthy = ("1", "true", "yes")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-r", "--relay", default=env.get("RELAY_URL", "moqt://127.0.0.1:4443"))
    parser.add_argument("-t", "--test", default=env.get("TESTCASE") or None, metavar="CASE")
    parser.add_argument("-l", "--list", action="store_true", help="list the cases")
    parser.add_argument(
        "--tls-disable-verify",
        action="store_true",
        default=env.get("TLS_DISABLE_VERIFY", "").lower() in truthy,
    )
    parser.add_argument("--cafile", help="pin the relay's certificate (PEM)")
    parser.add_argument(
        "--backend", default=None, choices=("aioquic", "qh3"), help="default: the fastest installed"
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=env.get("VERBOSE", "").lower() in truthy
    )
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(CASES))
        return 0
    if args.test is not None and args.test not in CASE_FUNCTIONS:
        print(f"TAP version 14\n1..0 # SKIP unsupported test case {args.test}")
        return 127
    host, port, path = parse_relay_url(args.relay)
    target = Target(host, port, path, not args.tls_disable_verify, args.cafile, args.backend)
    cases = [args.test] if args.test else list(DEFAULT_RUN)

    async def run_all() -> list[Result]:
        results = []
        for name in cases:
            result = await run_case(name, target)
            if args.verbose:
                status = "PASS" if result.passed else "FAIL"
                print(f"  [{status}] {name}: {result.message}", file=sys.stderr)
            results.append(result)
        return results

    results = asyncio.run(run_all())
    print(tap(results, args.relay))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
