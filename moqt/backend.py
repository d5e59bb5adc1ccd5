"""The QUIC backend seam: qh3 or aioquic, chosen per process, and the measured default.

:func:`default_backend` is the fastest backend installed: qh3 (the ``quic-fast`` extra) before
aioquic, the order ``bench/bench_moqt.py`` measures (bench/NOTES.md). Every MOQT process and
client takes it unless told otherwise, and :class:`TransportConfig` defaults to
:data:`DEFAULT_DATAGRAM_SIZE` (1,452 bytes: a 1,500-byte Ethernet MTU less IPv4 and UDP
headers, RFC 9000 §14) with path-MTU probing where the backend does it (qh3, RFC 9000 §14.3).
:func:`transport_banner` is the line a service logs at start-up.

Both libraries share aioquic's shape (``QuicConfiguration``, a sans-I/O ``QuicConnection``, the
same event classes), so the MOQT session runs on either. What differs, and lives here:

* the event classes are distinct types per library (the session dispatches on this backend's);
* qh3 raises ``ValueError`` when a new stream would pass the peer's stream-count limit, and the
  failed send has already used the stream ID; aioquic queues the stream instead. Callers check
  :meth:`Backend.can_open_stream` before opening one and never retry a failed send;
* how many bytes a stream still holds for sending (aioquic: private sender state; qh3:
  ``get_send_buffer_size``);
* configuration knobs (aioquic has a congestion-control choice, qh3 probes the path MTU);
* qh3 2.1 does the Python work of packet logging for every datagram it sends even with no
  logger set; :meth:`Backend.quiet` takes it out of such a connection (every MOQT connection,
  and the raw-QUIC floor of ``bench/bench_moqt.py``, so both stand on the same QUIC);
* qh3's ``datagrams_to_send`` builds every datagram the connection may send before its
  protocol sends the first; :meth:`Backend.send_as_built` sends them in batches as they are
  built instead, so sender and receiver work at once (what may be built is still the
  connection's to decide: congestion window and pacer, RFC 9002 §7 and §7.7; the private
  attributes it and :mod:`moqt.transport` use are qh3 2.1's, the version the extra pins);
* a connection closed by its peer reports ``ConnectionTerminated`` only once it has drained
  (RFC 9000 §10.2.2), and qh3 refuses to send in the meantime; :meth:`Backend.closing_event`
  gives the event as soon as the closing starts, so the session can end at once;
* anti-amplification: aioquic pads a client Initial datagram to 1200 bytes with zeros *after*
  its Initial packet, and qh3's server counts only the bytes of packets it parses toward the 3x
  limit (RFC 9000 §8.1 asks for every byte of the datagram). A qh3 server then sees ~530 bytes,
  may send ~1.6 KB, pads its Initial to 1280 and cannot fit the Handshake packet in the rest; its
  packet builder raises "packet builder capacity exhausted" out of ``datagrams_to_send``, the
  datagrams built in that call are lost and the handshake limps on retransmissions.
  :func:`initial_padded_outside_packets` spots such a datagram so the server can validate the
  address with Retry first (no amplification limit after it).

The asyncio ``connect``/``serve`` of each library are reached from :mod:`moqt.asyncio`, the
shell, so that this module stays free of I/O imports (house rule 1).
"""

from __future__ import annotations

import importlib
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any, Protocol, cast

from .errors import NeedMoreData
from .wire import Reader

ALPN_MOQT_16 = "moqt-16"
DEFAULT_SOCKET_BUFFER = 4 << 20  # perf.md: the default 212 KiB UDP buffer drops datagrams
MAX_DATAGRAM_FRAME_SIZE = 65536  # d16 §3.1: QUIC DATAGRAM MUST be negotiated
BACKENDS = ("aioquic", "qh3")
PREFERENCE = ("qh3", "aioquic")  # fastest first (bench/bench_moqt.py; bench/NOTES.md)
DEFAULT_DATAGRAM_SIZE = 1452  # 1500-byte MTU - 20 (IPv4) - 8 (UDP) - 20 spare (RFC 9000 §14)
AIOQUIC_MAX_DATAGRAM = 16384  # aioquic writes STREAM/CRYPTO lengths as 2-byte varints (< 16384)
QUIC_V2 = 0x6B3343CF  # RFC 9369 renumbers the long packet types


