"""Verifying a block body of known length in slices of the one buffer it lands in (§6.7).

The fast path of :mod:`kvsp.transfer.verify`: the body lands in one buffer, its header is
parsed once on the event loop as soon as it has arrived, and worker threads hash large slices
of the buffer as they arrive, with no second parse of the body; the layers handed out are
views of that buffer. Kept apart from :class:`~kvsp.transfer.verify.VerifyingBody` because its
bookkeeping (slice offsets, one ordered ``Repr-Digest`` job, layer jobs, a thread-safe finish)
is its own; both raise the same errors and give the same result.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from kvsp import sha256x2
from kvsp.container import (
    DEFAULT_LIMITS,
    KVB1_HEADER,
    Container,
    ContainerHeader,
    Layer,
    check_digest_list,
    check_magic_prefix,
    header_fields,
    header_size,
    mismatch,
    parse_fixed_header,
    parse_header,
)
from kvsp.errors import ContainerError
from kvsp.transfer.buffers import BufferPool
from kvsp.transfer.verify import CODEC_END, BlockPlan, check_repr_digest, receive_buffer

SLICE_STEP = 512 * 1024
"""Octets a ``"slices"`` body gathers before it hands them to a hashing job."""


class SliceBody:
    """A :class:`~kvsp.transfer.http11.BodyConsumer` that verifies a block of known length by
    hashing slices of the one buffer it lands in (§6.7), with no second parse of the body.

    The header is parsed on the event loop as soon as it has arrived; from then on, every
    ``step`` octets (and at the end) a worker job extends the ``Repr-Digest`` hash (one job at
    a time, in order) and another hashes the layers completed meanwhile, each layer in one
    ``update`` over its K and V sections (adjacent in the body), so the workers make a few
    large GIL-free calls per block. The layers handed out are views of the buffer, which comes
    from ``buffers`` when given (:class:`~kvsp.transfer.buffers.BufferPool`).

    With ``paired`` (and :data:`kvsp.sha256x2.ACCELERATED`) a block in the replica's codec is
    hashed in one ordered pass instead: each slice feeds the ``Repr-Digest`` stream and the
    current layer's stream together, the two interleaved on the SHA extensions
    (:func:`kvsp.sha256x2.feed_layers`: one native call, and one GIL release, per slice
    however many layers it spans), and a layer's digest is checked as soon as its last octet
    is hashed.

    Raises: as :class:`~kvsp.transfer.verify.VerifyingBody`.
    """

    def __init__(
        self,
        plan: BlockPlan,
        expected: bytes,
        length: int,
        *,
        executor: Executor | None,
        step: int = SLICE_STEP,
        paired: bool = False,
        buffers: BufferPool | None = None,
    ) -> None:
        self._plan = plan
        self._paired_wanted = paired and sha256x2.ACCELERATED
        self._paired = False  # decided with the codec: only producer layers have digests
        self._layer_hash: sha256x2.Sha256 | None = None  # restarted at each layer's end
        self._layer_at = 0  # the layer the paired pass is in
        self._expected = expected
        self._length = length
        self._executor = executor
        self._step = step
        self._body = receive_buffer(length, buffers)
        self._fill = 0
        self._header: ContainerHeader | None = None
        self._layer_count = -1  # known once the fixed header has arrived
        self._producer = False
        self._check: Sequence[bytes] | None = None  # the record's digests, when checked
        self._hashing_layers = False
        self._starts: list[int] = []  # offset of each layer, then the end of the body
        self._digests: list[bytes] = []
        self._layers_sent = 0
        self._first_layer = 0
        self._layer_from = 0  # start of the layers not yet handed to a job
        # the Repr-Digest pass
        self._hash: Any = hashlib.sha256()
        self._target = 0  # octets the pass must reach
        self._hashed = 0  # octets it has reached
        self._hash_running = False
        # completion
        self._lock = threading.Lock()
        self._jobs = 0
        self._closed = False
        self.error: BaseException | None = None
        self._loop = asyncio.get_running_loop()
        self._done: asyncio.Future[None] = self._loop.create_future()

    # the consumer

    def buffer(self, size: int) -> memoryview:
        return self._body[self._fill : self._fill + size]

    def written(self, n: int) -> None:
        self._fill = fill = self._fill + n
        if self._header is None and not self._parse_header():
            return
        last = fill == self._length
        if last or fill - self._target >= self._step:
            self._hash_to(fill)
        starts = self._starts
        if self._paired:
            pass  # the Repr-Digest pass hashes the layers too
        elif self._hashing_layers and self._layers_sent < len(starts) - 1:
            done = bisect.bisect_right(starts, fill) - 1  # layers wholly received
            if done > self._layers_sent and (last or starts[done] - self._layer_from >= self._step):
                self._submit(self._hash_layers, self._layers_sent, done)
                self._layers_sent = done
                self._layer_from = starts[done]
        if self.error is not None:
            raise self.error

    def finish(self) -> None:
        if self._header is None:
            raise ContainerError(f"a body of {self._fill} octets is not a KVB1 container")
        self._close()

    def fail(self, exc: BaseException) -> None:
        self._close()

    # the header

    def _parse_header(self) -> bool:
        fill, body = self._fill, self._body
        if self._layer_count < 0:
            if fill < CODEC_END:
                return False
            check_magic_prefix(body[:4])
            self._producer = self._plan.producer(int.from_bytes(body[6:CODEC_END], "big"))
            if fill < KVB1_HEADER.size:
                return False
            fixed = parse_fixed_header(
                body[: KVB1_HEADER.size], self._plan.geometry, DEFAULT_LIMITS
            )
            self._layer_count = fixed.layer_count
        size = header_size(self._layer_count)
        if size > self._length:
            raise ContainerError(f"a body of {self._length} octets for a header of {size}")
        if fill < size:
            return False
        header = parse_header(body[:size], self._plan.geometry, DEFAULT_LIMITS)
        if header.total_length != self._length:
            raise ContainerError(
                f"a body of {self._length} octets for a container of {header.total_length}"
            )
        self._plan.check_layers(header)
        record = self._plan.record
        self._first_layer = header.first_layer
        if self._producer:
            self._hashing_layers = True
            if self._paired_wanted and header.layer_count > 0:
                self._paired = True
                self._hash = sha256x2.Sha256()
                self._layer_hash = sha256x2.Sha256()
            if record.layer_digests is not None:
                check_digest_list(
                    record.layer_digests, header.first_layer, header.layer_count, None
                )
                self._check = record.layer_digests
            self._digests = [b""] * header.layer_count
        starts = [size]
        for k_len, v_len in header.lengths:
            starts.append(starts[-1] + k_len + v_len)
        self._starts = starts
        self._layer_from = size
        self._header = header
        return True

    # the jobs

    def _submit(self, job: Callable[[int, int], None], a: int, b: int) -> None:
        with self._lock:
            self._jobs += 1
        if self._executor is None:
            self._run(job, a, b)
        else:
            self._executor.submit(self._run, job, a, b)

    def _run(self, job: Callable[[int, int], None], a: int, b: int) -> None:
        try:
            if self.error is None:
                job(a, b)
        except BaseException as exc:
            self.error = exc
        with self._lock:
            self._jobs -= 1
            settle = self._closed and self._jobs == 0
        if settle:
            self._settle()

    def _hash_to(self, target: int) -> None:
        with self._lock:
            self._target = target
            if self._hash_running:
                return
            self._hash_running = True
        self._submit(self._hash_job, 0, 0)

    def _hash_job(self, a: int, b: int) -> None:
        while True:
            with self._lock:
                start, end = self._hashed, self._target
                if start == end or self.error is not None:
                    self._hash_running = False
                    return
            if self._paired:
                self._hash_paired(start, end)
            else:
                self._hash.update(self._body[start:end])
            self._hashed = end

    def _hash_paired(self, start: int, end: int) -> None:
        """Feed ``[start, end)`` to the Repr-Digest stream and, from the first layer on, to
        the layer streams, checking every layer that completes; one native call (one GIL
        release) for the whole slice, however many layers it spans."""
        body, starts, check = self._body, self._starts, self._check
        layer = self._layer_hash
        assert layer is not None
        if start < starts[0]:  # the header: Repr-Digest only
            cut = min(end, starts[0])
            self._hash.update(body[start:cut])
            start = cut
        first = self._layer_at
        done = bisect.bisect_right(starts, end, first + 1)  # layers first..done-2 complete
        ends = [starts[k] - start for k in range(first + 1, done)]
        digests = sha256x2.feed_layers(self._hash, layer, body[start:end], ends)
        for i, got in enumerate(digests, first):
            index = self._first_layer + i
            if check is not None and got != check[index]:
                raise mismatch(index, got, check[index])
            self._digests[i] = got
        self._layer_at = self._layers_sent = first + len(digests)

    def _hash_layers(self, first: int, stop: int) -> None:
        body, starts, check = self._body, self._starts, self._check
        base = self._first_layer
        for i in range(first, stop):
            got = hashlib.sha256(body[starts[i] : starts[i + 1]]).digest()
            if check is not None and got != check[base + i]:
                raise mismatch(base + i, got, check[base + i])
            self._digests[i] = got

    def _close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            settle = self._jobs == 0
        if settle:
            self._settle()

    def _settle(self) -> None:
        if self._executor is None:
            self._set_done()
        else:
            self._loop.call_soon_threadsafe(self._set_done)

    def _set_done(self) -> None:
        if not self._done.done():
            self._done.set_result(None)

    async def result(self) -> tuple[Container, bool]:
        """The verified container and whether it was checked against the record.

        Raises:
            DigestMismatch, ContainerError, Incompatible: see
                :class:`~kvsp.transfer.verify.VerifyingBody`.
        """
        await self._done
        if self.error is not None:
            raise self.error
        header = self._header
        if header is None or self._fill != self._length or self._hashed != self._length:
            raise ContainerError(f"truncated body: {self._fill} of {self._length} octets")
        check_repr_digest(self._hash.digest(), self._expected)
        self._plan.check_layers(header)
        if self._producer and self._layers_sent != header.layer_count:
            raise RuntimeError("complete body with layers left unhashed")
        self._plan.check_replica_digest(self._producer, self._digests)
        body, starts, first = self._body, self._starts, header.first_layer
        layers = []
        for i, (k_len, _) in enumerate(header.lengths):
            k_end = starts[i] + k_len
            layers.append(Layer(first + i, body[starts[i] : k_end], body[k_end : starts[i + 1]]))
        return Container(**header_fields(header), layers=tuple(layers)), self._producer
