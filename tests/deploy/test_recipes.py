"""The recipes in ``deploy/`` against the code: every systemd unit parses strictly and starts an
existing ``kvsp serve`` service with flags it has, every TOML key is a flag of the service the
file is for (through the real config layer, ``--print-config``), and ``deploy/README.md`` names
every file. A renamed flag or service breaks this test, not a deployment."""

from __future__ import annotations

import argparse
import configparser
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvsp.cli import SERVICES, build_parser, main
from kvsp.web.config_file import RESERVED_VARIABLES

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
CONFIGS = sorted(DEPLOY.rglob("*.toml"))

DIRECTIVES: dict[str, frozenset[str]] = {
    "Unit": frozenset({"Description", "Documentation", "After", "Wants", "Requires"}),
    "Service": frozenset(
        {
            "Type",
            "User",
            "Group",
            "ExecStart",
            "ExecReload",
            "EnvironmentFile",
            "Restart",
            "RestartSec",
            "KillSignal",
            "KillMode",
            "TimeoutStopSec",
            "StateDirectory",
            "StateDirectoryMode",
            "ReadWritePaths",
            "UMask",
            "NoNewPrivileges",
            "ProtectSystem",
            "ProtectHome",
            "PrivateTmp",
            "PrivateDevices",
            "ProtectKernelTunables",
            "ProtectKernelModules",
            "ProtectControlGroups",
            "RestrictNamespaces",
            "RestrictSUIDSGID",
            "LockPersonality",
            "RestrictAddressFamilies",
            "CapabilityBoundingSet",
            "LimitNOFILE",
        }
    ),
    "Install": frozenset({"WantedBy"}),
}
"""The systemd directives the units may use: a misspelt one fails here (systemd only warns)."""


@pytest.fixture(autouse=True)
def _no_kvsp_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipes are checked as written: no KVSP_* setting leaks in from the caller."""
    for name in [n for n in os.environ if n.startswith("KVSP_")]:
        if name not in RESERVED_VARIABLES:
            monkeypatch.delenv(name)


def _serve_parsers() -> dict[str, argparse.ArgumentParser]:
    """The parser of each ``kvsp serve SERVICE``, as ``kvsp`` builds it."""

    def choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                found: dict[str, argparse.ArgumentParser] = action.choices
                return found
        raise AssertionError(f"{parser.prog} has no subcommands")

    return choices(choices(build_parser())["serve"])


def _unit(path: Path) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(
        strict=True, interpolation=None, delimiters=("=",), empty_lines_in_values=False
    )
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(path.read_text(encoding="utf-8"), source=str(path))
    return unit


def _service_of_unit(path: Path) -> str:
    found = re.fullmatch(r"kvsp-([a-z]+)\.service", path.name)
    assert found is not None, f"{path.name}: not kvsp-SERVICE.service"
    return found.group(1)


def test_there_is_a_unit_for_every_service() -> None:
    assert {_service_of_unit(path) for path in UNITS} == set(SERVICES)


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_a_unit_uses_known_directives_and_the_hardening(path: Path) -> None:
    service = _service_of_unit(path)
    unit = _unit(path)
    assert unit.sections() == list(DIRECTIVES)
    for section, allowed in DIRECTIVES.items():
        unknown = set(unit[section]) - allowed
        assert not unknown, f"{path.name} [{section}]: {sorted(unknown)}"
    run = unit["Service"]
    assert run["User"] not in {"", "root"}
    assert run["Restart"] == "on-failure"
    assert run["NoNewPrivileges"] == "yes"
    assert run["ProtectSystem"] == "strict"
    assert run["StateDirectory"] == f"kvsp/{service}"
    assert run["KillSignal"] == "SIGTERM"
    # a drain (sessions moved, records withdrawn) needs time before systemd's SIGKILL
    assert int(run["TimeoutStopSec"].removesuffix("s")) >= 30
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_the_holder_may_write_where_its_disk_tier_lives() -> None:
    run = _unit(DEPLOY / "systemd" / "kvsp-holder.service")["Service"]
    holder = _settings(DEPLOY / "two-site/central/holder.toml")
    assert any(tier.startswith("disk=") for tier in holder["tier"])  # it lives in STATE/blocks
    assert holder["state"] in run["ReadWritePaths"].split()


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_exec_start_runs_kvsp_serve_with_flags_the_service_has(path: Path) -> None:
    service = _service_of_unit(path)
    words = shlex.split(_unit(path)["Service"]["ExecStart"])
    assert Path(words[0]).name == "kvsp"
    assert words[1:3] == ["serve", service]
    options = _serve_parsers()[service]._option_string_actions
    flags = [word.split("=", 1)[0] for word in words[3:] if word.startswith("-")]
    assert flags, f"{path.name}: no flags"
    unknown = [flag for flag in flags if flag not in options]
    assert not unknown, f"{path.name}: kvsp serve {service} has no {unknown}"
    assert words[words.index("--config") + 1] == f"/etc/kvsp/{service}.toml"


def _settings(path: Path) -> dict[str, Any]:
    document = tomllib.loads(path.read_text(encoding="utf-8"))
    return {k: v for k, v in document.items() if not isinstance(v, dict)}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_key_of_a_config_file_is_a_flag_of_its_service(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    service = path.stem
    assert service in SERVICES, f"{path.name}: name it after its service"
    document = tomllib.loads(path.read_text(encoding="utf-8"))
    assert all(not isinstance(v, dict) for v in document.values()), "one service per file"
    with pytest.raises(SystemExit) as exited:
        main(["serve", service, "--config", str(path), "--print-config"])
    out, err = capsys.readouterr()
    assert exited.value.code == 0, err
    sources = dict(re.findall(r"^([a-z0-9-]+) = .*  # (.*)$", out, re.MULTILINE))
    for key in _settings(path):
        assert sources.get(key) == str(path), f"{path.name}: {key} not taken from the file"


def test_the_sites_are_labelled_and_the_instances_know_both_control_planes() -> None:
    for site in ("central", "edge"):
        for path in sorted((DEPLOY / "two-site" / site).glob("*.toml")):
            if path.stem != "control":
                assert _settings(path)["site"] == site, path
    for path in DEPLOY.glob("two-site/*/instance.toml"):
        assert len(_settings(path)["pc"]) >= 2, path
    assert _settings(DEPLOY / "two-site/central/control.toml")["store"].startswith("redis://")
    assert "relay" in _settings(DEPLOY / "two-site/edge/instance.toml")
    relay = _settings(DEPLOY / "two-site/edge/relay.toml")
    assert {"cert", "key", "cafile"} <= set(relay)


def test_the_readme_names_every_file() -> None:
    readme = (DEPLOY / "README.md").read_text(encoding="utf-8")
    files = [p for p in DEPLOY.rglob("*") if p.is_file() and p.name != "README.md"]
    assert files
    missing = [
        str(p.relative_to(DEPLOY)) for p in files if str(p.relative_to(DEPLOY)) not in readme
    ]
    assert not missing


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_accepts_the_units(tmp_path: Path) -> None:
    for path in UNITS:  # the binary is not installed here: any executable stands in for it
        text = path.read_text(encoding="utf-8")
        (tmp_path / path.name).write_text(text.replace("/opt/kvsp/venv/bin/kvsp", "/bin/true"))
    done = subprocess.run(
        ["systemd-analyze", "verify", *sorted(str(p) for p in tmp_path.glob("*.service"))],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, "")
