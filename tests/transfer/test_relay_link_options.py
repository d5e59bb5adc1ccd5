"""The MOQT client options of a process with a holder face (``kvsp serve instance``:
``--moqt-carriers``, ``--moqt-backend``, ``--moqt-datagram-size``;
:mod:`kvsp.transfer.relay_link`) and the relay's ``--quic-datagram-size``: bad values are
argparse errors that name the option, and good ones reach the MOQT client and the relay link
(RFC 9000 §14 and §18.2 bound the datagram size)."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import pytest

from kvsp.errors import BadRequest, UnsupportedHolder
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.moqt_mapping import encode_moqt_namespace, kv_namespace
from kvsp.records import ReplicaRecord
from kvsp.transfer.relay_link import RelayAttachment, add_relay_arguments, check_relay_argument
from relay.app import configure_parser as relay_parser

HOLDER = "moqt://127.0.0.1:4443/"


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(prog="kvsp serve instance")
    add_relay_arguments(out)
    return out


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--moqt-datagram-size", "1199"], "--moqt-datagram-size"),
        (["--moqt-datagram-size", "65528"], "--moqt-datagram-size"),
        (["--moqt-datagram-size", "1.5e3"], "--moqt-datagram-size"),
        (["--moqt-backend", "quiche"], "--moqt-backend"),
        (["--moqt-carriers", "maybe"], "--moqt-carriers"),
    ],
)
def test_bad_values_are_argparse_errors_naming_the_option(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(argv)
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_the_relays_datagram_size_is_checked_too(capsys: pytest.CaptureFixture[str]) -> None:
    relay = argparse.ArgumentParser(prog="kvsp serve relay")
    relay_parser(relay)
    assert relay.parse_args(["--moqt-datagram-size", "1200"]).moqt_datagram_size == 1200
    with pytest.raises(SystemExit):
        relay.parse_args(["--moqt-datagram-size", "900"])
    assert "--moqt-datagram-size" in capsys.readouterr().err


def test_by_default_a_records_qmux_carriers_come_before_quic(tmp_path: Path) -> None:
    socket_path = tmp_path / "relay.sock"
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(socket_path))
        client = RelayAttachment(parser().parse_args([]), "token").moqt_client()
        carriers = client.candidates(HOLDER, _record(f"moqt+unix://localhost{socket_path}"))
    assert [a.carrier for a in carriers] == ["unix", "quic"]
    assert client.backend is None and client.transport is None


def test_carriers_off_is_quic_only_with_the_backend_and_datagram_size_asked_for(
    tmp_path: Path,
) -> None:
    argv = ["--moqt-carriers", "off", "--moqt-backend", "aioquic", "--moqt-datagram-size", "1200"]
    attachment = RelayAttachment(parser().parse_args(argv), "token")
    socket_path = tmp_path / "relay.sock"
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(socket_path))
        client = attachment.moqt_client()
        carriers = client.candidates(HOLDER, _record(f"moqt+unix://localhost{socket_path}"))
    assert [a.carrier for a in carriers] == ["quic"]
    assert client.backend == "aioquic"
    assert client.transport is not None and client.transport.max_datagram_size == 1200


def test_carriers_off_refuses_a_qmux_relay_url() -> None:
    argv = ["--moqt-carriers", "off", "--relay", "moqt+tls://127.0.0.1:4444/"]
    with pytest.raises(UnsupportedHolder, match="turned off"):
        RelayAttachment(parser().parse_args(argv), "token")
    argv = ["--moqt-carriers", "off", "--moqt-backend", "aioquic", "--relay", HOLDER]
    link = RelayAttachment(parser().parse_args(argv), "token").link
    assert link is not None and link.config.backend == "aioquic" and not link.config.qmux


def _record(carrier: str) -> ReplicaRecord:
    namespace = kv_namespace(CompatId(b"\x22" * 32), ScopeId(b"\x33" * 16), BlockKey(b"\x11" * 32))
    return ReplicaRecord.from_json(
        {
            "block_key": "11" * 32,
            "compat_id": "22" * 32,
            "scope_id": "33" * 16,
            "holder": HOLDER,
            "codec": 1,
            "size": 1024,
            "digest": "sha-256:" + "44" * 32,
            "ttl_ms": 1000,
            "moqt_namespace": encode_moqt_namespace(namespace),
            "moqt_carriers": [carrier],
        }
    )


@pytest.mark.parametrize(
    ("argv", "detail"),
    [
        (
            ["--relay", "moqt+foo://x/"],
            "--relay: 'moqt+foo://x/' is not a moqt, moqt+tls, moqt+tcp or moqt+unix URI "
            "with a host",
        ),
        (
            ["--relay", "moqt+tls://relay.example/"],
            "--relay: 'moqt+tls://relay.example/' names no port",
        ),
        (
            ["--relay", "moqt+unix://localhost/r.sock", "--moqt-carriers", "off"],
            "--relay: unix:/r.sock: QMux carriers are turned off",
        ),
        (
            ["--relay", "moqt+tcp://192.0.2.1:4445/"],
            "--relay: tcp:192.0.2.1:4445: plain TCP beyond loopback needs a trusted network "
            "(--trusted-network)",
        ),
    ],
)
def test_a_relay_the_process_may_not_dial_is_refused_before_it_starts(
    argv: list[str], detail: str
) -> None:
    with pytest.raises(BadRequest) as caught:
        check_relay_argument(parser().parse_args(argv))
    assert caught.value.detail == detail
    good = ["--relay", "moqt+tcp://192.0.2.1:4445/", "--trusted-network"]
    check_relay_argument(parser().parse_args(good))
    check_relay_argument(parser().parse_args([]))


def test_an_instance_with_a_bad_relay_stops_before_registering(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not after it has put its descriptor at the IS and started its engine."""
    from kvsp.cli import main

    token = tmp_path / "token"
    token.write_text("t" * 32)
    argv = ["serve", "instance", "--state", str(tmp_path / "s"), "--listen", "127.0.0.1:0"]
    argv += ["--pc", "http://127.0.0.1:9/", "--token-file", str(token), "--relay", "moqt+foo://x/"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "registering the descriptor" not in err
    assert err.strip().splitlines()[-1].startswith("kvsp: error: --relay: 'moqt+foo://x/' is not")
