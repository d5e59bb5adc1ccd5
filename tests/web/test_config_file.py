"""Flags of every ``kvsp serve`` service and the relay from ``--config FILE`` and ``KVSP_*``
variables (:mod:`kvsp.web.config_file`): precedence, lists and switches, errors that name the
bad key or variable, ``--print-config``, and a real holder started from a file."""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.cli import SERVICES, build_parser, main
from kvsp.registries import Tier
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.config_file import RESERVED_VARIABLES, SERVICE_TABLES, env_variable
from kvsp.web.testing import start_process
from relay.app import build_parser as relay_parser

# the flags each service requires, given on the command line where a test needs them
REQUIRED: dict[str, list[str]] = {
    "instance": ["--pc", "http://127.0.0.1:9/", "--token-file", "instance.token"],
    "pc": ["--index", "http://127.0.0.1:9/", "--index-token-file", "pc.token"],
}
TOKEN = "holder-token-0123456789abcdefghijklmnop"


@pytest.fixture(autouse=True)
def _no_kvsp_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests set the KVSP_* settings they mean; none leaks in from the caller."""
    for name in list(os.environ):
        if name.startswith("KVSP_") and name not in RESERVED_VARIABLES:
            monkeypatch.delenv(name)


def _parse(service: str, *argv: str) -> argparse.Namespace:
    if service == "relay-main":
        return relay_parser().parse_args(list(argv))
    return build_parser().parse_args(["serve", service, *argv])


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _exit_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out, err = capsys.readouterr()
    code = exited.value.code
    return (code if isinstance(code, int) else 1), out, err


def test_the_file_knows_every_service_table() -> None:
    assert set(SERVICES) == SERVICE_TABLES


@pytest.mark.parametrize("service", [*SERVICES, "relay-main"])
def test_command_line_beats_environment_beats_file_beats_default(
    service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = "relay" if service == "relay-main" else service
    config = _write(
        tmp_path / "kvsp.toml",
        'listen = "127.0.0.1:1001"\nlog-level = "error"\nhead-timeout = 2.5\n'
        f'[{table}]\nlog-level = "info"\nkeep-alive-timeout = 7\n',
    )
    required = REQUIRED.get(service, [])
    default = _parse(service, *required)
    assert (default.listen, default.log_level, default.keep_alive_timeout) != (
        "127.0.0.1:1001",
        "info",
        7,
    )
    from_file = _parse(service, *required, "--config", str(config))
    # the service's table overrides the top level, which applies to every service
    assert from_file.listen == "127.0.0.1:1001"
    assert from_file.log_level == "info"
    assert from_file.head_timeout == 2.5
    assert from_file.keep_alive_timeout == 7
    assert from_file.body_timeout == default.body_timeout
    monkeypatch.setenv("KVSP_LISTEN", "127.0.0.1:1002")
    monkeypatch.setenv("KVSP_CONFIG", str(config))  # the file may come from the environment
    from_env = _parse(service, *required)
    assert (from_env.listen, from_env.log_level) == ("127.0.0.1:1002", "info")
    from_cli = _parse(service, *required, "--listen", "127.0.0.1:1003")
    assert from_cli.listen == "127.0.0.1:1003"
    assert from_cli.keep_alive_timeout == 7


def test_required_flags_may_come_from_the_file(tmp_path: Path) -> None:
    config = _write(
        tmp_path / "instance.toml",
        'pc = "http://127.0.0.1:9/"\ntoken-file = "/etc/kvsp/instance.token"\n',
    )
    args = _parse("instance", "--config", str(config))
    assert args.token_file == Path("/etc/kvsp/instance.token")


def test_a_list_repeats_a_repeatable_flag_and_the_command_line_replaces_it(
    tmp_path: Path,
) -> None:
    config = _write(tmp_path / "h.toml", '[holder]\ntier = ["host=2GiB", "disk=1GiB"]\n')
    args = _parse("holder", "--config", str(config))
    assert args.tier == [(Tier.HOST, 2 << 30), (Tier.DISK, 1 << 30)]
    # not a mix of sources: the command line's tiers are all the tiers
    args = _parse("holder", "--config", str(config), "--tier", "host=1MiB")
    assert args.tier == [(Tier.HOST, 1 << 20)]


def test_a_list_for_a_single_valued_flag_is_one_comma_separated_value(tmp_path: Path) -> None:
    config = _write(
        tmp_path / "i.toml",
        'pc = ["http://a.example/", "http://b.example/"]\ntoken-file = "t"\n',
    )
    from_file = _parse("instance", "--config", str(config))
    given = _parse("instance", "--pc", "http://a.example/,http://b.example/", "--token-file", "t")
    assert from_file.control == given.control


@pytest.mark.parametrize(
    ("text", "variable", "expected"),
    [
        ("insecure = true\n", None, True),
        ("insecure = false\n", None, False),
        ("insecure = true\n", "no", False),
        ("", "on", True),
        ("", "1", True),
        ("", "", False),
    ],
)
def test_switches_take_booleans(
    text: str,
    variable: str | None,
    expected: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = _write(tmp_path / "c.toml", text)
    if variable is not None:
        monkeypatch.setenv("KVSP_INSECURE", variable)
    assert _parse("holder", "--config", str(config)).insecure is expected


def test_environment_variable_names() -> None:
    assert env_variable("index-token-file") == "KVSP_INDEX_TOKEN_FILE"
    assert env_variable("--listen") == "KVSP_LISTEN"


@pytest.mark.parametrize(
    ("text", "variables", "fragment"),
    [
        ('lisen = "127.0.0.1:0"\n', {}, "unknown key 'lisen'"),
        ('[holder]\ncontrol = "http://x/"\n', {}, "unknown key 'control'"),
        ('[holdr]\nlisten = "127.0.0.1:0"\n', {}, "unknown table [holdr]"),
        ("", {"KVSP_LISEN": "x"}, "KVSP_LISEN names no flag of kvsp serve holder"),
        ("", {"KVSP_CONTROL": "http://x/"}, "KVSP_CONTROL names no flag"),
        ("", {"KVSP_INSECURE": "maybe"}, "KVSP_INSECURE: expected true or false"),
        ("insecure = 1\n", {}, "insecure: expected true or false"),
        ("listen = true\n", {}, "listen: expected a string or a number"),
        ("listen = [\n", {}, "not TOML"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it(
    text: str,
    variables: dict[str, str],
    fragment: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = _write(tmp_path / "c.toml", text)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    code, _, err = _exit_of(["serve", "holder", "--config", str(config)], capsys)
    assert code == 2
    assert err.count("\n") == 1
    assert err.startswith("kvsp serve holder: error: ")
    assert fragment in err


def test_a_missing_config_file_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _exit_of(["serve", "index", "--config", str(tmp_path / "nope.toml")], capsys)
    assert code == 2
    assert "cannot read it" in err


def test_a_bad_value_is_reported_as_argparse_does_with_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _write(tmp_path / "c.toml", 'body-limit = "lots"\n')
    code, _, err = _exit_of(["serve", "holder", "--config", str(config)], capsys)
    assert code == 2
    assert err.startswith("usage: kvsp serve holder")
    assert (
        f"argument --body-limit: expected a size such as 2GiB or 512MB, got 'lots' (from {config})"
        in err
    )
    monkeypatch.setenv("KVSP_HEAD_TIMEOUT", "-1")
    code, _, err = _exit_of(["serve", "holder"], capsys)
    assert code == 2
    assert (
        "argument --head-timeout: expected a positive number, got '-1' (from KVSP_HEAD_TIMEOUT)"
        in err
    )


def test_variables_the_project_uses_for_other_things_are_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in RESERVED_VARIABLES:
        monkeypatch.setenv(name, "3")
    assert _parse("holder").listen == "127.0.0.1:8471"


def test_a_value_may_start_with_a_dash(tmp_path: Path) -> None:
    config = _write(tmp_path / "c.toml", 'log-level = "-x"\n')
    assert _parse("index", "--config", str(config)).log_level == "-x"


def _comparable(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in {"config", "print_config", "handler"}}


@pytest.mark.parametrize("service", list(SERVICES))
def test_print_config_prints_toml_that_gives_the_same_settings(
    service: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = _write(tmp_path / "c.toml", 'log-format = "text"\n')
    monkeypatch.setenv("KVSP_LOG_LEVEL", "info")
    argv = [*REQUIRED.get(service, []), "--config", str(config), "--listen", "127.0.0.1:0"]
    effective = _parse(service, *argv)
    code, out, _ = _exit_of(["serve", service, *argv, "--print-config"], capsys)
    assert code == 0
    settings = tomllib.loads(out)
    assert (settings["listen"], settings["log-format"], settings["log-level"]) == (
        "127.0.0.1:0",
        "text",
        "info",
    )
    assert 'listen = "127.0.0.1:0"  # command line' in out
    assert f'log-format = "text"  # {config}' in out
    assert 'log-level = "info"  # KVSP_LOG_LEVEL' in out
    monkeypatch.delenv("KVSP_LOG_LEVEL")
    printed = _write(tmp_path / "printed.toml", out)
    assert _comparable(_parse(service, "--config", str(printed))) == _comparable(effective)


def test_print_config_names_secret_files_never_their_content(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token_file = _write(tmp_path / "index.token", TOKEN + "\n")
    config = _write(tmp_path / "h.toml", f'index-token-file = "{token_file}"\n')
    code, out, _ = _exit_of(["serve", "holder", "--config", str(config), "--print-config"], capsys)
    assert code == 0
    assert tomllib.loads(out)["index-token-file"] == str(token_file)
    assert TOKEN not in out


def test_the_relay_entry_point_prints_its_config(tmp_path: Path) -> None:
    import subprocess

    config = _write(tmp_path / "r.toml", 'cache-size = "2GiB"\n[relay]\nopen = true\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSP_")}
    done = subprocess.run(
        [sys.executable, "-m", "relay.app", "--config", str(config), "--print-config"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    settings = tomllib.loads(done.stdout)
    assert (settings["cache-size"], settings["open"]) == ("2GiB", True)


@pytest.fixture
def principals(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "principals.toml"
    write_principals(path, [principal_entry("service", TOKEN, ["admin"], None)])
    yield path


def test_a_holder_starts_from_its_config_file(tmp_path: Path, principals: Path) -> None:
    token_file = _write(tmp_path / "service.token", TOKEN + "\n")
    serve = [sys.executable, "-m", "kvsp", "serve"]
    (tmp_path / "index").mkdir()
    index = start_process(
        [*serve, "index", "--listen", "127.0.0.1:0", "--principals", str(principals)],
        workdir=tmp_path / "index",
        cwd=tmp_path / "index",
        ready_timeout=60,
    )
    with index:
        config = _write(
            tmp_path / "holder.toml",
            f'listen = "127.0.0.1:0"\nprincipals = "{principals}"\n'
            f'[holder]\nindex = "{index.base_url}"\nindex-token-file = "{token_file}"\n'
            f'state = "{tmp_path / "holder-state"}"\n',
        )
        (tmp_path / "holder").mkdir()
        with (
            start_process(
                [*serve, "holder", "--config", str(config)],
                workdir=tmp_path / "holder",
                cwd=tmp_path / "holder",
                ready_timeout=60,
            ) as holder,
            httpx.Client(timeout=10) as http,
        ):
            assert holder.base_url.startswith("http://127.0.0.1:")
            assert not holder.base_url.endswith(":8471/")
            assert http.get(holder.base_url + "healthz").status_code == 200
            # ready only when its IS answers: the IS it was given in the file
            assert http.get(holder.base_url + "readyz").status_code == 200
