"""``--cert``/``--key`` of every ``kvsp serve`` service and of the relay, checked before the
start: a missing file, one that is not PEM, a key with a passphrase or a key of another
certificate is one line naming the flag and the file, exit status 1 (2 from ``python -m
relay.app``), never a traceback from the TLS setup."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from kvsp.cli import main
from kvsp.errors import BadRequest
from kvsp.web.cliargs import check_tls_pair
from moqt.certs import make_self_signed


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[Path, Path], tuple[Path, Path]]:
    folder = tmp_path_factory.mktemp("pairs")
    return make_self_signed("localhost", folder / "a"), make_self_signed("localhost", folder / "b")


def _check(cert: Path | None, key: Path | None) -> tuple[Path, Path] | None:
    return check_tls_pair(argparse.Namespace(cert=cert, key=key))


def test_a_good_pair_passes_and_none_is_none(pairs: tuple[tuple[Path, Path], ...]) -> None:
    cert, key = pairs[0]
    assert _check(cert, key) == (cert, key)
    assert _check(None, None) is None


def test_each_bad_pair_names_its_flag_and_file(
    pairs: tuple[tuple[Path, Path], ...], tmp_path: Path
) -> None:
    (cert, key), (_, other_key) = pairs
    text = tmp_path / "notes.txt"
    text.write_text("not PEM")
    missing = tmp_path / "missing.pem"
    locked = tmp_path / "locked.pem"
    private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    locked.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    cases = [
        (cert, None, "--cert and --key go together"),
        (None, key, "--cert and --key go together"),
        (missing, key, f"--cert {missing}: No such file or directory"),
        (cert, missing, f"--key {missing}: No such file or directory"),
        (text, key, f"--cert {text}: not a PEM certificate"),
        (key, key, f"--cert {key}: not a PEM certificate"),
        (cert, text, f"--key {text}: not a PEM private key without a passphrase"),
        (cert, locked, f"--key {locked}: not a PEM private key without a passphrase"),
        (cert, other_key, f"--key {other_key} is not the private key of --cert {cert}"),
    ]
    for bad_cert, bad_key, message in cases:
        with pytest.raises(BadRequest) as caught:
            _check(bad_cert, bad_key)
        assert caught.value.detail == message


@pytest.mark.parametrize("service", ["control", "holder", "relay"])
def test_a_service_refuses_a_key_of_another_certificate_in_one_line(
    service: str,
    pairs: tuple[tuple[Path, Path], ...],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (cert, _), (_, other_key) = pairs
    argv = ["serve", service, "--state", str(tmp_path / "s"), "--listen", "127.0.0.1:0"]
    argv += ["--open"] if service == "relay" else []
    assert main([*argv, "--cert", str(cert), "--key", str(other_key)]) == 1
    line = f"kvsp: error: --key {other_key} is not the private key of --cert {cert}"
    assert capsys.readouterr().err.strip().splitlines()[-1] == line


def test_relay_app_says_a_missing_certificate_without_a_traceback(tmp_path: Path) -> None:
    missing = tmp_path / "cert.pem"
    done = subprocess.run(
        [sys.executable, "-m", "relay.app", "--open", "--state", str(tmp_path / "s")]
        + ["--listen", "127.0.0.1:0", "--cert", str(missing), "--key", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    line = f"relay: error: --cert {missing}: No such file or directory"
    assert done.stderr.strip().splitlines()[-1] == line
