"""Incremental parsing of QMux records from a byte stream (draft-ietf-quic-qmux-01 §3.2).

:class:`RecordReader` takes the carrier's bytes in any chunking and returns what became
complete: frames of :mod:`moqt.qmux_frames`, :class:`StreamPiece` slices of STREAM payload
handed out as they arrive (QMux delivers stream data in order, §4.1, so nothing is
reassembled and nothing is copied), and :data:`RECORD_END` after each record (the idle timer
restarts on it, §6.1). Only a record Size, a frame header or a non-STREAM frame that straddles
two chunks is copied, bounded by the record size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from .errors import NeedMoreData
from .qmux_frames import (
    Frame,
    FrameType,
    QMuxError,
    decode_other_frame,
    frame_encoding_error,
    read_stream_header,
)
from .wire import Bytes, Reader, as_byte_view


@dataclass(frozen=True, slots=True)
class StreamPiece:
    """Part (or all) of a received STREAM frame: ``data`` starts at stream ``offset``;
    ``frame_end`` is where the whole frame ends, ``fin`` is set on its last piece only."""

    stream_id: int
    offset: int
    data: memoryview
    fin: bool
    frame_end: int


class RecordEnd:
    """Marker the reader yields when a record has been received completely (§6.1)."""


RECORD_END = RecordEnd()


Received: TypeAlias = Frame | StreamPiece | RecordEnd
_HEADER_PROBE = 64  # bytes of the next chunk tried first when a frame header straddles chunks


class RecordReader:
    """Parses QMux records from a byte stream fed in arbitrary chunks (§3.2).

    :meth:`feed` returns what became complete: frames, :class:`StreamPiece` slices (zero copy
    out of the fed buffers) and :data:`RECORD_END` after each record. A record whose Size is
    above ``max_record_size`` (what we advertised) or zero is FRAME_ENCODING_ERROR (§5.2,
    §3.2), as is a frame that runs past its record. Once it found an error, the reader is
    unusable.
    """

    def __init__(self, max_record_size: int) -> None:
        self.max_record_size = max_record_size
        self._pending = b""  # the start of a record Size or of a frame, copied
        self._record_left = 0  # bytes of the current record not yet parsed; 0: between records
        self._stream: tuple[int, int, int, bool] | None = None  # id, next offset, end, fin
        self._stream_left = 0

    @property
    def buffered(self) -> int:
        """Bytes held back waiting for the rest of a frame or record Size."""
        return len(self._pending)

    def feed(self, data: Bytes) -> list[Received]:
        """Parse ``data``; return what it completed (see the class docstring).

        Raises:
            QMuxError: FRAME_ENCODING_ERROR (or TRANSPORT_PARAMETER_ERROR inside
                QX_TRANSPORT_PARAMETERS) for malformed input; what ``data`` completed before
                it is dropped (:meth:`feed_until_error` keeps it).
        """
        out, error = self.feed_until_error(data)
        if error is not None:
            raise error
        return out

    def feed_until_error(self, data: Bytes) -> tuple[list[Received], QMuxError | None]:
        """Parse ``data``; return what it completed up to the first malformed part, and that
        part's error (None if there is none). A receiver acts on what came before the error
        first, as it would have had the carrier delivered those bytes in an earlier chunk, so
        how a connection ends does not depend on how its bytes were cut."""
        out: list[Received] = []
        try:
            self._parse(as_byte_view(data), out)
        except QMuxError as exc:
            return out, exc
        return out, None

    def _parse(self, view: memoryview, out: list[Received]) -> None:
        pos, end = 0, len(view)
        if self._pending:
            pos = self._resume(view, out)
        while pos < end:
            if self._stream_left:
                pos = self._stream_payload(view, pos, out)
            elif self._record_left:
                pos = self._frame(view, pos, end, out)
            else:
                pos = self._record_size(view, pos, end)

    def _resume(self, view: memoryview, out: list[Received]) -> int:
        """Complete the straddling record Size or frame with the start of ``view``; returns
        how much of ``view`` that used."""
        pending = self._pending
        limit = self._record_left - len(pending) if self._record_left else 8 - len(pending)
        take = min(len(view), limit)
        joined = memoryview(pending)
        for size in (min(take, _HEADER_PROBE), take):
            joined = memoryview(pending + bytes(view[:size]))
            self._pending = b""
            if self._record_left:
                used = self._frame(joined, 0, len(joined), out)
            else:
                used = self._record_size(joined, 0, len(joined))
            if not self._pending:
                return used - len(pending)
        self._pending = bytes(joined)
        return take

    def _record_size(self, view: memoryview, pos: int, end: int) -> int:
        reader = Reader.at(view, pos)
        try:
            size = reader.read_varint()
        except NeedMoreData:
            self._pending = bytes(view[pos:end])
            return end
        if size > self.max_record_size:  # §5.2 MUST
            raise frame_encoding_error(f"record of {size} bytes above max_record_size")
        if size == 0:  # §3.2: one or more frames
            raise frame_encoding_error("empty record")
        self._record_left = size
        return reader.position

    def _frame(self, view: memoryview, pos: int, end: int, out: list[Received]) -> int:
        record_end = pos + self._record_left
        stop = min(end, record_end)
        reader = Reader.at(view[:stop], pos)
        try:
            kind = reader.read_varint()
            if FrameType.STREAM <= kind <= 0x0F:
                self._stream_header(reader, kind, record_end, out)
                used = reader.position
            else:
                frame, used = _decode_other_partial(kind, reader, view, pos, stop, record_end)
                out.append(frame)
        except NeedMoreData:
            if stop == record_end:  # §3.2 MUST: a truncated last frame
                raise frame_encoding_error("truncated frame at the end of a record") from None
            self._pending = bytes(view[pos:stop])
            return stop
        self._record_left -= used - pos
        if not self._record_left and not self._stream_left:
            out.append(RECORD_END)
        return used

    def _stream_header(
        self, reader: Reader, kind: int, record_end: int, out: list[Received]
    ) -> None:
        stream_id, offset, length, fin = read_stream_header(reader, kind)
        left = record_end - reader.position
        if length < 0:  # no Length: the frame runs to the end of the record
            length = left
        elif length > left:  # §3.2: a frame never spans records
            raise frame_encoding_error("STREAM frame runs past its record", kind)
        if length:
            self._stream = (stream_id, offset, offset + length, fin)
            self._stream_left = length
        else:
            out.append(StreamPiece(stream_id, offset, memoryview(b""), fin, offset))

    def _stream_payload(self, view: memoryview, pos: int, out: list[Received]) -> int:
        stream = self._stream
        if stream is None:
            raise RuntimeError("no STREAM frame in progress")
        stream_id, offset, frame_end, fin = stream
        take = min(self._stream_left, len(view) - pos)
        self._stream_left -= take
        self._record_left -= take
        done = not self._stream_left
        out.append(StreamPiece(stream_id, offset, view[pos : pos + take], fin and done, frame_end))
        if done:
            self._stream = None
            if not self._record_left:
                out.append(RECORD_END)
        else:
            self._stream = (stream_id, offset + take, frame_end, fin)
        return pos + take


def _decode_other_partial(
    kind: int, reader: Reader, view: memoryview, pos: int, stop: int, record_end: int
) -> tuple[Frame, int]:
    """A non-STREAM frame; frames without a Length need their whole record."""
    if kind == FrameType.DATAGRAM and stop < record_end:
        raise NeedMoreData
    if kind == FrameType.PADDING and stop < record_end:
        scan = reader.position
        while scan < stop and view[scan] == 0:
            scan += 1
        if scan == stop:  # the padding may go on in the next chunk
            raise NeedMoreData
    return decode_other_frame(kind, reader, view, pos, stop)
