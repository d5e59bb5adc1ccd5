"""The QUIC backend seam (moqt/backend.py): what differs between aioquic and qh3 and is handled
there; here, the packet-logging work a qh3 connection does without a logger."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from moqt.backend import Backend, get_backend
from moqt.certs import make_self_signed
from tests.support.backends import NEEDS_QH3

SERVER_ADDR = ("10.0.0.2", 4443)


@pytest.fixture(scope="module")
def cafile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cert, _ = make_self_signed("localhost", tmp_path_factory.mktemp("certs"))
    return cert


def connecting_client(backend: Backend, cafile: Path, logger: Any = None) -> Any:
    """A client connection that has its first flight to send."""
    config = backend.configuration(is_client=True, cafile=str(cafile), server_name="localhost")
    config.quic_logger = logger
    quic = backend.QuicConnection(configuration=config)
    quic.connect(SERVER_ADDR, now=0.0)
    return quic


def header_parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls of qh3's Python QUIC header parser (what its packet logging uses)."""
    module: Any = importlib.import_module("qh3.quic.connection")
    calls: list[int] = []
    parse = module._pull_quic_header

    def counted(*args: Any) -> Any:
        calls.append(1)
        return parse(*args)

    monkeypatch.setattr(module, "_pull_quic_header", counted)
    return calls


@NEEDS_QH3
def test_quiet_drops_qh3_packet_logging_without_a_logger(
    cafile: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = get_backend("qh3")
    calls = header_parses(monkeypatch)
    loud = connecting_client(backend, cafile)
    assert loud.datagrams_to_send(now=0.0) and calls  # qh3 parses each sent packet to log it
    calls.clear()
    quiet = connecting_client(backend, cafile)
    backend.quiet(quiet)
    datagrams = quiet.datagrams_to_send(now=0.0)
    assert datagrams and not calls  # the same flight, no parse


@NEEDS_QH3
def test_quiet_keeps_the_packet_log_a_logger_asked_for(cafile: Path) -> None:
    backend = get_backend("qh3")
    logger_module: Any = importlib.import_module("qh3.quic.logger")
    logger = logger_module.QuicLogger()
    quic = connecting_client(backend, cafile, logger)
    backend.quiet(quic)
    assert quic.datagrams_to_send(now=0.0)
    events = [e["name"] for trace in logger.to_dict()["traces"] for e in trace["events"]]
    assert "transport:packet_sent" in events


def test_quiet_leaves_aioquic_alone(cafile: Path) -> None:
    backend = get_backend("aioquic")
    quic = connecting_client(backend, cafile)
    backend.quiet(quic)
    assert "_log_packets" not in vars(quic) and quic.datagrams_to_send(now=0.0)


class PolledCore:
    """A stand-in qh3 connection core: ``poll_transmit`` hands out ``ready`` one at a time,
    noting how many were taken when each batch was sent."""

    def __init__(self, ready: list[tuple[bytes, Any]], fail_after: int | None = None) -> None:
        self.ready = list(ready)
        self.taken = 0
        self.fail_after = fail_after

    def poll_transmit(self, now: float) -> tuple[bytes, Any, int] | None:
        if self.fail_after is not None and self.taken == self.fail_after:
            raise RuntimeError("packet builder capacity exhausted")
        if not self.ready:
            return None
        self.taken += 1
        data, addr = self.ready.pop(0)
        return data, addr, len(data)


class QuietConnection:
    """What :meth:`Backend.send_as_built` reads of a qh3 ``QuicConnection``."""

    def __init__(self, core: PolledCore | None) -> None:
        self._quic_logger = None
        self._core = core


@NEEDS_QH3
def test_send_as_built_sends_each_batch_once_built_in_order() -> None:
    backend = get_backend("qh3")
    peer, other = ("10.0.0.2", 4443), ("10.0.0.3", 4443)
    ready = [(b"%d" % i, peer) for i in range(10)] + [(b"10", other), (b"11", peer)]
    core = PolledCore(ready)
    sent: list[tuple[list[bytes], Any, int]] = []
    done = backend.send_as_built(
        QuietConnection(core), 1.0, lambda d, a: sent.append((d, a, core.taken)), 4
    )
    assert done
    assert [(len(d), a) for d, a, _ in sent] == [(4, peer), (4, peer), (2, peer), (1, other)] + [
        (1, peer)
    ]
    assert [x for d, _, _ in sent for x in d] == [data for data, _ in ready]
    # the first batch left before the rest were built (one more polled: it decided the cut)
    assert sent[0][2] == 5


@NEEDS_QH3
def test_send_as_built_raises_a_core_failure_as_qh3_does() -> None:
    backend = get_backend("qh3")
    errors: Any = importlib.import_module("qh3.quic.connection")
    core = PolledCore([(b"x", SERVER_ADDR)] * 3, fail_after=2)
    with pytest.raises(errors.QuicConnectionError):
        backend.send_as_built(QuietConnection(core), 1.0, lambda d, a: None, 64)


@NEEDS_QH3
def test_send_as_built_leaves_a_logged_or_unstarted_connection_to_the_library(
    cafile: Path,
) -> None:
    backend = get_backend("qh3")
    logger = importlib.import_module("qh3.quic.logger").QuicLogger()
    logged = connecting_client(backend, cafile, logger)
    sent: list[Any] = []
    assert not backend.send_as_built(logged, 0.0, lambda d, a: sent.append(d), 64)
    assert not backend.send_as_built(QuietConnection(None), 0.0, lambda d, a: sent.append(d), 64)
    assert not sent and logged.datagrams_to_send(now=0.0)  # its flight is still there


@NEEDS_QH3
def test_send_as_built_sends_the_flight_datagrams_to_send_would(cafile: Path) -> None:
    backend = get_backend("qh3")
    polled, listed = connecting_client(backend, cafile), connecting_client(backend, cafile)
    backend.quiet(polled)
    backend.quiet(listed)
    sent: list[tuple[bytes, Any]] = []
    assert backend.send_as_built(polled, 0.0, lambda d, a: sent.extend((x, a) for x in d), 64)
    expected = listed.datagrams_to_send(now=0.0)
    assert [(len(d), a) for d, a in sent] == [(len(d), a) for d, a in expected]
    assert polled.datagrams_to_send(now=0.0) == []  # nothing left behind


def test_send_as_built_leaves_aioquic_to_its_library(cafile: Path) -> None:
    backend = get_backend("aioquic")
    quic = connecting_client(backend, cafile)
    assert not backend.send_as_built(quic, 0.0, lambda d, a: None, 64)
    assert quic.datagrams_to_send(now=0.0)
