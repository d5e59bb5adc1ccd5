"""TLS 1.3 for QMux on our own record pump (draft-ietf-quic-qmux-01 §3.1, RFC 8446 §5).

A plain socket transport carries the ciphertext; an :class:`ssl.SSLObject` over two
:class:`ssl.MemoryBIO` s does the handshake and the records, owned by one "worker" (a SSL
object is not safe to share between threads), in one of two places:

* ``threaded``: a worker thread per connection, so the records overlap with the loop that
  parses QMux frames, runs the MOQT session and hashes what arrives (§6.7);
* inline: the same steps run on the event loop, one pass after the socket read that fed them.

Once the handshake is done, an inline connection hands its records to
:class:`moqt._tlsrecords.Records` (RFC 8446 §5, as kernel TLS does after a user-space
handshake): each socket read is decrypted straight into the receive buffers as it is taken,
and each write is encrypted from the caller's buffers into the bytes sent before
:meth:`~TLSWorkerTransport.writelines` returns (no copy, nothing through the BIOs). It needs
the traffic secrets, which :func:`_capture` has OpenSSL's key log callback keep, and a server
context that sends no session tickets (:func:`~moqt.qmux_asyncio.server_ssl_context`); where
it refuses (keys logged to a file, not TLS 1.3, the module not built) and on the thread engine
the SSL object keeps the records: decryption then goes through ``_tlsrecords.read``, one C call
that feeds a socket read to the incoming BIO and reads every record it completes with the GIL
released (``SSLObject.read`` yields one record per call and takes the GIL back after each),
and ``SSLObject.read`` where even that refuses. The exchange between the loop and a worker
thread is in whole chunks:

* in: each socket read (up to :data:`READ_CHUNK`) goes to the worker, which feeds the incoming
  BIO and reads plaintext into :class:`~moqt.receive_buffers.ReceiveBuffers` of its own, handing
  the loop read-only slices of at most :data:`PLAIN_CHUNK` (so the loop starts on a large read
  before all of it is decrypted); the socket stops being read while :data:`READ_QUEUE` reads
  wait for the worker;
* out: :meth:`TLSWorkerTransport.writelines` hands the worker the buffers (copied unless they
  are immutable ``bytes``: asyncio's contract lets a caller reuse a buffer once the write call
  returns), the worker encrypts them in order and the loop writes the ciphertext to the
  socket. The protocol is paused while what waits for the worker and the socket together is
  above the high-water mark, as asyncio's transports do.

What the protocol sees matches asyncio's TLS transport: ``connection_made`` once the handshake
is done; ``eof_received`` on the peer's close_notify or on TCP EOF after the handshake, after
which the transport closes; ``connection_lost(exc)`` with the :class:`ssl.SSLError` of a record
that cannot be decrypted; a handshake failure (certificate verification, no common version)
raises from :func:`open_tls_connection` as the same exception, and a connection closed during
the handshake as :class:`ConnectionResetError`. :meth:`~TLSWorkerTransport.close` sends
close_notify after what was written, then FIN, and reads on (discarding) until the peer's FIN or
close_notify, at most :data:`LINGER` seconds: RFC 8446 §6.1 does not require waiting for the
peer's close_notify, but a socket closed with unread bytes queued is reset, and the peer then
loses what it had not yet read. Protocols get plaintext through ``data_received`` (a
:class:`asyncio.BufferedProtocol` must accept it there too, as
:class:`~moqt.qmux_asyncio.QMuxProtocol` does). The worker ends when the socket is lost.
:data:`~moqt.qmux_asyncio.DEFAULT_TLS_ENGINE` says which one QMux uses.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import ssl
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

__all__ = [
    "PLAIN_CHUNK",
    "READ_CHUNK",
    "READ_QUEUE",
    "TLSWorkerTransport",
    "open_tls_connection",
    "serve_tls",
]

try:
    from . import _tlsrecords
except ImportError:  # not built: SSLObject.read, one record a call
    _tlsrecords = None  # type: ignore[assignment]

log = logging.getLogger(__name__)
READ_CHUNK = 1 << 20  # bytes one socket read may take
READ_QUEUE = 8  # socket reads waiting for the worker above which the socket is not read
PLAIN_CHUNK = 256 << 10  # plaintext the worker hands over at once (less when it runs out)
RECORD_ROOM = (1 << 14) + 256  # room that holds any record's plaintext (RFC 8446 §5.2)
WIRE_CHUNK = 256 << 10  # ciphertext the worker hands over at once while encrypting
CIPHER_SUITES = "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256"
"""The TLS 1.3 suites in our order of preference (among those a context enables)."""
HANDSHAKE_TIMEOUT = 60.0  # seconds, asyncio's default for a TLS client handshake
LINGER = 5.0  # seconds a closed connection reads on after its close_notify and FIN
DEFAULT_HIGH_WATER = 64 << 10  # asyncio's default write limits
_POOL_MAX = READ_QUEUE + 2  # spare socket read buffers kept


class PlainBuffers(Protocol):
    """Where the worker reads plaintext: :class:`~moqt.receive_buffers.ReceiveBuffers`."""

    def get_buffer(self, sizehint: int = -1) -> memoryview: ...

    def filled(self, nbytes: int) -> memoryview: ...


@dataclass(slots=True)
class _Report:
    """What one step of the worker produced, for the loop (in order)."""

    reads: int = 0  # socket reads taken
    handshake: dict[str, Any] | None = None  # the session's parameters, once agreed
    wire: list[bytes] = field(default_factory=list)  # ciphertext to send
    written: int = 0  # plaintext bytes encrypted
    plain: list[memoryview] = field(default_factory=list)
    eof: str | None = None  # "close_notify" or "tcp": the peer ended
    error: BaseException | None = None
    shutdown: bool = False  # our close_notify is in wire: close the socket after it

    def __bool__(self) -> bool:
        return bool(
            self.reads
            or self.handshake is not None
            or self.wire
            or self.written
            or self.plain
            or self.eof
            or self.error
            or self.shutdown
        )


_DATA, _EOF, _WRITE, _CLOSE, _STOP = range(5)
_NO_DATA = b""
_NO_ROOM = bytearray()  # a read into nothing: _tlsrecords only feeds the BIO


def _capture(sslobj: ssl.SSLObject) -> bool:
    """Whether :mod:`moqt._tlsrecords` keeps ``sslobj``'s traffic secrets, so that
    :class:`_tlsrecords.Records` can take the records over after the handshake; it also puts
    AES-128-GCM first among the suites the context allows (the suite every TLS 1.3 peer has,
    RFC 8446 §9.1, and the cheapest to run here)."""
    if _tlsrecords is None or not hasattr(_tlsrecords, "Records"):
        return False
    raw = sslobj._sslobj  # type: ignore[attr-defined]
    if not _tlsrecords.capture(raw):
        return False
    suites = _preferred_suites(sslobj.context)
    if suites:
        _tlsrecords.ciphersuites(raw, suites)
    return True


_SUITES: weakref.WeakKeyDictionary[ssl.SSLContext, str] = weakref.WeakKeyDictionary()


def _preferred_suites(context: ssl.SSLContext) -> str:
    """The TLS 1.3 suites ``context`` enables (what OpenSSL's configuration and the system's
    policy allow, nothing more), in :data:`CIPHER_SUITES` order, then any others it enables."""
    suites = _SUITES.get(context)
    if suites is None:
        enabled = [c["name"] for c in context.get_ciphers() if c.get("protocol") == "TLSv1.3"]
        first = [name for name in CIPHER_SUITES.split(":") if name in enabled]
        suites = _SUITES[context] = ":".join(first + [n for n in enabled if n not in first])
    return suites


class _Worker:
    """The thread that owns the SSL object: every SSLObject call happens here."""

    def __init__(
        self,
        sslobj: ssl.SSLObject,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        plain: PlainBuffers,
        pool: collections.deque[bytearray],
        post: Callable[[_Report], None],
        name: str,
        schedule: Callable[[Callable[[], None]], Any] | None = None,
        *,
        server_side: bool = False,
    ) -> None:
        self._ssl = sslobj
        self._in = incoming
        self._out = outgoing
        self._plain = plain
        self._pool = pool
        self._post = post
        self.jobs: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._handshaken = False
        self._failed = False
        self._peer_closed = False
        self._tcp_eof = False
        self._eof_told = False
        self._records: Any = None  # the _ssl object, once _tlsrecords reads it in bulk
        self._server_side = server_side
        self._sealed: Any = None  # the _tlsrecords.Records that took the records over
        self._captured = schedule is not None and _capture(sslobj)  # its secrets, for that
        self._running = False  # a step is under way (inline): a job now waits its turn
        self._schedule = schedule
        self._inline: collections.deque[tuple[Any, ...]] = collections.deque()
        self._scheduled = self._stopped = False
        self.thread = (
            threading.Thread(target=self._run, name=name, daemon=True) if schedule is None else None
        )

    def start(self) -> None:
        """Begin: the thread, or (inline) a first step on the loop (a client's ClientHello)."""
        if self.thread is not None:
            self.thread.start()
        else:
            self._kick()

    def submit(self, job: tuple[Any, ...]) -> None:
        """Queue ``job`` for the thread, or (inline) for the loop's next pass; with the records
        taken over (:meth:`direct`) run it now instead when nothing waits before it."""
        if self.thread is not None:
            self.jobs.put(job)
        elif self.direct():
            self._run_now([job])
        else:
            self._inline.append(job)
            self._kick()

    def direct(self) -> bool:
        """Whether a job submitted now runs at once: inline, with the records sealed and opened
        by :class:`_tlsrecords.Records` (no copy through the BIOs, nothing left for a later
        pass), and no job queued or running before it."""
        return (
            self._sealed is not None
            and self.thread is None
            and not self._inline
            and not self._running
            and not self._scheduled
            and not self._stopped
        )

    def _kick(self) -> None:
        if not self._scheduled and not self._stopped and self._schedule is not None:
            self._scheduled = True
            self._schedule(self._run_inline)

    def _run_inline(self) -> None:
        """(inline) Run what was queued, and what its reports queue, on the loop thread."""
        jobs = self._inline
        try:
            while not self._stopped:
                batch = list(jobs)
                jobs.clear()
                self._run_now(batch)
                if not jobs:
                    break
        finally:
            self._scheduled = False

    def _run_now(self, batch: list[tuple[Any, ...]]) -> None:
        """(inline) One step on the loop thread; a job submitted meanwhile (by the protocol,
        from what the step delivered) is queued for the next."""
        self._running = True
        try:
            if self._step(batch):
                self._stopped = True
                self._inline.clear()
                del self._ssl, self._plain
                self._sealed = None
        except Exception as exc:  # a failure of ours: the connection fails with it
            log.exception("TLS records failed")
            self._stopped = True
            self._post(_Report(error=exc))
        finally:
            self._running = False
        if self._inline and not self._stopped:
            self._kick()

    def _run(self) -> None:
        try:
            if self._step(()):
                return
            while True:
                jobs = [self.jobs.get()]
                with contextlib.suppress(queue.Empty):
                    while len(jobs) < 64:
                        jobs.append(self.jobs.get_nowait())
                if self._step(jobs):
                    return
        except RuntimeError:  # the loop closed under a connection never closed: nothing to tell
            log.debug("TLS worker stopped: its event loop is closed")
        except Exception as exc:  # a failure of ours: the connection fails with it, not hangs
            log.exception("TLS worker failed")
            with contextlib.suppress(RuntimeError):
                self._post(_Report(error=exc))
        finally:
            del self._ssl, self._plain

    def _step(self, jobs: Iterable[tuple[Any, ...]]) -> bool:
        """Run ``jobs``, then the handshake or the reads they allow; True: stop."""
        report = _Report()
        for job in jobs:
            if job[0] == _STOP:
                return True
            report = self._take(job, report)
        if not self._failed:
            report = self._receive(report)
        self._drain(report)
        if report:
            self._post(report)
        return False

    def _take(self, job: tuple[Any, ...], report: _Report) -> _Report:
        """Run one job from the loop; the report to go on with."""
        kind = job[0]
        if kind == _DATA:
            buffer, nbytes = job[1], job[2]
            if not self._failed:
                with memoryview(buffer) as view:
                    if self._sealed is not None:
                        if not self._peer_closed:
                            report = self._open(view[:nbytes], report)
                    elif self._records is not None:  # the copy into the BIO off the GIL
                        _tlsrecords.read(self._records, self._in, view[:nbytes], _NO_ROOM)
                    else:
                        self._in.write(view[:nbytes])
            if len(self._pool) < _POOL_MAX:
                self._pool.append(buffer)
            report.reads += 1
        elif kind == _WRITE:
            if not self._failed:
                self._encrypt(job[1], report)
            report.written += job[2]
            self._post(report)  # each batch goes out while the next is encrypted
            report = _Report()
        elif kind == _EOF:
            self._tcp_eof = True
        elif kind == _CLOSE and not self._failed:
            self._shutdown(report)
        return report

    def _receive(self, report: _Report) -> _Report:
        """The handshake, or the plaintext, and the end the incoming bytes allow."""
        if not self._handshaken:
            self._handshake(report)
        taken_over = self._sealed is not None  # then each socket read is opened as taken
        if self._handshaken and not self._failed and not self._peer_closed and not taken_over:
            report = self._decrypt(report)
        if self._tcp_eof and not self._eof_told and not self._failed:
            self._eof_told = True
            if not self._handshaken:
                closed = ConnectionResetError("the peer closed during the TLS handshake")
                self._fail(report, closed)
            elif not self._peer_closed:
                report.eof = "tcp"
        return report

    def _fail(self, report: _Report, error: BaseException) -> None:
        self._failed = True
        report.error = error

    def _drain(self, report: _Report) -> None:
        if self._out.pending:
            report.wire.append(self._out.read())

    def _handshake(self, report: _Report) -> None:
        sslobj = self._ssl
        try:
            sslobj.do_handshake()
        except ssl.SSLWantReadError:
            return
        except Exception as exc:  # ssl.SSLError, certificate verification included
            self._fail(report, exc)
            return
        self._handshaken = True
        raw = sslobj._sslobj  # type: ignore[attr-defined]
        report.handshake = {
            "peercert": sslobj.getpeercert(),
            "cipher": sslobj.cipher(),
            "compression": sslobj.compression(),
            "alpn_protocol": sslobj.selected_alpn_protocol(),
            "tls_version": sslobj.version(),
        }
        if self._captured:
            try:
                self._sealed = _tlsrecords.Records(raw, self._server_side)
            except ValueError as exc:  # the records stay with OpenSSL
                log.debug("%s", exc)
            else:
                self._drain(report)  # the handshake's last flight
                if self._in.pending:  # records that came with it are ours now
                    self._open(self._in.read(), report)
                return
        if _tlsrecords is not None and _tlsrecords.bind(raw, self._in, sslobj.version() or ""):
            self._records = raw

    def _decrypt(self, report: _Report) -> _Report:
        """Read what the incoming BIO holds, posting every PLAIN_CHUNK; the report to go on
        with."""
        if self._records is not None:
            return self._decrypt_bulk(report)
        sslobj, buffers, post = self._ssl, self._plain, self._post
        view = buffers.get_buffer()
        got = 0
        while True:
            try:
                count = cast(int, sslobj.read(len(view) - got, view[got:]))
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                count = 0
            except Exception as exc:  # a record that does not decrypt, an alert
                self._fail(report, exc)
                break
            if count == 0:  # close_notify
                self._peer_closed = self._eof_told = True
                report.eof = "close_notify"
                break
            got += count
            if got >= PLAIN_CHUNK or got == len(view):
                report.plain.append(buffers.filled(got))
                self._drain(report)  # a KeyUpdate answer, if any
                post(report)
                report = _Report()
                view = buffers.get_buffer()
                got = 0
        if got:
            report.plain.append(buffers.filled(got))
        return report

    def _decrypt_bulk(self, report: _Report) -> _Report:
        """:meth:`_decrypt` with :mod:`moqt._tlsrecords`: each call fills a plaintext buffer
        with every record the BIO completes, the GIL released throughout."""
        records, incoming, buffers, post = self._records, self._in, self._plain, self._post
        while True:
            view = buffers.get_buffer()[:PLAIN_CHUNK]
            try:
                count, status = _tlsrecords.read(records, incoming, _NO_DATA, view)
            except Exception as exc:  # a record that does not decrypt, an alert
                self._fail(report, exc)
                return report
            if self._landed(report, count, status):
                return report
            self._drain(report)  # the buffer is full: hand it over, a KeyUpdate answer too
            post(report)
            report = _Report()

    def _landed(self, report: _Report, count: int, status: int) -> bool:
        """Hand over the ``count`` octets of plaintext the buffers just took; True when the
        ciphertext is all read (``status`` NEED) or the peer's close_notify came (CLOSED)."""
        if count:
            report.plain.append(self._plain.filled(count))
        if status == _tlsrecords.CLOSED:
            self._peer_closed = self._eof_told = True
            report.eof = "close_notify"
            return True
        return status == _tlsrecords.NEED

    def _open(self, data: Any, report: _Report) -> _Report:
        """Decrypt ``data`` (ciphertext) with :attr:`_sealed` into the plaintext buffers, all
        of it (a record split between reads is kept there); the report to go on with."""
        opened, buffers = self._sealed.open, self._plain
        view = memoryview(data)
        while True:
            room = buffers.get_buffer(RECORD_ROOM)
            try:
                taken, count, status = opened(view, room)
                if status == _tlsrecords.MORE and not count:  # the tail is under RECORD_ROOM
                    view = view[taken:]
                    taken, status = self._open_aside(view, report)
            except ssl.SSLError as exc:  # a record that does not authenticate, an alert
                self._fail(report, exc)
                return report
            if self._landed(report, count, status):
                return report
            view = view[taken:]  # the next record needs a fresh buffer

    def _open_aside(self, data: memoryview, report: _Report) -> tuple[int, int]:
        """Open the next records of ``data`` into a room of their own and copy their plaintext
        into the buffers, whose free tail (a :class:`PlainBuffers` may keep one shorter than
        :data:`RECORD_ROOM`) cannot hold the next record: (octets taken, status)."""
        aside = bytearray(RECORD_ROOM)
        taken, count, status = self._sealed.open(data, aside)
        buffers, at = self._plain, 0
        while at < count:
            room = buffers.get_buffer(count - at)
            n = min(len(room), count - at)
            room[:n] = aside[at : at + n]
            report.plain.append(buffers.filled(n))
            at += n
        return taken, status

    def _encrypt(self, buffers: list[Any], report: _Report) -> None:
        if self._sealed is not None:
            try:
                report.wire.append(self._sealed.seal(buffers))
            except Exception as exc:  # noqa: BLE001 - the connection fails with it
                self._fail(report, exc)
            return
        sslobj, out = self._ssl, self._out
        try:
            for buffer in buffers:
                sslobj.write(buffer)
                if out.pending >= WIRE_CHUNK:
                    report.wire.append(out.read())
        except Exception as exc:
            self._fail(report, exc)
        self._drain(report)

    def _shutdown(self, report: _Report) -> None:
        if self._sealed is not None:
            report.wire.append(self._sealed.close_notify())
            report.shutdown = True
            return
        try:
            self._ssl.unwrap()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            pass  # our close_notify is out; the peer's is not awaited
        except ssl.SSLError as exc:
            log.debug("TLS shutdown: %s", exc)
        self._drain(report)
        report.shutdown = True


class _Carrier(asyncio.BufferedProtocol):
    """The plain socket's protocol: ciphertext in, flow control and loss to the transport."""

    def __init__(self, tls: TLSWorkerTransport) -> None:
        self._tls = tls
        self._buffer: bytearray | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not isinstance(transport, asyncio.Transport):
            raise TypeError(f"TLS needs a stream transport, got {transport!r}")
        self._tls._carrier_made(transport)

    def get_buffer(self, sizehint: int) -> bytearray:
        pool = self._tls._pool
        try:
            self._buffer = pool.pop()
        except IndexError:
            self._buffer = bytearray(READ_CHUNK)
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            self._tls._ciphertext(buffer, nbytes)

    def eof_received(self) -> bool:
        self._tls._tcp_eof()
        return True  # the transport closes the socket once the worker has read what came

    def pause_writing(self) -> None:
        self._tls._wire_paused(True)

    def resume_writing(self) -> None:
        self._tls._wire_paused(False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._tls._carrier_lost(exc)


class TLSWorkerTransport(asyncio.Transport):
    """A TLS stream transport whose records are processed on a worker thread (see the
    module's docstring); :attr:`carrier` is the protocol to give the plain socket, and
    :attr:`handshake` completes when the protocol is connected (or fails as the handshake
    did)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        protocol: asyncio.BaseProtocol,
        context: ssl.SSLContext,
        plain_buffers: PlainBuffers,
        *,
        server_side: bool,
        server_hostname: str | None = None,
        threaded: bool = True,
    ) -> None:
        super().__init__()
        self._loop = loop
        self._protocol = protocol
        self._server_side = server_side
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        sslobj = context.wrap_bio(
            incoming, outgoing, server_side=server_side, server_hostname=server_hostname
        )
        self._pool: collections.deque[bytearray] = collections.deque()
        self._worker = _Worker(
            sslobj,
            incoming,
            outgoing,
            plain_buffers,
            self._pool,
            self._post if threaded else self._on_report,
            "qmux-tls",
            None if threaded else loop.call_soon,
            server_side=server_side,
        )
        self.carrier = _Carrier(self)
        self.handshake: asyncio.Future[None] = loop.create_future()
        self.handshake.add_done_callback(_retrieve)
        self._sock: asyncio.Transport | None = None
        self._extra: dict[str, Any] = {}
        self._connected = False  # protocol.connection_made was called
        self._closing = False
        self._lost = False
        self._error: BaseException | None = None
        self._tcp_eof_seen = False
        self._held: collections.deque[memoryview] = collections.deque()  # while reading paused
        self._held_eof: str | None = None
        self._reads = 0  # socket reads the worker has not taken yet
        self._reading_paused = False  # by the protocol
        self._socket_paused = False  # by us, while the worker lags
        self._pending = 0  # plaintext written, not yet encrypted
        self._high, self._low = DEFAULT_HIGH_WATER, DEFAULT_HIGH_WATER // 4
        self._writing_paused = False
        self._wire_full = False
        self._shutdown_sent = False  # our close_notify and FIN are out: reading to the end
        self._peer_ended = False  # its close_notify (or FIN) was handed on
        self._linger: asyncio.TimerHandle | None = None

    @property
    def worker_thread(self) -> threading.Thread | None:
        """The thread that owns the SSL object (it ends when the socket is lost); None
        inline."""
        return self._worker.thread

    # --- from the socket ------------------------------------------------------------------

    def _carrier_made(self, transport: asyncio.Transport) -> None:
        self._sock = transport
        for key in ("peername", "sockname", "socket"):
            self._extra[key] = transport.get_extra_info(key)
        transport.set_write_buffer_limits(self._high, self._low)
        self._worker.start()

    def _ciphertext(self, buffer: bytearray, nbytes: int) -> None:
        if self._lost:
            return
        self._reads += 1
        self._worker.submit((_DATA, buffer, nbytes))
        self._control_reading()

    def _tcp_eof(self) -> None:
        self._tcp_eof_seen = True
        if self._shutdown_sent and self._sock is not None:
            self._sock.close()  # the end of a close we began
            return
        self._worker.submit((_EOF,))

    def _wire_paused(self, paused: bool) -> None:
        self._wire_full = paused
        self._control_writing()

    def _carrier_lost(self, exc: Exception | None) -> None:
        self._lost = self._closing = True
        if self._linger is not None:
            self._linger.cancel()
        self._worker.submit((_STOP,))
        error = self._error or exc
        if not self.handshake.done():
            self.handshake.set_exception(
                error or ConnectionResetError("the connection closed during the TLS handshake")
            )
        if self._connected or self._server_side:
            self._connected = False
            self._protocol.connection_lost(error)  # type: ignore[arg-type]
        self._sock = None

    # --- from the worker ------------------------------------------------------------------

    def _post(self, report: _Report) -> None:
        """(worker thread) hand ``report`` to the loop."""
        self._loop.call_soon_threadsafe(self._on_report, report)

    def _on_report(self, report: _Report) -> None:
        sock = self._sock
        if self._lost or sock is None:
            return
        try:
            self._apply(report, sock)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            log.error("TLS transport: the protocol failed", exc_info=True)
            self._fatal(exc)

    def _apply(self, report: _Report, sock: asyncio.Transport) -> None:
        if report.reads:
            self._reads -= report.reads
            self._control_reading()
        if report.wire and not sock.is_closing():
            for wire in report.wire:  # one at a time: 3.11's writelines joins them (a copy)
                sock.write(wire)
        if report.written:
            self._pending -= report.written
            self._control_writing()
        if report.handshake is not None:
            self._extra.update(report.handshake)
            if not self.handshake.done():
                self.handshake.set_result(None)
            self._connected = True
            self._protocol.connection_made(self)
        if report.plain and self._connected and not self._shutdown_sent:
            self._held.extend(report.plain)
        if report.error is not None:
            self._fatal(report.error)
            return
        if report.eof is not None:
            self._held_eof = report.eof
        self._deliver()
        if report.shutdown and self._sock is not None:
            self._shut_down(self._sock)

    def _shut_down(self, sock: asyncio.Transport) -> None:
        """Our close_notify is written: send FIN after it and read on (discarding) until the
        peer's FIN, its close_notify or :data:`LINGER` seconds. Closing a socket whose
        receive queue holds unread bytes (a session ticket, the peer's last data) makes the
        kernel answer with a reset instead of a FIN, and the peer loses what it was sending."""
        if self._shutdown_sent:
            return
        self._shutdown_sent = True
        if self._tcp_eof_seen or self._peer_ended or not sock.can_write_eof():
            sock.close()  # the peer has ended already: nothing more to wait for
            return
        sock.write_eof()
        self._held.clear()  # what arrives now is read and dropped, as after asyncio's close
        self._control_reading()
        self._linger = self._loop.call_later(LINGER, sock.abort)

    def fail(self, error: BaseException) -> None:
        """Abort the connection; the protocol's ``connection_lost`` (or the handshake) gets
        ``error``."""
        self._fatal(error)

    def _deliver(self) -> None:
        """Hand the protocol what was decrypted, then the end, while it reads."""
        held = self._held
        while held and not self._reading_paused and not self._lost:
            self._protocol.data_received(held.popleft())  # type: ignore[attr-defined]
        if not held and self._held_eof is not None and not self._reading_paused:
            how, self._held_eof = self._held_eof, None
            self._eof(how)

    def _fatal(self, error: BaseException) -> None:
        if self._lost:
            return
        if self._error is None:
            self._error = error
        if not self.handshake.done():
            self.handshake.set_exception(error)
        log.debug("TLS connection failed: %r", error)
        self._closing = True
        if self._sock is not None:
            self._sock.abort()

    def _eof(self, how: str) -> None:
        self._peer_ended = True
        if self._connected and not self._lost and not self._shutdown_sent:
            self._protocol.eof_received()  # type: ignore[attr-defined]
        if self._shutdown_sent:  # the peer's answer to our close
            if self._sock is not None:
                self._sock.close()
        elif how == "tcp":  # nothing more can come: close without close_notify, as asyncio
            self._closing = True
            if self._sock is not None:
                self._sock.close()
        else:
            self.close()

    # --- flow control ---------------------------------------------------------------------

    def _control_reading(self) -> None:
        sock = self._sock
        if sock is None or self._lost:
            return
        paused = self._reading_paused and not self._shutdown_sent  # a closing one drains
        stop = paused or self._reads >= READ_QUEUE
        if stop and not self._socket_paused:
            self._socket_paused = True
            sock.pause_reading()
        elif not stop and self._socket_paused:
            self._socket_paused = False
            sock.resume_reading()

    def _control_writing(self) -> None:
        if self._lost:
            return
        if not self._writing_paused:
            if self.get_write_buffer_size() > self._high:
                self._writing_paused = True
                self._protocol.pause_writing()
        elif self._pending <= self._low and not self._wire_full:
            self._writing_paused = False
            self._protocol.resume_writing()

    # --- asyncio.Transport ----------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """``peername``, ``sockname``, ``socket`` and, after the handshake, ``peercert``,
        ``cipher``, ``compression``, ``alpn_protocol``, ``tls_version`` (no ``ssl_object``:
        it belongs to the worker thread)."""
        return self._extra.get(name, default)

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Send close_notify after what was written, then FIN; the socket closes at the
        peer's FIN or close_notify (at most :data:`LINGER` seconds later)."""
        if self._closing:
            return
        self._closing = True
        if self._sock is None:
            return
        if self._connected and not self._tcp_eof_seen and self._error is None:
            self._worker.submit((_CLOSE,))
        else:
            self._sock.close()

    def abort(self) -> None:
        """Drop the connection now, unsent data with it."""
        self._closing = True
        if self._sock is not None:
            self._sock.abort()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def is_reading(self) -> bool:
        return not self._reading_paused and not self._lost

    def pause_reading(self) -> None:
        self._reading_paused = True
        self._control_reading()

    def resume_reading(self) -> None:
        self._reading_paused = False
        self._control_reading()
        if self._held or self._held_eof is not None:
            self._loop.call_soon(self._deliver)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = DEFAULT_HIGH_WATER if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low
        if self._sock is not None:
            self._sock.set_write_buffer_limits(high, low)
        self._control_writing()

    def get_write_buffer_size(self) -> int:
        sock = self._sock
        return self._pending + (sock.get_write_buffer_size() if sock is not None else 0)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writelines((data,))

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        """Hand the buffers to the worker to encrypt, in order; a buffer that is not
        immutable ``bytes`` (or a view of one) is copied first, unless the records are taken
        over and nothing is queued (:meth:`_Worker.direct`): they are encrypted before this
        returns."""
        if self._closing or not self._connected:
            return
        if self._worker.direct():  # encrypted before this returns: no copy to keep
            buffers = list(list_of_data)
        else:
            buffers = [_frozen(buffer) for buffer in list_of_data]
        size = sum(len(buffer) for buffer in buffers)
        if not size:
            return
        self._pending += size
        self._worker.submit((_WRITE, buffers, size))
        self._control_writing()

    def can_write_eof(self) -> bool:
        return False


def _frozen(buffer: bytes | bytearray | memoryview) -> bytes | memoryview:
    """``buffer`` if nothing can change it (bytes, a view of bytes), else a copy."""
    if type(buffer) is bytes:
        return buffer
    if isinstance(buffer, memoryview) and type(buffer.obj) is bytes:
        return buffer
    return bytes(buffer)


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()  # a failure is reported to whoever waits, or logged at debug


async def open_tls_connection(
    protocol: asyncio.BaseProtocol,
    host: str,
    port: int,
    *,
    context: ssl.SSLContext,
    server_hostname: str | None,
    plain_buffers: PlainBuffers,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    threaded: bool = True,
) -> TLSWorkerTransport:
    """Connect to ``host``:``port``, run the TLS handshake on a worker thread and connect
    ``protocol``; the transport is returned once the handshake is done.

    Raises:
        ssl.SSLError: the handshake failed (ssl.SSLCertVerificationError: the certificate).
        ConnectionResetError: the peer closed during the handshake. OSError: no connection.
        TimeoutError: no handshake within ``handshake_timeout`` seconds.
    """
    loop = asyncio.get_running_loop()
    tls = TLSWorkerTransport(
        loop,
        protocol,
        context,
        plain_buffers,
        server_side=False,
        server_hostname=server_hostname or host,
        threaded=threaded,
    )
    await loop.create_connection(lambda: tls.carrier, host, port)
    try:
        await asyncio.wait_for(asyncio.shield(tls.handshake), handshake_timeout)
    except BaseException:
        tls.abort()
        raise
    return tls


async def serve_tls(
    factory: Callable[[], tuple[asyncio.BaseProtocol, PlainBuffers]],
    host: str,
    port: int,
    *,
    context: ssl.SSLContext,
    accepted: Callable[[TLSWorkerTransport], None] | None = None,
    threaded: bool = True,
) -> asyncio.Server:
    """Listen on ``host``:``port``; each connection gets ``factory()``'s protocol behind a
    :class:`TLSWorkerTransport` (``accepted`` sees the transport before its handshake, to
    bound it). A failed handshake ends with ``connection_lost(exc)`` on that protocol."""
    loop = asyncio.get_running_loop()

    def carrier() -> _Carrier:
        protocol, buffers = factory()
        tls = TLSWorkerTransport(
            loop, protocol, context, buffers, server_side=True, threaded=threaded
        )
        if accepted is not None:
            accepted(tls)
        return tls.carrier

    return await loop.create_server(carrier, host, port)
