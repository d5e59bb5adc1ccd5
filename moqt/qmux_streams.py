"""Per-stream state of a QMux connection and the builder of outgoing records.

Split out of :mod:`moqt.qmux` to keep that module about the protocol. :class:`QMuxStream` holds
one QUIC stream's send queue (the caller's buffers, never joined) and both sides' offsets and
limits (RFC 9000 §3, §4). :class:`RecordBuilder` packs frames into QMux records of at most the
peer's ``max_record_size`` (draft-ietf-quic-qmux-01 §3.2, §5.2) as a list of buffers for
writev: small frames and headers are gathered into one buffer, large payloads stay slices.
"""

from __future__ import annotations

from collections import deque

from .wire import Bytes, encode_varint

COPY_BELOW = 4096  # payload pieces smaller than this are copied next to their frame header


class QMuxStream:
    """One stream's state; ``local`` when we opened it, ``uni`` 1 for a unidirectional one."""

    __slots__ = (
        "stream_id",
        "local",
        "uni",
        "recv_offset",
        "recv_max",
        "recv_final",
        "recv_done",
        "stop_sent",
        "send_queue",
        "send_queued",
        "send_offset",
        "send_max",
        "fin_requested",
        "send_done",
        "reset_sent",
        "blocked_at",
    )

    def __init__(self, stream_id: int, *, local: bool) -> None:
        self.stream_id = stream_id
        self.local = local
        self.uni = stream_id >> 1 & 1
        self.recv_offset = 0  # bytes received (all delivered: QMux is in order)
        self.recv_max = 0  # our MAX_STREAM_DATA
        self.recv_final: int | None = None
        self.recv_done = False  # FIN delivered or RESET_STREAM received
        self.stop_sent = False
        self.send_queue: deque[Bytes] = deque()
        self.send_queued = 0  # bytes queued, not yet framed
        self.send_offset = 0  # bytes framed
        self.send_max = 0  # the peer's MAX_STREAM_DATA
        self.fin_requested = False
        self.send_done = False  # FIN framed or RESET_STREAM queued
        self.reset_sent = False
        self.blocked_at = -1  # the limit a STREAM_DATA_BLOCKED was sent for

    def push(self, data: Bytes) -> None:
        """Queue ``data`` (kept by reference)."""
        self.send_queue.append(data)
        self.send_queued += len(data)

    def pop(self, length: int) -> list[Bytes]:
        """Take ``length`` queued bytes as buffers (slices where a buffer is split)."""
        out: list[Bytes] = []
        queue = self.send_queue
        left = length
        while left:
            head = queue[0]
            size = len(head)
            if size <= left:
                out.append(queue.popleft())
                left -= size
            else:
                view = head if type(head) is memoryview else memoryview(head)
                out.append(view[:left])
                queue[0] = view[left:]
                left = 0
        self.send_queued -= length
        return out

    def clear(self) -> None:
        """Drop what is queued (the stream was reset)."""
        self.send_queue.clear()
        self.send_queued = 0


class RecordBuilder:
    """Frames into records of at most ``max_size`` bytes of Frames, as a list of buffers."""

    __slots__ = ("max_size", "size", "_small", "_parts", "_out")

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self.size = 0  # Frames bytes in the current record
        self._small = bytearray()  # gathered since the last large payload slice
        self._parts: list[Bytes] = []
        self._out: list[Bytes] = []

    @staticmethod
    def single(frame: bytes) -> list[Bytes]:
        """One record holding one small frame."""
        return [encode_varint(len(frame)) + frame]

    def room(self) -> int:
        """Bytes the current record can still take."""
        return self.max_size - self.size

    def add(self, frame: bytes) -> None:
        """A small, whole frame."""
        if len(frame) > self.room():
            self.flush()
        self._small += frame
        self.size += len(frame)

    def add_stream(self, header: bytes, payload: list[Bytes]) -> None:
        """A STREAM frame: ``header`` then ``payload`` (the caller checked :meth:`room`)."""
        small = self._small
        small += header
        size = len(header)
        for piece in payload:
            length = len(piece)
            size += length
            if length < COPY_BELOW:
                small += piece
            else:
                if small:
                    self._parts.append(bytes(small))
                    small.clear()
                self._parts.append(piece)
        self.size += size

    def flush(self) -> None:
        """Close the current record."""
        if not self.size:
            return
        parts = self._parts
        if self._small:
            parts.append(bytes(self._small))
            self._small.clear()
        self._out.append(encode_varint(self.size) + parts[0])
        self._out.extend(parts[1:])
        self._parts = []
        self.size = 0

    def finish(self) -> list[Bytes]:
        """Every record built, in order."""
        self.flush()
        out, self._out = self._out, []
        return out
