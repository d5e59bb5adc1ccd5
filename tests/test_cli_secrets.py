"""Secrets stay off command lines (DESIGN.md §3; SECURITY.md "Tokens"): a process's arguments
are readable by every local user (``ps``, ``/proc/PID/cmdline``), so every ``kvsp`` command and
``kvsp serve`` service reads tokens from files; ``kvsp token-audience`` prints the credential a
curl user shows a holder, relay or instance."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsp.audience import audience_credential
from kvsp.cli import build_parser, main
from relay.app import main as relay_main

_SECRET_OPTION = re.compile(r"--(?:[a-z-]+-)?token$")


def _parsers(
    parser: argparse.ArgumentParser, path: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


def test_no_command_takes_a_token_as_an_argument() -> None:
    found = []
    for path, parser in _parsers(build_parser(load_services=True, load_sim=True), "kvsp"):
        for action in parser._actions:
            found += [f"{path} {o}" for o in action.option_strings if _SECRET_OPTION.match(o)]
    assert found == []


@pytest.mark.parametrize("service", ["relay", "instance", "holder"])
def test_a_token_option_is_not_taken_for_a_token_file(
    service: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--token SECRET`` is refused outright: no abbreviation of ``--token-file`` or
    ``--index-token-file`` reads the secret as a path (and echoes it in an error)."""
    argv = ["--index", "http://127.0.0.1:1/", "--token", "secret-on-the-command-line"]
    with pytest.raises(SystemExit) as exited:
        if service == "relay":
            relay_main(argv)
        elif service == "holder":
            main(["serve", "holder", *argv])
        else:
            control = ["--control", "http://127.0.0.1:1/", "--token-file", "t"]
            main(["serve", "instance", *control, *argv])
    assert exited.value.code == 2
    assert "unrecognized arguments: --token secret" in capsys.readouterr().err


def test_token_audience_prints_the_credential_for_a_uri(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = "cli-secrets-test-token-0123456789abcdef"
    (tmp_path / "t").write_text(token + "\n")
    assert main(["token-audience", "--token-file", str(tmp_path / "t"), "http://h:8471/x"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == audience_credential(token, "http://h:8471/") and token not in printed
    assert main(["token-audience", "--token-file", str(tmp_path / "t"), "ftp://h/"]) != 0
    assert main(["token-audience", "--token-file", str(tmp_path / "none"), "http://h/"]) != 0
    assert token not in capsys.readouterr().err


def test_a_scope_key_file_is_read_and_never_echoed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = "00" * 32
    (tmp_path / "key").write_text(key + "\n")
    assert main(["scope-id", "--scope-key-file", str(tmp_path / "key")]) == 0
    from_file = capsys.readouterr().out
    assert main(["scope-id", "--scope-key", key]) == 0
    assert capsys.readouterr().out == from_file
    (tmp_path / "bad").write_text("not-hex-secret-material\n")
    assert main(["scope-id", "--scope-key-file", str(tmp_path / "bad")]) != 0
    assert "secret-material" not in capsys.readouterr().err
