"""The QUIC backend seam (moqt/backend.py): what differs between aioquic and qh3 and is handled
there; here, the packet-logging work a qh3 connection does without a logger."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from moqt.backend import Backend, get_backend
from moqt.certs import make_self_signed

NEEDS_QH3 = pytest.mark.skipif(
    importlib.util.find_spec("qh3") is None, reason="qh3 (extra quic-fast) not installed"
)
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