class QuicConnectionLike(Protocol):
    """The part of ``QuicConnection`` the MOQT session uses (same in aioquic and qh3)."""

    def send_stream_data(self, stream_id: int, data: Any, end_stream: bool = False) -> None:
        """Queue stream data (bytes, bytearray or memoryview)."""

    def get_next_available_stream_id(self, is_unidirectional: bool = False) -> int:
        """The ID the next locally opened stream of that kind gets."""

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        """Abort sending on a stream (RESET_STREAM)."""

    def stop_stream(self, stream_id: int, error_code: int) -> None:
        """Ask the peer to stop sending on a stream (STOP_SENDING)."""

    def send_datagram_frame(self, data: bytes) -> None:
        """Queue a DATAGRAM frame."""

    def close(
        self, error_code: int = 0, frame_type: int | None = None, reason_phrase: str = ""
    ) -> None:
        """Close the connection with an application error code."""


class SessionBackend(Protocol):
    """What :class:`~moqt.session.MOQTSession` needs of its transport beside the connection:
    the event classes to dispatch on and a few library-specific answers. A QUIC
    :class:`Backend` (aioquic, qh3) and :data:`moqt.qmux.QMUX_BACKEND` both satisfy it."""

    @property
    def name(self) -> str:
        """The transport's name ("aioquic", "qh3", "qmux")."""

    @property
    def events(self) -> ModuleType:
        """The module of the connection's event classes (aioquic's names)."""

    def can_open_stream(self, quic: Any, *, unidirectional: bool) -> bool:
        """Whether a new local stream stays within the peer's stream-count limit."""

    def send_buffer_size(self, quic: Any, stream_id: int) -> int:
        """Bytes the stream still holds for sending."""

    def quiet(self, quic: Any) -> None:
        """Turn off per-packet work a connection does for an absent logger."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportConfig:
    """QUIC knobs shared by both backends; None keeps the library default.

    ``max_datagram_size`` defaults to :data:`DEFAULT_DATAGRAM_SIZE` (None: the library's own,
    1,200 bytes for aioquic). ``probe_path_mtu`` turns on path-MTU discovery where the backend
    does it (qh3; a client-side probe, RFC 9000 §14.3). ``socket_buffer`` is applied by
    :mod:`moqt.asyncio` as SO_RCVBUF/SO_SNDBUF on every QUIC socket. ``congestion_control`` is
    honoured where the backend offers a choice (aioquic).
    """

    max_datagram_size: int | None = DEFAULT_DATAGRAM_SIZE
    probe_path_mtu: bool = True
    max_data: int | None = None
    max_stream_data: int | None = None
    congestion_control: str | None = None
    idle_timeout: float | None = None
    socket_buffer: int = DEFAULT_SOCKET_BUFFER
    alpn_protocols: tuple[str, ...] = (ALPN_MOQT_16,)


@dataclass(frozen=True, slots=True)
class Backend:
    """One QUIC library: its configuration and connection classes and its event module."""

    name: str
    version: str
    QuicConfiguration: Any
    QuicConnection: Any
    events: ModuleType

    def configuration(
        self,
        *,
        is_client: bool,
        transport: TransportConfig | None = None,
        certificate: str | None = None,
        private_key: str | None = None,
        cafile: str | None = None,
        verify: bool = True,
        server_name: str | None = None,
    ) -> Any:
        """A ``QuicConfiguration`` for MOQT (ALPN ``moqt-16``, DATAGRAM enabled).

        ``certificate``/``private_key`` are PEM paths (a server needs them); ``cafile`` pins the
        peer's certificate; ``verify`` False disables certificate checks (tests only).

        Raises:
            ValueError: a server configuration without a certificate and key, or a datagram
                size the backend cannot use.
        """
        transport = transport or TransportConfig()
        size = transport.max_datagram_size
        if self.name == "aioquic" and size is not None and size > AIOQUIC_MAX_DATAGRAM:
            raise ValueError(f"aioquic corrupts frames above {AIOQUIC_MAX_DATAGRAM}-byte datagrams")
        config = self.QuicConfiguration(
            is_client=is_client,
            alpn_protocols=list(transport.alpn_protocols),
            max_datagram_frame_size=MAX_DATAGRAM_FRAME_SIZE,
        )
        for name in ("max_datagram_size", "max_data", "max_stream_data", "idle_timeout"):
            value = getattr(transport, name)
            if value is not None:
                setattr(config, name, value)
        if hasattr(config, "probe_datagram_size"):
            config.probe_datagram_size = transport.probe_path_mtu
        if transport.congestion_control is not None and hasattr(
            config, "congestion_control_algorithm"
        ):
            config.congestion_control_algorithm = transport.congestion_control
        if server_name is not None:
            config.server_name = server_name
        if certificate is not None:
            config.load_cert_chain(certificate, private_key)
        elif not is_client:
            raise ValueError("a server configuration needs a certificate and a private key")
        if cafile is not None:
            config.load_verify_locations(cafile=cafile)
        if not verify:
            config.verify_mode = ssl.CERT_NONE
        return config

    def probes_path_mtu(self, transport: TransportConfig) -> bool:
        """Whether this backend runs path-MTU discovery with ``transport`` (qh3 does)."""
        return transport.probe_path_mtu and self.name == "qh3"

    def can_open_stream(self, quic: Any, *, unidirectional: bool) -> bool:
        """Whether a new local stream stays within the peer's stream-count limit.

        aioquic queues a stream past the limit, so it always answers True there; qh3 raises
        instead, so its answer must be checked before the stream's first send.
        """
        if self.name != "qh3":
            return True
        limit = (
            quic.max_concurrent_uni_streams if unidirectional else quic.max_concurrent_bidi_streams
        )
        return bool(quic.get_next_available_stream_id(unidirectional) >> 2 < limit)

    def quiet(self, quic: Any) -> None:
        """Drop the per-datagram work of packet logging from a connection that has no QUIC
        logger. qh3 2.1 parses the QUIC header of every packet it sends (and notes every
        datagram) in Python on its way to a logger it then finds absent, a large share of a
        sending process's CPU (``py-spy`` on ``bench/bench_moqt.py``'s server). Nothing to do
        for aioquic, whose logging paths test for the logger first, nor where a logger is set.
        """
        if self.name != "qh3" or getattr(quic, "_quic_logger", True) is not None:
            return
        if hasattr(quic, "_log_packets") and hasattr(quic, "_log_datagram"):
            quic._log_packets = _no_log  # the instance attribute shadows the method
            quic._log_datagram = _no_log

    def send_as_built(
        self, quic: Any, now: float, send: Callable[[list[bytes], Any], None], batch: int
    ) -> bool:
        """Send the datagrams ``quic`` may send now by ``send(datagrams, addr)``, up to
        ``batch`` at a time, each batch as soon as it is built; False (nothing done) where
        the backend cannot (aioquic; a qh3 connection with a QUIC logger or not started).

        qh3's ``datagrams_to_send`` builds every datagram the connection may send (all of a
        large write when the congestion window allows) into one list before its protocol
        sends any: the peer idles while they are built, then the sender idles while the peer
        reads them. This polls the connection core one datagram at a time, as
        ``datagrams_to_send`` does (less its logging calls, which do nothing on a connection
        :meth:`quiet` made quiet), and sends every ``batch`` built. A core failure raises
        what ``datagrams_to_send`` raises (``QuicConnectionError``, INTERNAL_ERROR).
        """
        if self.name != "qh3" or getattr(quic, "_quic_logger", True) is not None:
            return False
        core = getattr(quic, "_core", None)
        if core is None:
            return False
        poll = core.poll_transmit
        ready: list[bytes] = []
        target: Any = None
        try:
            while (item := poll(now)) is not None:
                data, addr = item[0], item[1]
                if ready and (len(ready) >= batch or addr != target):
                    send(ready, target)
                    ready = []
                ready.append(data)
                target = addr
        except RuntimeError as exc:
            raise _qh3_error(exc) from exc
        if ready:
            send(ready, target)
        return True

    def closing_event(self, quic: Any) -> Any | None:
        """The ``ConnectionTerminated`` event ``quic`` will report, once it is closing or
        draining; None while it is open.

        Both libraries hold back that event until the closing or draining period has ended
        (three PTOs, RFC 9000 §10.2), though a peer's CONNECTION_CLOSE ends the connection at
        once for its application: nothing sent after it arrives will be delivered, and qh3
        refuses new stream data and resets ("connection is closed") from then on. Both keep
        it as ``_close_event`` (aioquic's name, which qh3 2.1 keeps) from the moment the
        connection starts closing, whoever closed it.
        """
        return getattr(quic, "_close_event", None)

    def send_buffer_size(self, quic: Any, stream_id: int) -> int:
        """Bytes the stream still holds in its send buffer (unsent, or unacknowledged)."""
        if self.name == "qh3":
            return int(quic.get_send_buffer_size(stream_id))
        stream = quic._streams.get(stream_id)
        if stream is None:
            return 0
        sender = stream.sender
        return int(sender._buffer_stop - sender._buffer_start)


def _no_log(event: str, data: bytes) -> None:
    """What packet logging does without a logger."""


def _qh3_error(exc: RuntimeError) -> Exception:
    """The error qh3's ``QuicConnection`` raises for a failure of its connection core."""
    connection = importlib.import_module("qh3.quic.connection")
    code = importlib.import_module("qh3.quic.packet").QuicErrorCode.INTERNAL_ERROR
    return cast(Exception, connection.QuicConnectionError(code, None, str(exc)))


def _load(name: str) -> Backend:
    package = importlib.import_module(name)
    configuration = importlib.import_module(f"{name}.quic.configuration")
    connection = importlib.import_module(f"{name}.quic.connection")
    events = importlib.import_module(f"{name}.quic.events")
    return Backend(
        name=name,
        version=str(getattr(package, "__version__", "unknown")),
        QuicConfiguration=configuration.QuicConfiguration,
        QuicConnection=connection.QuicConnection,
        events=events,
    )


def get_backend(name: str | None = None) -> Backend:
    """The backend called ``name`` ("aioquic" or "qh3"; None: :func:`default_backend`),
    loaded once per process.

    Raises:
        ValueError: an unknown name.
        ImportError: the library is not installed (qh3 is an optional extra).
    """
    return _named_backend(default_backend() if name is None else name)


@cache
def _named_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown QUIC backend {name!r}; expected one of {BACKENDS}")
    return _load(name)


def available_backends() -> list[str]:
    """The backends importable in this environment, default (fastest) first."""
    found = []
    for name in PREFERENCE:
        try:
            _named_backend(name)
        except ImportError:
            continue
        found.append(name)
    return found


def backend_of(configuration: Any) -> str:
    """The name of the backend whose ``QuicConfiguration`` ``configuration`` is (the default
    backend when it is neither's): what ``connect``/``serve`` run on when not told."""
    module = type(configuration).__module__.split(".", 1)[0]
    return module if module in BACKENDS else default_backend()


@cache
def default_backend() -> str:
    """The QUIC backend a process uses unless told otherwise: the fastest one installed (qh3,
    else aioquic; bench/NOTES.md has the measurement)."""
    return available_backends()[0]


def describe_transport(transport: TransportConfig | None = None, backend: str | None = None) -> str:
    """The datagram settings of ``transport`` (default :class:`TransportConfig`) on ``backend``
    (default :func:`default_backend`), for start-up logs: "1452-byte datagrams, path-MTU
    probing"."""
    transport = transport or TransportConfig()
    quic = get_backend(backend)
    size = transport.max_datagram_size
    text = "library-default datagrams" if size is None else f"{size}-byte datagrams"
    return text + (", path-MTU probing" if quic.probes_path_mtu(transport) else "")


def transport_banner(backend: str | None = None, transport: TransportConfig | None = None) -> str:
    """What a service logs at start-up about its QUIC: "qh3 2.1.0, 1452-byte datagrams,
    path-MTU probing"."""
    quic = get_backend(backend)
    return f"{quic.name} {quic.version}, {describe_transport(transport, quic.name)}"


def initial_padded_outside_packets(datagram: bytes) -> bool:
    """True for a datagram that opens with a long-header Initial packet and ends in bytes that
    belong to no packet: padding a server may not count toward its anti-amplification limit.
    """
    view = memoryview(datagram)
    if not view or not view[0] & 0x80 or _long_packet_type(view) != "initial":
        return False
    pos = 0
    while pos < len(view):
        end = _long_packet_end(view[pos:])
        if end is None:
            return True
        pos += end
    return False


def _long_packet_type(view: memoryview) -> str | None:
    """The long-header packet type at ``view[0]`` (RFC 9000 §17.2, RFC 9369 §3.2)."""
    if len(view) < 5:
        return None
    version = int.from_bytes(view[1:5], "big")
    if version == 0:
        return None  # Version Negotiation
    bits = (view[0] >> 4) & 3
    if version == QUIC_V2:
        bits = (bits - 1) & 3  # v2: Retry 0, Initial 1, 0-RTT 2, Handshake 3
    return ("initial", "0rtt", "handshake", "retry")[bits]


def _long_packet_end(view: memoryview) -> int | None:
    """Where the long-header packet at ``view[0]`` ends, or None if no whole packet starts
    there."""
    if not view[0] & 0x80:
        return None
    kind = _long_packet_type(view)
    if kind is None or kind == "retry":
        return None
    reader = Reader(view[5:])
    try:
        for _ in range(2):  # Destination and Source Connection IDs
            reader.read_bytes(reader.read_uint8())
        if kind == "initial":
            reader.read_bytes(reader.read_varint())  # Token
        length = reader.read_varint()
    except NeedMoreData:
        return None
    end = 5 + reader.position + length
    return end if end <= len(view) else None
