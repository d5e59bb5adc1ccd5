"""The payload sink of a FETCH (:class:`~kvsp.transfer.moqt_transfer.FetchLanding`): pieces in
any chunking land as the block's layers and reach the §6.7 checks; status objects are skipped;
an object that is not a layer, or a layer that fails its digest, is kept as the error (never
raised into the receive path) and nothing after it is taken. In process, no sockets: the
end-to-end FETCHes are in test_moqt_client*.py."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp import sha256x2
from kvsp.container import Geometry, Layer
from kvsp.errors import ContainerError, DigestMismatch
from kvsp.moqt_mapping import LayerAssembler
from kvsp.transfer.moqt_transfer import FetchLanding, LayerChecks, Watchdog
from moqt.errors import ObjectStatus
from moqt.objects import ObjectRun, ObjectStart
from moqt.session_events import ObjectHeader

GEOMETRY = Geometry(layers=4, kv_heads=1, head_dim=8, element_size=2)
TOKENS = 2
PAYLOAD = 2 * GEOMETRY.section_length(TOKENS)  # K ‖ V of one layer: 64 octets
LAYERS = [bytes([i]) * (PAYLOAD // 2) + bytes([0x80 | i]) * (PAYLOAD // 2) for i in range(4)]
DIGESTS = [hashlib.sha256(layer).digest() for layer in LAYERS]


def header(
    object_id: int, length: int = PAYLOAD, status: ObjectStatus = ObjectStatus.NORMAL
) -> ObjectHeader:
    start = ObjectStart(
        group_id=0,
        subgroup_id=0,
        object_id=object_id,
        publisher_priority=0,
        extensions=(),
        payload_length=length,
        status=status,
    )
    return ObjectHeader(stream_id=3, request_id=1, track_alias=None, object=start)


class Landed:
    def __init__(self, digests: list[bytes] = DIGESTS, hash_below: int | None = None) -> None:
        self.assembler = LayerAssembler(GEOMETRY, 0, 3, token_count=TOKENS, hash_below=hash_below)
        self.checks = LayerChecks(digests, b"\0" * 32)
        self.wakes = 0
        self.landing = FetchLanding(self.assembler, self.checks, self.wake)

    def wake(self) -> None:
        self.wakes += 1

    def send(self, h: ObjectHeader, payload: bytes, cuts: list[int]) -> None:
        view = memoryview(payload)
        bounds = [0, *sorted(c for c in cuts if 0 < c < len(payload)), len(payload)]
        for a, b in zip(bounds, bounds[1:], strict=False):
            if b > a:
                self.landing.payload(h, view[a:b], a)
        self.landing.object_end(h)

    def ready(self) -> list[Layer]:
        return list(self.checks.ready())


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.lists(st.integers(0, PAYLOAD), max_size=6), min_size=4, max_size=4))
def test_pieces_in_any_chunking_land_as_the_layers_checked_inline(cuts: list[list[int]]) -> None:
    landed = Landed()
    for index, layer in enumerate(LAYERS):
        landed.send(header(index), layer, cuts[index])
    assert landed.landing.error is None and landed.wakes == 4
    assert [bytes(layer.k) + bytes(layer.v) for layer in landed.ready()] == LAYERS
    assert landed.assembler.complete


def test_layers_left_for_the_hash_jobs_do_not_wake_the_consumer() -> None:
    landed = Landed(hash_below=0)  # nothing hashed as it arrives: the layers queue for a job
    for index, layer in enumerate(LAYERS):
        landed.send(header(index), layer, [9])
    assert landed.landing.error is None and landed.wakes == 0
    assert landed.checks.pending and not landed.ready()


def test_byte_at_a_time() -> None:
    landed = Landed()
    for index, layer in enumerate(LAYERS):
        landed.send(header(index), layer, list(range(1, PAYLOAD)))
    assert [layer.index for layer in landed.ready()] == [0, 1, 2, 3]
    assert landed.landing.progress == 4 * (PAYLOAD + 1)


def test_a_status_object_is_skipped() -> None:
    landed = Landed()
    landed.send(header(0), LAYERS[0], [])
    landed.send(header(1, 0, ObjectStatus.END_OF_GROUP), b"", [])
    for index in (1, 2, 3):
        landed.send(header(index), LAYERS[index], [7])
    assert landed.landing.error is None
    assert [layer.index for layer in landed.ready()] == [0, 1, 2, 3]


def test_an_object_that_is_not_a_layer_is_kept_as_the_error_and_nothing_more_is_taken() -> None:
    landed = Landed()
    landed.send(header(0), LAYERS[0], [])
    landed.send(header(0), LAYERS[0], [])  # layer 0 again: raised by the assembler
    assert isinstance(landed.landing.error, ContainerError) and landed.wakes == 2
    progress = landed.landing.progress
    landed.send(header(1), LAYERS[1], [])  # ignored
    assert landed.landing.error is not None and not landed.assembler.complete
    assert landed.landing.progress > progress  # still counted: the watchdog sees the data
    assert [layer.index for layer in landed.ready()] == [0]


def test_a_truncated_object_is_kept_as_the_error() -> None:
    landed = Landed()
    landed.send(header(0), LAYERS[0][:-1], [])
    assert isinstance(landed.landing.error, ContainerError)


def test_a_zero_length_layer_is_kept_as_the_error() -> None:
    landed = Landed()
    landed.send(header(0, 0), b"", [])
    assert isinstance(landed.landing.error, ContainerError)


def test_a_layer_that_fails_its_digest_inline_is_kept_as_the_error() -> None:
    landed = Landed(digests=[DIGESTS[0], DIGESTS[0], DIGESTS[2], DIGESTS[3]])
    for index, layer in enumerate(LAYERS):
        landed.send(header(index), layer, [5])
    assert isinstance(landed.landing.error, DigestMismatch)
    assert [layer.index for layer in landed.ready()] == [0]


def test_the_watchdog_reads_progress_from_the_callable() -> None:
    async def test() -> None:
        count = [0]
        stalls: list[int] = []
        dog = Watchdog(3600, lambda: stalls.append(1), progress=lambda: count[0])
        dog._check()  # noqa: SLF001 - the timer's callback, called here instead of waited for
        count[0] += 1
        dog._check()  # noqa: SLF001
        assert not dog.fired and not stalls
        dog._check()  # noqa: SLF001 - no progress since the last look
        assert dog.fired and stalls == [1]
        dog.cancel()

    asyncio.run(test())


def _layer(index: int) -> Layer:
    octets = memoryview(bytes([index]) * 8)
    return Layer(index, octets[:4], octets[4:])


def test_a_block_streams_result_comes_after_every_layer_and_its_error_stays() -> None:
    from collections.abc import AsyncGenerator

    from kvsp.transfer.moqt_transfer import BlockStream

    async def test() -> None:
        async def good(stream: BlockStream[str]) -> AsyncGenerator[Layer, None]:
            for index in range(3):
                yield _layer(index)
            stream.result = "block"

        assert await BlockStream(good).block() == "block"
        streamed = BlockStream(good)
        assert [layer.index async for layer in streamed] == [0, 1, 2]
        assert await streamed.block() == "block"

        async def bad(stream: BlockStream[str]) -> AsyncGenerator[Layer, None]:
            yield _layer(0)
            raise DigestMismatch("layer 1 differs")

        failing = BlockStream(bad)
        for _ in range(2):  # the first error, again, and nothing more handed out
            try:
                await failing.block()
            except DigestMismatch as exc:
                assert "layer 1" in str(exc)
            else:
                raise AssertionError("no error")
        try:
            await failing.__anext__()
        except DigestMismatch:
            pass
        else:
            raise AssertionError("iteration went on after the error")

    asyncio.run(test())


def test_a_whole_layer_in_one_piece_that_fails_its_digest_is_kept_as_the_error() -> None:
    landed = Landed(digests=[DIGESTS[0], DIGESTS[2], DIGESTS[2], DIGESTS[3]])
    for index, layer in enumerate(LAYERS):
        landed.send(header(index), layer, [])  # each payload in one piece
    assert isinstance(landed.landing.error, DigestMismatch)
    assert [layer.index for layer in landed.ready()] == [0]


def test_a_piece_longer_than_its_object_is_kept_as_the_error() -> None:
    for cuts in ([], [PAYLOAD // 2], [PAYLOAD]):  # whole and one more octet, or after a part
        landed = Landed()
        landed.send(header(0), LAYERS[0] + b"\x00", cuts)
        assert isinstance(landed.landing.error, ContainerError)
        assert not landed.ready()


def test_an_assembler_puts_a_whole_payload_k_first_then_v() -> None:
    assembler = LayerAssembler(GEOMETRY, 0, 3, token_count=TOKENS)
    for index in (2, 0):
        assembler.begin(0, index, PAYLOAD)
        assembler.feed(memoryview(LAYERS[index]))
        layer, digest = assembler.end()
        assert bytes(layer.k) == LAYERS[index][: PAYLOAD // 2]
        assert bytes(layer.v) == LAYERS[index][PAYLOAD // 2 :]
        assert digest == DIGESTS[index]
    assert assembler.span(0, 0) is not None and bytes(assembler.span(0, 0)) == LAYERS[0]


# --- runs of whole objects (FetchLanding.run) -------------------------------------------------


def run_of(object_ids: list[int], payloads: list[bytes] | None = None, group: int = 0) -> ObjectRun:
    """An :class:`ObjectRun` of whole objects, one after another in one buffer, each with a
    header of 3 filler octets before its payload."""
    data, objects = bytearray(), []
    for at, object_id in enumerate(object_ids):
        payload = LAYERS[object_id] if payloads is None else payloads[at]
        data += b"hdr"
        objects.append((group, 0, object_id, 0, (), len(data), len(payload)))
        data += payload
    return ObjectRun(memoryview(bytes(data)), objects, sum(item[6] for item in objects))


@settings(max_examples=50, deadline=None)
@given(split=st.integers(0, 4), hash_below=st.sampled_from([None, 0]))
def test_a_run_lands_as_the_pieces_and_ends_would(split: int, hash_below: int | None) -> None:
    by_pieces, by_run = Landed(hash_below=hash_below), Landed(hash_below=hash_below)
    for index, layer in enumerate(LAYERS):
        by_pieces.send(header(index), layer, [])
    # objects before the split arrive as pieces, the rest as one run
    for index in range(split):
        by_run.send(header(index), LAYERS[index], [7])
    if split < 4:
        by_run.landing.run(run_of(list(range(split, 4))))
    assert by_run.landing.error is None

    def octets(landed: Landed) -> list[tuple[int, bytes, bytes]]:
        return [(x.index, bytes(x.k), bytes(x.v)) for x in landed.assembler.layers()]

    assert octets(by_run) == octets(by_pieces) and by_run.assembler.complete
    if hash_below is None:  # checked inline: one wake for the run
        assert by_run.wakes == split + (split < 4)
        assert [bytes(x.k) + bytes(x.v) for x in by_run.ready()] == LAYERS
    else:  # queued for a hash job, as the pieces' layers are
        assert by_run.wakes == 0 and by_run.checks.pending


def test_a_layer_of_a_run_that_fails_its_digest_is_kept_as_the_error() -> None:
    landed = Landed(digests=[DIGESTS[0], DIGESTS[0], DIGESTS[2], DIGESTS[3]])
    landed.landing.run(run_of([0, 1, 2, 3]))
    assert isinstance(landed.landing.error, DigestMismatch)
    assert [layer.index for layer in landed.ready()] == [0]  # nothing after the mismatch


def test_an_object_of_a_run_that_is_not_a_layer_is_kept_as_the_error() -> None:
    for bad in (
        run_of([0, 0]),  # a layer twice
        run_of([0, 1], group=1),  # outside group 0
        run_of([0, 1], [LAYERS[0], LAYERS[1][:-2]]),  # another payload length
        run_of([0], [b""]),  # no payload
    ):
        landed = Landed()
        landed.landing.run(bad)
        assert isinstance(landed.landing.error, ContainerError)
        progress = landed.landing.progress
        landed.landing.run(run_of([2, 3]))  # ignored
        assert landed.landing.progress == progress + 1 and not landed.assembler.complete


def test_a_run_inside_an_open_object_is_kept_as_the_error() -> None:
    landed = Landed()
    landed.landing.payload(header(0), memoryview(LAYERS[0][:5]), 0)  # object 0 is still open
    landed.landing.run(run_of([1]))
    assert isinstance(landed.landing.error, ContainerError)


@pytest.mark.parametrize("accelerated", [True, False])
@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 1, 0, 2], [1, 2, 3, 0], [2, 3]])
def test_a_runs_layers_in_any_order_are_hashed_and_checked_each_against_its_own_digest(
    monkeypatch: pytest.MonkeyPatch, order: list[int], accelerated: bool
) -> None:
    if accelerated and not sha256x2.ACCELERATED:
        pytest.skip("kvsp._sha256x2 is not built here")
    monkeypatch.setattr(sha256x2, "ACCELERATED", accelerated)
    landed = Landed()
    landed.landing.run(run_of(order))
    assert landed.landing.error is None and landed.wakes == 1
    assert sorted(layer.index for layer in landed.ready()) == sorted(order)
    for wrong in order:  # each layer is checked against its own digest, wherever it is
        digests = list(DIGESTS)
        digests[wrong] = DIGESTS[(wrong + 1) % 4]
        landed = Landed(digests=digests)
        landed.landing.run(run_of(order))
        assert isinstance(landed.landing.error, DigestMismatch)
        handed = [layer.index for layer in landed.ready()]
        assert handed == order[: order.index(wrong)]


def test_a_watchdog_made_unarmed_starts_its_timer_at_the_first_arm() -> None:
    async def test() -> None:
        stalls: list[int] = []
        dog = Watchdog(0.01, lambda: stalls.append(1), armed=False)
        await asyncio.sleep(0.05)
        assert not dog.fired and not stalls  # no timer yet: a consumer that never waited
        dog.arm()
        dog.arm()  # once started, arming again changes nothing
        for _ in range(100):
            if dog.fired:
                break
            await asyncio.sleep(0.01)
        assert dog.fired and stalls == [1]
        dog.cancel()
        Watchdog(1, lambda: None, armed=False).cancel()  # never armed: nothing to cancel

    asyncio.run(test())
