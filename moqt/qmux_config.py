"""Settings of a QMux connection and the transport parameters they become
(draft-ietf-quic-qmux-01 §5; RFC 9000 §18.2; RFC 9221 §3), and the identifiers MOQT over QMux
uses (draft-nandakumar-moq-qmux-moqt-00; the moq-dev ALPN convention).
"""

from __future__ import annotations

from dataclasses import dataclass

from .qmux_frames import DEFAULT_MAX_RECORD_SIZE, TransportParameters

ALPN_MOQT_16_QMUX = "qmux-01.moqt-16"  # TLS ALPN: QMux version + MOQT version (moq-dev)
APP_PROTOCOL_MOQT_16 = "moqt-16"


@dataclass(frozen=True, slots=True, kw_only=True)
class QMuxConfig:
    """What we allow the peer (our transport parameters) and how we agree on a protocol.

    Windows are in bytes, ``idle_timeout`` in seconds (0: none), ``max_record_size`` is the
    largest record we accept (§5.2), ``max_datagram_frame_size`` 0 refuses DATAGRAM.
    ``application_protocols`` () means the carrier agreed on the protocol (TLS ALPN).

    Raises:
        ValueError: a window or limit out of range.
    """

    max_data: int = 16 << 20
    max_stream_data: int = 4 << 20
    max_streams_bidi: int = 128
    max_streams_uni: int = 1024
    max_record_size: int = 1 << 20
    idle_timeout: float = 30.0
    max_datagram_frame_size: int = 65536
    application_protocols: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_record_size < DEFAULT_MAX_RECORD_SIZE:  # §5.2 MUST
            raise ValueError(f"max_record_size below the default {DEFAULT_MAX_RECORD_SIZE}")
        for name in ("max_data", "max_stream_data", "max_streams_bidi", "max_streams_uni"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.idle_timeout < 0 or self.max_datagram_frame_size < 0:
            raise ValueError("idle_timeout and max_datagram_frame_size must not be negative")


def transport_parameters(config: QMuxConfig) -> TransportParameters:
    """Our QX_TRANSPORT_PARAMETERS for ``config`` (qmux §5)."""
    window = config.max_stream_data
    return TransportParameters(
        max_idle_timeout=round(config.idle_timeout * 1000) or None,
        initial_max_data=config.max_data,
        initial_max_stream_data_bidi_local=window,
        initial_max_stream_data_bidi_remote=window,
        initial_max_stream_data_uni=window,
        initial_max_streams_bidi=config.max_streams_bidi,
        initial_max_streams_uni=config.max_streams_uni,
        max_datagram_frame_size=config.max_datagram_frame_size or None,
        max_record_size=config.max_record_size,
        application_protocols=config.application_protocols or None,
    )
