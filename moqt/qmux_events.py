"""The events a :class:`~moqt.qmux.QMuxConnection` emits, shaped like aioquic's.

Same class names and field names as ``aioquic.quic.events``, so :class:`~moqt.session.MOQTSession`
dispatches on this module exactly as on a QUIC library's (it is
``moqt.qmux.QMUX_BACKEND.events``). Only the events QMux can produce exist here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .wire import Bytes


class QuicEvent:
    """Base class of the QMux connection's events."""


@dataclass(slots=True)
class HandshakeCompleted(QuicEvent):
    """The peer's transport parameters arrived and the application protocol is agreed."""

    alpn_protocol: str | None
    early_data_accepted: bool = False
    session_resumed: bool = False


@dataclass(slots=True)
class StreamDataReceived(QuicEvent):
    """Stream data, in order; ``data`` may be a memoryview slice of the received bytes."""

    data: Bytes
    end_stream: bool
    stream_id: int


@dataclass(slots=True)
class StreamReset(QuicEvent):
    """The peer reset its sending side of a stream (RESET_STREAM)."""

    error_code: int
    stream_id: int


@dataclass(slots=True)
class StopSendingReceived(QuicEvent):
    """The peer asked us to stop sending on a stream (STOP_SENDING); we reset it."""

    error_code: int
    stream_id: int


@dataclass(slots=True)
class DatagramFrameReceived(QuicEvent):
    """A DATAGRAM frame's payload."""

    data: bytes


@dataclass(slots=True)
class PingAcknowledged(QuicEvent):
    """The peer answered our QX_PING with sequence number ``uid``."""

    uid: int


@dataclass(slots=True)
class ConnectionTerminated(QuicEvent):
    """The connection is closed: by the peer's CONNECTION_CLOSE, by us (an error we found or
    :meth:`~moqt.qmux.QMuxConnection.close`), by the idle timeout or by the carrier's end."""

    error_code: int
    frame_type: int | None
    reason_phrase: str
